"""The connection layer: which driver a database needs, running its reads and write batches,
translating its errors, and reading and applying its schema revision (`revision`).

- a path or ``:memory:``: `LocalConnection`, over libsql or sqlite3 (`local`);
- ``http(s)://``, ``libsql://`` (TLS), ``ws(s)://``: `HranaConnection`, one HTTP request
  per read or write (`hrana`);
- a path with a ``sync_url``: `ReplicaConnection`, local reads and writes sent to the
  primary (`replica`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Protocol

from harel_store.batch import Request
from harel_store.checks import check_timeout
from harel_store.connection.hrana import HranaConnection
from harel_store.connection.local import (
    LocalConnection,
    check_database,
    check_local_options,
    open_file,
)
from harel_store.connection.replica import ReplicaConnection, open_replica

__all__ = [
    "Connection",
    "HranaConnection",
    "LocalConnection",
    "ReplicaConnection",
    "is_remote",
    "open_libsql",
    "open_sqlite",
    "show",
]

REMOTE_SCHEMES = ("libsql://", "http://", "https://", "ws://", "wss://")


class Connection(Protocol):
    """What the store needs of a database, wherever it lives."""

    where: str  # the database as shown in messages: never a secret

    def execute(self, request: Request) -> Any:
        """A read's result, or a batch's step results; raises StoreError (OutcomeUnknown
        for a write whose fate is unknown) or `Conflicted`."""

    def sync(self) -> None:
        """An embedded replica pulls its primary's state; elsewhere nothing."""

    def close(self) -> None: ...


def is_remote(database: str | Path) -> bool:
    return str(database).lower().startswith(REMOTE_SCHEMES)


_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)[^/?#]*@")


def show(database: str | Path) -> str:
    """The database fit for messages: anything shaped like a URL (whatever its scheme)
    without its user info, query or fragment, any of which may carry a token."""
    text = str(database)
    if "://" not in text:
        return text
    return _USERINFO.sub(r"\1", text.split("#", 1)[0].split("?", 1)[0])


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
    """The connection ``LibsqlStore`` takes for these arguments (see the module docstring)."""
    database = check_database(database)
    timeout = check_timeout(timeout, "timeout")
    check_local_options(synchronous, busy_timeout)
    if sync_url is not None:
        if not isinstance(sync_url, str):
            raise TypeError(f"sync_url must be a URL string, not {type(sync_url).__name__}")
        if not is_remote(sync_url):
            raise ValueError(
                f"sync_url must be an http(s):// or libsql:// URL, not {show(str(sync_url))!r}"
            )
        if is_remote(database) or database == ":memory:":
            raise ValueError(
                f"an embedded replica needs a local file to hold its copy, not {show(database)!r}"
            )
        if sync_interval is not None:
            sync_interval = check_timeout(sync_interval, "sync_interval")
        return open_replica(
            database,
            sync_url,
            show(sync_url),
            auth_token=auth_token,
            sync_interval=sync_interval,
            timeout=timeout,
            busy_timeout=busy_timeout,
        )
    if is_remote(database):
        return HranaConnection(
            str(database),
            show(database),
            auth_token=auth_token,
            timeout=timeout,
            busy_timeout=busy_timeout,
        )
    return open_file(database, driver="libsql", synchronous=synchronous, busy_timeout=busy_timeout)


def open_sqlite(
    database: str | Path, *, synchronous: str = "FULL", busy_timeout: float = 5.0
) -> LocalConnection:
    """The connection ``SqliteStore`` takes: a local file over the stdlib's sqlite3."""
    database = check_database(database)
    check_local_options(synchronous, busy_timeout)
    return open_file(database, driver="sqlite", synchronous=synchronous, busy_timeout=busy_timeout)
