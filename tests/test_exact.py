"""Exactness: every value the store accepts comes back exactly, or is refused with
ValueError/TypeError and nothing is written.

Integers past 2**53 (which libsql 0.1.8 would bind as a rounded REAL) on every store kind,
and a property test of JSON documents on both local drivers and a remote primary.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harel_store import (
    AsyncLibsqlStore,
    DefinitionRecord,
    Event,
    Execution,
    LibsqlStore,
    SqliteStore,
    StoreConflict,
    TimerOp,
)
from tests.conftest import reset_remote
from tests.helpers import raw

BIG = 1_700_000_000_000_000_001  # past 2**53: a float holds neither it nor its neighbours
EDGE = 2**53


def stage_version(store: Any, execution_id: str, version: int) -> None:
    """Move a stored execution to ``version`` behind the store's back (an SQL literal, so
    no driver's binding is involved), as many commits would."""
    conn = raw(store)
    conn.execute(
        f"UPDATE harel_executions SET version = {version}, "
        f"data = json_set(data, '$.version', {version}) WHERE id = '{execution_id}'"
    )
    conn.commit()
    store.sync()


def test_definition_versions_past_2_53_stay_apart(store: Any) -> None:
    for version in (BIG, BIG + 1, 2**63 - 1):
        record = DefinitionRecord(
            definition_id="d", version=version, digest=f"v{version}", source={}
        )
        assert store.publish_definition(record) == record
    for version in (BIG, BIG + 1, 2**63 - 1):
        loaded = store.load_definition("d", version)
        assert loaded is not None and loaded.version == version and loaded.digest == f"v{version}"
    assert store.load_definition("d", BIG + 2) is None


def test_the_version_cas_is_exact_past_2_53(store: Any) -> None:
    exe = Execution(id="e", definition_id="d")
    store.save(exe)
    stage_version(store, "e", EDGE)
    current = store.load("e")
    assert current is not None and current.version == EDGE

    for stale in (EDGE + 1, EDGE - 1):  # both round to 2**53 as floats
        writer = current.model_copy(update={"version": stale})
        with pytest.raises(StoreConflict) as info:
            store.commit(writer, [(None, Event(name="x"))])
        assert info.value.found == EDGE and writer.version == stale
    assert store.pending_outbox() == []

    store.commit(current, [], timers=[TimerOp.schedule("t", 1.0)])
    assert current.version == EDGE + 1
    stored = store.load("e")
    assert stored is not None and stored.version == EDGE + 1

    assert store.purge("e", EDGE) is False  # the row is at 2**53 + 1
    assert store.load("e") is not None
    assert store.purge("e", EDGE + 1) is True
    assert store.load("e") is None


def test_sequence_numbers_past_2_53_are_acked_exactly(store: Any) -> None:
    conn = raw(store)
    for seq in (EDGE, EDGE + 1):
        conn.execute(
            "INSERT INTO harel_outbox (seq, target_id, event) "
            f'VALUES ({seq}, \'t\', \'{{"name":"n","id":"{seq}","payload":{{}}}}\')'
        )
        conn.execute(
            "INSERT INTO harel_spawns (seq, parent_id, child_id, root_path, context) "
            f"VALUES ({seq}, 'p', 'c{seq}', 'r', '{{}}')"
        )
    conn.commit()
    store.sync()
    assert [e.seq for e in store.pending_outbox()] == [EDGE, EDGE + 1]
    store.ack_outbox(EDGE + 1)
    store.ack_spawn(EDGE + 1)
    assert [e.seq for e in store.pending_outbox()] == [EDGE]
    assert [s.seq for s in store.pending_spawns()] == [EDGE]


def test_a_trace_ring_keeps_exactly_trace_max_steps_however_large(store: Any) -> None:
    store.trace_max = BIG
    for step in range(3):
        store.append_trace("e", {"step": step})
    assert [s["step"] for s in store.read_trace("e")] == [0, 1, 2]
    store.trace_max = 2
    store.append_trace("e", {"step": 3})
    assert [s["step"] for s in store.read_trace("e")] == [2, 3]


# --- JSON documents: given back exactly, or refused with nothing written ---

KEYS = st.one_of(
    st.text(st.characters(codec=None), max_size=4),  # lone surrogates too
    st.sampled_from(["1", "None", "null", "true", "\ud800", "\udfff", ""]),
    st.integers(-2, 2),
    st.none(),
    st.booleans(),
    st.floats(allow_nan=False, width=16),
)
SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([2**53 + 1, -(2**63), 2**63, 2**200, -0.0, 5e-324, 1.7976931348623157e308]),
    st.floats(),  # NaN and the infinities too
    st.text(st.characters(codec=None), max_size=8),
)
DOCUMENTS = st.dictionaries(
    KEYS,
    st.recursive(
        SCALARS,
        lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
        max_leaves=12,
    ),
    max_size=4,
)

NUMBERS = itertools.count()

# Where a document goes, and how it comes back.
Put = Callable[[Any, Any, int], Any]


def _context(store: Any, doc: Any, n: int) -> Any:
    exe = Execution(id=f"x{n}", definition_id="d", context=doc)
    store.save(exe)
    loaded = store.load(exe.id)
    return loaded.context


def _payload(store: Any, doc: Any, n: int) -> Any:
    store.commit(Execution(id=f"p{n}", definition_id="d"), [("t", Event(name="e", payload=doc))])
    (entry,) = store.outbox_for("t")
    store.ack_outbox(entry.seq)
    return entry.event.payload


def _trace(store: Any, doc: Any, n: int) -> Any:
    store.append_trace(f"t{n}", doc)
    (step,) = store.read_trace(f"t{n}")
    del step["index"]
    return step


def _spawn(store: Any, doc: Any, n: int) -> Any:
    store.commit(Execution(id=f"s{n}", definition_id="d"), [], spawns=[(f"c{n}", "r", doc)])
    (spawn,) = store.pending_spawns()
    store.ack_spawn(spawn.seq)
    return spawn.context


def _source(store: Any, doc: Any, n: int) -> Any:
    record = DefinitionRecord(definition_id="d", version=n, digest="x", source=doc)
    return store.publish_definition(record).source


PUTS: dict[str, Put] = {
    "context": _context,
    "payload": _payload,
    "trace": _trace,
    "spawn": _spawn,
    "source": _source,
}


def contents(store: Any) -> str:
    """Everything the store holds, through its own reads."""
    page = store.list_executions(limit=1000)
    return repr(
        (
            page.items,
            store.pending_outbox(),
            store.pending_spawns(),
            [store.read_trace(e.id) for e in page.items],
        )
    )


@pytest.fixture(params=["libsql-file", "sqlite-file", "libsql-remote", "async-libsql-remote"])
def doc_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    kind = request.param
    if kind.endswith("remote"):
        server = request.getfixturevalue("sqld")
        reset_remote(server)
        if kind.startswith("async"):
            from tests.helpers import SyncFacade

            loop = asyncio.new_event_loop()
            create = AsyncLibsqlStore.create(server.url, auth_token=server.token)
            store: Any = SyncFacade(loop.run_until_complete(create), loop)
            yield store
            store.close()
            loop.close()
            return
        store = LibsqlStore(server.url, auth_token=server.token)
    else:
        store = (LibsqlStore if kind.startswith("libsql") else SqliteStore)(tmp_path / "d.db")
    yield store
    store.close()


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(where=st.sampled_from(sorted(PUTS)), doc=DOCUMENTS)
def test_a_document_comes_back_exactly_or_is_refused(
    doc_store: Any, where: str, doc: dict[Any, Any]
) -> None:
    n = next(NUMBERS)  # each example writes under ids and a version of its own
    before = contents(doc_store)
    try:
        back = PUTS[where](doc_store, doc, n)
    except (ValueError, TypeError) as exc:
        assert str(exc)
        assert contents(doc_store) == before, "a refused document wrote something"
        assert doc_store.load_definition("d", n) is None
        assert doc_store.read_trace(f"t{n}") == []
        return
    assert repr(back) == repr(doc), f"{where} came back changed"  # repr: 1 is not True or 1.0
    # and the same text for any other reader of the column
    assert json.loads(json.dumps(back)) == back


@pytest.mark.parametrize(
    "doc",
    [
        {"a": {1: "a", "1": "b"}},
        {"a": dict([("\ud800", 1), ("\udfff", 2)])},  # two keys, each U+FFFD once encoded
        {"a": {None: 1}},
        {"a": [{2.5: 1}]},
        {"a": {"v": "\ud800"}},
        {"a": b"bytes"},
        {"a": {1, 2}},
    ],
    ids=["int key", "surrogate keys", "None key", "float key", "surrogate value", "bytes", "set"],
)
@pytest.mark.parametrize("where", sorted(PUTS))
def test_documents_json_would_change_are_refused_everywhere(
    doc_store: Any, where: str, doc: dict[str, Any]
) -> None:
    before = contents(doc_store)
    with pytest.raises((ValueError, TypeError)) as info:
        PUTS[where](doc_store, doc, 1)
    assert str(info.value)
    assert contents(doc_store) == before
    assert doc_store.load_definition("d", 1) is None
    assert doc_store.read_trace("t1") == []
