"""Issue 25, classes 5, 6 and 17: a row of the wrong shape or type, from a server or edited
by hand in a local file, is a `StoreError` naming the query and the row (`OutcomeUnknown`
for a write of unknown fate), never a raw ValueError/TypeError/ValidationError; the CLI
prints one line and exits 1. The check is the row each query declares in queries.sql."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    SqliteStore,
    StoreConflict,
    StoreError,
    TimerOp,
)
from harel_store.connection import LocalConnection
from harel_store.sql import QUERIES, RowError
from tests.helpers import raw
from tests.test_cli import cli, failed
from tests.test_hostile_remote import Bent, bent, first_result, store  # noqa: F401

LOCAL = [SqliteStore, LibsqlStore]


def test_a_declared_row_is_checked_and_a_real_made_float() -> None:
    query = QUERIES["timers_view"]
    row = ("e", "p", 3, None, None, 0, None)
    assert query.check([row]) == [("e", "p", 3.0, None, None, 0, None)]
    assert type(query.check([row])[0][2]) is float
    for bad, what in [
        (("e", "p", "abc", None, None, 0, None), "fire_at: text 'abc', not a number; row 'e'"),
        (("e", "p", 1.0, None, None, 2.5, None), "attempts: real 2.5, not an integer"),
        (("e", "p", None, None, None, 0, None), "fire_at: null None"),
        (("e", "p", 1.0), "3 columns, not 7"),
        ((), "0 columns, not 7"),
    ]:
        with pytest.raises(RowError, match="timers_view") as info:
            query.check([bad])
        assert what in str(info.value)
    huge = ("e", "p", "x" * 10_000, None, None, 0, None)
    with pytest.raises(RowError) as info:
        query.check([huge])
    assert len(str(info.value)) < 200


def _seed(path: str, kind: Any) -> None:
    with kind(path) as s:
        exe = Execution(id="exe-1", definition_id="d")
        s.save(exe)
        s.commit(exe, [], timers=[TimerOp(action="schedule", path="t1", fire_at=5.0)])


def _edit(path: str, sql: str, *params: Any) -> None:
    # stdlib sqlite3 only once every store on the file is closed
    with closing(sqlite3.connect(path)) as conn, conn:
        conn.execute(sql, params)


@pytest.mark.parametrize("kind", LOCAL, ids=lambda k: k.__name__)
@pytest.mark.parametrize(
    ("column", "value"),
    [
        ("claimed_until", "abc"),
        ("claimed_until", b"\x00\x01"),
        ("attempts", "seven"),
        ("attempts", b"\x01"),
    ],
)
def test_a_timer_edited_by_hand_is_a_store_error_naming_it(
    tmp_path: Path, kind: Any, column: str, value: Any
) -> None:
    # (a fire_at of text or blob sorts after every number: no view lists it)
    path = str(tmp_path / "x.db")
    _seed(path, kind)
    _edit(path, f"UPDATE harel_timers SET {column} = ? WHERE execution_id = 'exe-1'", value)
    with kind(path) as s, pytest.raises(StoreError, match=rf"{column}: .*row 'exe-1'"):
        s.timers_view()


@pytest.mark.parametrize("kind", LOCAL, ids=lambda k: k.__name__)
def test_attempts_edited_through_the_store_connection(tmp_path: Path, kind: Any) -> None:
    path = str(tmp_path / "x.db")
    _seed(path, kind)
    with kind(path) as s:
        conn = raw(s)
        conn.execute("UPDATE harel_timers SET attempts = 2.5")
        conn.commit()
        with pytest.raises(StoreError, match=r"timers_view .*attempts: real 2.5.*row 'exe-1'"):
            s.timers_view()


def _seed_queues(path: str, kind: Any) -> None:
    with kind(path) as s:
        exe = Execution(id="exe-1", definition_id="d")
        s.save(exe)
        s.commit(
            exe,
            [("exe-2", Event(name="e"))],
            timers=[TimerOp(action="schedule", path="t1", fire_at=5.0)],
            spawns=[("kid", "root", {})],
            trace={"n": 1},
        )


_DEAD = "UPDATE harel_outbox SET seq = -seq, dead_at = 1.0, "

# Each read of the queues and the operator views, and a column edited to a type it cannot
# hold: the query the error names, and the read.
EDITED = [
    ("UPDATE harel_outbox SET attempts = 'x'", "outbox_view", lambda s: s.outbox_view()),
    ("UPDATE harel_outbox SET created_at = 'x'", "pending_counts", lambda s: s.stats(0.0)),
    ("UPDATE harel_outbox SET target_id = X'01'", "pending_outbox", lambda s: s.pending_outbox()),
    ("UPDATE harel_outbox SET target_id = X'01'", "claim_outbox", lambda s: s.claim_outbox("w")),
    ("UPDATE harel_spawns SET attempts = 2.5", "spawns_view", lambda s: s.spawns_view()),
    ("UPDATE harel_spawns SET root_path = X'01'", "claim_spawns", lambda s: s.claim_spawns("w")),
    (
        "UPDATE harel_timers SET attempts = 'x'",
        "mark_dead_timers",
        lambda s: s.claim_due_timers("w", 10.0, max_attempts=1),
    ),
    ("UPDATE harel_trace SET idx = 'x'", "read_trace", lambda s: s.read_trace("exe-1")),
    ("UPDATE harel_executions SET status = X'01'", "count_by_status", lambda s: s.stats(0.0)),
    (_DEAD + "attempts = 'x'", "dead_letters", lambda s: s.dead_letters()),
    (_DEAD + "last_error = X'01'", "dead_outbox_entry", lambda s: s.dead_letter("outbox", 1)),
    (
        "UPDATE harel_outbox SET attempts = 'x'",
        "attempts_of",
        lambda s: s.attempts_of(s.pending_outbox()),
    ),
    ("UPDATE harel_executions SET data = X'01'", "load_execution", lambda s: s.load("exe-1")),
    (
        "UPDATE harel_executions SET status = 'finished', version = 'x'",
        "finished_trees",
        lambda s: s.purge_finished(1e12),
    ),
]


@pytest.mark.parametrize("kind", LOCAL, ids=lambda k: k.__name__)
@pytest.mark.parametrize(("edit", "query", "read"), EDITED, ids=[e[1] for e in EDITED])
def test_a_queue_row_edited_by_hand_is_a_store_error_naming_its_query(
    tmp_path: Path, kind: Any, edit: str, query: str, read: Callable[[Any], Any]
) -> None:
    path = str(tmp_path / "x.db")
    _seed_queues(path, kind)
    _edit(path, edit)
    with kind(path) as s, pytest.raises(StoreError, match=rf"row of {query} that does not fit"):
        read(s)


def test_the_cli_prints_one_line_and_exits_1(tmp_path: Path) -> None:
    path = str(tmp_path / "x.db")
    _seed(path, LibsqlStore)
    _edit(path, "UPDATE harel_timers SET attempts = 'abc'")
    line = failed(cli("timers", "--url", path))
    assert "timers_view" in line and "exe-1" in line


# -- remote: a stand-in for the HTTP client bends the real sqld's rows --------------------


def _rows(change: Callable[[list[Any]], list[Any]]) -> Any:
    def bend(result: dict[str, Any]) -> None:
        inner = result["response"]["result"]
        inner["rows"] = [change(row) for row in inner["rows"]]

    return first_result(bend)


_TEXT = {"type": "text", "value": "abc"}
_NULL = {"type": "null"}

BENDS = {
    "short": lambda row: row[:1],
    "empty": lambda row: [],
    "extra": lambda row: [*row, _NULL],
    "null": lambda row: [*row[:2], _NULL, *row[3:]],
    "text": lambda row: [*row[:2], _TEXT, *row[3:]],
}


@pytest.fixture
def timed(store: LibsqlStore) -> Iterator[LibsqlStore]:  # noqa: F811
    exe = Execution(id="exe-r", definition_id="d")
    store.save(exe)
    store.commit(exe, [], timers=[TimerOp(action="schedule", path="t1", fire_at=5.0)])
    yield store


@pytest.mark.sqld
@pytest.mark.parametrize("how", list(BENDS))
def test_remote_timer_rows_of_the_wrong_shape(
    timed: LibsqlStore,
    bent: Bent,  # noqa: F811
    how: str,
) -> None:
    for call in (lambda: timed.timers_view(), lambda: timed.due_timers(1e12)):
        bent.bend = _rows(BENDS[how])
        with pytest.raises(StoreError) as info:
            call()
        assert type(info.value) is StoreError
        bent.bend = None


def _batch_rows(change: Callable[[list[Any]], list[Any]]) -> Any:
    def bend(result: dict[str, Any]) -> None:
        for step in result["response"]["result"]["step_results"]:
            if step is not None and [c["name"] for c in step["cols"]] == ["seq"]:
                step["rows"] = [change(row) for row in step["rows"]]

    return first_result(bend)


@pytest.mark.sqld
@pytest.mark.parametrize(
    "cell",
    [_TEXT, {"type": "float", "value": 7.9}, _NULL],
    ids=["text", "float", "null"],
)
def test_remote_commit_seqs_of_the_wrong_type(
    store: LibsqlStore,  # noqa: F811
    bent: Bent,  # noqa: F811
    cell: dict[str, Any],
) -> None:
    exe = Execution(id="exe-s", definition_id="d")
    store.save(exe)
    bent.bend = _batch_rows(lambda row: [cell])
    with pytest.raises(OutcomeUnknown, match="seq"):
        store.commit(exe, [("x", Event(name="go"))])
    assert exe.version == 1


# -- issue 35, class 13: the version column is the CAS's truth ----------------------------

VERSION_KINDS = [
    "libsql-memory",
    "libsql-file",
    "sqlite-file",
    "async-libsql-file",
    pytest.param("libsql-remote", marks=pytest.mark.sqld),
    pytest.param("async-libsql-remote", marks=pytest.mark.sqld),
    pytest.param("libsql-replica", marks=pytest.mark.sqld),
]


def _bump_version_column(s: Any, execution_id: str) -> None:
    """A foreign client's UPDATE of the version column alone (the JSON keeps its version):
    through the store's own connection on a local database, the test's own on a server."""
    conn = raw(s)
    conn.execute("UPDATE harel_executions SET version = version + 1 WHERE id = ?", (execution_id,))
    conn.commit()
    inner = s.sync_store if hasattr(s, "sync_store") else s
    if not isinstance(inner._conn, LocalConnection):  # a connection of the test's own
        conn.close()
    s.sync()  # a replica reads its own copy: it sees a foreign write once it pulls it


@pytest.mark.parametrize("kind", VERSION_KINDS)
def test_a_load_takes_the_version_column_so_a_moved_row_is_not_frozen(
    kind: str, open_store: Callable[[], Any]
) -> None:
    s = open_store()
    exe = Execution(id="v", definition_id="d")
    s.save(exe)
    _bump_version_column(s, "v")
    with pytest.raises(StoreConflict) as info:
        s.commit(exe, [])
    assert info.value.found == 2
    loaded = s.load("v")
    assert loaded is not None and loaded.version == 2
    s.commit(loaded, [(None, Event(name="go"))])
    assert loaded.version == 3
    _bump_version_column(s, "v")
    again, seen = s.load_for_event("v", "in-1")
    assert again is not None and again.version == 4 and not seen
    s.commit(again, [], "in-1")
    assert s.load_for_event("v", "in-1")[0].version == 5
    assert [e.version for e in s.list_executions().items] == [5]
