"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

from harel_store import AsyncLibsqlStore
from harel_store.connection import HranaConnection, LocalConnection
from harel_store.store import Store

ROOT = Path(__file__).resolve().parent.parent
# The command line an operator runs, on the repository's alembic.ini.
ALEMBIC = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]


class SyncFacade:
    """Drives an AsyncLibsqlStore from a sync test body, on one private event loop."""

    def __init__(self, store: AsyncLibsqlStore, loop: asyncio.AbstractEventLoop) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(attr(*args, **kwargs))

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)

    @property
    def sync_store(self) -> Store:
        return self._store._s  # type: ignore[no-any-return]


def raw(store: Any) -> Any:
    """A DB-API connection to the store's database (to stage faults a caller could not
    cause): a local store's own; for a remote store or a replica, a libsql connection of
    the test's own to the primary, where the writes land."""
    inner = store.sync_store if hasattr(store, "sync_store") else store
    conn = inner._conn
    if isinstance(conn, LocalConnection):
        return conn.db
    primary = conn if isinstance(conn, HranaConnection) else conn._primary
    import libsql

    token = primary._secrets[0] if primary._secrets else ""
    return libsql.connect(primary.url, auth_token=token)
