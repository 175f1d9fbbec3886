"""``AsyncLibsqlStore``: the sync store off-loaded to a thread, one call at a time.

The libsql driver has no awaitable API and holds the GIL for the whole of every call, so
this twin frees the event loop only as much as the driver lets it: see the README's
"Async" section for the loop lag it causes, measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from harel_store.models import (
    DefinitionRecord,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    OutboxEntry,
    SpawnEntry,
    TimerOp,
)
from harel_store.store import LibsqlStore, StoreStats

T = TypeVar("T")


class AsyncLibsqlStore:
    """Async version of `LibsqlStore`: every method is the sync one on a worker thread."""

    def __init__(self, sync_store: LibsqlStore) -> None:
        self._s = sync_store
        self._lock = asyncio.Lock()

    @classmethod
    async def create(
        cls,
        database: str | Path = ":memory:",
        *,
        auth_token: str = "",
        sync_url: str | None = None,
        sync_interval: float | None = None,
        **options: Any,
    ) -> AsyncLibsqlStore:
        """Open the sync store on a thread (connecting and migrating is blocking IO)."""
        store = await asyncio.to_thread(
            LibsqlStore,
            database,
            auth_token=auth_token,
            sync_url=sync_url,
            sync_interval=sync_interval,
            **options,
        )
        return cls(store)

    def __repr__(self) -> str:
        return f"AsyncLibsqlStore({self._s!r})"

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

    async def _run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async with self._lock:
            return await asyncio.to_thread(fn, *args, **kwargs)

    async def save(self, exe: Execution) -> None:
        """Async version of `LibsqlStore.save`."""
        return await self._run(self._s.save, exe)

    async def commit(
        self,
        exe: Execution,
        emits: Iterable[tuple[str | None, Event]],
        processed_event_id: str | None = None,
        timers: Iterable[TimerOp] = (),
        spawns: Iterable[tuple[str, str, dict[str, Any]]] = (),
        trace: dict[str, Any] | None = None,
    ) -> list[int]:
        """Async version of `LibsqlStore.commit`."""
        return await self._run(
            self._s.commit, exe, emits, processed_event_id, timers, spawns, trace
        )

    async def load(self, execution_id: str) -> Execution | None:
        """Async version of `LibsqlStore.load`."""
        return await self._run(self._s.load, execution_id)

    async def load_for_event(
        self, execution_id: str, event_id: str
    ) -> tuple[Execution | None, bool]:
        """Async version of `LibsqlStore.load_for_event`."""
        return await self._run(self._s.load_for_event, execution_id, event_id)

    async def is_processed(self, execution_id: str, event_id: str) -> bool:
        """Async version of `LibsqlStore.is_processed`."""
        return await self._run(self._s.is_processed, execution_id, event_id)

    async def list_executions(
        self,
        *,
        definition_id: str | None = None,
        status: str | Iterable[str] | None = None,
        roots_only: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> ExecutionPage:
        """Async version of `LibsqlStore.list_executions`."""
        return await self._run(
            self._s.list_executions,
            definition_id=definition_id,
            status=status,
            roots_only=roots_only,
            limit=limit,
            cursor=cursor,
        )

    async def pending_outbox(self) -> list[OutboxEntry]:
        """Async version of `LibsqlStore.pending_outbox`."""
        return await self._run(self._s.pending_outbox)

    async def ack_outbox(self, seq: int) -> None:
        """Async version of `LibsqlStore.ack_outbox`."""
        return await self._run(self._s.ack_outbox, seq)

    async def pending_spawns(self) -> list[SpawnEntry]:
        """Async version of `LibsqlStore.pending_spawns`."""
        return await self._run(self._s.pending_spawns)

    async def ack_spawn(self, seq: int) -> None:
        """Async version of `LibsqlStore.ack_spawn`."""
        return await self._run(self._s.ack_spawn, seq)

    async def due_timers(self, now: float) -> list[tuple[str, str, float]]:
        """Async version of `LibsqlStore.due_timers`."""
        return await self._run(self._s.due_timers, now)

    async def delete_timer(self, execution_id: str, path: str, fire_at: float) -> None:
        """Async version of `LibsqlStore.delete_timer`."""
        return await self._run(self._s.delete_timer, execution_id, path, fire_at)

    async def append_trace(self, execution_id: str, entry: dict[str, Any]) -> None:
        """Async version of `LibsqlStore.append_trace`."""
        return await self._run(self._s.append_trace, execution_id, entry)

    async def read_trace(self, execution_id: str) -> list[dict[str, Any]]:
        """Async version of `LibsqlStore.read_trace`."""
        return await self._run(self._s.read_trace, execution_id)

    async def purge(self, execution_id: str, expected_version: int) -> bool:
        """Async version of `LibsqlStore.purge`."""
        return await self._run(self._s.purge, execution_id, expected_version)

    async def ids_with_prefix(self, prefix: str) -> list[str]:
        """Async version of `LibsqlStore.ids_with_prefix`."""
        return await self._run(self._s.ids_with_prefix, prefix)

    async def publish_definition(self, record: DefinitionRecord) -> DefinitionRecord:
        """Async version of `LibsqlStore.publish_definition`."""
        return await self._run(self._s.publish_definition, record)

    async def load_definition(self, definition_id: str, version: int) -> DefinitionRecord | None:
        """Async version of `LibsqlStore.load_definition`."""
        return await self._run(self._s.load_definition, definition_id, version)

    async def sync(self) -> None:
        """Async version of `LibsqlStore.sync`."""
        return await self._run(self._s.sync)

    async def close(self) -> None:
        """Async version of `LibsqlStore.close`."""
        return await self._run(self._s.close)

    async def stats(self, now: float) -> StoreStats:
        """Async version of `LibsqlStore.stats`."""
        return await self._run(self._s.stats, now)

    async def timers_of(self, execution_id: str) -> list[tuple[str, float]]:
        """Async version of `LibsqlStore.timers_of`."""
        return await self._run(self._s.timers_of, execution_id)

    async def outbox_for(self, execution_id: str) -> list[OutboxEntry]:
        """Async version of `LibsqlStore.outbox_for`."""
        return await self._run(self._s.outbox_for, execution_id)

    async def children_of(self, execution_id: str) -> list[ExecutionSummary]:
        """Async version of `LibsqlStore.children_of`."""
        return await self._run(self._s.children_of, execution_id)

    async def purge_tree(self, execution_id: str, expected_version: int) -> list[str]:
        """Async version of `LibsqlStore.purge_tree`."""
        return await self._run(self._s.purge_tree, execution_id, expected_version)
