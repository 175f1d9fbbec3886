"""The databases a console shows: one store, an async store, a fleet, a database URL or a
fleet file's databases (name: URL), each read the same way (`Databases.call`: a store method
by name, awaited; a sync store's in a thread), each database on its own so that one that
fails leaves the others shown."""

from __future__ import annotations

import asyncio
import functools
import os
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from harel_store.aio import AsyncLibsqlStore
from harel_store.connection import Connection, open_libsql, parse_database, show
from harel_store.connection.local import open_reader
from harel_store.errors import StoreError
from harel_store.fleet import AsyncFleet, Fleet, _listing, _paged, rendezvous
from harel_store.models import ExecutionPage
from harel_store.store import Store, checked
from harel_store.wakeup import Waiter

FAILED_FOR = 5.0  # seconds a database that failed to open answers with that failure

Where = str | Path
Source = Store | AsyncLibsqlStore | Fleet | AsyncFleet | Where | Mapping[str, Where]


class _Opened:
    """A database the console opens itself (a URL): checked, never migrated; a local file
    read-only unless the console acts (so that looking writes nothing, not even the journal
    mode); opened at first use and again after a failure, so a database that is down or
    behind head shows its error on each page until it is back."""

    def __init__(self, where: str, auth_token: str, writes: bool) -> None:
        db = parse_database(where, auth_token)  # ValueError for a bad URL, before any I/O
        if db.local == ":memory:":
            raise ValueError(":memory: is no other connection's: give a file or a server")
        if db.local is not None and not Path(db.local).exists():
            raise ValueError(f"no database at {show(where)}")
        self.where = where
        self._local = None if writes else db.local
        self._token = auth_token
        self._store: Store | None = None
        self._lock = threading.Lock()
        self._closed = False
        self._failed: tuple[float, str] | None = None  # until when, and why

    @property
    def ready(self) -> Store | None:
        return self._store

    def store(self) -> Store:
        """The store, opened now if it is not (at most one opening at a time: `Databases`
        has callers wait their turn on its loop, not in threads); after a failure, that
        failure again for `FAILED_FOR` seconds, so a database that is down costs its pages
        its timeout once, not each."""
        with self._lock:
            if self._closed:
                raise StoreError("the console is closed")
            if self._store is not None:
                return self._store
            if self._failed is not None and time.monotonic() < self._failed[0]:
                raise StoreError(self._failed[1])
            try:
                conn: Connection
                if self._local is not None:
                    conn = open_reader(self._local)
                else:
                    conn = open_libsql(self.where, auth_token=self._token)
                self._store = Store(checked(conn, migrate=False))
            except StoreError as exc:
                self._failed = (time.monotonic() + FAILED_FOR, str(exc))
                raise
            self._failed = None
            return self._store

    def close(self) -> None:
        with self._lock:
            self._closed = True
            store, self._store = self._store, None
        if store is not None:
            store.close()


class Databases:
    """The console's view of its source: the names of its databases (one, named "", for a
    store), where an execution lives, and each database's store methods, awaited."""

    def __init__(self, source: Source, *, auth_token: str = "", writes: bool = False) -> None:
        self._opened: dict[str, _Opened] = {}
        self._opening: dict[str, asyncio.Lock] = {}
        self._source: Any = source
        if isinstance(source, (str, os.PathLike)):
            where = os.fspath(source)
            self._opened = {"": _Opened(where, auth_token, writes)}
            self.fleet, self.label, self.names = False, show(where), [""]
        elif isinstance(source, Mapping):
            if not source:
                raise ValueError("no database to show")
            Fleet(source, auth_token=auth_token).close()  # checked as a fleet's: no I/O
            self._opened = {
                name: _Opened(os.fspath(where), auth_token, writes)
                for name, where in source.items()
            }
            self.fleet, self.label, self.names = True, "fleet", sorted(self._opened)
        elif isinstance(source, (Fleet, AsyncFleet)):
            self.fleet, self.label, self.names = True, "fleet", source.names
        elif isinstance(source, (Store, AsyncLibsqlStore)):
            self.fleet, self.label, self.names = False, repr(source), [""]
        else:
            raise TypeError(
                "source must be a store, an async store, a Fleet, an AsyncFleet, a database"
                f" URL or a mapping of names to URLs, not {type(source).__name__}"
            )

    def route(self, execution_id: str) -> str:
        """The name of the database ``execution_id`` lives in ("" for a single database)."""
        if isinstance(self._source, (Fleet, AsyncFleet)):
            return self._source.route(execution_id)
        if len(self.names) == 1:
            return self.names[0]
        return rendezvous(self.names, execution_id)

    async def store(self, name: str) -> Store | AsyncLibsqlStore:
        """The store of database ``name`` (opened on first use, in a thread: it blocks)."""
        source = self._source
        if name in self._opened:
            opened = self._opened[name]
            if opened.ready is not None:
                return opened.ready
            lock = self._opening.setdefault(name, asyncio.Lock())
            async with lock:  # one opening at a time, the others waiting here, not in threads
                return await asyncio.to_thread(opened.store)
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

    async def list_executions(self, **options: Any) -> tuple[ExecutionPage, dict[str, str]]:
        """One page of the listing across every database (as a fleet merges them: `_paged`),
        and the one-line error of each database that failed (its rows left out)."""
        if not self.fleet:
            return await self.call(self.names[0], "list_executions", **options), {}
        every = {"updated_after": None, "updated_before": None, "id_prefix": None, **options}
        arguments, order = _listing(**every)  # ValueError/TypeError, before any read
        failed: dict[str, str] = {}
        plan = _paged(self.names, arguments, order)
        asked = next(plan)
        while True:
            reads = [self.call(name, "list_executions", **read) for name, read in asked.items()]
            pages: dict[str, ExecutionPage] = {}
            for name, got in zip(
                asked, await asyncio.gather(*reads, return_exceptions=True), strict=True
            ):
                if isinstance(got, (StoreError, OSError)):
                    failed[name] = one_line(got)
                    pages[name] = ExecutionPage(items=[])
                elif isinstance(got, BaseException):
                    raise got
                else:
                    pages[name] = got
            try:
                asked = plan.send(pages)
            except StopIteration as done:
                return done.value, failed

    async def waiter(self, name: str) -> Waiter:
        """A subscription to database ``name``'s wake-up signals (`harel_store.wakeup`)."""
        store = await self.store(name)
        return store._waiter()

    async def close(self) -> None:
        """Close what the console opened itself (a store or fleet given to it is the
        caller's)."""
        for opened in self._opened.values():
            await asyncio.to_thread(opened.close)


def one_line(exc: BaseException) -> str:
    """An error as one line (a store's errors never carry a token)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text[:500]
