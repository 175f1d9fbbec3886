"""A fleet's listing reads each database for its share of a page and reads on where one
database holds more of it (a database per tenant): every page, through every cursor, is
the page one store holding every row gives."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncFleet, Execution, Fleet, LibsqlStore
from harel_store.fleet import rendezvous


def tenant(execution_id: str) -> str:
    """acme's executions in db0, the others hashed over all three."""
    return (
        "db0"
        if execution_id.startswith("acme")
        else rendezvous(["db0", "db1", "db2"], execution_id)
    )


def every_page(lister: Any, **arguments: Any) -> list[list[str]]:
    pages, cursor = [], None
    while True:
        page = lister(cursor=cursor, **arguments)
        pages.append([s.id for s in page.items])
        if page.next_cursor is None:
            return pages
        cursor = page.next_cursor


@pytest.fixture
def stores(tmp_path: Path) -> Any:
    databases = {f"db{i}": str(tmp_path / f"db{i}.db") for i in range(3)}
    with Fleet(databases, route=tenant) as fleet, LibsqlStore(tmp_path / "one.db") as one:
        ids = [f"acme-{i:02d}" for i in range(60)] + [f"zeta-{i:02d}" for i in range(25)]
        ids += [f"beta-{i:02d}" for i in range(15)]
        for n, exe_id in enumerate(ids):
            status = "finished" if n % 3 == 0 else "running"
            fleet.store_for(exe_id).save(Execution(id=exe_id, definition_id="d", status=status))
            one.save(Execution(id=exe_id, definition_id="d", status=status))
            time.sleep(0.002)  # the database's clock counts milliseconds: no two rows tie
        assert len(fleet.store("db0").list_executions(limit=1000).items) >= 60
        yield databases, fleet, one


@pytest.mark.parametrize("limit", [1, 7, 25, 100, 1000])
@pytest.mark.parametrize("newest_first", [False, True])
def test_every_page_is_one_stores_page(stores: Any, limit: int, newest_first: bool) -> None:
    _, fleet, one = stores
    for extra in ({}, {"id_prefix": "acme"}, {"status": "running"}, {"id_prefix": "beta"}):
        arguments = {"limit": limit, "newest_first": newest_first, **extra}
        expected = every_page(one.list_executions, **arguments)
        assert every_page(fleet.list_executions, **arguments) == expected
        assert sum(map(len, expected)) == len(
            one.list_executions(**{**arguments, "limit": 1000}).items
        )


def test_the_async_fleet_reads_on_as_the_sync_one(stores: Any) -> None:
    databases, _, one = stores

    async def pages() -> list[list[str]]:
        async with AsyncFleet(databases, route=tenant) as afleet:
            found, cursor = [], None
            while True:
                page = await afleet.list_executions(limit=30, cursor=cursor)
                found.append([s.id for s in page.items])
                if page.next_cursor is None:
                    return found
                cursor = page.next_cursor

    assert asyncio.run(pages()) == every_page(one.list_executions, limit=30)
