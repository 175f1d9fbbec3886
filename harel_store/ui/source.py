"""The databases a console shows: one store, an async store, a fleet or a URL, each read
the same way (`Databases.call`: a store method by name, awaited; a sync store's in a
thread), each database on its own so that one that fails leaves the others shown."""

from __future__ import annotations

import asyncio
import functools
import os
from pathlib import Path
from typing import Any

from harel_store.aio import AsyncLibsqlStore
from harel_store.connection import parse_database, show
from harel_store.fleet import AsyncFleet, Fleet
from harel_store.store import Store
from harel_store.wakeup import Waiter

Source = Store | AsyncLibsqlStore | Fleet | AsyncFleet | str | os.PathLike[str]


class Databases:
    """The console's view of its source: the names of its databases (one, unnamed, for a
    store), where an execution lives, and each database's store methods, awaited."""

    def __init__(self, source: Source, *, auth_token: str = "") -> None:
        self._owned = False
        if isinstance(source, (str, os.PathLike)):
            where = os.fspath(source)
            db = parse_database(where, auth_token)  # ValueError for a bad URL, before I/O
            if db.local == ":memory:":
                raise ValueError(":memory: is no other connection's: give a file or a server")
            if db.local is not None and not Path(db.local).exists():
                raise ValueError(f"no database at {show(where)}")
            # Checked, never migrated: a database behind head shows its SchemaError.
            source = Fleet({"db": where}, auth_token=auth_token, migrate=False)
            self._owned, self.fleet = True, False
            self.label = show(where)
        elif isinstance(source, (Fleet, AsyncFleet)):
            self.fleet, self.label = True, "fleet"
        elif isinstance(source, (Store, AsyncLibsqlStore)):
            self.fleet, self.label = False, repr(source)
        else:
            raise TypeError(
                "source must be a store, an async store, a Fleet, an AsyncFleet or a database"
                f" URL, not {type(source).__name__}"
            )
        self._source = source
        self.names: list[str] = source.names if isinstance(source, (Fleet, AsyncFleet)) else [""]

    def route(self, execution_id: str) -> str:
        """The name of the database ``execution_id`` lives in ("" for a single store)."""
        if isinstance(self._source, (Fleet, AsyncFleet)):
            return self._source.route(execution_id)
        return ""

    async def store(self, name: str) -> Store | AsyncLibsqlStore:
        """The store of database ``name`` (opened on first use, in a thread if it blocks)."""
        source = self._source
        if isinstance(source, Fleet):
            return await asyncio.to_thread(source.store, name)
        if isinstance(source, AsyncFleet):
            return await source.store(name)
        assert isinstance(source, (Store, AsyncLibsqlStore))
        return source

    async def call(self, name: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """``store.method(*args, **kwargs)`` on database ``name``, awaited."""
        store = await self.store(name)
        if isinstance(store, AsyncLibsqlStore):
            return await getattr(store, method)(*args, **kwargs)
        call = functools.partial(getattr(store, method), *args, **kwargs)
        return await asyncio.to_thread(call)

    async def list_executions(self, **options: Any) -> Any:
        """One page of the listing across every database (a fleet's own merge)."""
        source = self._source
        if isinstance(source, Fleet):
            return await asyncio.to_thread(functools.partial(source.list_executions, **options))
        if isinstance(source, AsyncFleet):
            return await source.list_executions(**options)
        return await self.call("", "list_executions", **options)

    async def waiter(self, name: str) -> Waiter:
        """A subscription to database ``name``'s wake-up signals (`harel_store.wakeup`)."""
        store = await self.store(name)
        return store._waiter()

    async def close(self) -> None:
        """Close what the console opened itself (a source given to it is the caller's)."""
        if self._owned:
            assert isinstance(self._source, Fleet)
            await asyncio.to_thread(self._source.close)
