"""Times for operators (migration 0005), on every kind of store: executions' created_at and
updated_at on the database's clock, listings newest first and by time window, the outbox
entries' source, the operator views of the queues, and the stats an operator ages by.

Orderings are tested on times staged through a connection of the test's own (as
tests/test_claims.py moves leases), so no test waits on the clock but the one that checks
every CAS write moves it.
"""

from __future__ import annotations

import math
import sqlite3
import sys
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    ArmedTimer,
    Event,
    Execution,
    LibsqlStore,
    PendingOutbox,
    PendingSpawn,
    SqliteStore,
    TimerOp,
)
from harel_store.schema import describe
from harel_store.sql import HEAD
from tests.helpers import ALEMBIC, Refusal, raises_each, raw
from tests.in_process import alembic_in_process

# id -> (status, parent_id, updated_at staged; None: written before 0005)
ROWS: dict[str, tuple[str, str | None, float | None]] = {
    "e0": ("running", None, 10.0),
    "e1": ("finished", None, 30.0),
    "e2": ("running", None, 20.0),
    "e3": ("failed", "e0", 20.0),
    "e4": ("running", None, None),
    "e5": ("cancelled", "e0", None),
}
NEWEST = ["e1", "e3", "e2", "e0", "e5", "e4"]  # (updated_at, id) descending, untimed last


def ids(page: Any) -> list[str]:
    return [s.id for s in page.items]


def stage(store: Any) -> None:
    """ROWS, with their update times (created_at likewise) set by hand."""
    for eid, (status, parent, _) in ROWS.items():
        store.save(Execution(id=eid, definition_id="d", status=status, parent_id=parent))
    db = raw(store)
    for eid, (*_, at) in ROWS.items():
        db.execute(
            "UPDATE harel_executions SET created_at = ?, updated_at = ? WHERE id = ?",
            (at, at, eid),
        )
    db.commit()
    store.sync()


def walk(store: Any, limit: int, **kwargs: Any) -> list[str]:
    """Every id of a listing, page by page."""
    got: list[str] = []
    cursor = None
    while True:
        page = store.list_executions(limit=limit, cursor=cursor, **kwargs)
        assert len(page.items) <= limit
        got += ids(page)
        cursor = page.next_cursor
        if cursor is None:
            return got


def test_every_cas_write_stamps_the_database_clock(store: Any) -> None:
    before = time.time()
    exe = Execution(id="a", definition_id="d")
    store.save(exe)
    (first,) = store.list_executions().items
    assert first.created_at == first.updated_at  # one 'now' for the insert
    assert first.created_at is not None and before - 5 <= first.created_at <= time.time() + 5
    last = first.updated_at
    # Each CAS shape: data only, with an emit, moving the status, every column (a new parent).
    for step in ("save", "commit", "status", "parent"):
        if step == "status":
            exe.status = "finished"
        if step == "parent":
            exe.parent_id = "p"
        time.sleep(0.003)  # the clock has millisecond steps
        if step == "commit":
            store.commit(exe, [(None, Event(name="go"))])
        else:
            store.save(exe)
        (now,) = store.list_executions().items
        assert now.created_at == first.created_at, step
        assert now.updated_at is not None and now.updated_at > last, step
        last = now.updated_at
    (child,) = store.children_of("p")
    assert (child.created_at, child.updated_at) == (first.created_at, last)
    # The times come back exactly: a window bound at a row's own time.
    assert ids(store.list_executions(updated_after=last)) == ["a"]
    assert ids(store.list_executions(updated_before=last)) == []


def test_newest_first_orders_by_update_time_then_id_untimed_last(store: Any) -> None:
    stage(store)
    assert ids(store.list_executions(newest_first=True)) == NEWEST
    for limit in (1, 2, 4, 5):
        assert walk(store, limit, newest_first=True) == NEWEST
    running = [e for e in NEWEST if ROWS[e][0] == "running"]
    assert walk(store, 1, newest_first=True, status="running") == running
    assert walk(store, 1, newest_first=True, status=["failed", "cancelled"]) == ["e3", "e5"]
    roots = [e for e in NEWEST if ROWS[e][1] is None]
    assert walk(store, 2, newest_first=True, roots_only=True) == roots
    assert ids(store.list_executions(newest_first=True, definition_id="x")) == []
    assert walk(store, 3, newest_first=True, definition_id="d") == NEWEST
    # Untimed rows keep the times they had (None) in every summary.
    summaries = {s.id: s for s in store.list_executions().items}
    assert (summaries["e4"].created_at, summaries["e4"].updated_at) == (None, None)
    assert summaries["e1"].updated_at == 30.0


def test_a_time_window_is_inclusive_below_and_exclusive_above(store: Any) -> None:
    stage(store)
    # A window is read oldest first (newest first on request); untimed rows are in none.
    assert walk(store, 1, updated_after=20.0) == ["e2", "e3", "e1"]
    assert walk(store, 1, updated_before=20.0) == ["e0"]
    assert walk(store, 2, updated_after=10.0, updated_before=30.0) == ["e0", "e2", "e3"]
    assert walk(store, 1, updated_after=10, updated_before=30, newest_first=True) == [
        "e3",
        "e2",
        "e0",
    ]
    assert walk(store, 1, updated_after=20.5, newest_first=True) == ["e1"]
    assert walk(store, 2, updated_after=20.0, status="running") == ["e2"]
    assert walk(store, 2, updated_before=1e300, roots_only=True) == ["e0", "e2", "e1"]
    assert ids(store.list_executions(updated_after=30.5)) == []
    assert ids(store.list_executions(updated_after=30.0, updated_before=10.0)) == []


def test_a_cursor_pages_only_the_order_it_came_from(store: Any) -> None:
    stage(store)
    by_id = store.list_executions(limit=1).next_cursor
    newest = store.list_executions(limit=1, newest_first=True).next_cursor
    oldest = store.list_executions(limit=1, updated_after=0.0).next_cursor
    for cursor, kwargs in [
        (by_id, {"newest_first": True}),
        (by_id, {"updated_after": 0.0}),
        (newest, {}),
        (newest, {"updated_after": 0.0}),
        (oldest, {"newest_first": True}),
        (oldest, {}),
    ]:
        with pytest.raises(ValueError, match="order"):
            store.list_executions(cursor=cursor, **kwargs)
    # The same order with a narrower window keeps to the window.
    assert ids(store.list_executions(cursor=newest, newest_first=True, updated_before=15.0)) == [
        "e0"
    ]
    assert ids(store.list_executions(cursor=oldest, updated_after=25.0)) == ["e1"]
    # A cursor into the untimed rows lists none of them once a window is given.
    untimed = store.list_executions(limit=5, newest_first=True).next_cursor
    assert ids(store.list_executions(cursor=untimed, newest_first=True)) == ["e4"]
    assert ids(store.list_executions(cursor=untimed, newest_first=True, updated_after=0)) == []


def test_an_id_prefix_bounds_every_listing_shape(store: Any) -> None:
    """In id order a range of the index, in update order a check on each row; with every
    filter and page size, across pages, and with characters LIKE or GLOB would read."""
    stage(store)
    for eid in ("e%", "e_1", "e\U0010ffff", "f", "e10"):
        store.save(Execution(id=eid, definition_id="d", status="running"))
    everything = walk(store, 50)
    filters: list[dict[str, Any]] = [
        {},
        {"status": "running"},
        {"status": ["running", "failed"]},
        {"definition_id": "d"},
        {"roots_only": True},
        {"definition_id": "d", "roots_only": True, "status": "running"},
        {"newest_first": True},
        {"newest_first": True, "status": "running"},
        {"updated_after": 15.0},
        {"updated_after": 0.0, "newest_first": True, "roots_only": True},
    ]
    for prefix in ("e", "e1", "e%", "e_", "e\U0010ffff", "", "g", "e0"):
        for kwargs in filters:
            whole = walk(store, 50, **kwargs)
            want = [i for i in whole if i.startswith(prefix)]
            for limit in (1, 2, 50):
                assert walk(store, limit, id_prefix=prefix, **kwargs) == want, (prefix, kwargs)
    assert walk(store, 2, id_prefix="e1") == ["e1", "e10"]
    assert len(everything) == 11


BAD_LISTINGS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"updated_after": "10"}, TypeError),
    ({"updated_before": True}, TypeError),
    ({"updated_after": math.nan}, ValueError),
    ({"updated_before": math.inf}, ValueError),
    ({"updated_after": 10**400}, ValueError),
    ({"newest_first": 1}, TypeError),
    ({"newest_first": True, "limit": 0}, ValueError),
    ({"newest_first": True, "status": "paused"}, ValueError),
    ({"newest_first": True, "cursor": "!!"}, ValueError),
    ({"id_prefix": 7}, TypeError),
]


def test_bad_listing_arguments_are_refused(store: Any) -> None:
    store.save(Execution(id="a", definition_id="d"))
    cases: list[Refusal] = [
        (lambda kwargs=kwargs: store.list_executions(**kwargs), error)
        for kwargs, error in BAD_LISTINGS
    ]

    def unchanged() -> None:
        assert ids(store.list_executions()) == ["a"]

    raises_each(cases, after=unchanged)


def test_paging_newest_first_while_rows_are_updated(store: Any) -> None:
    exes = [Execution(id=f"x{i:02d}", definition_id="d") for i in range(24)]
    for exe in exes:
        store.save(exe)
    seen: list[str] = []
    moved: set[str] = set()
    cursor = None
    for turn in range(20):
        page = store.list_executions(limit=5, cursor=cursor, newest_first=True)
        keys = [(s.updated_at, s.id) for s in page.items]
        assert keys == sorted(keys, reverse=True)
        seen += ids(page)
        cursor = page.next_cursor
        if cursor is None:
            break
        for exe in exes[turn::7]:  # rows already listed and rows still to come move up
            store.save(exe)
            moved.add(exe.id)
    else:
        pytest.fail("paging did not end")
    assert len(seen) == len(set(seen))  # a row moves above the cursor: never listed twice
    assert {e.id for e in exes} - moved <= set(seen)  # a row left alone is never missed


def test_outbox_entries_name_their_source(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    before = time.time()
    store.commit(
        Execution(id="a", definition_id="d"),
        [("b", Event(name="one", id="ev1")), (None, Event(name="all", id="ev2"))],
    )
    store.commit(Execution(id="c", definition_id="d"), [("b", Event(name="two", id="ev3"))])
    view = store.outbox_view()
    assert all(isinstance(e, PendingOutbox) for e in view)
    assert [(e.target_id, e.source_id, e.event.id) for e in view] == [
        ("b", "a", "ev1"),
        (None, "a", "ev2"),
        ("b", "c", "ev3"),
    ]
    assert [e.seq for e in view] == [e.seq for e in store.pending_outbox()]
    assert all(before - 5 <= (e.created_at or 0) <= time.time() + 5 for e in view)
    assert {(e.claimed_by, e.claimed_until) for e in view} == {(None, None)}
    assert [e.event.id for e in store.outbox_view(target="b")] == ["ev1", "ev3"]
    assert [e.event.id for e in store.outbox_view(source="a")] == ["ev1", "ev2"]
    assert [e.event.id for e in store.outbox_view(target="b", source="c")] == ["ev3"]
    assert store.outbox_view(target="b", source="x") == []
    assert [e.event.id for e in store.outbox_view(limit=1)] == ["ev1"]
    (claimed,) = store.claim_outbox("w1", limit=1, lease=60.0)
    first = store.outbox_view(limit=1)[0]
    assert first.claimed_by == "w1" and first.claimed_until is not None
    assert first.created_at is not None and first.claimed_until > first.created_at + 50
    assert store.outbox_for("b")[0] == claimed  # the relay's tuple is unchanged
    db = raw(store)
    db.execute("UPDATE harel_outbox SET event = '{broken' WHERE seq = ?", (view[1].seq,))
    db.commit()
    store.sync()
    assert [e.event.id for e in store.outbox_view()] == ["ev1", "ev3"]
    assert any(f"outbox entry {view[1].seq}" in r.getMessage() for r in caplog.records)


def test_the_spawn_and_timer_views(store: Any, caplog: pytest.LogCaptureFixture) -> None:
    before = time.time()
    store.commit(
        Execution(id="p", definition_id="d"),
        [],
        spawns=[("c1", "r", {"n": 1}), ("c2", "r", {"n": 2})],
        timers=[TimerOp.schedule("late", sys.float_info.max), TimerOp.schedule("soon", 5.0)],
    )
    store.commit(
        Execution(id="q", definition_id="d"),
        [],
        spawns=[("c3", "r", {})],
        timers=[TimerOp.schedule("soon", 5.0)],
    )
    spawns = store.spawns_view()
    assert all(isinstance(s, PendingSpawn) for s in spawns)
    assert [(s.parent_id, s.child_id, s.root_path, s.context) for s in spawns] == [
        ("p", "c1", "r", {"n": 1}),
        ("p", "c2", "r", {"n": 2}),
        ("q", "c3", "r", {}),
    ]
    assert all(before - 5 <= (s.created_at or 0) <= time.time() + 5 for s in spawns)
    assert [s.child_id for s in store.spawns_view(parent="q")] == ["c3"]
    assert [s.child_id for s in store.spawns_view(limit=2)] == ["c1", "c2"]
    store.claim_spawns("w1", limit=1)
    assert store.spawns_view(limit=1)[0].claimed_by == "w1"

    timers = store.timers_view()
    assert timers == [
        ArmedTimer("p", "soon", 5.0, None, None, 0, None),
        ArmedTimer("q", "soon", 5.0, None, None, 0, None),
        ArmedTimer("p", "late", sys.float_info.max, None, None, 0, None),
    ]
    assert store.timers_view(due_before=5.0) == []  # exclusive
    assert [t.execution_id for t in store.timers_view(due_before=5.5, limit=1)] == ["p"]
    store.claim_due_timers("w2", 6.0, limit=1)
    assert store.timers_view(limit=1)[0].claimed_by == "w2"

    db = raw(store)
    db.execute("UPDATE harel_spawns SET context = '[]' WHERE child_id = 'c2'")
    db.commit()
    store.sync()
    assert [s.child_id for s in store.spawns_view()] == ["c1", "c3"]
    assert any("spawn" in r.getMessage() for r in caplog.records if r.name == "harel_store")


BAD_VIEWS: list[Refusal] = [
    (lambda s: s.outbox_view(target=5), TypeError),
    (lambda s: s.outbox_view(source=""), ValueError),
    (lambda s: s.outbox_view(limit=0), ValueError),
    (lambda s: s.spawns_view(parent=1), TypeError),
    (lambda s: s.spawns_view(limit=1001), ValueError),
    (lambda s: s.timers_view(due_before=math.nan), ValueError),
    (lambda s: s.timers_view(due_before="soon"), TypeError),
    (lambda s: s.timers_view(limit=True), TypeError),
]


def test_bad_view_arguments_are_refused(store: Any) -> None:
    raises_each(BAD_VIEWS, store)


def test_stats_give_the_ages_on_the_database_clock(store: Any) -> None:
    empty = store.stats(0.0)
    assert (empty.oldest_spawn_at, empty.soonest_timer_at) == (None, None)
    assert abs(empty.now - time.time()) < 5
    store.commit(
        Execution(id="p", definition_id="d"),
        [(None, Event(name="go"))],
        spawns=[("c1", "r", {})],
        timers=[TimerOp.schedule("t", 7.5), TimerOp.schedule("u", 99.0)],
    )
    stats = store.stats(0.0)
    assert stats.oldest_spawn_at == store.spawns_view()[0].created_at
    assert stats.oldest_outbox_at == store.outbox_view()[0].created_at
    assert stats.soonest_timer_at == 7.5
    assert stats.oldest_spawn_at is not None and stats.oldest_spawn_at <= stats.now


# --- migration 0005 on a database that holds rows ---

ALEMBIC_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


def alembic(db: Path, *args: str) -> None:
    alembic_in_process([*ALEMBIC, "-x", f"url={db}", *args]).check_returncode()


def schema(db: Path) -> Any:
    with closing(sqlite3.connect(db)) as conn:
        return describe(conn)


@pytest.mark.slow
@pytest.mark.parametrize("opener", [LibsqlStore, SqliteStore])
def test_0005_up_and_down_on_a_populated_database(opener: Any, tmp_path: Path) -> None:
    db, at_0004 = tmp_path / "old.db", tmp_path / "ref.db"
    alembic(db, "upgrade", "0004")
    alembic(at_0004, "upgrade", "0004")
    with closing(sqlite3.connect(db)) as conn, conn:
        old = Execution(id="old", definition_id="d", version=1)
        conn.execute(
            "INSERT INTO harel_executions (id, definition_id, data, version, status) "
            "VALUES ('old', 'd', ?, 1, 'running')",
            (old.model_dump_json(),),
        )
        conn.execute(
            "INSERT INTO harel_outbox (target_id, event) VALUES ('old', ?)",
            ('{"name":"x","id":"e"}',),
        )
        conn.execute(
            "INSERT INTO harel_spawns (parent_id, child_id, root_path, context) "
            "VALUES ('old', 'kid', 'r', '{}')"
        )
    with opener(db) as store:  # migrates to head
        assert store.schema_revision == HEAD
        (summary,) = store.list_executions().items
        assert (summary.created_at, summary.updated_at) == (None, None)
        store.save(Execution(id="new", definition_id="d"))
        assert ids(store.list_executions(newest_first=True)) == ["new", "old"]  # untimed last
        assert ids(store.list_executions(updated_after=0.0)) == ["new"]
        (entry,) = store.outbox_view()
        assert (entry.source_id, entry.created_at, entry.event.id) == (None, None, "e")
        (spawn,) = store.spawns_view()
        assert spawn.created_at is None and store.stats(0.0).oldest_spawn_at is None
        exe = store.load("old")
        assert exe is not None
        store.commit(exe, [])  # an old row takes a time at its next write; created_at stays
        moved = {s.id: s for s in store.list_executions().items}["old"]
        assert moved.created_at is None and moved.updated_at is not None
        assert walk(store, 1, newest_first=True) == ["old", "new"]
    alembic(db, "downgrade", "0004")
    assert schema(db) == schema(at_0004)
    with closing(sqlite3.connect(db)) as conn:
        rows = conn.execute("SELECT id, version FROM harel_executions ORDER BY id").fetchall()
        assert rows == [("new", 1), ("old", 2)]
        assert conn.execute("SELECT COUNT(*) FROM harel_outbox").fetchone() == (1,)
        assert conn.execute("SELECT COUNT(*) FROM harel_spawns").fetchone() == (1,)
    alembic(db, "upgrade", "head")  # and back up: every row again untimed
    with opener(db) as store:
        assert walk(store, 1, newest_first=True) == ["old", "new"]
        assert [s.updated_at for s in store.list_executions().items] == [None, None]
