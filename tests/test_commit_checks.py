"""The commit's checks and shaping as made cheaper (issue 51, CPU a commit): each fast path
takes only what the slow one would have let through, and the version is set as assignment
validation would have set it.

Local in-memory stores of both drivers: the plan is the one every store kind runs.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import Field

from harel_store import (
    Event,
    Execution,
    LibsqlStore,
    SqliteStore,
    StoreConflict,
    TimerOp,
)
from harel_store.checks import check_id, check_json


@pytest.fixture(params=["libsql", "sqlite"])
def store(request: pytest.FixtureRequest) -> Iterator[Any]:
    opened = (LibsqlStore if request.param == "libsql" else SqliteStore)(":memory:")
    yield opened
    opened.close()


class Text(str):
    """A str subclass: JSON holds it as the string it is."""


class Real(float):
    """A float subclass, whose value may be NaN."""


def counts(store: Any) -> tuple[int, int, int]:
    """Executions, outbox entries and timers stored: what a refused commit must not change."""
    return (
        len(store.list_executions(limit=1000).items),
        len(store.pending_outbox()),
        len(store.due_timers(1e12)),
    )


@pytest.mark.parametrize(
    "value",
    [
        "caf\u00e9 \u2603",  # not ASCII: the slow path, accepted
        Text("plain"),
        [Text("a"), 1, True, None, 2.5, [Text("b")]],
        (1, 2),  # a tuple, given back as a list
        Real(1.5),
        {"inner": [{"k": Text("v")}]},
    ],
    ids=["non-ascii", "str subclass", "subclasses in lists", "tuple", "float subclass", "nested"],
)
def test_json_the_store_gives_back_is_accepted(store: Any, value: Any) -> None:
    exe = Execution(id="e", definition_id="d")
    exe.context = {"v": value}
    store.commit(exe, [])
    expected = json.loads(json.dumps({"v": value}))
    assert store.load("e").context == expected


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ([1, [2, float("nan")]], "not a JSON number"),
        ([Real("nan")], "not a JSON number"),
        ([1, "x\ud800"], "lone surrogate"),
        ([Text("\udfff")], "lone surrogate"),
        ([b"bytes"], "not a JSON value"),
        ({"a": {1: "int key"}}, "is not a string"),
        ({"a": [{"\ud800": 1}]}, "lone surrogate"),
        ([{1, 2}], "not a JSON value"),
        ([float("inf")], "not a JSON number"),
    ],
    ids=["nan in a list", "nan subclass", "surrogate in a list", "surrogate subclass", "bytes",
         "int key", "surrogate key", "set", "inf"],
)  # fmt: skip
def test_json_the_store_cannot_give_back_is_refused_and_nothing_written(
    store: Any, value: Any, why: str
) -> None:
    store.save(Execution(id="e", definition_id="d"))
    exe = store.load("e")
    before = counts(store)
    exe.__dict__["context"] = {"v": value}  # past validation, as model_construct would
    timers = [TimerOp.schedule("main", 1.0)]
    with pytest.raises(ValueError, match=why):
        store.commit(exe, [("e", Event(name="go"))], processed_event_id="m", timers=timers)
    assert exe.version == 1
    assert counts(store) == before
    assert store.load("e").version == 1


def test_a_scalar_document_is_checked_as_before() -> None:
    for value in ("text", Text("t"), 1, True, None, 2.5, Real(2.5)):
        check_json(value, "value")
    for bad, why in ((float("nan"), "not a JSON number"), ("\ud800", "surrogate"), (b"", "bytes")):
        with pytest.raises(ValueError, match=why):
            check_json(bad, "value")


@pytest.mark.parametrize(
    ("value", "error"),
    [
        ("", ValueError),
        ("x" * 513, ValueError),
        ("a\x00b", ValueError),
        ("a\ud800", ValueError),
        ("é\x00", ValueError),
        (Text("ok"), None),
        ("é" * 512, None),
        (b"bytes", TypeError),
        (None, TypeError),
    ],
    ids=["empty", "too long", "nul", "surrogate", "non-ascii nul", "str subclass",
         "non-ascii 512", "bytes", "none"],
)  # fmt: skip
def test_an_id_takes_the_fast_path_only_when_the_slow_one_would_pass(
    value: Any, error: type[Exception] | None
) -> None:
    if error is None:
        assert check_id(value, "id") == value
    else:
        with pytest.raises(error):
            check_id(value, "id")
    assert check_id(None, "id", optional=True) is None


def test_the_version_is_set_as_assignment_would_set_it(store: Any) -> None:
    exe = Execution(id="e", definition_id="d")
    assert "version" not in exe.model_fields_set
    store.commit(exe, [])
    assert exe.version == 1 and type(exe.version) is int
    assert "version" in exe.model_fields_set  # as `exe.version = 1` leaves it
    assert exe.model_dump(exclude_unset=True)["version"] == 1
    stale = store.load("e")
    store.commit(exe, [])
    with pytest.raises(StoreConflict):
        store.commit(stale, [])
    assert stale.version == 1  # restored
    assert json.loads(stale.model_dump_json())["version"] == 1
    exe.version = 2  # assignment validation still guards the model for its user
    with pytest.raises(ValueError):
        exe.version = -1


class Order(Execution):
    """An engine's own record type: a declared field beside the store's."""

    priority: int = Field(default=0)


def test_a_subclass_is_serialized_with_its_own_fields(store: Any) -> None:
    order = Order(id="o", definition_id="d", priority=7)
    store.commit(order, [("o", Event(name="placed"))])
    loaded = store.load("o")
    assert loaded.model_extra == {"priority": 7}
    assert Order.model_validate(loaded.model_dump()).priority == 7


def test_timers_from_any_iterable_and_a_list_left_as_given(store: Any) -> None:
    timers = [TimerOp.schedule("a", 5.0), TimerOp.schedule("b", 6.0)]
    given = list(timers)
    exe = Execution(id="e", definition_id="d")
    store.commit(exe, [], timers=timers)
    assert timers == given
    store.commit(exe, [], timers=(op for op in [TimerOp.cancel("a")]))
    assert [t.path for t in store.due_timers(1e12)] == ["b"]


def test_a_flow_key_that_raises_writes_nothing() -> None:
    def flow_key(execution_id: str) -> str:
        if execution_id == "bad":
            raise RuntimeError("no key for bad")
        return "k"

    store = LibsqlStore(":memory:", flow_key=flow_key)
    try:
        exe = Execution(id="e", definition_id="d")
        with pytest.raises(RuntimeError, match="no key"):
            store.commit(exe, [("e", Event(name="a")), ("bad", Event(name="b"))])
        assert exe.version == 0
        assert store.load("e") is None
        with pytest.raises(RuntimeError, match="no key"):
            store.commit(exe, [], spawns=[("bad", "main", {})])
        assert store.load("e") is None
        store.commit(exe, [("e", Event(name="a"))], timers=[TimerOp.schedule("main", 1.0)])
        rows = store._conn.db.execute("SELECT flow_key FROM harel_outbox", ()).fetchall()
        timers = store._conn.db.execute("SELECT flow_key FROM harel_timers", ()).fetchall()
        assert [tuple(r) for r in rows + timers] == [("k",), ("k",)]
    finally:
        store.close()
