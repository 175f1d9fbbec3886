"""Every hot named query is index-backed: EXPLAIN QUERY PLAN shows no scan of a large table.

Plans are fixed when a statement is prepared, so an empty database shows the plan a table of a
million rows gets (the store never runs ANALYZE). Also: 0002 backfills the summary columns that
listing reads, and a row whose JSON was already corrupt gets NULLs instead of an error.
"""

from __future__ import annotations

import re
import sqlite3
import time
from pathlib import Path
from typing import Any

import libsql
import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore
from harel_store.sql import MIGRATIONS, QUERIES
from tests.helpers import raw

# The queries an engine worker, relay or monitor runs all the time (operator CLI queries and
# schema bookkeeping are not here).
HOT = {
    "insert_execution", "update_execution", "execution_version", "load_execution",
    "load_for_event", "is_processed", "insert_outbox", "mark_processed", "insert_spawn",
    "schedule_timer", "cancel_timer", "append_trace", "trim_trace", "read_trace",
    "list_executions", "list_by_status", "list_by_definition", "list_roots",
    "list_roots_by_definition", "pending_outbox", "ack_outbox", "pending_spawns",
    "due_timers", "delete_timer", "purge_executions", "purge_processed", "purge_trace",
    "purge_timers", "purge_outbox", "purge_spawns", "ids_in_range", "publish_definition",
    "load_definition", "claim_outbox", "claim_spawns", "claim_due_timers", "list_newest",
    "list_oldest", "mark_dead_outbox", "mark_dead_spawns", "mark_dead_timers", "ack_spawns",
    "fail_outbox", "fail_spawns", "fail_timer", "extend_outbox", "extend_spawns",
    "extend_timer", "revive_outbox", "revive_spawns", "revive_timer", "dead_letters",
    "release_outbox", "release_spawns", "release_timer", "attempts_of",
    "finished_trees", "forget_markers", "renew_markers_since", "purge_dead_outbox",
    "purge_dead_spawns", "purge_dead_timers", "purge_children_left", "orphan_trees",
    "stored_definition", "flows_in_use", "work_ahead", "work_ahead_flows", "held_by",
    "claim_outbox_flows", "claim_spawns_flows", "claim_due_timers_flows",
    "release_worker_outbox", "release_worker_spawns", "release_worker_timers", "workers",
    "mark_flowed_outbox", "mark_flowed_spawns", "mark_flowed_timers", "flows",
    "mark_dead_outbox_flows", "mark_dead_spawns_flows", "mark_dead_timers_flows",
    "advance_clock", "advance_clock_flows", "log_flow_claims_outbox", "log_flow_claims_spawns",
    "log_flow_claims_timers", "prune_flow_claims", "touch_flows", "touch_held_flows",
}  # fmt: skip
# The relays read the queue oldest first: it holds only undelivered entries (an ack deletes),
# and its live ones from seq 1 up (a dead letter's seq is negated, below them), so reading it
# in rowid order up to the LIMIT costs what it returns, with no sort, however many dead
# letters there are.
WHOLE_QUEUE = {
    "pending_outbox": "harel_outbox",
    "pending_spawns": "harel_spawns",
}
# A claim walks the live rows of the keys without settings in round-robin order (0011): the
# rank index from its start, stepping over the few rows under a live lease, up to the LIMIT,
# with no sort.
RANKED = {
    "claim_outbox": "harel_outbox",
    "claim_spawns": "harel_spawns",
    "claim_outbox_flows": "harel_outbox",
    "claim_spawns_flows": "harel_spawns",
    "mark_dead_outbox": "harel_outbox",
    "mark_dead_spawns": "harel_spawns",
    "mark_dead_outbox_flows": "harel_outbox",
    "mark_dead_spawns_flows": "harel_spawns",
}
# What may be scanned: whether some key has settings (EXISTS: the first row ends it), and a
# walk of the keys with settings (each key with room then seeks its own rows).
SMALL = ("SCAN harel_flow_claims",  # the rate log: what the windows of the keys with a rate hold
         "SCAN harel_flows", "SCAN harel_flows USING COVERING INDEX sqlite_autoindex_harel_flows_1",
         "SCAN harel_outbox USING INDEX harel_outbox_rank",
         "SCAN harel_spawns USING INDEX harel_spawns_rank")  # fmt: skip
LISTINGS = {
    "list_executions": "sqlite_autoindex_harel_executions_1",
    "list_by_status": "harel_executions_status",
    "list_by_definition": "harel_executions_definition",
    "list_roots": "harel_executions_roots",
    "list_roots_by_definition": "harel_executions_definition_roots",
}


def _arity(sql: str) -> int:
    numbered = [int(n) for n in re.findall(r"\?(\d+)", sql)]
    return max(numbered) if numbered else sql.count("?")


def _plan(conn: Any, name: str) -> list[str]:
    sql = QUERIES[name].sql
    rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", (None,) * _arity(sql)).fetchall()
    return [str(row[3]) for row in rows]


@pytest.fixture(params=["libsql", "sqlite"])
def conn(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    store = {"libsql": LibsqlStore, "sqlite": SqliteStore}[request.param](tmp_path / "plan.db")
    yield raw(store)
    store.close()


@pytest.mark.parametrize("name", sorted(HOT))
def test_no_hot_query_scans_a_table(conn: Any, name: str) -> None:
    plan = _plan(conn, name)
    scans = [step for step in plan if step.startswith("SCAN harel_") and step not in SMALL]
    # The timers' claim with flows joins the (materialized) few keys with room.
    automatic = "SEARCH f USING AUTOMATIC COVERING INDEX (key=?) LEFT-JOIN"
    assert not [s for s in plan if "AUTOMATIC" in s and s != automatic], plan
    assert scans == [], plan
    if name in WHOLE_QUEUE:
        live = f"SEARCH {WHOLE_QUEUE[name]} USING INTEGER PRIMARY KEY (rowid>?)"
        assert live in plan, plan
        assert not [s for s in plan if "TEMP B-TREE" in s], plan
    if name in RANKED:
        table = RANKED[name]
        assert f"SCAN {table} USING INDEX {table.removeprefix('harel_')}_rank" not in plan
        assert f"SCAN {table} USING INDEX {table}_rank" in plan, plan
        if name.startswith("claim") and not name.endswith("_flows"):  # a merge sorts
            assert not [s for s in plan if "TEMP B-TREE" in s], plan


@pytest.mark.parametrize("name", sorted(LISTINGS))
def test_every_listing_seeks_its_own_index(conn: Any, name: str) -> None:
    searches = [s for s in _plan(conn, name) if s.startswith("SEARCH harel_executions")]
    assert searches, name
    assert all(f"INDEX {LISTINGS[name]} " in s for s in searches), searches
    # the keyset (or an id prefix) seeks a closed range: it never skips, and stops at the end
    assert all("id>? AND id<?)" in s for s in searches), searches


def test_the_timer_sweep_seeks_by_fire_at(conn: Any) -> None:
    # The fire_at index holds live timers only: no dead letter is ever stepped over.
    assert _plan(conn, "due_timers") == [
        "SEARCH harel_timers USING COVERING INDEX harel_timers_fire_at (fire_at<?)"
    ]
    # The claim (and the dead-letter pass before it) reads each due timer's lease from the
    # table, by primary key. The claim ranks the due timers in their keys (0011): it sorts
    # them, never a timer that is not due.
    for name in ("claim_due_timers", "claim_due_timers_flows", "mark_dead_timers",
                 "mark_dead_timers_flows"):  # fmt: skip
        plan = _plan(conn, name)
        due = "harel_timers_fire_at (fire_at<?)"
        assert [s for s in plan if s.startswith("SEARCH") and s.endswith(due)], plan
        assert not [s for s in plan if s.startswith("SCAN harel") and s not in SMALL], plan
        if name.startswith("mark_dead"):  # in fire_at order: what the index gives
            assert not [s for s in plan if "TEMP B-TREE" in s], plan


def test_acks_and_their_kin_find_each_row_by_primary_key(conn: Any) -> None:
    for name in ("ack_outbox", "fail_outbox", "extend_outbox", "revive_outbox", "ack_spawns"):
        plan = _plan(conn, name)
        assert plan[0].endswith("USING INTEGER PRIMARY KEY (rowid=?)"), plan
        assert [s for s in plan if "json_each" in s], plan
    for name in ("delete_timer", "fail_timer", "extend_timer", "revive_timer"):
        plan = _plan(conn, name)
        assert plan[0] == "SEARCH harel_timers USING PRIMARY KEY (execution_id=? AND path=?)"
        # a revive reads whether its key has settings now (0011): one probe
        probe = "SEARCH harel_flows USING COVERING INDEX sqlite_autoindex_harel_flows_1 (key=?)"
        assert plan[1:] in ([], ["CORRELATED SCALAR SUBQUERY 1", probe]), plan


def test_retention_walks_its_own_indexes_oldest_first(conn: Any) -> None:
    # purge_finished reads the final roots alone (never a running execution, never a child),
    # forget_processed the executions that have markers, each marker by primary key.
    roots = [s for s in _plan(conn, "finished_trees") if s.startswith("SEARCH harel_executions")]
    assert roots == [
        "SEARCH harel_executions USING INDEX harel_executions_final_roots (updated_at=?)",
        "SEARCH harel_executions USING INDEX harel_executions_final_roots (updated_at<?)",
    ]
    # The orphans: the final children alone, oldest first in index order (no sort of them),
    # each parent probed by primary key; never the table's rows to decide.
    plan = _plan(conn, "orphan_trees")
    walk = [s for s in plan if s.startswith("SEARCH o ")]
    assert walk == [
        "SEARCH o USING INDEX harel_executions_final_children (updated_at=? AND parent_id>?)",
        "SEARCH o USING INDEX harel_executions_final_children (updated_at<?)",
    ]
    probe = "SEARCH harel_executions USING COVERING INDEX sqlite_autoindex_harel_executions_1"
    probe += " (id=?)"
    assert plan.count(probe) == 2, plan
    walked = plan[plan.index(walk[1]) : plan.index("SCAN (subquery-5)")]
    assert not [s for s in walked if "TEMP B-TREE" in s], plan  # read in index order
    for name in ("forget_markers", "renew_markers_since"):
        plan = _plan(conn, name)
        walk = "SEARCH harel_executions USING INDEX harel_executions_markers (markers_since<?)"
        assert walk in plan, plan
        assert not [s for s in plan if "TEMP B-TREE" in s], plan
    # A commit's marker keeps its execution's markers_since (0012's trigger) by primary key.
    (body,) = conn.execute(
        "SELECT sql FROM sqlite_master WHERE name = 'harel_processed_events_since'"
    ).fetchone()
    update = body[body.index("UPDATE") : body.rindex(";")].replace("NEW.recorded_at", "?")
    update = update.replace("NEW.execution_id", "?")
    rows = conn.execute(f"EXPLAIN QUERY PLAN {update}", (None,) * 3).fetchall()
    assert str(rows[0][3]).endswith("sqlite_autoindex_harel_executions_1 (id=?)"), rows
    for kind, table in (("outbox", "outbox"), ("spawns", "spawns"), ("timers", "timers")):
        plan = _plan(conn, f"purge_dead_{kind}")
        assert any(f"INDEX harel_{table}_dead (dead_at>? AND dead_at<?)" in s for s in plan), plan


def test_dead_letters_read_each_kinds_dead_index_from_its_start(conn: Any) -> None:
    searches = [s for s in _plan(conn, "dead_letters") if s.startswith(("SEARCH", "SCAN harel"))]
    assert searches == [
        f"SEARCH harel_{table} USING INDEX harel_{table}_dead (dead_at>?)"
        for table in ("outbox", "spawns", "timers")
    ]


CLAIMS = {
    "claim_outbox": "harel_outbox",
    "claim_spawns": "harel_spawns",
    "claim_due_timers": "harel_timers",
}


@pytest.mark.parametrize("name", sorted(CLAIMS))
def test_a_claim_updates_the_rows_it_picked_by_primary_key(conn: Any, name: str) -> None:
    first = _plan(conn, name)[0]
    assert first.startswith(f"SEARCH {CLAIMS[name]} USING ") and "PRIMARY KEY" in first, first


def _at_0001(path: Path, driver: str) -> Any:
    conn = (libsql.connect if driver == "libsql" else sqlite3.connect)(str(path))
    for statement in MIGRATIONS[0].statements("up"):
        conn.execute(statement, ())
    conn.execute(QUERIES["create_version_table"].sql, ())
    conn.execute(QUERIES["claim_revision"].sql, (MIGRATIONS[0].revision,))
    return conn


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_0002_backfills_summaries_and_survives_a_corrupt_row(driver: str, tmp_path: Path) -> None:
    path = tmp_path / "old.db"
    conn = _at_0001(path, driver)
    child = Execution(
        id="b",
        definition_id="d",
        version=3,
        status="failed",
        outcome="boom",
        parent_id="a",
        active_path="s.t",
        finished_at=12.5,
    )
    rows = [
        ("a", "d", Execution(id="a", definition_id="d", version=1).model_dump_json(), 1),
        ("b", "d", child.model_dump_json(), 3),
        ("c", "d", "{not json", 1),
    ]
    for row in rows:
        conn.execute("INSERT INTO harel_executions VALUES (?, ?, ?, ?)", row)
    conn.execute("INSERT INTO harel_outbox (target_id, event) VALUES ('a', '{}')", ())
    conn.commit()
    conn.close()

    store = {"libsql": LibsqlStore, "sqlite": SqliteStore}[driver](path)
    try:
        assert store.schema_revision == MIGRATIONS[-1].revision
        db = raw(store)
        summary = db.execute(
            "SELECT id, status, outcome, active_path, parent_id, finished_at "
            "FROM harel_executions ORDER BY id",
            (),
        ).fetchall()
        assert [tuple(r) for r in summary] == [
            ("a", "running", None, None, None, None),
            ("b", "failed", "boom", "s.t", "a", 12.5),
            ("c", None, None, None, None, None),
        ]
        assert [e.id for e in store.list_executions().items] == ["a", "b"]
        assert [e.id for e in store.list_executions(status="failed").items] == ["b"]
        assert [e.id for e in store.list_executions(roots_only=True).items] == ["a"]
        assert (
            store.list_executions(definition_id="d").items[1]
            == store.list_executions(status=["failed", "running"]).items[1]
        )
        created = db.execute("SELECT created_at FROM harel_outbox", ()).fetchall()
        assert [tuple(r) for r in created] == [(None,)]
    finally:
        store.close()


def test_new_outbox_entries_carry_sqlite_clock_epoch_seconds(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "clock.db") as store:
        before = time.time()
        store.commit(Execution(id="x", definition_id="d"), [(None, Event(name="go"))])
        after = time.time()
        (created,) = raw(store).execute("SELECT created_at FROM harel_outbox", ()).fetchone()
        assert before - 1 <= created <= after + 1


def test_a_parents_children_are_an_index_seek(conn: Any) -> None:
    plan = _plan(conn, "children_of")  # a page starts where the last one ended, no sort
    assert plan == [
        "SEARCH harel_executions USING INDEX harel_executions_parent (parent_id=? AND id>?)"
    ]


def _steps(conn: Any, name: str) -> dict[int, tuple[int, str]]:
    """The plan as a tree: step id -> (parent id, detail)."""
    sql = QUERIES[name].sql
    rows = conn.execute(f"EXPLAIN QUERY PLAN {sql}", (None,) * _arity(sql)).fetchall()
    return {row[0]: (row[1], str(row[3])) for row in rows}


# Newest first (with or without a status filter: the same statement, its four status slots
# filled with the statuses asked for, or all four) and a time window, oldest or newest first.
TIMED = "SEARCH harel_executions USING INDEX harel_executions_updated "
TIME_LISTINGS = {
    "list_newest": [TIMED + "(status=? AND updated_at>? AND updated_at<?)"] * 4
    + [TIMED + "(status=? AND updated_at=? AND id<?)"] * 4,  # the untimed rows, by id
    "list_oldest": [TIMED + "(status=? AND updated_at>? AND updated_at<?)"] * 4,
}


@pytest.mark.parametrize("name", sorted(TIME_LISTINGS))
def test_time_listings_seek_a_closed_range_of_the_update_index(conn: Any, name: str) -> None:
    steps = _steps(conn, name)
    seeks = [detail for _, detail in steps.values() if detail.startswith(("SEARCH", "SCAN harel"))]
    # Both ends of the time range bound each seek, so it stops at the window's end whatever
    # the table holds; the keyset's tie-break on id is checked on the few rows at its start.
    assert seeks == TIME_LISTINGS[name], seeks
    for parent, detail in steps.values():
        if "TEMP B-TREE" in detail:
            # The only sorts are the merge's, of each seek's LIMITed output: never the seek's
            # own rows (the index gives them in order).
            assert steps[parent][1] in ("LEFT", "RIGHT"), (detail, steps)


OPERATOR_VIEWS = {
    # the live queue in seq order, up to the LIMIT
    "outbox_view": ["SEARCH harel_outbox USING INTEGER PRIMARY KEY (rowid>?)"],
    "outbox_view_target": [
        "SEARCH harel_outbox USING INDEX harel_outbox_target (target_id=? AND rowid>?)"
    ],
    "spawns_view": ["SEARCH harel_spawns USING INTEGER PRIMARY KEY (rowid>?)"],
    "spawns_view_parent": [
        "SEARCH harel_spawns USING INDEX harel_spawns_parent (parent_id=? AND rowid>?)"
    ],
    "timers_view": ["SEARCH harel_timers USING INDEX harel_timers_fire_at (fire_at<?)"],
}


@pytest.mark.parametrize("name", sorted(OPERATOR_VIEWS))
def test_operator_views_read_in_key_order_without_a_sort(conn: Any, name: str) -> None:
    assert _plan(conn, name) == OPERATOR_VIEWS[name]


def test_stats_read_one_end_of_a_key_for_each_time(conn: Any) -> None:
    plan = _plan(conn, "pending_counts")
    assert "SEARCH harel_timers USING COVERING INDEX harel_timers_fire_at" in plan, plan
    assert not [s for s in plan if "TEMP B-TREE" in s or "AUTOMATIC" in s], plan
