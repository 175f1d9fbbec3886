"""Retention (migration 0007) on every kind of store: `purge_finished` (final trees, whole,
least recently updated first, a bounded batch a call), `forget_processed` (dedupe markers by
the time they were recorded, each execution's ``markers_since`` kept exact), `purge_dead`
(dead letters by the time they died), `retention_counts`, their argument checks, and 0007
itself on a populated database, up and down.

Ages are staged, never waited for: ``updated_at``, ``recorded_at`` (with ``markers_since``,
as the store keeps it) and ``dead_at`` are set by hand through a connection of the test's
own (`tests.helpers.raw`). The exhaustive cases (limits, order, untimed rows, a blocked
front, a writer between the read and the purge) run on the two local stores only, to keep
this file fast.
"""

from __future__ import annotations

import math
import re
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore, StoreError, TimerOp
from harel_store.batch import Batch
from harel_store.connection import LocalConnection
from harel_store.models import Status
from harel_store.pace import Pacer
from harel_store.schema import describe
from harel_store.sql import HEAD, QUERIES
from tests.helpers import ALEMBIC, raw
from tests.in_process import alembic_in_process


@pytest.fixture(autouse=True)
def _timeless_pace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every retention write is timed as taking no time, so that the sizes a local store's
    `Pacer` picks (after the first write's `pace.FIRST`) are the call's ``limit`` however
    busy the machine is: these tests count what each call removes. `tests.test_pace` tests
    the sizing itself."""
    took = Pacer.took
    monkeypatch.setattr(Pacer, "took", lambda self, kind, items, _: took(self, kind, items, 0.0))


OLD = 1000.0  # a time long before any the database's clock writes in these tests
BEFORE = OLD + 100.0  # a horizon after every staged time and before every real one

# --- helpers ---


def _own_connection(store: Any) -> bool:
    """Whether `raw` gives the store's own connection (a local store) rather than a new one."""
    inner = store.sync_store if hasattr(store, "sync_store") else store
    return isinstance(inner._conn, LocalConnection)


def write(store: Any, *steps: tuple[str, tuple[Any, ...]]) -> None:
    """Run ``steps`` (sql, params) in one transaction of the test's own connection, then let
    the store see them (a replica pulls them from the primary)."""
    db = raw(store)
    try:
        for sql, params in steps:
            db.execute(sql, params)
        db.commit()
    finally:
        if not _own_connection(store):
            db.close()
    store.sync()


def read(store: Any, sql: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Rows as the database (a replica's primary) holds them."""
    db = raw(store)
    try:
        return [tuple(row) for row in db.execute(sql, params).fetchall()]
    finally:
        if not _own_connection(store):
            db.close()


def ids(store: Any) -> list[str]:
    """Every execution's id, in order."""
    return [row[0] for row in read(store, "SELECT id FROM harel_executions ORDER BY id")]


def new(
    store: Any, eid: str, status: Status = "running", parent: str | None = None, **commit: Any
) -> Execution:
    """An execution committed anew (with whatever else ``commit`` names)."""
    exe = Execution(id=eid, definition_id="d", status=status, parent_id=parent)
    store.commit(exe, [], **commit)
    return exe


def make_trees(store: Any, spec: dict[str, tuple[Status, str | None]]) -> dict[str, Execution]:
    """Executions id -> (status, parent_id), made in the order given."""
    return {eid: new(store, eid, status, parent) for eid, (status, parent) in spec.items()}


def set_updated(store: Any, times: dict[str, float | None]) -> None:
    """Stage each execution's updated_at (None: a row written before 0005)."""
    write(
        store,
        *(
            ("UPDATE harel_executions SET updated_at = ? WHERE id = ?", (at, eid))
            for eid, at in times.items()
        ),
    )


RENEW_SINCE = (
    "UPDATE harel_executions SET markers_since = (SELECT MIN(recorded_at) "
    "FROM harel_processed_events WHERE execution_id = harel_executions.id)",
    (),
)


def set_recorded(store: Any, times: dict[tuple[str, str], float]) -> None:
    """Stage each marker's recorded_at, and every execution's markers_since with it (the
    MIN of its markers' times, as the store keeps it)."""
    steps = [
        (
            "UPDATE harel_processed_events SET recorded_at = ? "
            "WHERE execution_id = ? AND event_id = ?",
            (at, eid, event),
        )
        for (eid, event), at in times.items()
    ]
    write(store, *steps, RENEW_SINCE)


def markers(store: Any) -> list[tuple[str, str]]:
    return [
        (row[0], row[1])
        for row in read(
            store, "SELECT execution_id, event_id FROM harel_processed_events ORDER BY 1, 2"
        )
    ]


def check_markers_since(store: Any) -> None:
    """Every execution's markers_since is the time of its oldest marker (NULL: none), and
    no marker is left without its execution."""
    rows = read(
        store,
        "SELECT id, markers_since, (SELECT MIN(recorded_at) FROM harel_processed_events "
        "WHERE execution_id = e.id) FROM harel_executions AS e ORDER BY id",
    )
    assert [(eid, since) for eid, since, _ in rows] == [(eid, least) for eid, _, least in rows]
    orphans = read(
        store,
        "SELECT count(*) FROM harel_processed_events "
        "WHERE execution_id NOT IN (SELECT id FROM harel_executions)",
    )
    assert orphans == [(0,)]


def drain(call: Callable[[], int], check: Callable[[], None] = lambda: None) -> list[int]:
    """What each call returns until one returns 0 (``check`` after each)."""
    counts: list[int] = []
    while not counts or counts[-1]:
        assert len(counts) < 50, f"never reached 0: {counts}"
        counts.append(call())
        check()
    return counts


def claim_all(store: Any, worker: str) -> list[Any]:
    return [
        *store.claim_outbox(worker, max_attempts=1),
        *store.claim_spawns(worker, max_attempts=1),
        *store.claim_due_timers(worker, 10.0, max_attempts=1),
    ]


def bury(store: Any, eid: str = "src") -> Execution:
    """A running ``eid`` whose two outbox entries (for "tgt"), spawn ("kid") and two due
    timers (t1, t2) are dead letters: claimed once at max_attempts=1, their leases run out,
    claimed again. Returns it."""
    src = Execution(id=eid, definition_id="d")
    store.commit(
        src,
        [("tgt", Event(name="a", id="ev-a")), ("tgt", Event(name="b", id="ev-b"))],
        timers=[TimerOp.schedule("t1", 1.0), TimerOp.schedule("t2", 2.0)],
        spawns=[("kid", "root", {"k": 1})],
    )
    assert len(claim_all(store, "w1")) == 5
    write(
        store,
        *(
            (f"UPDATE {table} SET claimed_until = claimed_until - 3600", ())
            for table in ("harel_outbox", "harel_spawns", "harel_timers")
        ),
    )
    assert claim_all(store, "w2") == []
    assert len(store.dead_letters()) == 5
    return src


def set_dead_at(
    store: Any, outbox: tuple[float, float], spawn: float, timers: tuple[float, float]
) -> None:
    """Stage when each of `bury`'s dead letters died: its outbox entries (the first, the
    second), its spawn, its timers (t1, t2)."""
    write(
        store,
        (
            # A dead outbox entry's seq is stored negated (a live one's is positive).
            "UPDATE harel_outbox SET dead_at = CASE abs(seq) WHEN (SELECT MIN(abs(seq)) "
            "FROM harel_outbox WHERE dead_at IS NOT NULL) THEN ? ELSE ? END "
            "WHERE dead_at IS NOT NULL",
            outbox,
        ),
        ("UPDATE harel_spawns SET dead_at = ? WHERE dead_at IS NOT NULL", (spawn,)),
        (
            "UPDATE harel_timers SET dead_at = CASE path WHEN 't1' THEN ? ELSE ? END "
            "WHERE dead_at IS NOT NULL",
            timers,
        ),
    )


def dead(store: Any) -> list[tuple[str, Any]]:
    """The dead letters in the order they died: (kind, outbox seq / spawn child / timer path)."""
    keys: dict[str, Callable[[Any], Any]] = {
        "outbox": lambda item: item.seq,
        "spawn": lambda item: item.child_id,
        "timer": lambda item: item.path,
    }
    return [(d.kind, keys[d.kind](d.item)) for d in store.dead_letters()]


@pytest.fixture(params=[SqliteStore, LibsqlStore], ids=["sqlite", "libsql"])
def local(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """A store on a local file, for the exhaustive cases."""
    with request.param(tmp_path / "local.db") as store:
        yield store


# --- purge_finished ---


def test_purge_finished_removes_old_final_roots_with_everything_they_own(store: Any) -> None:
    kinds: dict[str, Status] = {
        "fin": "finished",
        "fail": "failed",
        "canc": "cancelled",
        "run": "running",
        "new": "finished",
    }
    src = Execution(id="src", definition_id="d")  # running; emits to each of them
    store.commit(src, [(eid, Event(name="hi", id=f"to-{eid}")) for eid in kinds])
    for eid, status in kinds.items():
        store.commit(
            Execution(id=eid, definition_id="d", status=status),
            [("src", Event(name="back", id=f"from-{eid}"))],  # targeted at src: it stays
            processed_event_id=f"ev-{eid}",
            timers=[TimerOp.schedule("tick", 5.0)],
            spawns=[(f"{eid}-kid", "root", {"n": 1})],
            trace={"step": eid},
        )
    set_updated(store, {"fin": OLD, "fail": OLD + 1, "canc": OLD + 2, "run": OLD, "src": OLD})
    assert store.purge_finished(BEFORE) == 3
    for eid in ("fin", "fail", "canc"):
        assert store.load(eid) is None, eid
        assert store.read_trace(eid) == [], eid
        assert store.timers_of(eid) == [], eid
        assert store.outbox_for(eid) == [], eid
        assert not store.is_processed(eid, f"ev-{eid}"), eid
    for eid in ("run", "new", "src"):
        assert store.load(eid) is not None, eid
    for eid in ("run", "new"):  # what the survivors own is all still there
        assert [t["step"] for t in store.read_trace(eid)] == [eid]
        assert store.timers_of(eid) == [("tick", 5.0)]
        assert [e.event.id for e in store.outbox_for(eid)] == [f"to-{eid}"]
        assert store.is_processed(eid, f"ev-{eid}")
    assert sorted(s.parent_id for s in store.pending_spawns()) == ["new", "run"]
    # What the purged ones emitted for others is the others' to handle.
    assert [e.event.id for e in store.outbox_for("src")] == [f"from-{eid}" for eid in kinds]
    check_markers_since(store)
    assert store.purge_finished(BEFORE) == 0
    # "new" is final but was updated after BEFORE: only a later horizon takes it.
    assert drain(lambda: store.purge_finished(store.clock() + 60)) == [1, 0]
    assert ids(store) == ["run", "src"]
    assert sorted(s.parent_id for s in store.pending_spawns()) == ["run"]


def test_a_tree_goes_whole_and_only_when_every_member_is_final(store: Any) -> None:
    exes = make_trees(
        store,
        {
            "t": ("finished", None),  # all final: goes whole
            "t.a": ("finished", "t"),
            "t.a.x": ("failed", "t.a"),
            "t.b": ("cancelled", "t"),
            "u": ("finished", None),  # a running child: stays whole
            "u.a": ("running", "u"),
            "v": ("running", None),  # a final child of a running root: stays
            "v.a": ("finished", "v"),
            "n": ("finished", None),  # a root updated after the horizon: stays, its child too
            "n.a": ("finished", "n"),
        },
    )
    set_updated(store, {eid: OLD for eid in exes if eid != "n"})
    assert store.retention_counts(finished_before=BEFORE) == (4, 0, 0)
    assert store.purge_finished(BEFORE) == 4
    assert ids(store) == ["n", "n.a", "u", "u.a", "v", "v.a"]
    assert store.purge_finished(BEFORE) == 0
    assert store.load("t.a.x") is None and store.load("v.a") is not None
    exes["u.a"].status = "finished"  # the child ends, updated now: after the horizon, so
    store.save(exes["u.a"])  # its old root's tree waits for a later one
    assert store.retention_counts(finished_before=BEFORE) == (0, 0, 0)
    assert store.purge_finished(BEFORE) == 0
    exes["v"].status = "cancelled"  # updated now: newer than BEFORE
    store.save(exes["v"])
    assert store.purge_finished(BEFORE) == 0
    assert drain(lambda: store.purge_finished(store.clock() + 60)) == [6, 0]
    assert ids(store) == []


def test_a_member_updated_after_the_horizon_keeps_its_old_tree(store: Any) -> None:
    # purge_finished removes executions last updated before `before`: a tree whose root is
    # old goes only once every member is old too (and the dry run's count agrees).
    make_trees(
        store,
        {
            "t": ("finished", None),  # old root, old child, young grandchild: stays whole
            "t.a": ("finished", "t"),
            "t.a.x": ("failed", "t.a"),
            "o": ("finished", None),  # all old: goes, though behind t with limit 1
            "o.a": ("cancelled", "o"),
        },
    )
    set_updated(store, {"t": OLD, "t.a": OLD, "o": OLD + 1, "o.a": OLD + 1})
    assert store.retention_counts(finished_before=BEFORE) == (2, 0, 0)
    assert drain(lambda: store.purge_finished(BEFORE, limit=1)) == [2, 0]
    assert ids(store) == ["t", "t.a", "t.a.x"]
    assert store.retention_counts(finished_before=BEFORE) == (0, 0, 0)
    later = store.clock() + 60
    assert store.retention_counts(finished_before=later) == (3, 0, 0)
    assert drain(lambda: store.purge_finished(later)) == [3, 0]
    assert ids(store) == []


def test_an_execution_whose_parent_is_gone_is_the_root_of_its_own_tree(store: Any) -> None:
    exes = make_trees(
        store,
        {
            "p": ("running", None),  # purged alone below (purge --orphan)
            "p.a": ("finished", "p"),  # an orphan with its own final subtree: goes
            "p.a.x": ("failed", "p.a"),
            "p.b": ("cancelled", "p"),  # an orphan alone: goes
            "p.c": ("finished", "p"),  # an orphan with a running child: stays
            "p.c.y": ("running", "p.c"),
            "p.d": ("finished", "p"),  # an orphan updated after the horizon: stays
            "p.e": ("running", "p"),  # running: stays
        },
    )
    assert store.purge("p", exes["p"].version)
    new(store, "late", "finished", "gone")  # a spawn made after gc took its parent
    old = ["p.a", "p.a.x", "p.b", "p.c", "p.c.y", "p.e", "late"]
    set_updated(store, dict.fromkeys(old, OLD))
    set_updated(store, {"p.b": None})  # a row written before 0005: older than any time
    assert store.retention_counts(finished_before=BEFORE) == (4, 0, 0)
    assert drain(lambda: store.purge_finished(BEFORE, limit=1)) == [1, 1, 2, 0]
    assert ids(store) == ["p.c", "p.c.y", "p.d", "p.e"]
    assert store.retention_counts(finished_before=BEFORE) == (0, 0, 0)
    later = store.clock() + 60
    assert store.retention_counts(finished_before=later) == (1, 0, 0)
    assert drain(lambda: store.purge_finished(later)) == [1, 0]
    assert ids(store) == ["p.c", "p.c.y", "p.e"]


def test_each_call_takes_at_most_limit_and_never_splits_a_tree(local: Any) -> None:
    for i in range(5):
        new(local, f"s{i}", "finished")
    set_updated(local, {f"s{i}": OLD + i for i in range(5)})
    left: list[list[str]] = []

    def note() -> None:
        left.append(ids(local))

    assert drain(lambda: local.purge_finished(BEFORE, limit=2), note) == [2, 2, 1, 0]
    assert left == [["s2", "s3", "s4"], ["s4"], [], []]
    # A tree of 3 first; then a single and a tree of 2 that would not fit beside it.
    make_trees(
        local,
        {
            "a": ("finished", None),
            "a.1": ("finished", "a"),
            "a.2": ("failed", "a.1"),
            "b": ("finished", None),
            "c": ("cancelled", None),
            "c.1": ("finished", "c"),
            "d": ("finished", None),
        },
    )
    set_updated(local, {"a": OLD, "a.1": OLD, "a.2": OLD, "b": OLD + 1, "c": OLD + 2})
    set_updated(local, {"c.1": OLD + 2, "d": OLD + 3})
    left.clear()
    assert drain(lambda: local.purge_finished(BEFORE, limit=2), note) == [3, 1, 2, 1, 0]
    assert left == [["b", "c", "c.1", "d"], ["c", "c.1", "d"], ["d"], [], []]
    make_trees(local, {"e": ("finished", None), "e.1": ("finished", "e")})
    assert local.purge_finished(local.clock() + 60, limit=1) == 2  # larger than limit: alone
    assert ids(local) == []


def test_the_least_recently_updated_go_first_untimed_before_all(local: Any) -> None:
    # updated_at (None: written before 0005); they go by time, untimed first.
    times: dict[str, float | None] = {
        "p": 50.0,
        "q": 10.0,
        "r": 30.0,
        "s": 30.0,
        "t": None,
        "u": 20.0,
        "w": None,
    }
    for eid in times:
        new(local, eid, "failed" if eid in "qs" else "finished")
    new(local, "t.kid", "finished", "t")  # an untimed root's tree goes whole
    new(local, "x", "running")  # never
    set_updated(local, {**times, "t.kid": None, "x": None})
    # Untimed roots are older than any time, even the least there is.
    assert local.retention_counts(finished_before=-1.7e308) == (3, 0, 0)
    gone: list[list[str]] = []
    remaining = set(ids(local))

    def note() -> None:
        now = set(ids(local))
        gone.append(sorted(remaining - now))
        remaining.intersection_update(now)

    assert drain(lambda: local.purge_finished(BEFORE, limit=1), note) == [2, 1, 1, 1, 1, 1, 1, 0]
    assert gone == [["t", "t.kid"], ["w"], ["q"], ["u"], ["r"], ["s"], ["p"], []]
    assert ids(local) == ["x"]


def test_final_roots_with_running_children_in_front_do_not_stop_the_walk(local: Any) -> None:
    for i in range(5):  # five blocked trees before the purgeable one, limit 2
        new(local, f"b{i}", "finished")
        new(local, f"b{i}.run", "running", f"b{i}")
    new(local, "z", "finished")
    new(local, "z.1", "finished", "z")
    set_updated(local, {**{f"b{i}": OLD + i for i in range(5)}, "z": OLD + 10, "z.1": OLD})
    assert local.retention_counts(finished_before=BEFORE) == (2, 0, 0)
    assert drain(lambda: local.purge_finished(BEFORE, limit=2)) == [2, 0]
    assert drain(lambda: local.purge_finished(BEFORE, limit=1)) == [0]
    assert "z" not in ids(local) and len(ids(local)) == 10
    # Blocked ones among purgeable ones: every purgeable one is found.
    for i in range(3):
        new(local, f"y{i}", "finished")
    set_updated(local, {"y0": OLD - 1, "y1": OLD + 2.5, "y2": OLD + 20})
    assert sum(drain(lambda: local.purge_finished(BEFORE, limit=2))) == 3
    assert len(ids(local)) == 10
    new(local, "w", "finished")  # limit 1, behind the five blocked trees: larger than limit
    new(local, "w.1", "finished", "w")
    set_updated(local, {"w": OLD + 30, "w.1": OLD + 30})
    assert drain(lambda: local.purge_finished(BEFORE, limit=1)) == [2, 0]
    # A member with no status (a row before its summary columns) is not final: it blocks.
    new(local, "q", "finished")
    new(local, "q.1", "finished", "q")
    write(local, ("UPDATE harel_executions SET status = NULL WHERE id = 'q.1'", ()))
    set_updated(local, {"q": OLD})
    assert local.retention_counts(finished_before=BEFORE) == (0, 0, 0)
    assert local.purge_finished(BEFORE, limit=1) == 0
    assert len(ids(local)) == 12


def meddle_before_purge(
    store: Any, monkeypatch: pytest.MonkeyPatch, meddle: Callable[[], None]
) -> None:
    """Let another writer's commit (``meddle``) in just before the first purge batch the
    store runs, after the read that chose what to purge (the interleaving a second process
    can cause at any time)."""
    conn = store._conn
    execute = conn.execute
    pending = [meddle]

    def meddled(request: Any) -> Any:
        if (
            pending
            and isinstance(request, Batch)
            and request.steps
            and request.steps[0][0] is QUERIES["purge_executions"]
        ):
            pending.pop()()
        return execute(request)

    monkeypatch.setattr(conn, "execute", meddled)


def test_a_tree_that_moves_between_the_read_and_the_purge_is_read_again(
    local: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A member written meanwhile: its version CAS fails, the trees are read again.
    new(local, "r", "finished")
    kid = new(local, "r.1", "finished", "r")
    set_updated(local, {"r": OLD, "r.1": OLD})

    def reopen() -> None:
        kid.status = "running"
        local.save(kid)

    meddle_before_purge(local, monkeypatch, reopen)
    assert local.purge_finished(BEFORE) == 0
    assert ids(local) == ["r", "r.1"]
    kid.status = "finished"  # updated now: a horizon after it takes the tree
    local.save(kid)
    assert local.purge_finished(local.clock() + 60) == 2


def test_a_child_made_between_the_read_and_the_purge_keeps_its_tree(
    local: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A running child of the final root committed by another writer after purge_finished
    # read the tree (a spawn's relay, say): the tree is no longer all final, so it stays.
    new(local, "r", "finished")
    set_updated(local, {"r": OLD})

    def spawn() -> None:
        new(local, "r.late", "running", "r")

    meddle_before_purge(local, monkeypatch, spawn)
    removed = local.purge_finished(BEFORE)
    assert ids(local) == ["r", "r.late"], f"removed {removed}: r.late left without its root"
    assert removed == 0


@pytest.mark.parametrize("kind", ["libsql", "libsql-remote"])
def test_purge_tree_refuses_a_tree_that_gained_a_child_after_its_read(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The guard that no member has a child outside the tree, remotely a step of its own.
    root = new(store, "r", "finished")
    new(store, "r.1", "finished", "r")

    def spawn() -> None:
        new(store, "r.1.late", "running", "r.1")

    meddle_before_purge(store, monkeypatch, spawn)
    with pytest.raises(StoreError, match=r"1 of its executions is still running \(r\.1\.late\)"):
        store.purge_tree("r", root.version)  # read again: r.1.late runs
    assert ids(store) == ["r", "r.1", "r.1.late"]


# --- forget_processed ---


def test_forget_processed_forgets_old_markers_and_keeps_markers_since(store: Any) -> None:
    m1 = new(store, "m1", processed_event_id="ev1")
    for event in ("ev2", "ev3"):
        store.commit(m1, [], processed_event_id=event)
    m2 = new(store, "m2", processed_event_id="ev1")
    new(store, "m3")  # no marker at all
    check_markers_since(store)
    set_recorded(store, {("m1", "ev1"): OLD, ("m1", "ev2"): OLD + 300, ("m2", "ev1"): OLD + 50})
    check_markers_since(store)
    assert store.retention_counts(markers_before=BEFORE) == (0, 2, 0)
    assert store.forget_processed(BEFORE) == 2
    check_markers_since(store)
    assert markers(store) == [("m1", "ev2"), ("m1", "ev3")]
    assert not store.is_processed("m1", "ev1") and not store.is_processed("m2", "ev1")
    assert store.is_processed("m1", "ev2") and store.is_processed("m1", "ev3")
    assert store.load_for_event("m1", "ev1")[1] is False
    assert read(store, "SELECT markers_since FROM harel_executions WHERE id = 'm1'") == [
        (OLD + 300,)
    ]
    assert store.forget_processed(BEFORE) == 0
    assert store.forget_processed(OLD + 301) == 1  # the newest keeps its own time
    check_markers_since(store)
    assert markers(store) == [("m1", "ev3")]
    # An execution whose markers are all forgotten takes a marker again, and forgets it too.
    store.commit(m2, [], processed_event_id="ev9")
    check_markers_since(store)
    (since,) = read(store, "SELECT markers_since FROM harel_executions WHERE id = 'm2'")
    assert since[0] is not None and since[0] > BEFORE
    assert store.is_processed("m2", "ev9")
    assert store.retention_counts(markers_before=store.clock() + 60) == (0, 2, 0)
    counts = drain(
        lambda: store.forget_processed(store.clock() + 60), lambda: check_markers_since(store)
    )
    assert counts == [2, 0]
    assert markers(store) == []
    assert not store.is_processed("m2", "ev9") and not store.is_processed("m1", "ev3")
    assert ids(store) == ["m1", "m2", "m3"]  # forgetting markers removes no execution


def test_forget_processed_takes_at_most_limit_a_call(local: Any) -> None:
    m1 = new(local, "m1", processed_event_id="ev0")
    for event in ("ev1", "ev2"):
        local.commit(m1, [], processed_event_id=event)
    m2 = new(local, "m2", processed_event_id="ev0")
    for event in ("ev1", "ev2"):
        local.commit(m2, [], processed_event_id=event)
    new(local, "m3", processed_event_id="ev0")
    old = {("m1", "ev0"): 100.0, ("m1", "ev1"): 110.0, ("m1", "ev2"): 120.0}
    old.update({("m2", "ev0"): 105.0, ("m2", "ev1"): 115.0})  # m2's ev2 and m3's: now
    set_recorded(local, old)
    assert local.retention_counts(markers_before=BEFORE) == (0, 5, 0)
    left: list[int] = []

    def check() -> None:
        check_markers_since(local)
        left.append(len(markers(local)))

    assert drain(lambda: local.forget_processed(BEFORE, limit=2), check) == [2, 2, 1, 0]
    assert left == [5, 3, 2, 2]
    assert markers(local) == [("m2", "ev2"), ("m3", "ev0")]
    assert local.retention_counts(markers_before=BEFORE) == (0, 0, 0)
    assert drain(lambda: local.forget_processed(local.clock() + 60, limit=1), check) == [1, 1, 0]


def test_markers_since_follows_a_clock_gone_back_and_a_marker_recorded_again(local: Any) -> None:
    exe = new(local, "m", processed_event_id="ev-future")
    future = local.clock() + 1e6
    set_recorded(local, {("m", "ev-future"): future})  # as if the clock has gone back since
    local.commit(exe, [], processed_event_id="ev-now")
    check_markers_since(local)
    (since,) = read(local, "SELECT markers_since FROM harel_executions WHERE id = 'm'")
    assert since[0] < future
    assert local.forget_processed(future) == 1  # ev-now; ev-future is not before future
    check_markers_since(local)
    assert local.is_processed("m", "ev-future") and not local.is_processed("m", "ev-now")
    set_recorded(local, {("m", "ev-future"): OLD})
    local.commit(exe, [], processed_event_id="ev-future")  # recorded again: keeps its time
    assert read(local, "SELECT recorded_at FROM harel_processed_events") == [(OLD,)]
    check_markers_since(local)
    assert local.forget_processed(BEFORE) == 1
    check_markers_since(local)


# --- purge_dead ---


def test_purge_dead_removes_the_dead_letters_that_died_before(store: Any) -> None:
    src = bury(store)
    store.commit(  # a live entry and a live timer: never dead letters
        src, [("tgt", Event(name="c", id="ev-c"))], timers=[TimerOp.schedule("t3", 3.0)]
    )
    set_dead_at(store, outbox=(OLD + 300, OLD), spawn=OLD + 200, timers=(OLD + 150, OLD + 400))
    assert dead(store) == [
        ("outbox", 2),
        ("timer", "t1"),
        ("spawn", "kid"),
        ("outbox", 1),
        ("timer", "t2"),
    ]
    assert store.retention_counts(dead_before=OLD + 250) == (0, 0, 3)
    assert store.purge_dead(OLD + 250) == 3
    assert dead(store) == [("outbox", 1), ("timer", "t2")]
    assert store.purge_dead(OLD + 250) == 0
    assert drain(lambda: store.purge_dead(store.clock() + 60)) == [2, 0]
    assert store.dead_letters() == []
    assert [e.event.id for e in store.pending_outbox()] == ["ev-c"]
    assert store.timers_of("src") == [("t3", 3.0)]
    assert ids(store) == ["src"]


def test_purge_dead_takes_at_most_limit_across_kinds_oldest_of_each_first(local: Any) -> None:
    bury(local)
    set_dead_at(local, outbox=(OLD + 30, OLD + 10), spawn=OLD + 20, timers=(OLD + 50, OLD + 40))
    assert local.purge_dead(BEFORE, limit=1) == 1
    assert [kind for kind, _ in dead(local)].count("outbox") == 1
    assert ("outbox", 1) in dead(local)  # the one that died first went
    assert local.purge_dead(BEFORE, limit=2) == 2  # the other outbox entry, then the spawn
    assert dead(local) == [("timer", "t2"), ("timer", "t1")]
    assert local.purge_dead(BEFORE, limit=1) == 1
    assert dead(local) == [("timer", "t1")]
    assert drain(lambda: local.purge_dead(BEFORE, limit=100000)) == [1, 0]
    bury(local, "src2")  # again, all five at once with limit 2
    set_dead_at(local, outbox=(OLD, OLD), spawn=OLD, timers=(OLD, OLD))
    assert local.retention_counts(dead_before=BEFORE) == (0, 0, 5)
    assert drain(lambda: local.purge_dead(BEFORE, limit=2)) == [2, 2, 1, 0]
    assert local.dead_letters() == []


# --- retention_counts ---


def test_retention_counts_is_what_the_loops_then_remove(store: Any) -> None:
    make_trees(
        store,
        {
            "t": ("finished", None),
            "t.a": ("failed", "t"),
            "u": ("finished", None),
            "u.a": ("running", "u"),
            "new": ("finished", None),
        },
    )
    r = new(store, "r", processed_event_id="ev1")
    store.commit(r, [], processed_event_id="ev2")
    new(store, "m", processed_event_id="ev1")
    bury(store)
    set_updated(store, {"t": OLD, "t.a": OLD, "u": OLD, "u.a": OLD, "r": OLD, "src": OLD})
    set_recorded(store, {("r", "ev1"): OLD, ("m", "ev1"): OLD + 1})
    set_dead_at(store, outbox=(OLD, OLD + 1), spawn=store.clock(), timers=(OLD + 2, OLD + 1e9))
    assert store.retention_counts() == (0, 0, 0)  # nothing asked, nothing counted
    assert store.retention_counts(finished_before=BEFORE) == (2, 0, 0)
    assert store.retention_counts(markers_before=BEFORE) == (0, 2, 0)
    assert store.retention_counts(dead_before=BEFORE) == (0, 0, 3)
    every = {"finished_before": BEFORE, "markers_before": BEFORE, "dead_before": BEFORE}
    counts = store.retention_counts(**every)
    assert counts == (2, 2, 3)
    removed = (
        sum(drain(lambda: store.purge_finished(BEFORE, limit=1))),
        sum(drain(lambda: store.forget_processed(BEFORE, limit=1))),
        sum(drain(lambda: store.purge_dead(BEFORE, limit=1))),
    )
    assert removed == counts
    check_markers_since(store)
    assert store.retention_counts(**every) == (0, 0, 0)
    later = store.clock() + 60  # the rest: "new"; r's ev2; two dead letters
    assert store.retention_counts(finished_before=later, markers_before=later) == (1, 1, 0)
    assert store.retention_counts(dead_before=OLD + 2e9) == (0, 0, 2)


# --- arguments ---

BAD: list[tuple[str, Callable[[Any], Any], type[Exception], str]] = [
    ("before nan", lambda s: s.purge_finished(math.nan), ValueError, "before must be finite"),
    ("before inf", lambda s: s.purge_finished(math.inf), ValueError, "before must be finite"),
    ("before -inf", lambda s: s.forget_processed(-math.inf), ValueError, "finite"),
    ("before huge int", lambda s: s.purge_dead(10**400), ValueError, "finite"),
    ("before str", lambda s: s.purge_finished("1e12"), TypeError, "epoch seconds, not str"),
    ("before None", lambda s: s.forget_processed(None), TypeError, "not NoneType"),
    ("before bool", lambda s: s.purge_dead(True), TypeError, "not bool"),
    ("finished 0", lambda s: s.purge_finished(1e12, limit=0), ValueError, "1 and 10000, not 0"),
    ("finished -1", lambda s: s.purge_finished(1e12, limit=-1), ValueError, "1 and 10000"),
    ("finished 10001", lambda s: s.purge_finished(1e12, limit=10001), ValueError, "10000"),
    ("finished 1.5", lambda s: s.purge_finished(1e12, limit=1.5), TypeError, "int, not float"),
    ("finished '3'", lambda s: s.purge_finished(1e12, limit="3"), TypeError, "int, not str"),
    ("finished True", lambda s: s.purge_finished(1e12, limit=True), TypeError, "int, not bool"),
    ("finished None", lambda s: s.purge_finished(1e12, limit=None), TypeError, "int"),
    ("forget 0", lambda s: s.forget_processed(1e12, limit=0), ValueError, "1 and 100000"),
    ("forget -1", lambda s: s.forget_processed(1e12, limit=-1), ValueError, "1 and 100000"),
    ("forget 100001", lambda s: s.forget_processed(1e12, limit=100001), ValueError, "100000"),
    ("forget 1.5", lambda s: s.forget_processed(1e12, limit=1.5), TypeError, "int, not float"),
    ("forget True", lambda s: s.forget_processed(1e12, limit=True), TypeError, "int, not bool"),
    ("forget '3'", lambda s: s.forget_processed(1e12, limit="3"), TypeError, "int, not str"),
    ("dead 0", lambda s: s.purge_dead(1e12, limit=0), ValueError, "1 and 100000"),
    ("dead 100001", lambda s: s.purge_dead(1e12, limit=100001), ValueError, "100000"),
    ("dead 1.5", lambda s: s.purge_dead(1e12, limit=1.5), TypeError, "int, not float"),
    ("dead '3'", lambda s: s.purge_dead(1e12, limit="3"), TypeError, "int, not str"),
    ("dead True", lambda s: s.purge_dead(1e12, limit=True), TypeError, "int, not bool"),
    (
        "counts nan",
        lambda s: s.retention_counts(finished_before=math.nan),
        ValueError,
        "finished_before must be finite",
    ),
    (
        "counts str",
        lambda s: s.retention_counts(markers_before="now"),
        TypeError,
        "markers_before must be",
    ),
    (
        "counts inf",
        lambda s: s.retention_counts(dead_before=math.inf),
        ValueError,
        "dead_before must be finite",
    ),
]


def test_bad_arguments_are_refused_and_remove_nothing(store: Any) -> None:
    new(store, "old", "finished", processed_event_id="ev")
    bury(store)
    everything = {"finished_before": 1e12, "markers_before": 1e12, "dead_before": 1e12}
    assert store.retention_counts(**everything) == (1, 1, 5)
    for label, call, error, match in BAD:
        try:
            call(store)
        except Exception as exc:  # which one, and its message, checked here
            assert isinstance(exc, error), (label, exc)
            assert re.search(match, str(exc)), (label, str(exc))
        else:
            pytest.fail(f"{label}: accepted")
    assert store.retention_counts(**everything) == (1, 1, 5)
    assert store.is_processed("old", "ev") and store.load("old") is not None
    # The bounds themselves are accepted (with a horizon that takes nothing).
    assert store.purge_finished(0.0, limit=10000) == 0
    assert store.purge_finished(0, limit=1) == 0
    assert store.forget_processed(0.0, limit=100000) == 0
    assert store.purge_dead(0.0, limit=100000) == 0
    assert store.retention_counts(**everything) == (1, 1, 5)


# --- migration 0007 ---


def alembic(*args: str) -> None:
    alembic_in_process([*ALEMBIC, *args]).check_returncode()


def schema_of(path: Path) -> object:
    with closing(sqlite3.connect(path)) as conn, conn:
        return describe(conn)


def test_0007_on_a_populated_database_up_and_down(tmp_path: Path) -> None:
    db, at_0006 = tmp_path / "old.db", tmp_path / "ref.db"
    alembic("-x", f"url={db}", "upgrade", "0006")
    alembic("-x", f"url={at_0006}", "upgrade", "0006")
    rows: list[tuple[str, Status, float | None]] = [
        ("x", "running", 10.0),
        ("y", "finished", 20.0),
        ("z", "running", 30.0),
        ("untimed", "failed", None),  # written before 0005
    ]
    with closing(sqlite3.connect(db)) as conn, conn:
        for eid, status, updated in rows:
            data = Execution(id=eid, definition_id="d", status=status, version=1)
            conn.execute(
                "INSERT INTO harel_executions (id, definition_id, data, version, status, "
                "created_at, updated_at) VALUES (?, 'd', ?, 1, ?, ?, ?)",
                (eid, data.model_dump_json(), status, updated, updated),
            )
        conn.executemany(
            "INSERT INTO harel_processed_events VALUES (?, ?)",
            [("x", "ev1"), ("x", "ev2"), ("y", "ev1")],
        )
    started = time.time()
    with LibsqlStore(db) as store:  # migrates to head
        assert store.schema_revision == HEAD
        times = read(
            store, "SELECT recorded_at FROM harel_processed_events ORDER BY execution_id, event_id"
        )
        assert len(times) == 3 and len(set(times)) == 1  # one time: the migration's
        (migrated,) = times[0]
        assert started - 5 <= migrated <= time.time() + 5
        since = read(store, "SELECT id, markers_since FROM harel_executions ORDER BY id")
        assert since == [("untimed", None), ("x", migrated), ("y", migrated), ("z", None)]
        check_markers_since(store)
        assert store.is_processed("x", "ev2") and store.is_processed("y", "ev1")
        # A marker is forgotten no sooner than the migration's time allows.
        assert store.retention_counts(markers_before=migrated) == (0, 0, 0)
        assert store.forget_processed(migrated) == 0
        assert store.forget_processed(started - 60) == 0
        assert markers(store) == [("x", "ev1"), ("x", "ev2"), ("y", "ev1")]
        # The final roots, untimed first, through the index 0007 made.
        assert store.retention_counts(finished_before=0.0) == (1, 0, 0)
        assert drain(lambda: store.purge_finished(25.0, limit=1)) == [1, 1, 0]
        assert ids(store) == ["x", "z"]
        assert drain(lambda: store.forget_processed(store.clock() + 60)) == [2, 0]
        assert markers(store) == [] and not store.is_processed("x", "ev1")
        check_markers_since(store)
        z = store.load("z")
        assert z is not None
        store.commit(z, [], processed_event_id="ev-new")  # a marker 0006 keeps on the way down
    alembic("-x", f"url={db}", "downgrade", "0006")
    assert schema_of(db) == schema_of(at_0006)
    with closing(sqlite3.connect(db)) as conn:
        assert conn.execute("SELECT * FROM harel_processed_events").fetchall() == [("z", "ev-new")]
        assert conn.execute("SELECT id FROM harel_executions ORDER BY id").fetchall() == [
            ("x",),
            ("z",),
        ]
    with LibsqlStore(db) as store:  # up again: the marker kept gets a time anew
        assert store.is_processed("z", "ev-new")
        check_markers_since(store)
        assert store.forget_processed(store.clock() + 60) == 1
