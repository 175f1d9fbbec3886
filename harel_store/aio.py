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

import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TypeVar

from harel_store.awaiting import Call, wait_message
from harel_store.batch import Plan, adrive, settle
from harel_store.checks import check_trace_max
from harel_store.connection import HranaConnection, is_remote, open_libsql
from harel_store.connection.local import LocalConnection, Synchronous
from harel_store.connection.revision import ensure_schema
from harel_store.executions import _wait_args
from harel_store.flows import FlowKey, check_flow_function
from harel_store.lazy import asyncio
from harel_store.models import (
    Execution,
)
from harel_store.operation import awaitable
from harel_store.store import DEFAULT_TRACE_MAX, LibsqlStore, Store
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
        self._local = conn if isinstance(conn, LocalConnection) else None
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
        flow_key: FlowKey | None = None,
    ) -> AsyncLibsqlStore:
        """Open the store as `LibsqlStore` would (a local file or a replica on a thread)."""
        check_trace_max(trace_max)
        check_flow_function(flow_key)
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
                flow_key=flow_key,
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
        return cls(Store(remote, trace_max=trace_max, flow_key=flow_key))

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
        if self._local is not None:
            return await adrive(self._local.aexecute, plan)
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

    # Every operation of the sync store, driving its plan (harel_store.operation).
    save = awaitable(Store.save)
    commit = awaitable(Store.commit)
    append_trace = awaitable(Store.append_trace)
    purge = awaitable(Store.purge)
    publish_definition = awaitable(Store.publish_definition)
    clock = awaitable(Store.clock)
    purge_finished = awaitable(Store.purge_finished)
    forget_processed = awaitable(Store.forget_processed)
    purge_dead = awaitable(Store.purge_dead)
    retention_counts = awaitable(Store.retention_counts)
    load = awaitable(Store.load)
    load_for_event = awaitable(Store.load_for_event)
    is_processed = awaitable(Store.is_processed)
    list_executions = awaitable(Store.list_executions)
    ids_with_prefix = awaitable(Store.ids_with_prefix)
    pending_outbox = awaitable(Store.pending_outbox)
    claim_outbox = awaitable(Store.claim_outbox)
    outbox_for = awaitable(Store.outbox_for)
    pending_spawns = awaitable(Store.pending_spawns)
    claim_spawns = awaitable(Store.claim_spawns)
    due_timers = awaitable(Store.due_timers)
    claim_due_timers = awaitable(Store.claim_due_timers)
    peek_work = awaitable(Store.peek_work)
    claim_work = awaitable(Store.claim_work)
    _awaited = awaitable(Store._awaited)
    ack = awaitable(Store.ack)
    _ack_held = awaitable(Store._ack_held)
    ack_outbox = awaitable(Store.ack_outbox)
    ack_spawn = awaitable(Store.ack_spawn)
    delete_timer = awaitable(Store.delete_timer)
    fail = awaitable(Store.fail)
    extend = awaitable(Store.extend)
    revive = awaitable(Store.revive)
    release = awaitable(Store.release)
    attempts_of = awaitable(Store.attempts_of)
    dead_letters = awaitable(Store.dead_letters)
    dead_view = awaitable(Store.dead_view)
    revive_dead_letter = awaitable(Store.revive_dead_letter)
    read_trace = awaitable(Store.read_trace)
    trace_view = awaitable(Store.trace_view)
    load_definition = awaitable(Store.load_definition)
    stats = awaitable(Store.stats)
    dead_letter = awaitable(Store.dead_letter)
    discard_dead_letter = awaitable(Store.discard_dead_letter)
    discard_dead_letters = awaitable(Store.discard_dead_letters)
    timers_of = awaitable(Store.timers_of)
    children_of = awaitable(Store.children_of)
    outbox_view = awaitable(Store.outbox_view)
    spawns_view = awaitable(Store.spawns_view)
    timers_view = awaitable(Store.timers_view)
    purge_tree = awaitable(Store.purge_tree)
    set_flow = awaitable(Store.set_flow)
    pause_flow = awaitable(Store.pause_flow)
    resume_flow = awaitable(Store.resume_flow)
    clear_flow = awaitable(Store.clear_flow)
    flows = awaitable(Store.flows)
    release_worker = awaitable(Store.release_worker)
    _restarted = awaitable(Store._restarted)
    workers = awaitable(Store.workers)

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
        found = await self._awaited({execution_id: statuses})
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
