"""The store's core: its connection, its state and what every operation shares.

`StoreCore` holds the connection (`harel_store.connection`), runs a plan on it (``_run``),
remembers the versions it last saw (the CAS's hint) and signals this process's relays
(`harel_store.wakeup`). The operations are written on its subclasses, one module per part of
the contract (`harel_store.executions`, `harel_store.queues`, `harel_store.retention`), and
`harel_store.store.Store` is all of them.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar, cast

from pydantic import ValidationError

from harel_store import wakeup
from harel_store.awaiting import Awaits, Source
from harel_store.batch import Plan, drive
from harel_store.checks import (
    check_int,
    check_trace_max,
)
from harel_store.connection import Connection
from harel_store.connection.revision import revision
from harel_store.errors import CorruptRecord
from harel_store.models import (
    Execution,
    ExecutionSummary,
)
from harel_store.pace import Pacer

DEFAULT_TRACE_MAX = 200
MAX_PAGE = 1000
# The most a retention call may take at once (its one write transaction's size).
MAX_PURGE = 10_000
MAX_FORGET = 100_000
# What an execution owns besides its row (purge_<name> in queries.sql).
COMPANIONS = ("processed", "trace", "timers", "outbox", "spawns")
# How many executions' stored summaries a store remembers to pick its CAS write's shape.
REMEMBERED = 10_000
# Bounds that leave a time range open: an empty BLOB sorts above every number (and every
# TEXT); no time on the database's clock is below the most negative float.
ABOVE_ALL = b""
BELOW_ALL_TIMES = -sys.float_info.max
# How often purge_tree reads a tree again after its delete met a member that had moved: a
# tree that busy, or a server that refuses every delete, fails instead of looping.
_PURGE_TRIES = 100

T = TypeVar("T")
_S = TypeVar("_S", bound="StoreCore")


def _limit(limit: object) -> int:
    """A read's row limit: None (all: SQLite's -1) or a positive int."""
    if limit is None:
        return -1
    if check_int(limit, "limit") < 1:
        raise ValueError(f"limit must be >= 1 (or None: all), not {limit}")
    return limit  # type: ignore[return-value]


def _page(limit: object) -> int:
    """A page's row limit (a listing's, a claim's): 1 to MAX_PAGE."""
    rows = check_int(limit, "limit")
    if not 1 <= rows <= MAX_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {rows}")
    return rows


def _batch_limit(limit: object, most: int) -> int:
    """A retention call's limit: 1 to ``most``."""
    rows = check_int(limit, "limit")
    if not 1 <= rows <= most:
        raise ValueError(f"limit must be between 1 and {most}, not {rows}")
    return rows


class StoreCore:
    """The store's connection and state, under every operation. Safe to share between threads."""

    def __init__(
        self,
        connection: Connection,
        *,
        trace_max: int | None = DEFAULT_TRACE_MAX,
        flow_key: Callable[[str], str] | None = None,
    ) -> None:
        self._conn = connection
        self._trace_max = check_trace_max(trace_max)
        # The flow key of an item of an execution (harel_store.flows): None is its root key.
        self._flow_key = flow_key
        # Execution id -> (version, status, parent_id) as last loaded or written here, the
        # oldest forgotten first. Only a hint: the CAS write checks what it leaves unwritten.
        self._stored: dict[str, tuple[int, str, str | None]] = {}
        self._stored_lock = threading.Lock()
        # wait_for's reader runs `Executions._awaited`, which every Store has.
        self._awaits = Awaits(cast("Source", self), connection.where)
        # How many items a retention write takes (harel_store.pace), and the file's
        # data_version at the previous one.
        self._pacer = Pacer()
        self._seen_version: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._conn.where!r})"

    def __enter__(self: _S) -> _S:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: Plan[T]) -> T:
        return drive(self._conn.execute, plan)

    @property
    def trace_max(self) -> int | None:
        """How many trace steps each execution keeps, the oldest dropped first (None or 0:
        every step); ValueError/TypeError for anything but a non-negative int or None."""
        return self._trace_max

    @trace_max.setter
    def trace_max(self, value: int | None) -> None:
        self._trace_max = check_trace_max(value)

    @property
    def database_key(self) -> str:
        """What tells this store's database apart in this process (its file, or its
        server's URL): the relays of one database wait on its signal (`harel_store.wakeup`)."""
        return self._conn.key

    def _notify(self, signals: Iterable[str]) -> None:
        """Tell the waiters of this database in this process what changed (`wakeup`)."""
        wakeup.notify(self._conn.key, signals)

    def _waiter(self) -> wakeup.Waiter:
        """A subscription to this database's signals: this process's writes, and every other
        process's through the database's watch (started with the first subscriber)."""
        return wakeup.Waiter(self._conn.key, self._conn.watch)

    @property
    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (``HEAD`` once the store is open)."""
        return self._run(revision())

    def _remember(self, exe: Execution) -> None:
        with self._stored_lock:
            self._stored.pop(exe.id, None)  # re-inserted last: the most recently used
            self._stored[exe.id] = (exe.version, exe.status, exe.parent_id)
            if len(self._stored) > REMEMBERED:
                del self._stored[next(iter(self._stored))]

    def _forget(self, execution_ids: Iterable[str]) -> None:
        with self._stored_lock:
            for execution_id in execution_ids:
                self._stored.pop(execution_id, None)

    def _execution(self, execution_id: str, data: str, version: int) -> Execution:
        """The stored record at its ``version`` column: the CAS compares the column, which a
        foreign client may have moved without the JSON's copy (a load that took the JSON's
        would conflict on every commit, and reload the same stale version, for ever)."""
        try:
            exe = Execution.model_validate_json(data)
            if exe.version != version:
                exe.version = version
        except ValidationError as exc:
            raise CorruptRecord(
                f"execution {execution_id!r} has a corrupt stored record: {exc}"
            ) from exc
        self._remember(exe)
        return exe

    @staticmethod
    def _summaries(rows: Iterable[Sequence[Any]]) -> list[ExecutionSummary]:
        """A listing's rows as summaries: each was checked against the row its query declares
        (queries.sql), so the model is built without a second validation."""
        keys = tuple(ExecutionSummary.model_fields)
        build = ExecutionSummary.model_construct
        return [build(**dict(zip(keys, row, strict=True))) for row in rows]

    def sync(self) -> None:
        """Pull the primary's latest state into an embedded replica (no-op otherwise)."""
        self._conn.sync()

    def close(self) -> None:
        """Close the connection; the store is unusable afterwards (a second close is a no-op).
        A `wait_for` waiting meanwhile raises StoreError."""
        self._awaits.close()
        self._conn.close()
