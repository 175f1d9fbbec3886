"""The connection layer: which driver a database needs, running its reads and write batches,
translating its errors, and reading and applying its schema revision (`revision`).

What a database argument means is read in one place, `url.parse_database`:

- a path, ``:memory:`` or a ``file:`` URI: `LocalConnection`, over libsql or sqlite3 (`local`);
- ``http(s)://``, ``libsql://`` (TLS), ``ws(s)://``, ``sqlite+libsql://host``:
  `HranaConnection`, one HTTP request per read or write (`hrana`);
- a path with a ``sync_url``: `ReplicaConnection`, local reads and writes sent to the
  primary (`replica`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

from harel_store.batch import Request
from harel_store.checks import check_timeout
from harel_store.connection.hrana import HranaConnection
from harel_store.connection.local import LocalConnection, check_local_options, open_file
from harel_store.connection.replica import ReplicaConnection, open_replica
from harel_store.connection.url import DatabaseURL, is_remote, parse_database, show
from harel_store.wakeup import Watch

__all__ = [
    "Connection",
    "DatabaseURL",
    "HranaConnection",
    "LocalConnection",
    "ReplicaConnection",
    "is_remote",
    "open_libsql",
    "open_sqlite",
    "parse_database",
    "show",
]


class Connection(Protocol):
    """What the store needs of a database, wherever it lives."""

    where: str  # the database as shown in messages: never a secret
    key: str  # what tells the database apart in this process (harel_store.wakeup)

    def execute(self, request: Request) -> Any:
        """A read's result, or a batch's step results; raises StoreError (OutcomeUnknown
        for a write whose fate is unknown) or `Conflicted`."""

    def sync(self) -> None:
        """An embedded replica pulls its primary's state; elsewhere nothing."""

    def watch(self) -> Watch | None:
        """What tells this process of other processes' writes (`harel_store.wakeup`); None
        where nobody else can write (an in-memory database)."""

    def close(self) -> None: ...


def open_libsql(
    database: str | Path,
    *,
    auth_token: str = "",
    sync_url: str | None = None,
    sync_interval: float | None = None,
    timeout: float = 30.0,
    synchronous: str = "FULL",
    busy_timeout: float = 5.0,
) -> Connection:
    """The connection ``LibsqlStore`` takes for these arguments (see the module docstring).
    A token in the URL (``?authToken=``) wins over ``auth_token``."""
    db = parse_database(database, auth_token)
    timeout = check_timeout(timeout, "timeout")
    check_local_options(synchronous, busy_timeout)
    if sync_url is not None:
        if not isinstance(sync_url, str):
            raise TypeError(f"sync_url must be a URL string, not {type(sync_url).__name__}")
        primary = parse_database(sync_url, auth_token)
        if primary.remote is None:
            raise ValueError(
                f"sync_url must be a server's URL (http(s)://, libsql://), not {primary.where!r}"
            )
        if db.local is None or db.local == ":memory:":
            raise ValueError(
                f"an embedded replica needs a local file to hold its copy, not {db.where!r}"
            )
        if sync_interval is not None:
            sync_interval = check_timeout(sync_interval, "sync_interval")
        return open_replica(
            db.local,
            primary.remote,
            primary.where,
            auth_token=primary.auth_token,
            sync_interval=sync_interval,
            timeout=timeout,
            busy_timeout=busy_timeout,
        )
    if db.remote is not None:
        return HranaConnection(
            db.remote,
            db.where,
            auth_token=db.auth_token,
            timeout=timeout,
            busy_timeout=busy_timeout,
        )
    assert db.local is not None
    return open_file(db.local, driver="libsql", synchronous=synchronous, busy_timeout=busy_timeout)


def open_sqlite(
    database: str | Path, *, synchronous: str = "FULL", busy_timeout: float = 5.0
) -> LocalConnection:
    """The connection ``SqliteStore`` takes: a local file over the stdlib's sqlite3."""
    db = parse_database(database)
    check_local_options(synchronous, busy_timeout)
    if db.local is None:
        raise ValueError(f"SqliteStore opens a local file, not a server: {db.where!r}")
    return open_file(db.local, driver="sqlite", synchronous=synchronous, busy_timeout=busy_timeout)
