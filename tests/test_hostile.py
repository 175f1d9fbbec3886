"""Hostile and broken input: a clear typed error, and the database exactly as it was.

Every call in BAD is made against a file holding some state; the file's full dump must be
the same afterwards. Then: metacharacters are only ever data, and a row corrupted on disk
is named by the error while the rest of the store keeps working.
"""

from __future__ import annotations

import base64
import json
import sqlite3
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    DefinitionRecord,
    Event,
    Execution,
    LibsqlStore,
    StoreError,
    TimerOp,
)
from harel_store.connection.local import import_libsql
from harel_store.store import Store
from tests.workers.common import open_store

DRIVERS = ["libsql", "sqlite"]


def deep(levels: int) -> dict[str, Any]:
    root: dict[str, Any] = {}
    node = root
    for _ in range(levels):
        node["x"] = {}
        node = node["x"]
    return root


def exe(**kw: Any) -> Execution:
    """The stored execution at its stored version: only validation stands between it and a write."""
    return Execution(id="victim", definition_id="d", version=1, **kw)


def unvalidated(**fields: Any) -> Execution:
    """The stored execution as ``model_construct`` builds it: no validation at all."""
    values = {"id": "victim", "definition_id": "d", "version": 1, "status": "running"}
    values.update(context={}, outcome=None, active_path=None, parent_id=None, finished_at=None)
    return Execution.model_construct(**{**values, **fields})


def defn(**fields: Any) -> DefinitionRecord:
    return DefinitionRecord(
        **{"definition_id": "d", "version": 2, "digest": "x", "source": {}, **fields}
    )


NAN, INF = float("nan"), float("inf")
HUGE = "x" * 100_000
BAD_IDS: list[Any] = ["", HUGE, 5, None, b"id", ["a"], "nul\x00byte"]

# (label, call, expected exception)
BAD: list[tuple[str, Callable[[Store], Any], type[Exception]]] = [
    *[(f"load({i!r:.12})", lambda s, i=i: s.load(i), (TypeError, ValueError)) for i in BAD_IDS],
    *[
        (f"read_trace({i!r:.12})", lambda s, i=i: s.read_trace(i), (TypeError, ValueError))
        for i in BAD_IDS
    ],
    *[
        (f"purge({i!r:.12})", lambda s, i=i: s.purge(i, 1), (TypeError, ValueError))
        for i in BAD_IDS
    ],
    *[
        (
            f"emit target {i!r:.12}",
            lambda s, i=i: s.commit(exe(), [(i, Event(name="e"))]),
            (TypeError, ValueError),
        )
        for i in BAD_IDS
        if i is not None
    ],
    *[
        (
            f"processed_event_id {i!r:.12}",
            lambda s, i=i: s.commit(exe(), [], i),
            (TypeError, ValueError),
        )
        for i in BAD_IDS
        if i is not None
    ],
    *[
        (
            f"spawn child {i!r:.12}",
            lambda s, i=i: s.commit(exe(), [], spawns=[(i, "r", {})]),
            (TypeError, ValueError),
        )
        for i in BAD_IDS
    ],
    ("load_for_event bad event", lambda s: s.load_for_event("victim", ""), ValueError),
    ("is_processed int", lambda s: s.is_processed("victim", 7), TypeError),
    ("append_trace bad id", lambda s: s.append_trace(HUGE, {}), ValueError),
    ("ids_with_prefix bytes", lambda s: s.ids_with_prefix(b"v"), TypeError),
    # contexts that are not JSON, or nested past reason
    ("context object", lambda s: s.commit(exe(context={"o": object()}), []), ValueError),
    ("context NaN", lambda s: s.commit(exe(context={"n": NAN}), []), ValueError),
    ("context -inf", lambda s: s.commit(exe(context={"n": [-INF]}), []), ValueError),
    ("context deep", lambda s: s.commit(exe(context=deep(5000)), []), ValueError),
    (
        "event payload NaN",
        lambda s: s.commit(exe(), [(None, Event(name="e", payload={"n": NAN}))]),
        ValueError,
    ),
    (
        "event payload deep",
        lambda s: s.commit(exe(), [(None, Event(name="e", payload=deep(5000)))]),
        ValueError,
    ),
    ("trace object", lambda s: s.commit(exe(), [], trace={"o": object()}), ValueError),
    ("trace NaN", lambda s: s.append_trace("victim", {"n": NAN}), ValueError),
    ("trace deep", lambda s: s.append_trace("victim", deep(100_000)), ValueError),
    ("trace not a dict", lambda s: s.append_trace("victim", [1]), TypeError),
    (
        "spawn context inf",
        lambda s: s.commit(exe(), [], spawns=[("c", "r", {"t": INF})]),
        ValueError,
    ),
    (
        "spawn context not a dict",
        lambda s: s.commit(exe(), [], spawns=[("c", "r", "{}")]),
        TypeError,
    ),
    (
        "definition source NaN",
        lambda s: s.publish_definition(
            DefinitionRecord(definition_id="d", version=9, digest="x", source={"n": NAN})
        ),
        ValueError,
    ),
    ("not an Execution", lambda s: s.commit({"id": "victim"}, []), TypeError),  # type: ignore[arg-type]
    ("emit not a pair", lambda s: s.commit(exe(), [Event(name="e")]), TypeError),  # type: ignore[list-item]
    # timers: NaN/inf times, unknown actions
    (
        "timer at NaN",
        lambda s: s.commit(exe(), [], timers=[TimerOp.schedule("p", NAN)]),
        ValueError,
    ),
    (
        "timer at inf",
        lambda s: s.commit(exe(), [], timers=[TimerOp.schedule("p", INF)]),
        ValueError,
    ),
    (
        "timer unknown action",
        lambda s: s.commit(exe(), [], timers=[TimerOp(action="explode", path="p")]),  # type: ignore[arg-type]
        ValueError,
    ),
    (
        "timer unknown action, unvalidated",
        lambda s: s.commit(exe(), [], timers=[TimerOp.model_construct(action="explode", path="p")]),
        ValueError,
    ),
    (
        "timer NaN, unvalidated",
        lambda s: s.commit(
            exe(), [], timers=[TimerOp.model_construct(action="schedule", path="p", fire_at=NAN)]
        ),
        ValueError,
    ),
    ("timer as a tuple", lambda s: s.commit(exe(), [], timers=[("schedule", "p", 1.0)]), TypeError),
    ("due_timers NaN", lambda s: s.due_timers(NAN), ValueError),
    ("due_timers str", lambda s: s.due_timers("1"), TypeError),
    ("delete_timer inf", lambda s: s.delete_timer("victim", "p", INF), ValueError),
    # cursors and limits
    ("cursor junk", lambda s: s.list_executions(cursor="!!not a cursor"), ValueError),
    ("cursor int", lambda s: s.list_executions(cursor=5), TypeError),
    (
        "cursor not JSON",
        lambda s: s.list_executions(cursor=base64.urlsafe_b64encode(b"\xff").decode()),
        ValueError,
    ),
    (
        "cursor wrong shape",
        lambda s: s.list_executions(cursor=base64.urlsafe_b64encode(b'{"after": 3}').decode()),
        ValueError,
    ),
    (
        "cursor SQL",
        lambda s: s.list_executions(cursor="' OR 1=1; DROP TABLE harel_executions; --"),
        ValueError,
    ),
    (
        "cursor lone surrogate",
        lambda s: s.list_executions(
            cursor=base64.urlsafe_b64encode(b'{"after": "\\ud800"}').decode()
        ),
        ValueError,
    ),
    (
        "cursor huge time",
        lambda s: s.list_executions(
            newest_first=True,
            cursor=base64.urlsafe_b64encode(
                b'{"after": "a", "order": "newest", "at": 1' + b"0" * 400 + b"}"
            ).decode(),
        ),
        ValueError,
    ),
    ("ids_with_prefix lone surrogate", lambda s: s.ids_with_prefix("a\ud800"), ValueError),
    ("id_prefix lone surrogate", lambda s: s.list_executions(id_prefix="\udfff"), ValueError),
    ("limit 0", lambda s: s.list_executions(limit=0), ValueError),
    ("limit -1", lambda s: s.list_executions(limit=-1), ValueError),
    ("limit huge", lambda s: s.list_executions(limit=10**12), ValueError),
    ("limit str", lambda s: s.list_executions(limit="10"), TypeError),
    ("limit float", lambda s: s.list_executions(limit=10.0), TypeError),
    ("status unknown", lambda s: s.list_executions(status="running' OR '1'='1"), ValueError),
    ("status LIKE", lambda s: s.list_executions(status=["%"]), ValueError),
    ("roots_only str", lambda s: s.list_executions(roots_only="no"), TypeError),
    ("definition_id int", lambda s: s.list_executions(definition_id=1), TypeError),
    # sequence numbers and versions
    ("ack_outbox str", lambda s: s.ack_outbox("1"), TypeError),
    ("ack_outbox bool", lambda s: s.ack_outbox(True), TypeError),
    ("ack_outbox 2**64", lambda s: s.ack_outbox(2**64), ValueError),
    ("ack_spawn float", lambda s: s.ack_spawn(1.0), TypeError),
    ("purge version str", lambda s: s.purge("victim", "1"), TypeError),
    ("purge version huge", lambda s: s.purge("victim", 10**30), ValueError),
    ("load_definition version str", lambda s: s.load_definition("d", "1"), TypeError),
    # numbers past what a float or SQLite's INTEGER holds
    ("due_timers 2**2000", lambda s: s.due_timers(2**2000), ValueError),
    ("stats 2**2000", lambda s: s.stats(2**2000), ValueError),
    ("delete_timer 10**400", lambda s: s.delete_timer("victim", "p", 10**400), ValueError),
    ("definition version 2**63", lambda s: s.publish_definition(defn(version=2**63)), ValueError),
    # strings no database text can hold
    ("load lone surrogate", lambda s: s.load("\ud800"), ValueError),
    ("trace of a lone surrogate", lambda s: s.read_trace("a\udfffb"), ValueError),
    ("outcome lone surrogate", lambda s: s.commit(exe(outcome="\ud800"), []), ValueError),
    # text a column of its own would cut at a NUL
    ("outcome NUL", lambda s: s.commit(exe(outcome="ok\x00tail"), []), ValueError),
    ("active_path NUL", lambda s: s.commit(exe(active_path="a\x00b"), []), ValueError),
    ("digest NUL", lambda s: s.publish_definition(defn(digest="sha\x00x")), ValueError),
    # documents json would not give back as given
    (
        "context colliding keys",
        lambda s: s.commit(exe(context={"a": {1: "x", "1": "y"}}), []),
        ValueError,
    ),
    ("context surrogate key", lambda s: s.commit(exe(context={"\ud800": 1}), []), ValueError),
    ("context bytes", lambda s: s.commit(exe(context={"b": b"x"}), []), ValueError),
    (
        "payload None key",
        lambda s: s.commit(exe(), [(None, Event(name="e", payload={"a": {None: 1}}))]),
        ValueError,
    ),
    ("trace None key", lambda s: s.append_trace("victim", {None: 1}), ValueError),
    ("spawn int key", lambda s: s.commit(exe(), [], spawns=[("c", "r", {1: "a"})]), ValueError),
    (
        "source surrogate key",
        lambda s: s.publish_definition(defn(source={"\udc80": 1})),
        ValueError,
    ),
    # models built with model_construct, which skips validation
    *[
        (
            f"unvalidated execution {label}",
            lambda s, f=fields: s.commit(unvalidated(**f), []),
            error,
        )
        for label, fields, error in [
            ("id None", {"id": None}, TypeError),
            ("id empty", {"id": ""}, ValueError),
            ("id NUL", {"id": "a\x00b"}, ValueError),
            ("id 600 chars", {"id": "x" * 600}, ValueError),
            ("status bogus", {"status": "bogus"}, ValueError),
            ("context None", {"context": None}, TypeError),
            ("outcome 5", {"outcome": 5}, TypeError),
            ("finished_at NaN", {"finished_at": NAN}, ValueError),
            ("version -1", {"version": -1}, ValueError),
            ("version 2**63", {"version": 2**63 - 1}, ValueError),
            ("version str", {"version": "1"}, TypeError),
            ("parent_id 5", {"parent_id": 5}, TypeError),
        ]
    ],
    (
        "unvalidated event",
        lambda s: s.commit(exe(), [(None, Event.model_construct(name="", id="i", payload={}))]),
        ValueError,
    ),
    (
        "unvalidated event payload",
        lambda s: s.commit(exe(), [(None, Event.model_construct(name="e", id="i", payload=[]))]),
        TypeError,
    ),
    (
        "unvalidated definition",
        lambda s: s.publish_definition(
            DefinitionRecord.model_construct(definition_id="d", version=-1, digest="x", source={})
        ),
        ValueError,
    ),
    # trace_max: set to anything but None or a non-negative int
    *[
        (f"trace_max {value!r}", lambda s, v=value: setattr(s, "trace_max", v), error)
        for value, error in [
            (-1, ValueError),
            ("3", TypeError),
            (2.5, TypeError),
            (True, TypeError),
        ]
    ],
]


def dump(store: Store, db: Path) -> list[str]:
    """The file's schema and rows, read through the store's own SQLite library: a sqlite3
    connection closing beside a LibsqlStore would delete its WAL, and the store's later
    writes would go where no other connection looks (see tests/test_two_libraries.py)."""
    connect = import_libsql().connect if isinstance(store, LibsqlStore) else sqlite3.connect
    raw = connect(str(db))
    try:
        out = [repr(row) for row in raw.execute(SCHEMA).fetchall()]
        for (table,) in raw.execute(TABLES).fetchall():
            rows = raw.execute(f'SELECT * FROM "{table}"').fetchall()
            out += sorted(repr(tuple(row)) for row in rows)
        return out
    finally:
        raw.close()


SCHEMA = "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
TABLES = "SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"


@pytest.fixture(params=DRIVERS)
def seeded(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Store, Path]]:
    db = tmp_path / "hostile.db"
    store = open_store(request.param, db)
    victim = Execution(id="victim", definition_id="d", context={"k": 1})
    store.commit(
        victim,
        [("other", Event(name="e"))],
        "in-1",
        [TimerOp.schedule("p", 5.0)],
        [("c", "r", {})],
        {"step": 1},
    )
    store.publish_definition(
        DefinitionRecord(definition_id="d", version=1, digest="x", source={"a": 1})
    )
    try:
        yield store, db
    finally:
        store.close()


@pytest.mark.parametrize(("label", "call", "error"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_a_typed_error_and_writes_nothing(
    seeded: tuple[Store, Path], label: str, call: Callable[[Store], Any], error: type[Exception]
) -> None:
    store, db = seeded
    before = dump(store, db)
    with pytest.raises(error) as info:
        call(store)
    assert not isinstance(info.value, StoreError), "bad input is the caller's error"
    assert str(info.value), "the error must say what is wrong"
    assert dump(store, db) == before
    assert store.load("victim").version == 1  # type: ignore[union-attr]  # still usable
    assert store.trace_max == 200


METACHARS = [
    "%",
    "_",
    "\\",
    "%_\\",
    "a%",
    "a_b",
    "'",
    "''; DROP TABLE harel_executions; --",
    '"',
    "?",
    "?1",
    ":name",
    "$x",
    "é",
    "🙂",
    "[*]",
    "a' OR '1'='1",
]


@pytest.mark.parametrize("driver", DRIVERS)
def test_sql_and_like_metacharacters_are_only_data(driver: str, tmp_path: Path) -> None:
    with open_store(driver, tmp_path / "meta.db") as store:
        for i, text in enumerate(METACHARS):
            e = Execution(id=text, definition_id=text, active_path=text, context={text: text})
            ev = Event(name=text, id=text, payload={text: text})
            store.commit(
                e,
                [(text, ev)],
                text,
                [TimerOp.schedule(text, float(i))],
                [(text, text, {text: text})],
                {text: text},
            )
            store.publish_definition(
                DefinitionRecord(definition_id=text, version=1, digest=text, source={text: text})
            )
        for text in METACHARS:
            got = store.load(text)
            assert got is not None and got.context == {text: text} and got.definition_id == text
            assert store.load_for_event(text, text) == (got, True)
            assert store.read_trace(text) == [{text: text, "index": 0}]
            assert store.ids_with_prefix(text) == sorted(m for m in METACHARS if m.startswith(text))
            assert [s.id for s in store.list_executions(definition_id=text).items] == [text]
            assert store.load_definition(text, 1).source == {text: text}  # type: ignore[union-attr]
        assert store.ids_with_prefix("") == sorted(METACHARS)
        assert [(o.target_id, o.event.id) for o in store.pending_outbox()] == [
            (m, m) for m in METACHARS
        ]
        assert sorted(store.due_timers(1e9)) == sorted(
            (m, m, float(i)) for i, m in enumerate(METACHARS)
        )
        for text in METACHARS:
            assert store.purge(text, 1)
        assert store.ids_with_prefix("") == [] and store.pending_outbox() == []
        assert store.due_timers(1e9) == [] and store.pending_spawns() == []


CORRUPT = ["{not json", "", "[1, 2]", "null", '"text"', "\xff\xfe garbage"]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize("garbage", CORRUPT)
def test_a_row_corrupted_on_disk_is_named_and_the_rest_still_works(
    driver: str, garbage: str, tmp_path: Path
) -> None:
    db = tmp_path / "corrupt.db"
    with open_store(driver, db) as store:
        for name in ("a-good", "b-bad", "c-good"):
            store.commit(
                Execution(id=name, definition_id="d"),
                [(name, Event(name="e"))],
                trace={"ok": True},
                spawns=[(f"{name}-kid", "r", {})],
            )
    raw = sqlite3.connect(db)
    with raw:
        raw.execute("UPDATE harel_executions SET data = ? WHERE id = 'b-bad'", (garbage,))
        raw.execute("UPDATE harel_outbox SET event = ? WHERE target_id = 'b-bad'", (garbage,))
        raw.execute("UPDATE harel_trace SET entry = ? WHERE execution_id = 'b-bad'", (garbage,))
        raw.execute("UPDATE harel_spawns SET context = ? WHERE parent_id = 'b-bad'", (garbage,))
    raw.close()
    with open_store(driver, db) as store:
        for read in (lambda: store.load("b-bad"), lambda: store.load_for_event("b-bad", "x")):
            with pytest.raises(StoreError, match="b-bad"):
                read()
        with pytest.raises(StoreError, match="'b-bad'"):
            store.read_trace("b-bad")
        with pytest.raises(StoreError, match="outbox entry 2"):
            store.pending_outbox()
        with pytest.raises(StoreError, match="spawn 2"):
            store.pending_spawns()
        for name in ("a-good", "c-good"):
            assert store.load(name).version == 1  # type: ignore[union-attr]
            assert store.read_trace(name) == [{"ok": True, "index": 0}]
        ids = [s.id for s in store.list_executions().items]
        assert ids == ["a-good", "b-bad", "c-good"]
        store.ack_outbox(2)
        store.ack_spawn(2)
        assert [o.target_id for o in store.pending_outbox()] == ["a-good", "c-good"]
        assert store.purge("b-bad", 1)
        assert store.read_trace("b-bad") == []


def test_corrupt_definition_source_is_named(tmp_path: Path) -> None:
    db = tmp_path / "def.db"
    with open_store("sqlite", db) as store:
        store.publish_definition(
            DefinitionRecord(definition_id="d", version=1, digest="x", source={})
        )
    raw = sqlite3.connect(db)
    with raw:
        raw.execute("UPDATE harel_definitions SET source = 'oops'")
    raw.close()
    with open_store("sqlite", db) as store, pytest.raises(StoreError, match="'d' v1"):
        store.load_definition("d", 1)


def test_json_stays_readable_by_other_tools(tmp_path: Path) -> None:
    """What the store writes is strict JSON (no NaN tokens): sqlite's json functions read it."""
    db = tmp_path / "j.db"
    with open_store("sqlite", db) as store:
        store.commit(Execution(id="j", definition_id="d", context={"f": 1.5}), [])
    raw = sqlite3.connect(db)
    try:
        (data,) = raw.execute("SELECT data FROM harel_executions").fetchone()
        assert json.loads(data)["context"] == {"f": 1.5}
        assert raw.execute("SELECT json_valid(data) FROM harel_executions").fetchone() == (1,)
    finally:
        raw.close()


def test_the_async_twin_built_from_a_path_says_to_await_create() -> None:
    from harel_store import AsyncLibsqlStore

    with pytest.raises(TypeError, match=r"await AsyncLibsqlStore.create"):
        AsyncLibsqlStore("x.db")  # type: ignore[arg-type]


@pytest.mark.parametrize("driver", DRIVERS)
@pytest.mark.parametrize(
    ("column", "value"),
    [("version", "seven"), ("version", 2.5), ("updated_at", "noon"), ("finished_at", b"\x01")],
)
def test_a_summary_column_corrupted_on_disk_is_named(
    driver: str, column: str, value: Any, tmp_path: Path
) -> None:
    db = tmp_path / "summary.db"
    with open_store(driver, db) as store:
        store.save(Execution(id="root", definition_id="d", status="finished"))
        store.save(Execution(id="kid", definition_id="d", parent_id="root", status="finished"))
    raw = sqlite3.connect(db)  # the store is closed: one library on the file at a time
    with raw:
        raw.execute(f"UPDATE harel_executions SET {column} = ? WHERE id = 'kid'", (value,))
    raw.close()
    with open_store(driver, db) as store:
        for read in (
            lambda: store.list_executions(),
            lambda: store.children_of("root"),
            lambda: store.purge_tree("root", 1),
        ):
            with pytest.raises(StoreError, match=rf"does not fit \({column}: .*; row 'kid'\)"):
                read()
        assert store.load("root") is not None  # the rest still works
