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

import asyncio
import hashlib
import inspect
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from harel_store.aio import AsyncLibsqlStore
from harel_store.checks import (
    check_finite,
    check_id,
    check_text,
    check_timeout,
    check_trace_max,
    decode_cursor,
    encode_cursor,
)
from harel_store.connection import parse_database
from harel_store.connection.local import check_local_options
from harel_store.core import _page
from harel_store.errors import StoreError
from harel_store.models import STATUSES, ExecutionPage, ExecutionSummary
from harel_store.store import LibsqlStore

__all__ = ["AsyncFleet", "Fleet", "rendezvous", "root_key"]

Route = Callable[[str], str]
# The options a fleet passes to every database's store: LibsqlStore's, less the ones that
# name a database (a replica's primary is one database's, never every database's).
_PER_DATABASE = ("database", "auth_token", "sync_url", "sync_interval")
_OPTIONS = frozenset(inspect.signature(LibsqlStore).parameters) - set(_PER_DATABASE)
_MOST_THREADS = 8  # a sync fleet reads at most this many databases at once


def root_key(execution_id: str) -> str:
    """The part of an execution id that decides its database: the text before its first
    ``"."`` (all of it when it has none)."""
    return execution_id.partition(".")[0]


def rendezvous(names: Iterable[str], execution_id: str) -> str:
    """The name whose sha256 of ``name + root key`` is highest (rendezvous hashing)."""
    key = root_key(execution_id)
    return max(names, key=lambda name: (hashlib.sha256((name + key).encode()).digest(), name))


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
        for name, database in databases.items():
            check_id(name, "database name")
            db = parse_database(database, auth_token)  # no I/O: its grammar only
            if db.local == ":memory:":
                raise ValueError(
                    f"database {name!r} is :memory:, which no other connection can see: "
                    "give a file or a server"
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


def _listing(
    definition_id: str | None,
    status: str | Iterable[str] | None,
    roots_only: bool,
    limit: int,
    cursor: str | None,
    updated_after: float | None,
    updated_before: float | None,
    newest_first: bool,
    id_prefix: str | None,
) -> tuple[dict[str, Any], str]:
    """A fleet listing's arguments, checked as one store checks them (before any database is
    opened), as each store takes them; and the listing's order (`harel_store.checks.ORDERS`)."""
    check_id(definition_id, "definition_id", optional=True)
    if id_prefix is not None:
        if not isinstance(id_prefix, str):
            raise TypeError(f"id_prefix must be a string, not {type(id_prefix).__name__}")
        check_text(id_prefix, "id_prefix")
    for flag, value in (("roots_only", roots_only), ("newest_first", newest_first)):
        if not isinstance(value, bool):
            raise TypeError(f"{flag} must be a bool, not {type(value).__name__}")
    if updated_after is not None:
        check_finite(updated_after, "updated_after")
    if updated_before is not None:
        check_finite(updated_before, "updated_before")
    statuses = [status] if isinstance(status, str) else None if status is None else list(status)
    for s in statuses or ():
        if s not in STATUSES:
            raise ValueError(f"unknown status {s!r}: expected one of {', '.join(STATUSES)}")
    _page(limit)
    window = updated_after is not None or updated_before is not None
    order = "newest" if newest_first else "oldest" if window else "id"
    if cursor is not None:
        decode_cursor(cursor, order)  # ValueError/TypeError for one no listing made
    arguments = {
        "definition_id": definition_id,
        "status": statuses,
        "roots_only": roots_only,
        "limit": limit,
        "cursor": cursor,
        "updated_after": updated_after,
        "updated_before": updated_before,
        "newest_first": newest_first,
        "id_prefix": id_prefix,
    }
    return arguments, order


def _merged(pages: list[ExecutionPage], limit: int, order: str) -> ExecutionPage:
    """One page of every database's pages (each in ``order``, each read after the same
    cursor): their rows in that order, cut to ``limit``, and the cursor of its last row."""
    rows = [item for page in pages for item in page.items]
    if order == "id":
        rows.sort(key=lambda s: s.id)
    elif order == "oldest":  # a time window: every row has its time
        rows.sort(key=lambda s: (s.updated_at, s.id))
    else:  # newest first; the rows without a time last, by id descending
        rows.sort(key=_newest, reverse=True)
    more = len(rows) > limit or any(page.next_cursor is not None for page in pages)
    items = rows[:limit]
    if not more or not items:
        return ExecutionPage(items=items)
    last = items[-1]
    return ExecutionPage(items=items, next_cursor=encode_cursor(last.id, order, last.updated_at))


def _newest(s: ExecutionSummary) -> tuple[bool, float, str]:
    return (s.updated_at is not None, s.updated_at or 0.0, s.id)


class Fleet(_Fleet):
    """Several named databases an engine spreads its executions over (see the module
    docstring). ``databases`` maps each name (an id, as execution ids are) to a database as
    `LibsqlStore` takes it (a path or a URL; not ``:memory:``); ``route``, if given, maps an
    execution id to a name; ``auth_token`` and ``options`` (`LibsqlStore`'s: ``timeout``,
    ``synchronous``, ``busy_timeout``, ``trace_max``, ``migrate``) are the same for every
    database. Nothing is opened until it is used. Safe to share between threads."""

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
        every row would give, with a cursor for the next. Each database is read once a page
        (``limit`` rows past the cursor), several at once."""
        arguments, order = _listing(
            definition_id,
            status,
            roots_only,
            limit,
            cursor,
            updated_after,
            updated_before,
            newest_first,
            id_prefix,
        )

        def page(name: str) -> ExecutionPage:
            return self.store(name).list_executions(**arguments)

        if len(self._names) == 1:
            pages = [page(self._names[0])]
        else:
            pages = list(self._threads().map(page, self._names))
        return _merged(pages, limit, order)

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
            definition_id,
            status,
            roots_only,
            limit,
            cursor,
            updated_after,
            updated_before,
            newest_first,
            id_prefix,
        )

        async def page(name: str) -> ExecutionPage:
            return await (await self.store(name)).list_executions(**arguments)

        pages = await asyncio.gather(*(page(name) for name in self._names))
        return _merged(list(pages), limit, order)

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
