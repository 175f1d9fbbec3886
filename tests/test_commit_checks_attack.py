"""Hostile review of 'CPU a commit' (issue 51, item 4): what the commit's fast paths might
do differently from the code before them (ead13ba), as a user of the store would see it.

Tests marked ``# Failed on 3ba0cab`` found a regression of the first version (each passed
at ead13ba, checked against ``git archive ead13ba``), fixed since: the fast paths now take
the store's own models only (a subclass is serialized, and its version set, as before),
the timers are copied, flow keys are found after every check, and a dict subclass is read
through its items(). The others guard what held.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ConfigDict, Field, ValidationError, field_validator, model_validator

from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    StoreConflict,
    TimerOp,
)
from harel_store.batch import Batch, Conflicted
from harel_store.checks import MAX_DEPTH, check_id, check_json
from tests import test_commit_checks

store = test_commit_checks.store  # an in-memory store of each driver, a test


def stored_data(store: Any, execution_id: str) -> dict[str, Any]:
    row = store._conn.db.execute(
        "SELECT data FROM harel_executions WHERE id = ?", (execution_id,)
    ).fetchone()
    data: dict[str, Any] = json.loads(row[0])
    return data


def stored_timers(store: Any) -> list[tuple[str, float]]:
    rows = store._conn.db.execute("SELECT path, fire_at FROM harel_timers ORDER BY path", ())
    return [tuple(r) for r in rows.fetchall()]


# --- 1. dump_model bypasses a subclass's model_dump_json ------------------------------------


class Session(Execution):
    """An engine record with a live handle it keeps out of the stored JSON by overriding
    model_dump_json (the store used to call it)."""

    handle: Any = None

    def model_dump_json(self, **kwargs: Any) -> str:
        kwargs.setdefault("exclude", {"handle"})
        return super().model_dump_json(**kwargs)


def test_execution_subclass_model_dump_json_override_is_used(store: Any) -> None:
    # Failed on 3ba0cab: ValueError "execution is not JSON-serializable: Unable to serialize
    # unknown type: <class 'object'>" (at ead13ba the commit stored the JSON the override made).
    exe = Session(id="s", definition_id="d", handle=object())
    store.commit(exe, [])
    assert exe.version == 1
    assert "handle" not in stored_data(store, "s")


class Signed(Event):
    """An event type whose signing key never leaves the process (its model_dump_json drops it)."""

    secret: str = "k3y"

    def model_dump_json(self, **kwargs: Any) -> str:
        kwargs.setdefault("exclude", {"secret"})
        return super().model_dump_json(**kwargs)


def test_event_subclass_model_dump_json_override_is_used(store: Any) -> None:
    # Failed on 3ba0cab: the outbox row now holds "secret": "k3y" (at ead13ba it did not).
    store.commit(Execution(id="e", definition_id="d"), [(None, Signed(name="n", id="i"))])
    (entry,) = store.pending_outbox()
    assert entry.event.model_extra == {}


class _CoreBefore228:
    """A model's SchemaSerializer with pydantic-core < 2.28's defaults (pydantic 2.6 - 2.10,
    which pyproject.toml allows: ``pydantic>=2.6``): ``to_json(value, *, by_alias: bool =
    True, ...)``. BaseModel.model_dump_json always passes by_alias itself (False there, None
    from 2.11 on); a bare ``to_json(model)`` takes the core's default."""

    def __init__(self, real: Any) -> None:
        self.real = real

    def to_json(self, value: Any, **kwargs: Any) -> bytes:
        kwargs.setdefault("by_alias", True)
        data: bytes = self.real.to_json(value, **kwargs)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.real, name)


class Order(Execution):
    customer_id: str = Field(default="", serialization_alias="customerId")


def test_a_serialization_alias_is_not_stored_on_pydantic_before_2_11(
    store: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Failed on 3ba0cab: stored as "customerId"; reloaded, Order.customer_id is "" (lost).
    # The real thing, without the emulation: test_..._real_old_pydantic below.
    monkeypatch.setattr(
        Order, "__pydantic_serializer__", _CoreBefore228(Order.__pydantic_serializer__)
    )
    store.commit(Order(id="o", definition_id="d", customer_id="c1"), [])
    loaded = store.load("o")
    assert Order.model_validate(loaded.model_dump()).customer_id == "c1"


# --- 2. _set_version skips the model's assignment validation --------------------------------
# Execution has validate_assignment=True: at ead13ba `exe.version = old + 1` ran a subclass's
# validators (field and model "after"), its field constraints and its frozen flag; a commit
# they refused raised ValidationError, wrote nothing and left exe.version as it was.


class Invariant(Execution):
    @model_validator(mode="after")
    def _finished_has_a_time(self) -> Invariant:
        if self.status == "finished" and self.finished_at is None:
            raise ValueError("a finished execution needs finished_at")
        return self


class Frozen(Execution):
    model_config = ConfigDict(frozen=True)


class Capped(Execution):
    version: int = Field(default=0, ge=0, le=1, strict=True)


class OneWrite(Execution):
    @field_validator("version")
    @classmethod
    def _at_most_one(cls, version: int) -> int:
        if version > 1:
            raise ValueError("written once only")
        return version


def _invariant(store: Any) -> Execution:
    exe = Invariant(id="x", definition_id="d")
    exe.__dict__["status"] = "finished"  # as model_construct / an in-place change leaves it
    return exe


def _frozen(store: Any) -> Execution:
    return Frozen(id="x", definition_id="d")


def _capped(store: Any) -> Execution:
    exe = Capped(id="x", definition_id="d")
    store.commit(exe, [])
    return exe


def _one_write(store: Any) -> Execution:
    exe = OneWrite(id="x", definition_id="d")
    store.commit(exe, [])
    return exe


@pytest.mark.parametrize(
    "make",
    [_invariant, _frozen, _capped, _one_write],
    ids=["model after-validator", "frozen", "version le=1", "version field_validator"],
)
def test_a_subclass_validation_still_refuses_the_version_bump(store: Any, make: Any) -> None:
    # Failed on 3ba0cab (every case): the commit is written, exe.version raised past what
    # the subclass allows (a frozen model mutated; version 2 past le=1; ...).
    exe = make(store)
    before = exe.version
    with pytest.raises(ValidationError):
        store.commit(exe, [])
    assert exe.version == before
    loaded = store.load("x")
    assert (loaded.version if loaded is not None else 0) == before


class Tagged(Execution):
    """An etag kept in the stored JSON, derived from the version by a model validator."""

    etag: str = ""

    @model_validator(mode="after")
    def _etag(self) -> Tagged:
        self.__dict__["etag"] = f"{self.id}@{self.version}"
        return self


def test_a_field_derived_from_the_version_is_stored_current(store: Any) -> None:
    # Failed on 3ba0cab: the row holds "etag": "t@0" with version 1 (ead13ba: "t@1").
    exe = Tagged(id="t", definition_id="d")
    store.commit(exe, [])
    assert exe.etag == "t@1"
    assert stored_data(store, "t")["etag"] == "t@1"


def test_the_aio_twin_refuses_the_same_version_bump() -> None:
    # Failed on 3ba0cab: the async store drives the same plan.
    async def main() -> None:
        store = await AsyncLibsqlStore.create(":memory:")
        try:
            exe = Frozen(id="x", definition_id="d")
            with pytest.raises(ValidationError):
                await store.commit(exe, [])
            assert exe.version == 0
            assert await store.load("x") is None
        finally:
            await store.close()

    asyncio.run(main())


# --- 3. the timers list is used as given, and flow_key runs after its check -----------------


def _clear(timers: list[Any]) -> None:
    timers.clear()


def _append_nul_path(timers: list[Any]) -> None:
    timers.append(TimerOp.model_construct(action="schedule", path="a\x00b", fire_at=1.0))


def _append_inf(timers: list[Any]) -> None:
    timers.append(TimerOp.model_construct(action="schedule", path="y", fire_at=float("inf")))


def _append_junk(timers: list[Any]) -> None:
    timers.append("not a timer")


@pytest.mark.parametrize(
    "mutate",
    [_clear, _append_nul_path, _append_inf, _append_junk],
    ids=["cleared", "unchecked NUL path", "unchecked inf fire_at", "not a TimerOp"],
)
def test_a_flow_key_that_changes_the_timers_list_changes_nothing_written(mutate: Any) -> None:
    # Failed on 3ba0cab: the list changed after its check is what gets written: no timer
    # ("cleared"), a timer at path "a" (libsql cuts at the NUL) or at fire_at inf, or an
    # AttributeError from the batch. ead13ba wrote its checked copy: [("main", 5.0)].
    timers = [TimerOp.schedule("main", 5.0)]
    called: list[str] = []

    def flow_key(execution_id: str) -> str:
        if not called:
            mutate(timers)
        called.append(execution_id)
        return "k"

    store = LibsqlStore(":memory:", flow_key=flow_key)
    try:
        exe = Execution(id="e", definition_id="d")
        store.commit(exe, [], timers=timers, spawns=[("c", "main", {})])
        assert exe.version == 1
        assert stored_timers(store) == [("main", 5.0)]
    finally:
        store.close()


def test_an_argument_error_wins_over_the_flow_key() -> None:
    # Failed on 3ba0cab: LookupError from flow_key (called for the emit before the bad timer,
    # spawn or processed_event_id is seen); ead13ba raised the TypeError/ValueError of the
    # argument and never called flow_key for a commit refused on its arguments.
    calls: list[str] = []

    def flow_key(execution_id: str) -> str:
        calls.append(execution_id)
        raise LookupError(f"no flow for {execution_id}")

    store = LibsqlStore(":memory:", flow_key=flow_key)
    try:
        exe = Execution(id="e", definition_id="d")
        emits = [("t", Event(name="n"))]
        with pytest.raises(TypeError, match="each timer must be a TimerOp"):
            store.commit(exe, emits, timers=["x"])  # type: ignore[list-item]
        with pytest.raises(ValueError, match="spawn child_id"):
            store.commit(exe, emits, spawns=[("bad\x00", "main", {})])
        with pytest.raises(ValueError, match="processed_event_id"):
            store.commit(exe, emits, processed_event_id="")
        assert calls == []
        assert exe.version == 0 and store.load("e") is None
    finally:
        store.close()


class NamedKeysOnly(dict):  # type: ignore[type-arg]
    """A dict subclass whose iteration lists only its string keys (json.dumps and pydantic
    read a dict subclass through items() / the dict itself, not through __iter__)."""

    def __iter__(self) -> Iterator[Any]:
        return (key for key in dict.__iter__(self) if isinstance(key, str))


def test_a_dict_subclass_is_checked_through_its_items(store: Any) -> None:
    # Failed on 3ba0cab (very low severity: needs a dict subclass overriding __iter__): the
    # keys are now read through __iter__, so the int key 1 is not seen; the context is
    # stored with both 1 and "1" as "1", and reads back as {"a": 1, "1": "y"} (the "x" lost).
    # ead13ba read them through items(), as the encoder does: ValueError "the key 1 is not
    # a string".
    context = NamedKeysOnly({"a": 1, 1: "x", "1": "y"})
    with pytest.raises(ValueError, match="is not a string"):
        store.commit(Execution(id="e", definition_id="d"), [], spawns=[("c", "main", context)])
    assert store.load("e") is None


# --- what held (pass on both) ----------------------------------------------------------------


class LyingText(str):
    """A str subclass whose own methods the checks use, as they did before."""

    def isascii(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("value", "ok"),
    [
        ({"k": [LyingText("\ud800")]}, True),  # its isascii is trusted, as at ead13ba
        ({LyingText("\ud800"): 1}, True),
        ([[[[float("nan")]]]], False),
        ({"a": ({"b": (1, float("-inf"))},)}, False),
        ({"a": 1, 2: float("nan")}, False),  # both wrong: still a ValueError
        ([True, None, 10**30, -0.0, "é", ("t",)], True),
    ],
)
def test_json_documents_checked_as_before(value: Any, ok: bool) -> None:
    if ok:
        check_json(value, "doc")
    else:
        with pytest.raises(ValueError):
            check_json(value, "doc")


def test_int_and_str_enums_in_documents_and_ids() -> None:
    import enum

    class Level(enum.IntEnum):
        HIGH = 3

    class Name(str, enum.Enum):
        OK = "fine"
        BAD = "a\x00b"

    check_json({"level": Level.HIGH, "name": Name.OK, "l": [Level.HIGH, Name.OK]}, "doc")
    assert check_id(Name.OK, "id") is Name.OK
    with pytest.raises(ValueError):
        check_id(Name.BAD, "id")


def _nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("where", ["context", "spawn", "trace", "payload"])
def test_deep_nesting_is_a_value_error_not_a_recursion_error(store: Any, where: str) -> None:
    exe = Execution(id="e", definition_id="d")
    deep = _nested(sys.getrecursionlimit() + 100)  # past the limit, whatever it is here
    kwargs: dict[str, Any] = {}
    emits: list[Any] = []
    if where == "context":
        exe.context = {"v": deep}
    elif where == "spawn":
        kwargs["spawns"] = [("c", "main", {"v": deep})]
    elif where == "trace":
        kwargs["trace"] = {"v": deep}
    else:
        emits = [(None, Event(name="n", payload={"v": deep}))]
    with pytest.raises(ValueError, match=r"nested too deeply"):
        store.commit(exe, emits, **kwargs)
    assert exe.version == 0 and store.load("e") is None


def _document(levels: int) -> dict[str, Any]:
    """A document nested ``levels`` deep, its own dict the first."""
    return {"v": _nested(levels - 1)} if levels > 1 else {}


@pytest.mark.parametrize("where", ["context", "spawn", "trace", "payload"])
def test_every_document_nests_as_deep_as_a_context_can_and_no_deeper(
    store: Any, where: str
) -> None:
    """One bound for every document, the one pydantic's JSON parser sets for a context or a
    payload: a context nested past it committed and its load was then a CorruptRecord; a
    spawn's context (or a trace step) nested past pydantic's serializer committed, and its
    child could never be committed (found by review)."""
    for levels, ok in ((MAX_DEPTH, True), (MAX_DEPTH + 1, False)):
        exe = Execution(id=f"e{levels}", definition_id="d")
        doc = _document(levels)
        kwargs: dict[str, Any] = {}
        emits: list[Any] = []
        if where == "context":
            exe.context = doc
        elif where == "spawn":
            kwargs["spawns"] = [(f"c{levels}", "main", doc)]
        elif where == "trace":
            kwargs["trace"] = doc
        else:
            emits = [(None, Event(name="n", payload=doc))]
        if not ok:
            with pytest.raises(ValueError, match=rf"nested too deeply .*at most {MAX_DEPTH}"):
                store.commit(exe, emits, **kwargs)
            assert exe.version == 0 and store.load(exe.id) is None
            continue
        store.commit(exe, emits, **kwargs)
        if where == "spawn":  # the child it asks for can be written
            (spawn,) = store.pending_spawns()
            assert spawn.context == doc
            store.commit(
                Execution(id=spawn.child_id, definition_id="main", context=spawn.context), []
            )
            assert store.load(spawn.child_id).context == doc
        elif where == "context":
            assert store.load(exe.id).context == doc
        elif where == "payload":
            assert [e.event.payload for e in store.pending_outbox()] == [doc]
        else:
            assert [step["v"] for step in store.read_trace(exe.id)] == [doc["v"]]


def test_guards_conditions_and_remote_steps_run_as_before(store: Any) -> None:
    conn = store._conn
    store.commit(Execution(id="e", definition_id="d"), [], timers=[TimerOp.schedule("p", 1.0)])

    def run(batch: Batch) -> Any:
        return conn.execute(batch)

    ok = Batch()
    ok.guard("cancel_timer", "e", "nothing", rows=0)  # changes 0 rows: exactly what it needs
    ok.add("mark_processed", "e", "m1")
    skipped = ok.add("mark_processed", "e", "m2", only_if=(1, 2))  # 1 < 2: skipped
    ran = ok.add("mark_processed", "e", "m3", unless=(1, 2))  # 1 < 2: runs
    remote = ok.add("mark_processed", "e", "m4", remote=True)  # never on a local connection
    results = run(ok)
    assert results[skipped] is None and results[ran] == 1 and results[remote] is None
    assert store.is_processed("e", "m3") and not store.is_processed("e", "m2")
    assert not store.is_processed("e", "m4")

    for rows in (None, 2):  # a guard that changed no row / not exactly ``rows`` rows
        bad = Batch()
        bad.add("mark_processed", "e", "m5")
        bad.guard("cancel_timer", "e", "p" if rows else "missing", rows=rows)
        with pytest.raises(Conflicted):
            run(bad)
        assert not store.is_processed("e", "m5")  # rolled back
    zero = Batch()
    zero.guard("cancel_timer", "e", "p", rows=0)  # changed 1 where 0 is due
    with pytest.raises(Conflicted):
        run(zero)
    assert stored_timers(store) == [("p", 1.0)]


def test_grouped_commits_each_keep_their_own_version() -> None:
    store = LibsqlStore(":memory:")
    try:
        exes = [Execution(id=f"e{i}", definition_id="d") for i in range(8)]
        for exe in exes:
            store.commit(exe, [])
        stale: list[Execution] = []
        for i in range(0, 8, 2):
            loaded = store.load(f"e{i}")
            assert loaded is not None
            stale.append(loaded)
        for exe in exes[::2]:
            store.commit(exe, [])  # the stale copies now conflict
        barrier = threading.Barrier(len(exes) + len(stale))
        errors: dict[str, BaseException] = {}

        def commit(exe: Execution, key: str) -> None:
            barrier.wait()
            try:
                store.commit(exe, [], timers=[TimerOp.schedule(key, 1.0)])
            except BaseException as exc:
                errors[key] = exc

        threads = [
            threading.Thread(target=commit, args=(exe, f"{exe.id}/{n}"))
            for n, group in enumerate((exes, stale))
            for exe in group
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sorted(errors) == sorted(f"{exe.id}/1" for exe in stale)
        assert all(isinstance(exc, StoreConflict) for exc in errors.values())
        assert [exe.version for exe in stale] == [1] * len(stale)
        for exe in exes:
            reloaded = store.load(exe.id)
            assert reloaded is not None and reloaded.version == exe.version
        assert len(stored_timers(store)) == len(exes)
    finally:
        store.close()


def test_async_cancellation_leaves_the_version_as_stored() -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(":memory:")
        try:
            for n in range(12):
                exe = Execution(id=f"e{n}", definition_id="d")
                for _ in range(3):
                    task = asyncio.ensure_future(store.commit(exe, [(None, Event(name="n"))]))
                    for _ in range(n % 4):
                        await asyncio.sleep(0)
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
                    loaded = await store.load(exe.id)
                    assert exe.version == (loaded.version if loaded is not None else 0)
        finally:
            await store.close()

    asyncio.run(main())
