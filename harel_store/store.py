"""The store: every operation of the contract over one connection (a local file, a remote
primary, a replica), and the stores a user opens (`LibsqlStore`, `SqliteStore`).

Each operation is a *plan* (see `harel_store.batch`) written once (`harel_store.operation`):
it checks its arguments, yields the reads and write batches it needs and decodes their
results. A write is one batch that lands whole or not at all; the connection decides how it
travels. The operations live by what they touch: `harel_store.executions` (the engine's
commit, reads, listings, definitions, traces), `harel_store.queues` (the relays' claims, acks,
leases and dead letters), `harel_store.retention` (what gc removes), over `harel_store.core`
(the connection and the store's state); `Store` is all of them, plus the operator's `stats`.
`AsyncLibsqlStore` awaits the same plans.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

from harel_store.batch import Plan, drive, statement
from harel_store.checks import (
    check_finite,
    check_trace_max,
)
from harel_store.connection import Connection, is_remote, open_libsql, open_sqlite
from harel_store.connection.local import Synchronous
from harel_store.connection.revision import ensure_schema, revision
from harel_store.core import COMPANIONS, DEFAULT_TRACE_MAX, MAX_PAGE, MAX_PURGE
from harel_store.executions import Executions
from harel_store.flows import FlowKey, Flows, check_flow_function
from harel_store.operation import operation
from harel_store.queues import Queues
from harel_store.retention import Retention

__all__ = [
    "COMPANIONS",
    "DEFAULT_TRACE_MAX",
    "MAX_PAGE",
    "MAX_PURGE",
    "LibsqlStore",
    "SqliteStore",
    "Store",
    "StoreStats",
    "checked",
]


class StoreStats(NamedTuple):
    """What `Store.stats` counts (``*_at`` and ``now``: epoch seconds, the times of rows on
    the database's clock, None if unknown; ``claimed_*``: rows a relay holds under a lease
    that has not run out)."""

    schema_revision: str | None
    executions: dict[str, int]
    pending_outbox: int
    pending_spawns: int
    timers_due: int
    timers_future: int
    oldest_outbox_at: float | None
    claimed_outbox: int  # of pending_outbox, those under a live lease (claim_outbox)
    claimed_spawns: int
    claimed_timers: int
    oldest_spawn_at: float | None  # when the oldest pending spawn was written
    soonest_timer_at: float | None  # the earliest fire_at of any armed timer
    now: float  # the database's clock as it read these: the ages of the *_at times
    dead_outbox: int  # dead letters (0006), not counted in pending_outbox
    dead_spawns: int
    dead_timers: int  # not counted in timers_due or timers_future


def checked(connection: Connection, migrate: bool) -> Connection:
    """The connection, its schema at head (migrated there if ``migrate``); closed on failure."""
    try:
        drive(connection.execute, ensure_schema(connection.where, migrate))
    except BaseException:
        connection.close()
        raise
    return connection


class Store(Executions, Queues, Flows, Retention):
    """The store: every operation of the contract (`harel_store.executions`,
    `harel_store.queues`, `harel_store.retention`) over one connection. Safe to share
    between threads."""

    @operation
    def stats(self, now: float) -> Plan[StoreStats]:
        """Counts for an operator: executions by status, pending outbox entries and spawns,
        timers due at ``now`` and later, when the oldest pending outbox entry and spawn were
        written (None when unknown: none pending, or written before rows had a time), the
        soonest timer's fire_at, and the database's clock (``now``) to take their ages by.
        """
        now = check_finite(now, "now")
        by_status = {
            status or "unknown": count for status, count in (yield statement("count_by_status"))
        }
        counts = yield statement("pending_counts", now)
        current = yield from revision()
        return StoreStats(current, by_status, *counts)


class LibsqlStore(Store):
    """The store over libSQL: a local file, a remote primary, or an embedded replica.

    ``LibsqlStore("state.db")`` (or ``":memory:"``) is a local file;
    ``LibsqlStore("http://host:8080", auth_token=...)`` (also ``libsql://``, ``https://``)
    talks to a remote primary, one HTTP request per read or write;
    ``LibsqlStore("local.db", sync_url=URL, auth_token=...)`` is an embedded replica:
    local reads, writes sent to the primary. ``timeout`` (seconds) bounds each request to
    a server; past it, StoreError (OutcomeUnknown for a write that was sent).

    Local databases are migrated to head when opened; remote ones are only checked unless
    ``migrate=True``. Raises SchemaError on a schema it does not know or may not migrate.
    """

    def __init__(
        self,
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
    ) -> None:
        check_trace_max(trace_max)  # before anything is opened
        check_flow_function(flow_key)
        connection = open_libsql(
            database,
            auth_token=auth_token,
            sync_url=sync_url,
            sync_interval=sync_interval,
            timeout=timeout,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
        )
        if migrate is None:
            migrate = sync_url is None and not is_remote(database)
        super().__init__(checked(connection, migrate), trace_max=trace_max, flow_key=flow_key)


class SqliteStore(Store):
    """The same store over the standard library's ``sqlite3`` (local files and ``:memory:``)."""

    def __init__(
        self,
        database: str | Path = ":memory:",
        *,
        trace_max: int | None = DEFAULT_TRACE_MAX,
        synchronous: Synchronous = "FULL",
        busy_timeout: float = 5.0,
        migrate: bool = True,
        flow_key: FlowKey | None = None,
    ) -> None:
        check_trace_max(trace_max)
        check_flow_function(flow_key)
        connection = open_sqlite(database, synchronous=synchronous, busy_timeout=busy_timeout)
        super().__init__(checked(connection, migrate), trace_max=trace_max, flow_key=flow_key)
