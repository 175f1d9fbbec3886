"""A fleet of databases (issue 39): routing, lazy opening, one listing across every
database in a single store's order, bad input; on files and on real sqld servers."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    AsyncFleet,
    AsyncLibsqlStore,
    Execution,
    ExecutionPage,
    Fleet,
    LibsqlStore,
    StoreError,
)
from harel_store.models import Status
from tests.helpers import raw

T0 = 1_780_000_000.0
NAMES = ("east", "north", "south")


def expected_route(names: list[str], execution_id: str) -> str:
    """The design's rule, written out: the highest sha256 of name + root key."""
    key = execution_id.split(".", 1)[0]
    return max(names, key=lambda n: hashlib.sha256((n + key).encode()).hexdigest())


def files(tmp_path: Path, names: tuple[str, ...] = NAMES) -> dict[str, str]:
    return {name: str(tmp_path / f"{name}.db") for name in names}


# -- routing -----------------------------------------------------------------------------


def test_the_route_is_rendezvous_hashing_of_the_root_key(tmp_path: Path) -> None:
    fleet = Fleet(files(tmp_path))
    assert fleet.names == sorted(NAMES)
    fleet.names.append("west")  # a copy: the fleet is as it was
    assert fleet.names == sorted(NAMES)
    ids = [f"order-{i}" for i in range(300)]
    for eid in ids:
        assert fleet.route(eid) == expected_route(fleet.names, eid)
        # children (and theirs) live with their root
        assert fleet.route(f"{eid}.payment") == fleet.route(eid)
        assert fleet.route(f"{eid}.payment.retry.2") == fleet.route(eid)
    assert {fleet.route(eid) for eid in ids} == set(NAMES)  # every database takes some
    assert not any(Path(p).exists() for p in files(tmp_path).values())  # route reads nothing


def test_routes_are_the_same_in_another_process(tmp_path: Path) -> None:
    databases = files(tmp_path)
    ids = [f"tenant-{i}.job-{i % 7}" for i in range(500)]
    here = {eid: Fleet(databases).route(eid) for eid in ids}
    code = (
        "import json, sys\n"
        "from harel_store import Fleet\n"
        "databases, ids = json.load(sys.stdin)\n"
        "fleet = Fleet(databases)\n"
        "print(json.dumps({i: fleet.route(i) for i in ids}))\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}  # a different str hash: no effect
    done = subprocess.run(
        [sys.executable, "-c", code],
        input=json.dumps([databases, ids]),
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=True,
    )
    assert json.loads(done.stdout) == here


def test_a_fifth_database_moves_only_the_roots_it_wins(tmp_path: Path) -> None:
    four = Fleet(files(tmp_path, ("a", "b", "c", "d")))
    five = Fleet(files(tmp_path, ("a", "b", "c", "d", "e")))
    roots = [f"order-{i}" for i in range(10_000)]
    shares = Counter(four.route(r) for r in roots)
    assert all(0.2 <= n / len(roots) <= 0.3 for n in shares.values()), shares  # even
    moved = [r for r in roots if four.route(r) != five.route(r)]
    assert 0.15 <= len(moved) / len(roots) <= 0.25
    assert {five.route(r) for r in moved} == {"e"}  # nothing moves between the old four


def test_a_route_of_ones_own(tmp_path: Path) -> None:
    by_tenant = Fleet(files(tmp_path), route=lambda eid: eid.split(":", 1)[0])
    assert by_tenant.route("north:order-1") == "north"
    assert by_tenant.store_for("south:order-1") is by_tenant.store("south")
    with pytest.raises(ValueError, match="not a database of the fleet"):
        by_tenant.route("west:order-1")
    with pytest.raises(ValueError, match="not a database of the fleet"):
        Fleet(files(tmp_path), route=lambda eid: None).route("x")  # type: ignore[arg-type, return-value]
    with pytest.raises(TypeError, match="route must be callable"):
        Fleet(files(tmp_path), route="north")  # type: ignore[arg-type]
    by_tenant.close()
    assert not (tmp_path / "east.db").exists()


# -- construction and opening -------------------------------------------------------------


def test_nothing_is_opened_before_it_is_used(tmp_path: Path) -> None:
    databases = files(tmp_path)
    with Fleet(databases, trace_max=5, synchronous="NORMAL") as fleet:
        assert not any(Path(p).exists() for p in databases.values())
        north = fleet.store("north")
        assert isinstance(north, LibsqlStore)
        assert north.trace_max == 5
        assert fleet.store("north") is north
        assert [n for n, p in databases.items() if Path(p).exists()] == ["north"]
        exe = Execution(id="order-1", definition_id="order")
        fleet.store_for(exe.id).save(exe)
        assert fleet.store(fleet.route("order-1")).load("order-1") == exe
    with pytest.raises(StoreError, match="closed"):
        fleet.store("north")


def test_one_store_per_database_however_many_threads_ask(tmp_path: Path) -> None:
    fleet = Fleet(files(tmp_path))
    got: list[LibsqlStore] = []
    start = threading.Barrier(8)

    def ask() -> None:
        start.wait()
        got.append(fleet.store("east"))

    threads = [threading.Thread(target=ask) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and all(s is got[0] for s in got)
    fleet.close()


@pytest.mark.parametrize(
    ("databases", "options", "error", "match"),
    [
        ({}, {}, ValueError, "at least one database"),
        ({"a": ":memory:"}, {}, ValueError, ":memory:"),
        ({"a": "sqlite+libsql://"}, {}, ValueError, ":memory:"),
        ({"": "x.db"}, {}, ValueError, "database name"),
        ({"a\x00b": "x.db"}, {}, ValueError, "NUL"),
        ({1: "x.db"}, {}, TypeError, "database name"),
        ({"a": ""}, {}, ValueError, "must not be empty"),
        ({"a": None}, {}, TypeError, "path or a URL"),
        ({"a": "ftp://host/x"}, {}, ValueError, "unknown scheme"),
        ([("a", "x.db")], {}, TypeError, "map names"),
        ({"a": "x.db"}, {"sync_url": "http://127.0.0.1:1"}, TypeError, "no sync_url"),
        ({"a": "x.db"}, {"colour": "red"}, TypeError, "unknown option"),
        ({"a": "x.db"}, {"trace_max": -1}, ValueError, "trace_max"),
        ({"a": "x.db"}, {"auth_token": 7}, TypeError, "auth_token"),
        ({"a": "x.db"}, {"timeout": 0}, ValueError, "timeout"),
        ({"a": "x.db"}, {"synchronous": "SOMETIMES"}, ValueError, "synchronous"),
        ({"a": "x.db"}, {"busy_timeout": -1}, ValueError, "busy_timeout"),
    ],
)
def test_bad_fleets_are_refused_at_once(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    databases: Any,
    options: dict[str, Any],
    error: type,
    match: str,
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative x.db would be made here, were anything opened
    for kind in (Fleet, AsyncFleet):
        with pytest.raises(error, match=match):
            kind(databases, **options)
    assert list(tmp_path.iterdir()) == []


def test_unknown_names_and_bad_ids(tmp_path: Path) -> None:
    with Fleet(files(tmp_path)) as fleet:
        with pytest.raises(ValueError, match="no database named 'west'"):
            fleet.store("west")
        with pytest.raises(ValueError, match="no database named"):
            fleet.store(None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="execution_id"):
            fleet.route("")
        with pytest.raises(TypeError, match="execution_id"):
            fleet.store_for(7)  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


# -- one listing across the fleet ---------------------------------------------------------


def populate(stores: list[Any], route: Any) -> None:
    """The same 90 executions in ``stores[0]`` (one store holding all) and, routed, in the
    fleet's; times with ties (the id decides) and some without a time (written before 0005)."""
    statuses: list[Status] = ["running", "finished", "failed", "cancelled"]
    times: dict[str, float | None] = {}
    for i in range(30):
        root = Execution(
            id=f"{'order' if i % 3 else 'invoice'}-{i:02d}",
            definition_id="order" if i % 3 else "invoice",
            status=statuses[i % 4],
        )
        kids = [
            Execution(
                id=f"{root.id}.{part}", definition_id="step", parent_id=root.id, status=statuses[j]
            )
            for j, part in enumerate(("pay", "ship"))
        ]
        for k, exe in enumerate([root, *kids]):
            times[exe.id] = None if (i + k) % 11 == 0 else T0 + (i * 3 + k) % 7
            for store in (stores[0], route(exe.id)):
                store.save(exe.model_copy())
    for store in stores:
        conn = raw(store)
        for eid, at in times.items():
            conn.execute("UPDATE harel_executions SET updated_at = ? WHERE id = ?", (at, eid))
        conn.commit()


LISTINGS: list[dict[str, Any]] = [
    {},
    {"newest_first": True},
    {"updated_after": T0 + 2},
    {"updated_after": T0 + 1, "updated_before": T0 + 5, "newest_first": True},
    {"updated_before": T0 + 4},
    {"status": ["failed", "running"]},
    {"status": "finished", "newest_first": True},
    {"roots_only": True},
    {"definition_id": "order", "newest_first": True},
    {"id_prefix": "order-1"},
    {"id_prefix": "order-2", "newest_first": True, "roots_only": True},
]


def pages(lister: Any, limit: int, **arguments: Any) -> list[ExecutionPage]:
    out = []
    cursor = None
    while True:
        page = lister(limit=limit, cursor=cursor, **arguments)
        out.append(page)
        cursor = page.next_cursor
        if cursor is None:
            return out


def shown(listed: list[ExecutionPage]) -> list[tuple[list[dict[str, Any]], str | None]]:
    """Each page's rows (less created_at: each database's clock wrote its own) and cursor."""
    return [
        ([s.model_dump(exclude={"created_at"}) for s in page.items], page.next_cursor)
        for page in listed
    ]


async def apages(
    databases: dict[str, str], limit: int, arguments: dict[str, Any]
) -> list[ExecutionPage]:
    """Every page of an AsyncFleet's listing."""
    out = []
    async with AsyncFleet(databases) as fleet:
        cursor = None
        while True:
            page = await fleet.list_executions(limit=limit, cursor=cursor, **arguments)
            out.append(page)
            if (cursor := page.next_cursor) is None:
                return out


@pytest.fixture
def fleet_and_one(tmp_path: Path) -> Iterator[tuple[Fleet, LibsqlStore, dict[str, str]]]:
    with Fleet(files(tmp_path)) as fleet, LibsqlStore(str(tmp_path / "one.db")) as one:
        stores = [one, *(fleet.store(name) for name in fleet.names)]
        populate(stores, fleet.store_for)
        yield fleet, one, files(tmp_path)


@pytest.mark.parametrize("arguments", LISTINGS, ids=lambda a: ",".join(a) or "by-id")
def test_the_fleet_lists_as_one_store_holding_every_row(
    fleet_and_one: tuple[Fleet, LibsqlStore, dict[str, str]], arguments: dict[str, Any]
) -> None:
    fleet, one, databases = fleet_and_one
    assert all(fleet.store(n).list_executions().items for n in fleet.names)  # rows everywhere
    for limit in (1, 7, 200):
        theirs = pages(fleet.list_executions, limit, **arguments)
        ours = pages(one.list_executions, limit, **arguments)
        # the same rows, the same page breaks, the very same cursors
        assert shown(theirs) == shown(ours)
    theirs = asyncio.run(apages(databases, 7, arguments))  # the async fleet: the same
    assert shown(theirs) == shown(pages(one.list_executions, 7, **arguments))
    assert sum(len(p.items) for p in ours) > 0


def test_a_cursor_is_checked_before_any_database_is_read(tmp_path: Path) -> None:
    fleet = Fleet(files(tmp_path))
    for cursor in ("garbage", "", "eyJhZnRlciI6IDF9"):
        with pytest.raises(ValueError, match="not a cursor"):
            fleet.list_executions(cursor=cursor)
    with pytest.raises(TypeError, match="cursor"):
        fleet.list_executions(cursor=7)  # type: ignore[arg-type]
    by_id = LibsqlStore(str(tmp_path / "one.db"))
    for i in range(3):
        by_id.save(Execution(id=f"x{i}", definition_id="d"))
    next_cursor = by_id.list_executions(limit=1).next_cursor
    by_id.close()
    with pytest.raises(ValueError, match="in id order, not newest order"):
        fleet.list_executions(cursor=next_cursor, newest_first=True)
    refused: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"limit": 0}, ValueError),
        ({"limit": 1001}, ValueError),
        ({"status": "lost"}, ValueError),
        ({"newest_first": 1}, TypeError),
        ({"updated_after": float("nan")}, ValueError),
        ({"definition_id": ""}, ValueError),
        ({"id_prefix": 3}, TypeError),
    ]
    for bad, error in refused:
        with pytest.raises(error):
            fleet.list_executions(**bad)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.db"]  # no fleet file made


def test_the_async_fleet(tmp_path: Path) -> None:
    databases = files(tmp_path)

    async def main() -> None:
        async with AsyncFleet(databases) as fleet:
            assert fleet.route("order-1") == Fleet(databases).route("order-1")  # no await
            assert not any(Path(p).exists() for p in databases.values())
            many = await asyncio.gather(*(fleet.store("east") for _ in range(5)))
            assert all(s is many[0] for s in many)
            assert isinstance(many[0], AsyncLibsqlStore)
            for i in range(20):
                exe = Execution(id=f"order-{i:02d}", definition_id="order")
                await (await fleet.store_for(exe.id)).save(exe)
            seen: list[str] = []
            cursor = None
            while True:
                page = await fleet.list_executions(limit=6, cursor=cursor)
                seen += [s.id for s in page.items]
                if (cursor := page.next_cursor) is None:
                    break
            assert seen == [f"order-{i:02d}" for i in range(20)]
            newest = await fleet.list_executions(limit=100, newest_first=True)
            assert sorted(s.id for s in newest.items) == seen
            with pytest.raises(ValueError, match="no database named"):
                await fleet.store("west")
            with pytest.raises(ValueError, match="not a cursor"):
                await fleet.list_executions(cursor="nope")
        with pytest.raises(StoreError, match="closed"):
            await fleet.store("east")

    asyncio.run(main())


# -- on real sqld servers ----------------------------------------------------------------


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Any]]:
    """Two sqld servers, each with token auth on (each its own key, so its own token)."""
    from tests.sqld import SqldServer

    started = []
    try:
        for i in range(2):
            server = SqldServer(tmp_path_factory.mktemp(f"fleet-sqld-{i}"), auth=True)
            server.start()
            started.append(server)
        yield started
    finally:
        for server in started:
            server.stop()


def test_a_fleet_of_servers_and_a_file(servers: list[Any], tmp_path: Path) -> None:
    databases = {f"srv{i}": f"{s.url}?authToken={s.token}" for i, s in enumerate(servers)} | {
        "local": str(tmp_path / "local.db")
    }
    tokens = [s.token for s in servers]
    with Fleet(databases, migrate=True, timeout=10) as fleet:
        assert not any(t in repr(fleet) for t in tokens)
        roots = [f"order-{i}" for i in range(30)]
        for root in roots:
            store = fleet.store_for(root)
            parent = Execution(id=root, definition_id="order")
            store.save(parent)
            child = Execution(id=f"{root}.pay", definition_id="pay", parent_id=root)
            fleet.store_for(child.id).save(child)
            assert store.load(child.id) == child  # the child lives with its root
        assert {fleet.route(r) for r in roots} == set(databases)
        listed = pages(fleet.list_executions, 8)
        ids = [s.id for p in listed for s in p.items]
        assert ids == sorted([*roots, *(f"{r}.pay" for r in roots)])
        for name in fleet.names:
            assert all(fleet.route(s.id) == name for s in fleet.store(name).list_executions().items)


def test_a_server_that_refuses_the_token_shows_no_token(servers: list[Any]) -> None:
    secret = "not-the-token-" + "x" * 20
    fleet = Fleet(
        {"a": servers[0].url, "b": f"{servers[1].url}?authToken={secret}"},
        auth_token=secret,
        timeout=5,
    )
    assert secret not in repr(fleet)
    for name in fleet.names:
        with pytest.raises(StoreError) as caught:
            fleet.store(name)
        assert secret not in str(caught.value) and secret not in repr(caught.value)
    fleet.close()


# -- one database under two names (issue 48, class 13) -------------------------------------


def spellings(tmp_path: Path) -> list[tuple[str, str]]:
    """Pairs of spellings of one database: each pair names the same file or server."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    (tmp_path / "alias.db").symlink_to(tmp_path / "one.db")  # to a file not made yet
    return [
        ("one.db", str(tmp_path / "one.db")),  # relative (from tmp_path) and absolute
        (str(tmp_path / "alias.db"), str(tmp_path / "one.db")),  # a symlink to the file
        (str(tmp_path / "link" / "x.db"), str(tmp_path / "real" / "x.db")),  # a linked dir
        (str(tmp_path / "real" / ".." / "one.db"), "one.db"),
        (f"file://{tmp_path / 'one.db'}", "one.db"),
        (f"sqlite+libsql:///{tmp_path / 'one.db'}", str(tmp_path / "one.db")),
        ("http://db.example:8080", "http://DB.example:8080/"),
        ("https://db.example", "https://db.example:443/"),
        ("http://db.example", "http://db.example:80"),
        ("libsql://db.example", "https://db.example?authToken=other"),
        ("ws://db.example:8080", "http://db.example:8080"),
        ("sqlite+libsql://db.example:8080?secure=false", "http://db.example:8080"),
        ("http://[::1]:8080", "http://[0:0::1]:8080/"),
    ]


def test_one_database_under_two_names_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    for first, second in spellings(tmp_path):
        for kind in (Fleet, AsyncFleet):
            with pytest.raises(ValueError, match="one database under two names") as caught:
                kind({"east": first, "west": second})
            message = str(caught.value)
            assert "'east'" in message and "'west'" in message, message
            assert "other" not in message  # a token is never shown
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alias.db", "link", "real"]


def test_different_databases_that_look_alike_are_two(tmp_path: Path) -> None:
    for first, second in [
        (str(tmp_path / "a.db"), str(tmp_path / "b.db")),
        ("http://db.example:8080", "http://db.example:8081"),
        ("http://db.example", "https://db.example"),  # another port, another server
        ("http://east.db.example", "http://west.db.example"),  # sqld's namespaces
        ("http://db.example/a", "http://db.example/b"),
    ]:
        assert Fleet({"east": first, "west": second}).names == ["east", "west"]


# -- wait_for: routes, then waits ------------------------------------------------------------


def test_fleet_wait_for_routes_then_waits(tmp_path: Path) -> None:
    databases = files(tmp_path)
    with Fleet(databases) as fleet:
        ids = [f"order-{i}" for i in range(6)]
        assert len({fleet.route(i) for i in ids}) > 1
        for eid in ids:
            fleet.store_for(eid).save(Execution(id=eid, definition_id="order"))

        def finish() -> None:
            for eid in ids:
                store = fleet.store_for(eid)
                exe = store.load(eid)
                assert exe is not None
                store.commit(exe.model_copy(update={"status": "finished"}), [])

        timer = threading.Timer(0.2, finish)
        timer.start()
        try:
            for eid in ids:
                done = fleet.wait_for(eid, timeout=30)
                assert (done.id, done.status) == (eid, "finished")
        finally:
            timer.join()
        assert fleet.wait_for("order-2", status="finished", timeout=0).status == "finished"
        with pytest.raises(TimeoutError):
            fleet.wait_for("order-99", timeout=0.05)
        with pytest.raises(ValueError, match="unknown status"):
            fleet.wait_for("order-1", status="done", timeout=1)
        with pytest.raises(ValueError, match="execution_id"):
            fleet.wait_for("", timeout=1)
    # bad arguments open no database
    unopened = Fleet(files(tmp_path / "none"))
    with pytest.raises(ValueError, match="timeout"):
        unopened.wait_for("order-1", timeout=-1)
    with pytest.raises(ValueError, match="unknown status"):
        unopened.wait_for("order-1", status=("finished", "gone"), timeout=1)
    assert not (tmp_path / "none").exists()


def test_async_fleet_wait_for_routes_then_waits(tmp_path: Path) -> None:
    databases = files(tmp_path)

    async def main() -> None:
        async with AsyncFleet(databases) as fleet:
            ids = [f"order-{i}" for i in range(6)]
            for eid in ids:
                await (await fleet.store_for(eid)).save(Execution(id=eid, definition_id="order"))

            async def finish() -> None:
                await asyncio.sleep(0.2)
                for eid in ids:
                    store = await fleet.store_for(eid)
                    exe = await store.load(eid)
                    assert exe is not None
                    await store.commit(exe.model_copy(update={"status": "failed"}), [])

            task = asyncio.create_task(finish())
            done = await asyncio.gather(*(fleet.wait_for(eid, timeout=30) for eid in ids))
            await task
            assert [(d.id, d.status) for d in done] == [(eid, "failed") for eid in ids]
            again = await fleet.wait_for("order-3", status=["failed"], timeout=0)
            assert again.status == "failed"
            with pytest.raises(TimeoutError):
                await fleet.wait_for("order-99", timeout=0.05)
        unopened = AsyncFleet(files(tmp_path / "none"))
        with pytest.raises(TypeError):
            await unopened.wait_for("order-1", timeout="soon")  # type: ignore[arg-type]
        assert not (tmp_path / "none").exists()

    asyncio.run(main())
