"""Retention: purge_finished, forget_processed, purge_dead and retention_counts on every store
kind (the async twin too), and the details on local files: trees, limits, order, markers by
time, the markers_since invariant, bad arguments, migration 0007.

Ages are staged by moving stored times back with the database's own connection (never
waited on).
"""

from __future__ import annotations

import math
import sqlite3
import time
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore, TimerOp
from tests.helpers import raw
from tests.test_cli_dead import bury
from tests.test_migrations import alembic, schema_of

LATER = 60.0  # a `before` this far ahead of now: everything stored is older


def make(store: Any, eid: str, status: str = "finished", parent: str | None = None) -> Execution:
    """An execution with a marker, a trace step, a timer, a spawn and an outbox entry sent to
    it, then its final status (if not running) with a second marker."""
    exe = Execution(id=eid, definition_id="d", parent_id=parent)
    store.commit(
        exe,
        [(eid, Event(name="ping", id=f"ping-{eid}"))],
        processed_event_id=f"a-{eid}",
        timers=[TimerOp.schedule("wait", 1e9)],
        spawns=[(f"{eid}.kid", "kid", {})],
        trace={"step": 1},
    )
    if status != "running":
        exe.status = status  # type: ignore[assignment]
        store.commit(exe, [], processed_event_id=f"b-{eid}")
    return exe


def run_sql(store: Any, sql: str, *params: Any) -> None:
    conn = raw(store)
    conn.execute(sql, params)
    conn.commit()
    if hasattr(store, "sync"):
        store.sync()


def age(store: Any, eid: str, at: float) -> None:
    run_sql(store, "UPDATE harel_executions SET updated_at = ? WHERE id = ?", at, eid)


def since_is_exact(store: Any) -> None:
    """Every execution's markers_since is the time of its oldest marker (NULL: none)."""
    conn = raw(store)
    rows = conn.execute(
        "SELECT id, markers_since, (SELECT MIN(recorded_at) FROM harel_processed_events"
        " WHERE execution_id = e.id) FROM harel_executions AS e"
    ).fetchall()
    assert [(r[0], r[1]) for r in rows] == [(r[0], r[2]) for r in rows]


def drain(call: Any) -> list[int]:
    counts = []
    while n := call():
        counts.append(n)
    return counts


def test_retention_on_every_store_kind(store: Any) -> None:
    for eid, status in (("f", "finished"), ("x", "failed"), ("c", "cancelled"), ("r", "running")):
        make(store, eid, status)
    make(store, "t", "finished")
    make(store, "t.1", "finished", parent="t")
    make(store, "t.2", "running", parent="t")  # t's tree stays whole while t.2 runs
    now = store.clock()
    assert abs(now - time.time()) < 300
    assert store.retention_counts(finished_before=now + LATER) == (3, 0, 0)
    assert store.purge_finished(now - 3600) == 0  # none is that old
    assert drain(lambda: store.purge_finished(now + LATER, limit=2)) == [2, 1]
    for eid in ("f", "x", "c"):
        assert store.load(eid) is None and store.read_trace(eid) == []
        assert store.timers_of(eid) == [] and store.outbox_for(eid) == []
        assert not store.is_processed(eid, f"a-{eid}")
    assert {s.parent_id for s in store.pending_spawns()} == {"r", "t", "t.1", "t.2"}
    assert sorted(s.id for s in store.list_executions().items) == ["r", "t", "t.1", "t.2"]
    # markers: r has 1, t 2, t.1 2, t.2 1
    assert store.retention_counts(markers_before=now + LATER) == (0, 6, 0)
    assert drain(lambda: store.forget_processed(now + LATER, limit=4)) == [4, 2]
    assert not store.is_processed("r", "a-r") and store.load("r") is not None
    store.commit(store.load("r"), [], processed_event_id="again")
    assert store.is_processed("r", "again")
    assert store.forget_processed(now - 3600) == 0
    since_is_exact(store)
    assert store.forget_processed(store.clock() + LATER) == 1
    bury(store)
    dead = len(store.dead_letters())
    assert dead > 0 and store.retention_counts(dead_before=store.clock() + LATER)[2] == dead
    assert store.purge_dead(store.clock() - 3600) == 0
    assert drain(lambda: store.purge_dead(store.clock() + LATER, limit=1)) == [1] * dead
    assert store.dead_letters() == []


@pytest.fixture(params=[LibsqlStore, SqliteStore], ids=["libsql", "sqlite"])
def local(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    with request.param(tmp_path / "r.db") as store:
        yield store


def test_trees_go_whole_and_only_when_every_member_is_final(local: Any) -> None:
    make(local, "a", "finished")
    make(local, "a.1", "finished", parent="a")
    make(local, "a.1.1", "failed", parent="a.1")
    make(local, "b", "running")
    make(local, "b.1", "finished", parent="b")  # an old final child of a running root
    later = local.clock() + LATER
    assert local.purge_finished(later, limit=1) == 3  # larger than limit: whole, alone
    assert local.purge_finished(later) == 0
    assert sorted(s.id for s in local.list_executions().items) == ["b", "b.1"]
    b = local.load("b")
    b.status = "finished"
    local.save(b)
    assert local.purge_finished(local.clock() + LATER) == 2


def test_limit_order_null_times_and_a_blocked_front(local: Any) -> None:
    for n in range(5):
        make(local, f"e{n}")
        age(local, f"e{n}", 1000.0 + (5 - n))  # e4 least recently updated, e0 most
    # A front of final roots whose trees still run, older than every other.
    for n in range(4):
        make(local, f"z{n}")
        make(local, f"z{n}.k", "running", parent=f"z{n}")
        age(local, f"z{n}", 10.0)
    run_sql(local, "UPDATE harel_executions SET updated_at = NULL WHERE id = 'e2'")
    gone: list[str] = []
    while True:  # a call may take fewer than limit (the blocked trees it read), never 0 early
        before = [s.id for s in local.list_executions().items]
        removed = local.purge_finished(2000.0, limit=2)
        assert 0 <= removed <= 2
        after = {s.id for s in local.list_executions().items}
        assert len(before) - len(after) == removed
        if not removed:
            break
        # oldest first: the removed ones are the least recently updated of what is left
        gone += sorted(
            (i for i in before if i not in after), key=["e2", "e4", "e3", "e1", "e0"].index
        )
    assert gone == ["e2", "e4", "e3", "e1", "e0"]  # NULL first, then oldest
    assert local.retention_counts(finished_before=2000.0) == (0, 0, 0)
    assert sorted(s.id for s in local.list_executions().items)[:4] == ["z0", "z0.k", "z1", "z1.k"]


def test_markers_by_time(local: Any) -> None:
    exe = make(local, "m", "running")
    for n in range(4):
        local.commit(exe, [], processed_event_id=f"old-{n}")
    conn = raw(local)
    conn.execute(
        "UPDATE harel_processed_events SET recorded_at = 100.0 WHERE event_id LIKE 'old-%'"
    )
    conn.execute("UPDATE harel_executions SET markers_since = 100.0")
    conn.commit()
    since_is_exact(local)
    assert local.retention_counts(markers_before=200.0) == (0, 4, 0)
    assert drain(lambda: local.forget_processed(200.0, limit=3)) == [3, 1]
    since_is_exact(local)
    assert local.is_processed("m", "a-m") and not local.is_processed("m", "old-0")
    assert local.forget_processed(200.0) == 0


@pytest.mark.parametrize(
    ("call", "kwargs"),
    [
        ("purge_finished", {"before": math.nan}),
        ("purge_finished", {"before": math.inf}),
        ("purge_finished", {"before": "soon"}),
        ("purge_finished", {"before": None}),
        ("purge_finished", {"limit": 0}),
        ("purge_finished", {"limit": -1}),
        ("purge_finished", {"limit": 10_001}),
        ("purge_finished", {"limit": 1.5}),
        ("purge_finished", {"limit": "3"}),
        ("forget_processed", {"limit": 100_001}),
        ("forget_processed", {"before": math.nan}),
        ("purge_dead", {"limit": 0}),
        ("retention_counts", {"markers_before": math.inf}),
    ],
)
def test_bad_arguments_are_refused_and_nothing_goes(local: Any, call: str, kwargs: Any) -> None:
    make(local, "k")
    args = {"before": local.clock() + LATER, **kwargs}
    if call == "retention_counts":
        args = kwargs
    with pytest.raises((ValueError, TypeError)):
        getattr(local, call)(**args)
    assert local.load("k") is not None and local.is_processed("k", "a-k")


def test_0007_up_and_down_on_a_populated_database(tmp_path: Path) -> None:
    db, at_0006 = tmp_path / "old.db", tmp_path / "ref.db"
    alembic("-x", f"url={db}", "upgrade", "0006")
    alembic("-x", f"url={at_0006}", "upgrade", "0006")
    with closing(sqlite3.connect(db)) as conn, conn:
        conn.execute(
            "INSERT INTO harel_executions (id, definition_id, data, version, status)"
            " VALUES ('p', 'd', ?, 1, 'running')",
            (Execution(id="p", definition_id="d", version=1).model_dump_json(),),
        )
        for n in range(3):
            conn.execute("INSERT INTO harel_processed_events VALUES ('p', ?)", (f"ev{n}",))
    migrated_at = time.time()
    with LibsqlStore(db) as store:  # migrates to head
        since_is_exact(store)
        assert store.forget_processed(migrated_at - 3600) == 0  # stamped no older than 0007
        assert store.is_processed("p", "ev0")
        assert store.forget_processed(store.clock() + LATER) == 3
    alembic("-x", f"url={db}", "downgrade", "0006")
    assert schema_of(db) == schema_of(at_0006)
