"""A fleet: one engine's executions spread over several named databases.

Each execution lives in one database, chosen by `Fleet.route`: a route the user gives, or
rendezvous hashing of the id's *root key* (its text before the first ``"."``), so an
execution's children live with it and a database that joins takes only the roots it wins.
Each database is a `LibsqlStore` (`AsyncLibsqlStore` in an `AsyncFleet`), opened on first
use; the fleet adds no transaction of its own: what one store commits is atomic, nothing
spans two databases. `Fleet.list_executions` pages over every database at once, in the
order one store holding every row would give.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import threading
from collections.abc import Callable, Generator, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harel_store.aio import AsyncLibsqlStore
from harel_store.checks import (
    check_id,
    check_timeout,
    check_trace_max,
    encode_cursor,
)
from harel_store.connection import DatabaseURL, parse_database
from harel_store.connection.local import check_local_options
from harel_store.connection.url import server_key
from harel_store.errors import StoreError
from harel_store.executions import _wait_args, check_listing
from harel_store.flows import check_flow_function
from harel_store.lazy import asyncio
from harel_store.models import Execution, ExecutionPage, ExecutionSummary
from harel_store.store import LibsqlStore

__all__ = ["AsyncFleet", "Fleet", "identity", "rendezvous", "root_key"]

Route = Callable[[str], str]
# The options a fleet passes to every database's store: LibsqlStore's, less the ones that
# name a database (a replica's primary is one database's, never every database's).
_PER_DATABASE = ("database", "auth_token", "sync_url", "sync_interval")
_OPTIONS = frozenset(inspect.signature(LibsqlStore).parameters) - set(_PER_DATABASE)
_MOST_THREADS = 8  # a sync fleet reads at most this many databases at once
_FINAL = ("finished", "failed", "cancelled")  # what wait_for waits for by default


def root_key(execution_id: str) -> str:
    """The part of an execution id that decides its database: the text before its first
    ``"."`` (all of it when it has none)."""
    return execution_id.partition(".")[0]


def rendezvous(names: Iterable[str], execution_id: str) -> str:
    """The name whose sha256 of ``name + root key`` is highest (rendezvous hashing)."""
    key = root_key(execution_id)
    return max(names, key=lambda name: (hashlib.sha256((name + key).encode()).digest(), name))


def identity(db: DatabaseURL) -> str:
    """What tells one database from another, however it is spelled: a file's real path
    (symlinks, ``..`` and the current directory resolved; no file is opened), a server's
    key (`server_key`: its URL normalised, with no query)."""
    if db.local is not None:
        return os.path.realpath(db.local)
    assert db.remote is not None
    return server_key(db.remote)


class _Fleet:
    """What both fleets share: the names, their databases, the route and the options."""

    def __init__(
        self,
        databases: Mapping[str, str | Path],
        *,
        route: Route | None = None,
        auth_token: str = "",
        **options: Any,
    ) -> None:
        if not isinstance(databases, Mapping):
            raise TypeError(
                f"databases must map names to databases, not {type(databases).__name__}"
            )
        if not databases:
            raise ValueError("a fleet needs at least one database")
        if route is not None and not callable(route):
            raise TypeError(f"route must be callable, not {type(route).__name__}")
        if not isinstance(auth_token, str):
            raise TypeError(f"auth_token must be a string, not {type(auth_token).__name__}")
        unknown = sorted(set(options) - _OPTIONS)
        if unknown:
            per = [name for name in unknown if name in _PER_DATABASE]
            if per:
                raise TypeError(f"a fleet takes no {per[0]}: it is one database's, not all of them")
            raise TypeError(f"unknown option {unknown[0]!r} (LibsqlStore's: {sorted(_OPTIONS)})")
        # The options' values, checked as each store will check them, before any is opened.
        check_trace_max(options.get("trace_max"))
        check_timeout(options.get("timeout", 30.0), "timeout")
        check_local_options(options.get("synchronous", "FULL"), options.get("busy_timeout", 5.0))
        check_flow_function(options.get("flow_key"))
        # A remote database is read in a thread of its own (its wait on the server is the
        # cost); local files one after another (libsql holds the GIL through a statement).
        self._remote: set[str] = set()
        # One database under two names would list every row twice and run two relay loops
        # on it: refused, by its identity (a path resolved, a URL normalised; no I/O).
        seen: dict[str, tuple[str, str]] = {}
        for name, database in databases.items():
            check_id(name, "database name")
            db = parse_database(database, auth_token)  # no I/O: its grammar only
            if db.local is None:
                self._remote.add(name)
            if db.local == ":memory:":
                raise ValueError(
                    f"database {name!r} is :memory:, which no other connection can see: "
                    "give a file or a server"
                )
            first = seen.setdefault(identity(db), (name, db.where))
            if first[0] != name:
                raise ValueError(
                    f"{first[0]!r} ({first[1]}) and {name!r} ({db.where}) are one database"
                    " under two names: give each database once"
                )
        self._databases = dict(databases)
        self._names = sorted(self._databases)
        self._route = route
        self._auth_token = auth_token
        self._options = options
        self._closed = False

    @property
    def names(self) -> list[str]:
        """The names of the fleet's databases, sorted."""
        return list(self._names)

    def __repr__(self) -> str:  # the names only: a database's URL may carry a token
        return f"{type(self).__name__}({self._names!r})"

    def _shown(self) -> str:
        """The fleet's names for a message: the first few of a large fleet."""
        shown = ", ".join(self._names[:10])
        return shown if len(self._names) <= 10 else f"{shown}, ... ({len(self._names)} in all)"

    def _known(self, name: object) -> str:
        if not isinstance(name, str) or name not in self._databases:
            raise ValueError(f"no database named {name!r:.80} in the fleet ({self._shown()})")
        if self._closed:
            raise StoreError("the fleet is closed")
        return name

    def route(self, execution_id: str) -> str:
        """The name of the database ``execution_id`` lives in: the fleet's ``route`` if it
        was given one (its answer must name a database of the fleet, else ValueError), else
        rendezvous hashing of the id's root key (before its first ``"."``)."""
        check_id(execution_id, "execution_id")
        if self._route is None:
            return rendezvous(self._names, execution_id)
        name = self._route(execution_id)
        if not isinstance(name, str) or name not in self._databases:
            raise ValueError(
                f"route({execution_id!r:.80}) gave {name!r:.80}, not a database of the fleet"
                f" ({self._shown()})"
            )
        return name

    def _open_args(self, name: str) -> tuple[str | Path, dict[str, Any]]:
        return self._databases[name], {"auth_token": self._auth_token, **self._options}


def _listing(**given: Any) -> tuple[dict[str, Any], str]:
    """A fleet listing's arguments (`list_executions`' by name), checked as one store checks
    them (`check_listing`, before any database is opened), as each store takes them (its
    statuses a list, read again for each database); and the listing's order."""
    statuses, _, _, order, _ = check_listing(**given)
    return given | {"status": statuses}, order


Reads = dict[str, dict[str, Any]]  # a database's name: the arguments of its listing


def _paged(
    names: list[str], arguments: dict[str, Any], order: str
) -> Generator[Reads, dict[str, ExecutionPage], ExecutionPage]:
    """A fleet's page, as a plan the sync and the async fleet drive alike: it yields the
    listings to read (by database) and is sent their pages, until it returns the page.

    Each database is first asked for its share of the page and a quarter more (rehashed
    ids spread evenly, so one read each, almost always), not for the whole page: every row
    read costs (decoded into a summary). The rows up to the earliest last row of the
    databases that have more are known to be every row there is up to that point; when
    they fall short of the page, those databases are read on past their last row."""
    limit = arguments["limit"]
    share = min(limit, -(-limit * 5 // (4 * len(names))) + 1)
    asked = {name: {**arguments, "limit": share} for name in names}
    rows: dict[str, list[ExecutionSummary]] = {name: [] for name in names}
    after: dict[str, str | None] = {}
    while True:
        pages = yield asked
        for name, page in pages.items():
            rows[name] += page.items
            after[name] = page.next_cursor
        merged = _sorted([row for found in rows.values() for row in found], order)
        more = [name for name in names if after[name] is not None]
        known = merged
        if more:
            place = {id(row): i for i, row in enumerate(merged)}
            known = merged[: min(place[id(rows[name][-1])] for name in more) + 1]
        if len(known) >= limit or not more:
            break
        need = max(limit - len(known), share)
        asked = {name: {**arguments, "limit": need, "cursor": after[name]} for name in more}
    items = known[:limit]
    if not items or (len(known) <= limit and not more):
        return ExecutionPage(items=items)
    last = items[-1]
    return ExecutionPage(items=items, next_cursor=encode_cursor(last.id, order, last.updated_at))


def _sorted(rows: list[ExecutionSummary], order: str) -> list[ExecutionSummary]:
    """Rows in a listing's ``order``, as one store gives them."""
    if order == "id":
        return sorted(rows, key=lambda s: s.id)
    if order == "oldest":  # a time window: every row has its time
        return sorted(rows, key=lambda s: (s.updated_at, s.id))
    return sorted(rows, key=_newest, reverse=True)  # the rows without a time last


def _newest(s: ExecutionSummary) -> tuple[bool, float, str]:
    return (s.updated_at is not None, s.updated_at or 0.0, s.id)


class Fleet(_Fleet):
    """Several named databases an engine spreads its executions over (see the module
    docstring). ``databases`` maps each name (an id, as execution ids are) to a database as
    `LibsqlStore` takes it (a path or a URL; not ``:memory:``); ``route``, if given, maps an
    execution id to a name; ``auth_token`` and ``options`` (`LibsqlStore`'s: ``timeout``,
    ``synchronous``, ``busy_timeout``, ``trace_max``, ``migrate``, ``flow_key``) are the
    same for every database. Nothing is opened until it is used. Safe to share between threads."""

    def __init__(
        self,
        databases: Mapping[str, str | Path],
        *,
        route: Route | None = None,
        auth_token: str = "",
        **options: Any,
    ) -> None:
        super().__init__(databases, route=route, auth_token=auth_token, **options)
        self._stores: dict[str, LibsqlStore] = {}
        self._locks = {name: threading.Lock() for name in self._names}
        self._lock = threading.Lock()  # the pool and closing
        self._pool: ThreadPoolExecutor | None = None

    def store(self, name: str) -> LibsqlStore:
        """The store of database ``name``: opened on first use, the same object afterwards;
        ValueError for a name not in the fleet."""
        store = self._stores.get(self._known(name))
        if store is not None:
            return store
        with self._locks[name]:
            store = self._stores.get(name)
            if store is None:
                database, options = self._open_args(name)
                store = LibsqlStore(database, **options)
                with self._lock:
                    if self._closed:
                        store.close()
                        raise StoreError("the fleet is closed")
                    self._stores[name] = store
        return store

    def store_for(self, execution_id: str) -> LibsqlStore:
        """The store of the database ``execution_id`` lives in (`route`)."""
        return self.store(self.route(execution_id))

    def wait_for(
        self,
        execution_id: str,
        *,
        status: str | Iterable[str] = _FINAL,
        timeout: float,
    ) -> Execution:
        """`LibsqlStore.wait_for` on the database ``execution_id`` lives in (`route`): the
        execution as soon as it exists with a status in ``status``. Raises TimeoutError (the
        builtin) after ``timeout`` seconds; ValueError/TypeError for a bad id, status or
        timeout, before any database is opened; StoreError if the database fails."""
        execution_id, statuses, seconds = _wait_args(execution_id, status, timeout)
        store = self.store_for(execution_id)
        return store.wait_for(execution_id, status=statuses, timeout=seconds)

    def list_executions(
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
        """As `LibsqlStore.list_executions`, over every database: the page one store holding
        every row would give, with a cursor for the next. Each database is asked for its
        share of the page and a quarter more, several at once; one whose rows fall short of
        its share is read on (see `_paged`)."""
        arguments, order = _listing(
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

        def page(name: str, read: dict[str, Any]) -> ExecutionPage:
            return self.store(name).list_executions(**read)

        plan = _paged(self._names, arguments, order)
        asked = next(plan)
        while True:
            names = list(asked)
            if self._remote.isdisjoint(names) or len(names) == 1:
                pages = [page(name, read) for name, read in asked.items()]
            else:
                pages = list(self._threads().map(page, names, asked.values()))
            try:
                asked = plan.send(dict(zip(names, pages, strict=True)))
            except StopIteration as done:
                result: ExecutionPage = done.value
                return result

    def _threads(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._closed:
                raise StoreError("the fleet is closed")
            if self._pool is None:
                workers = min(len(self._names), _MOST_THREADS)
                self._pool = ThreadPoolExecutor(workers, thread_name_prefix="harel-fleet")
            return self._pool

    def close(self) -> None:
        """Close every store the fleet opened (the fleet is then closed; again is a no-op)."""
        with self._lock:
            self._closed = True
            stores, self._stores = list(self._stores.values()), {}
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        failure: BaseException | None = None
        for store in stores:
            try:
                store.close()
            except BaseException as exc:  # the others are still closed
                failure = failure or exc
        if failure is not None:
            raise failure

    def __enter__(self) -> Fleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncFleet(_Fleet):
    """Async version of `Fleet`: ``await fleet.store(name)`` (an `AsyncLibsqlStore`),
    ``await fleet.store_for(id)``, ``fleet.route(id)`` (no I/O), ``await
    fleet.list_executions(...)`` (every database read at once), ``await fleet.close()``,
    ``async with``."""

    def __init__(
        self,
        databases: Mapping[str, str | Path],
        *,
        route: Route | None = None,
        auth_token: str = "",
        **options: Any,
    ) -> None:
        super().__init__(databases, route=route, auth_token=auth_token, **options)
        self._stores: dict[str, AsyncLibsqlStore] = {}
        # Opening one database once from each event loop (an asyncio.Lock serves one loop);
        # two loops opening the same database at once keep the first store made.
        self._locks: dict[tuple[asyncio.AbstractEventLoop, str], asyncio.Lock] = {}
        self._lock = threading.Lock()

    def _opening(self, name: str) -> asyncio.Lock:
        loop = asyncio.get_running_loop()
        with self._lock:
            for old in [key for key in self._locks if key[0].is_closed()]:
                del self._locks[old]
            return self._locks.setdefault((loop, name), asyncio.Lock())

    async def store(self, name: str) -> AsyncLibsqlStore:
        """As `Fleet.store`: the database's `AsyncLibsqlStore`, opened on first use."""
        store = self._stores.get(self._known(name))
        if store is not None:
            return store
        async with self._opening(name):
            store = self._stores.get(name)
            if store is not None:
                return store
            database, options = self._open_args(name)
            made = await AsyncLibsqlStore.create(database, **options)
            with self._lock:
                store = None if self._closed else self._stores.setdefault(name, made)
            if store is not made:
                await made.close()
            if store is None:
                raise StoreError("the fleet is closed")
            return store

    async def store_for(self, execution_id: str) -> AsyncLibsqlStore:
        """As `Fleet.store_for`."""
        return await self.store(self.route(execution_id))

    async def wait_for(
        self,
        execution_id: str,
        *,
        status: str | Iterable[str] = _FINAL,
        timeout: float,
    ) -> Execution:
        """As `Fleet.wait_for`: `AsyncLibsqlStore.wait_for` on the execution's database."""
        execution_id, statuses, seconds = _wait_args(execution_id, status, timeout)
        store = await self.store_for(execution_id)
        return await store.wait_for(execution_id, status=statuses, timeout=seconds)

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
        """As `Fleet.list_executions`, every database read at once."""
        arguments, order = _listing(
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

        async def page(name: str, read: dict[str, Any]) -> ExecutionPage:
            return await (await self.store(name)).list_executions(**read)

        plan = _paged(self._names, arguments, order)
        asked = next(plan)
        while True:
            pages = await asyncio.gather(*(page(name, read) for name, read in asked.items()))
            try:
                asked = plan.send(dict(zip(asked, pages, strict=True)))
            except StopIteration as done:
                result: ExecutionPage = done.value
                return result

    async def close(self) -> None:
        """As `Fleet.close`."""
        with self._lock:
            self._closed = True
            stores, self._stores = list(self._stores.values()), {}
        failure: BaseException | None = None
        for store in stores:
            try:
                await store.close()
            except BaseException as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    async def __aenter__(self) -> AsyncFleet:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
