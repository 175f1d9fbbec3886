"""``AsyncLibsqlStore``: the store's methods as coroutines, running the sync store's plans.

On a remote primary each call is natively async: its one HTTP request goes through our
`http.AsyncClient`, with no thread and no store-wide lock, so calls from many tasks are
in flight at once: any number of reads, and the writes one request at a time, each request
carrying every write that waited for the one before (group commit; each its own transaction,
the version CAS keeping commits to one execution correct). On a local file or an embedded
replica the libsql driver has no awaitable API (and holds the GIL through every call), so
each call runs the sync store on a worker thread, one at a time.

The store is tied to no event loop: it can be made under one loop and used under another
(``asyncio.run`` twice), or under several at once in several threads. Its connections and
its per-loop state (a remote store's group commit, the worker path's lock) are made for
each loop as it comes, and a closed loop's are dropped without touching it.

Either way a cancelled call settles first: a call under way (its request sent, or its write
waiting for the request in flight) is waited for, each request bounded by ``timeout``, and
its outcome applied to ``exe`` before the cancellation propagates; a call cancelled before
it started sends nothing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from harel_store import queues
from harel_store.awaiting import Call, wait_message
from harel_store.batch import Plan, adrive, settle
from harel_store.checks import check_trace_max
from harel_store.connection import HranaConnection, is_remote, open_libsql
from harel_store.connection.local import Synchronous
from harel_store.connection.revision import ensure_schema
from harel_store.models import (
    DEAD_KINDS,
    ArmedTimer,
    ClaimedWork,
    DeadLetter,
    DefinitionRecord,
    DueTimer,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    OutboxEntry,
    PendingOutbox,
    PendingSpawn,
    RelayItem,
    SpawnEntry,
    TimerOp,
    TraceStep,
    WorkAhead,
)
from harel_store.store import (
    DEFAULT_TRACE_MAX,
    MAX_PAGE,
    LibsqlStore,
    Store,
    StoreStats,
    _wait_args,
)
from harel_store.wakeup import Waiter

T = TypeVar("T")


class AsyncLibsqlStore:
    """Async version of `LibsqlStore` (see the module docstring for how each call runs)."""

    def __init__(self, store: Store) -> None:
        if not isinstance(store, Store):
            raise TypeError(
                f"AsyncLibsqlStore wraps a store, not a {type(store).__name__}: open one with "
                "`store = await AsyncLibsqlStore.create(database, ...)`"
            )
        self._s = store
        conn = store._conn
        self._remote = conn if isinstance(conn, HranaConnection) else None
        # The worker-thread path: one call at a time from each event loop the store is used
        # on (the sync store has its own lock for calls from several loops' threads).
        self._locks: dict[asyncio.AbstractEventLoop, asyncio.Lock] = {}
        self._locks_lock = threading.Lock()

    @classmethod
    async def create(
        cls,
        database: str | Path = ":memory:",
        *,
        auth_token: str = "",
        sync_url: str | None = None,
        sync_interval: float | None = None,
        trace_max: int | None = DEFAULT_TRACE_MAX,
        synchronous: Synchronous = "FULL",
        busy_timeout: float = 5.0,
        timeout: float = 30.0,
        migrate: bool | None = None,
    ) -> AsyncLibsqlStore:
        """Open the store as `LibsqlStore` would (a local file or a replica on a thread)."""
        check_trace_max(trace_max)
        if sync_url is not None or not is_remote(database):
            store = await asyncio.to_thread(
                LibsqlStore,
                database,
                auth_token=auth_token,
                sync_url=sync_url,
                sync_interval=sync_interval,
                trace_max=trace_max,
                synchronous=synchronous,
                busy_timeout=busy_timeout,
                timeout=timeout,
                migrate=migrate,
            )
            return cls(store)
        remote = open_libsql(  # no I/O yet: a remote connection sends on first use
            database,
            auth_token=auth_token,
            timeout=timeout,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
        )
        assert isinstance(remote, HranaConnection)
        try:
            await adrive(remote.aexecute, ensure_schema(remote.where, bool(migrate)))
        except BaseException:
            await remote.aclose()
            raise
        return cls(Store(remote, trace_max=trace_max))

    def __repr__(self) -> str:
        return f"AsyncLibsqlStore({self._s._conn.where!r})"

    async def __aenter__(self) -> AsyncLibsqlStore:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def trace_max(self) -> int | None:
        return self._s.trace_max

    @trace_max.setter
    def trace_max(self, value: int | None) -> None:
        self._s.trace_max = value

    @property
    def database_key(self) -> str:
        """As `LibsqlStore.database_key`."""
        return self._s.database_key

    def _lock(self) -> asyncio.Lock:
        """The running loop's lock (an asyncio.Lock serves one loop); a closed loop's is
        dropped when the next loop's is made."""
        loop = asyncio.get_running_loop()
        lock = self._locks.get(loop)
        if lock is None:
            with self._locks_lock:
                for old in [old for old in self._locks if old.is_closed()]:
                    del self._locks[old]
                lock = self._locks.setdefault(loop, asyncio.Lock())
        return lock

    async def _run(self, plan: Plan[T]) -> T:
        if self._remote is not None:
            return await adrive(self._remote.aexecute, plan)
        async with self._lock():
            # run_in_executor rather than to_thread: a future, not a coroutine to wrap in a
            # task (~25 us less a call); the store's code reads no context variables.
            worker = asyncio.get_running_loop().run_in_executor(None, self._s._run, plan)
            task, cancelled = await settle(worker)
        if cancelled is not None:
            if not task.cancelled():
                task.exception()  # retrieved: the cancellation is what the caller gets
            raise cancelled
        return task.result()

    async def save(self, exe: Execution) -> None:
        """Async version of `LibsqlStore.save`."""
        return await self._run(self._s._save(exe))

    async def commit(
        self,
        exe: Execution,
        emits: Iterable[tuple[str | None, Event]],
        processed_event_id: str | None = None,
        timers: Iterable[TimerOp] = (),
        spawns: Iterable[tuple[str, str, dict[str, Any]]] = (),
        trace: dict[str, Any] | None = None,
        *,
        acks: Iterable[RelayItem] = (),
    ) -> list[int]:
        """Async version of `LibsqlStore.commit`."""
        return await self._run(
            self._s._commit(exe, emits, processed_event_id, timers, spawns, trace, acks=acks)
        )

    async def load(self, execution_id: str) -> Execution | None:
        """Async version of `LibsqlStore.load`."""
        return await self._run(self._s._load(execution_id))

    async def load_for_event(
        self, execution_id: str, event_id: str
    ) -> tuple[Execution | None, bool]:
        """Async version of `LibsqlStore.load_for_event`."""
        return await self._run(self._s._load_for_event(execution_id, event_id))

    async def is_processed(self, execution_id: str, event_id: str) -> bool:
        """Async version of `LibsqlStore.is_processed`."""
        return await self._run(self._s._is_processed(execution_id, event_id))

    async def list_executions(
        self,
        *,
        definition_id: str | None = None,
        status: str | Iterable[str] | None = None,
        roots_only: bool = False,
        limit: int = 50,
        cursor: str | None = None,
        updated_after: float | None = None,
        updated_before: float | None = None,
        newest_first: bool = False,
        id_prefix: str | None = None,
    ) -> ExecutionPage:
        """Async version of `LibsqlStore.list_executions`."""
        return await self._run(
            self._s._list_executions(
                definition_id=definition_id,
                status=status,
                roots_only=roots_only,
                limit=limit,
                cursor=cursor,
                updated_after=updated_after,
                updated_before=updated_before,
                newest_first=newest_first,
                id_prefix=id_prefix,
            )
        )

    async def pending_outbox(self, limit: int | None = None) -> list[OutboxEntry]:
        """Async version of `LibsqlStore.pending_outbox`."""
        return await self._run(self._s._pending_outbox(limit))

    async def claim_outbox(
        self,
        worker: str,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[OutboxEntry]:
        """Async version of `LibsqlStore.claim_outbox`."""
        return await self._run(
            self._s._claim_outbox(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        )

    async def ack_outbox(self, seq: int) -> None:
        """Async version of `LibsqlStore.ack_outbox`."""
        return await self._run(self._s._ack_outbox(seq))

    async def pending_spawns(self, limit: int | None = None) -> list[SpawnEntry]:
        """Async version of `LibsqlStore.pending_spawns`."""
        return await self._run(self._s._pending_spawns(limit))

    async def claim_spawns(
        self,
        worker: str,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[SpawnEntry]:
        """Async version of `LibsqlStore.claim_spawns`."""
        return await self._run(
            self._s._claim_spawns(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        )

    async def ack_spawn(self, seq: int) -> None:
        """Async version of `LibsqlStore.ack_spawn`."""
        return await self._run(self._s._ack_spawn(seq))

    async def due_timers(self, now: float, limit: int | None = None) -> list[DueTimer]:
        """Async version of `LibsqlStore.due_timers`."""
        return await self._run(self._s._due_timers(now, limit))

    async def claim_due_timers(
        self,
        worker: str,
        now: float,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[DueTimer]:
        """Async version of `LibsqlStore.claim_due_timers`."""
        return await self._run(
            self._s._claim_due_timers(
                worker, now, limit=limit, lease=lease, max_attempts=max_attempts
            )
        )

    async def peek_work(self, now: float) -> WorkAhead:
        """Async version of `LibsqlStore.peek_work`."""
        return await self._run(self._s._peek_work(now))

    async def claim_work(
        self,
        worker: str,
        now: float,
        *,
        kinds: Iterable[str] = DEAD_KINDS,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> ClaimedWork:
        """Async version of `LibsqlStore.claim_work`."""
        return await self._run(
            self._s._claim_work(
                worker, now, kinds=kinds, limit=limit, lease=lease, max_attempts=max_attempts
            )
        )

    async def wait_for(
        self,
        execution_id: str,
        *,
        status: str | Iterable[str] = ("finished", "failed", "cancelled"),
        timeout: float,
    ) -> Execution:
        """Async version of `LibsqlStore.wait_for` (the builtin TimeoutError on every Python)."""
        execution_id, statuses, seconds = _wait_args(execution_id, status, timeout)
        deadline = time.monotonic() + seconds
        found = await self._run(self._s._awaited({execution_id: statuses}))
        if execution_id in found:
            return found[execution_id]
        future: asyncio.Future[Execution] = asyncio.get_running_loop().create_future()
        call = Call(execution_id, statuses, future)
        self._s._awaits.add(call)
        try:
            left = max(deadline - time.monotonic(), 0.0)
            return await asyncio.wait_for(future, left)
        except asyncio.TimeoutError:
            raise TimeoutError(wait_message(execution_id, statuses, seconds)) from None
        finally:
            self._s._awaits.remove(call)  # and the future, done or cancelled, takes nothing

    def _waiter(self) -> Waiter:
        """As `Store._waiter`: this store's database's signals."""
        return self._s._waiter()

    async def delete_timer(self, execution_id: str, path: str, fire_at: float) -> None:
        """Async version of `LibsqlStore.delete_timer`."""
        return await self._run(self._s._delete_timer(execution_id, path, fire_at))

    async def ack(self, items: Iterable[RelayItem]) -> int:
        """Async version of `LibsqlStore.ack`."""
        return await self._run(self._s._ack(queues.items_of(items, "ack")))

    async def fail(
        self, worker: str, items: Iterable[RelayItem], *, error: str, retry_in: float = 0.0
    ) -> int:
        """Async version of `LibsqlStore.fail`."""
        return await self._run(self._s._fail(worker, items, error=error, retry_in=retry_in))

    async def extend(
        self, worker: str, items: Iterable[RelayItem], *, lease: float
    ) -> list[RelayItem]:
        """Async version of `LibsqlStore.extend`."""
        return await self._run(self._s._extend(worker, items, lease=lease))

    async def revive(self, items: Iterable[RelayItem]) -> int:
        """Async version of `LibsqlStore.revive`."""
        return await self._run(self._s._revive(items))

    async def release(self, worker: str, items: Iterable[RelayItem]) -> int:
        """Async version of `LibsqlStore.release`."""
        return await self._run(self._s._release(worker, items))

    async def attempts_of(self, items: Iterable[RelayItem]) -> list[int]:
        """Async version of `LibsqlStore.attempts_of`."""
        return await self._run(self._s._attempts_of(items))

    async def dead_letters(self, *, kind: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """Async version of `LibsqlStore.dead_letters`."""
        return await self._run(self._s._dead_letters(kind=kind, limit=limit))

    async def append_trace(self, execution_id: str, entry: dict[str, Any]) -> None:
        """Async version of `LibsqlStore.append_trace`."""
        return await self._run(self._s._append_trace(execution_id, entry))

    async def read_trace(self, execution_id: str) -> list[dict[str, Any]]:
        """Async version of `LibsqlStore.read_trace`."""
        return await self._run(self._s._read_trace(execution_id))

    async def purge(self, execution_id: str, expected_version: int) -> bool:
        """Async version of `LibsqlStore.purge`."""
        return await self._run(self._s._purge(execution_id, expected_version))

    async def clock(self) -> float:
        """Async version of `LibsqlStore.clock`."""
        return await self._run(self._s._clock())

    async def purge_finished(self, before: float, *, limit: int = 1000) -> int:
        """Async version of `LibsqlStore.purge_finished`."""
        return await self._run(self._s._purge_finished(before, limit=limit))

    async def forget_processed(self, before: float, *, limit: int = 10000) -> int:
        """Async version of `LibsqlStore.forget_processed`."""
        return await self._run(self._s._forget_processed(before, limit=limit))

    async def purge_dead(self, before: float, *, limit: int = 1000) -> int:
        """Async version of `LibsqlStore.purge_dead`."""
        return await self._run(self._s._purge_dead(before, limit=limit))

    async def retention_counts(
        self,
        *,
        finished_before: float | None = None,
        markers_before: float | None = None,
        dead_before: float | None = None,
    ) -> tuple[int, int, int]:
        """Async version of `LibsqlStore.retention_counts`."""
        return await self._run(
            self._s._retention_counts(
                finished_before=finished_before,
                markers_before=markers_before,
                dead_before=dead_before,
            )
        )

    async def ids_with_prefix(self, prefix: str) -> list[str]:
        """Async version of `LibsqlStore.ids_with_prefix`."""
        return await self._run(self._s._ids_with_prefix(prefix))

    async def publish_definition(self, record: DefinitionRecord) -> DefinitionRecord:
        """Async version of `LibsqlStore.publish_definition`."""
        return await self._run(self._s._publish_definition(record))

    async def load_definition(self, definition_id: str, version: int) -> DefinitionRecord | None:
        """Async version of `LibsqlStore.load_definition`."""
        return await self._run(self._s._load_definition(definition_id, version))

    async def stats(self, now: float) -> StoreStats:
        """Async version of `LibsqlStore.stats`."""
        return await self._run(self._s._stats(now))

    async def dead_letter(self, kind: str, key: int | tuple[str, str]) -> DeadLetter | None:
        """Async version of `LibsqlStore.dead_letter`."""
        return await self._run(self._s._dead_letter(kind, key))

    async def discard_dead_letter(self, kind: str, key: int | tuple[str, str]) -> bool:
        """Async version of `LibsqlStore.discard_dead_letter`."""
        return await self._run(self._s._discard_dead_letter(kind, key))

    async def discard_dead_letters(self, *, kind: str | None = None, limit: int = MAX_PAGE) -> int:
        """Async version of `LibsqlStore.discard_dead_letters`."""
        return await self._run(self._s._discard_dead_letters(kind=kind, limit=limit))

    async def timers_of(self, execution_id: str) -> list[tuple[str, float]]:
        """Async version of `LibsqlStore.timers_of`."""
        return await self._run(self._s._timers_of(execution_id))

    async def outbox_for(self, execution_id: str) -> list[OutboxEntry]:
        """Async version of `LibsqlStore.outbox_for`."""
        return await self._run(self._s._outbox_for(execution_id))

    async def children_of(self, execution_id: str) -> list[ExecutionSummary]:
        """Async version of `LibsqlStore.children_of`."""
        return await self._run(self._s._children_of(execution_id))

    async def outbox_view(
        self, *, target: str | None = None, source: str | None = None, limit: int = 50
    ) -> list[PendingOutbox]:
        """Async version of `LibsqlStore.outbox_view`."""
        return await self._run(self._s._outbox_view(target=target, source=source, limit=limit))

    async def spawns_view(
        self, *, parent: str | None = None, limit: int = 50
    ) -> list[PendingSpawn]:
        """Async version of `LibsqlStore.spawns_view`."""
        return await self._run(self._s._spawns_view(parent=parent, limit=limit))

    async def timers_view(
        self, *, due_before: float | None = None, limit: int = 50
    ) -> list[ArmedTimer]:
        """Async version of `LibsqlStore.timers_view`."""
        return await self._run(self._s._timers_view(due_before=due_before, limit=limit))

    async def trace_view(self, execution_id: str) -> list[TraceStep]:
        """Async version of `LibsqlStore.trace_view`."""
        return await self._run(self._s._trace_view(execution_id))

    async def purge_tree(self, execution_id: str, expected_version: int) -> list[str]:
        """Async version of `LibsqlStore.purge_tree`."""
        return await self._run(self._s._purge_tree(execution_id, expected_version))

    async def sync(self) -> None:
        """Async version of `LibsqlStore.sync` (nothing to pull on a remote primary)."""
        if self._remote is None:
            async with self._lock():
                await asyncio.to_thread(self._s.sync)

    async def close(self) -> None:
        """Async version of `LibsqlStore.close`."""
        if self._remote is not None:
            self._s._awaits.close()  # a wait_for under way ends (its reader: a read at most)
            await self._remote.aclose()
            return
        async with self._lock():
            await asyncio.to_thread(self._s.close)
