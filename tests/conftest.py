"""Fixtures: one contract suite over every way the store can be opened."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, LibsqlStore, SqliteStore
from tests.helpers import SyncFacade

Opener = Callable[..., Any]


def _async_opener(loop: asyncio.AbstractEventLoop) -> Opener:
    def open_async(database: str | Path = ":memory:", **kwargs: Any) -> SyncFacade:
        store = loop.run_until_complete(AsyncLibsqlStore.create(database, **kwargs))
        return SyncFacade(store, loop)

    return open_async


LOCAL_KINDS = ["libsql-memory", "libsql-file", "sqlite-file", "async-libsql-file"]


@pytest.fixture(params=LOCAL_KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(kind: str, tmp_path: Path) -> Iterator[Opener]:
    """A function that opens a store of this test's kind (same database on every call)."""
    opened: list[Any] = []
    database: str | Path = ":memory:" if kind.endswith("memory") else tmp_path / "state.db"
    loop = asyncio.new_event_loop() if kind.startswith("async") else None
    make: Opener = (
        _async_opener(loop)
        if loop
        else {"libsql": LibsqlStore, "sqlite": SqliteStore}[kind.split("-")[0]]
    )

    def opener(**kwargs: Any) -> Any:
        store = make(database, **kwargs)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()
    if loop is not None:
        loop.close()


@pytest.fixture
def store(open_store: Opener) -> Any:
    return open_store()
