"""A hostile review of the pace branch: the optimistic group layout of remote writes
(harel_store/connection/hrana.py: `_group_part`, `_settle`'s replay) and migration 0012's
marker trigger. Each defect found is fixed and its test is here, with the checks that held."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from contextlib import closing
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    StoreConflict,
)
from harel_store.batch import Batch, Conflicted
from harel_store.connection import http
from harel_store.connection.hrana import HranaConnection, _body, _Pending, _Wire
from harel_store.schema import head_schema, schema_at
from harel_store.sql import HEAD, MIGRATIONS
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer

HOLD = 0.3
OK_RESULT = {"cols": [], "rows": [], "affected_row_count": 1, "last_insert_rowid": None}
TRIGGER = "trigger harel_processed_events_since"


def emit(exe: Execution, n: int = 0) -> Any:
    return [(None, Event(name="go", id=f"{exe.id}-{n}"))]


# --- unit: what `_settle` makes of one answer ---


def offline(busy_timeout: float = 1.0) -> HranaConnection:
    return HranaConnection(
        "http://127.0.0.1:9", "test", auth_token="", timeout=1.0, busy_timeout=busy_timeout
    )


def guarded_group(n: int = 3) -> list[_Pending]:
    group = []
    for i in range(n):
        batch = Batch()
        batch.guard("cancel_timer", f"exe-{i}", "t")
        batch.on_conflict("execution_version", f"exe-{i}")
        group.append(_Pending(_Wire(batch)))
    return group


def answer(results: list[Any], errors: Any) -> http.Response:
    body = {
        "baton": None,
        "base_url": None,
        "results": [
            {
                "type": "ok",
                "response": {
                    "type": "batch",
                    "result": {"step_results": results, "step_errors": errors},
                },
            },
            {"type": "ok", "response": {"type": "close"}},
        ],
    }
    return http.Response(200, {}, json.dumps(body).encode())


def settled(
    conn: HranaConnection,
    group: list[_Pending],
    reply: http.Response,
    started: float = 0.0,
    tries: int = 0,
) -> tuple[list[_Pending], float]:
    """Drive `_settle` once; the writes it would send again, and the pause before."""
    gen = conn._settle(group, reply, started, tries)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value  # type: ignore[no-any-return]


def settle(conn: HranaConnection, group: list[_Pending], reply: http.Response) -> list[_Pending]:
    """Drive `_settle` once; the writes it would send again."""
    return settled(conn, group, reply)[0]


def steps_of(group: list[_Pending]) -> int:
    _body(group)
    return group[0].wire.commit + 2  # COMMIT, then ROLLBACK


def test_a_failed_guard_replays_once_then_each_member_settles_with_its_conflict() -> None:
    conn, group = offline(), guarded_group()
    n = steps_of(group)
    wires = [p.wire for p in group]
    # Optimistic: member 1's guard fails, the rest skipped, ROLLBACK ran.
    results: list[Any] = [None] * n
    errors: list[Any] = [None] * n
    for j in range(0, wires[1].last):
        results[j] = OK_RESULT
    (guard,) = wires[1].guards
    results[guard] = None
    errors[guard] = {"message": "malformed JSON", "code": "SQLITE_ERROR"}
    results[n - 1] = OK_RESULT
    again = settle(conn, group, answer(results, errors))
    assert again == group and all(w.saved for w in wires)
    assert not any(p.done for p in group)
    # Saved: member 1 fails alone, its conflict read says version 2; no third request.
    body = _body(group)
    assert b"SAVEPOINT" in body
    n = group[0].wire.commit + 2
    results, errors = [OK_RESULT] * n, [None] * n
    results[n - 1] = None  # ROLLBACK skipped
    for k, w in enumerate(wires):
        undo = w.last + 1
        (guard,) = w.guards
        if k == 1:
            results[guard], errors[guard] = None, {"message": "x", "code": None}
            assert w.conflict is not None
            results[w.conflict] = {
                "cols": [{"name": "version", "decltype": "INTEGER"}],
                "rows": [[{"type": "integer", "value": "2"}]],
                "affected_row_count": 0,
                "last_insert_rowid": None,
            }
        else:
            results[undo] = None
            if w.conflict is not None:
                results[w.conflict] = None
    again = settle(conn, group, answer(results, errors))
    assert again == []
    assert isinstance(group[1].error, Conflicted) and group[1].error.found == 2
    assert group[0].error is None and group[2].error is None


def test_an_answer_that_says_the_group_committed_is_not_sent_again() -> None:
    conn, group = offline(), guarded_group()
    n = steps_of(group)
    results: list[Any] = [OK_RESULT] * n
    results[n - 1] = None  # COMMIT ran; ROLLBACK skipped
    errors: list[Any] = [None] * n
    errors[group[1].wire.start] = {"message": "odd", "code": None}  # contradicts the rest
    again = settle(conn, group, answer(results, errors))
    # Main read it as committed (COMMIT's result is there); never send a landed write again.
    assert again == []


def test_a_garbled_answer_to_the_optimistic_request_is_outcome_unknown() -> None:
    conn, group = offline(), guarded_group()
    n = steps_of(group)
    again = settle(conn, group, answer([None] * n, "x" * n))
    assert again == []
    assert all(isinstance(p.error, OutcomeUnknown) for p in group)


def test_a_lone_write_after_a_saved_group_is_laid_out_alone() -> None:
    group = guarded_group(2)
    for p in group:
        p.wire.saved = True
    _body(group)
    lone = [group[0]]
    body = json.loads(_body(lone))
    sqls = [s["stmt"]["sql"] for s in body["requests"][0]["batch"]["steps"]]
    assert not any("SAVEPOINT" in s for s in sqls)
    assert group[0].wire.members == frozenset() and group[0].wire.conflict is not None


# --- 0012: the marker's trigger ---


def test_schema_sql_is_what_the_chain_builds_trigger_included() -> None:
    head = head_schema()
    assert head == schema_at(HEAD) and TRIGGER in head
    assert TRIGGER not in schema_at("0011")


def chain(conn: sqlite3.Connection, upto: str, direction: str = "up") -> None:
    for m in MIGRATIONS:
        if m.revision <= upto:
            for stmt in m.statements(direction):
                conn.execute(stmt)


def test_0012_up_from_0011_with_rows_then_down() -> None:
    with closing(sqlite3.connect(":memory:")) as conn:
        chain(conn, "0011")
        conn.execute(
            "INSERT INTO harel_executions (id, definition_id, data, version, markers_since)"
            " VALUES ('a', 'd', '{}', 1, 50.0), ('b', 'd', '{}', 1, NULL)"
        )
        conn.execute(
            "INSERT INTO harel_processed_events VALUES ('a', 'e1', 50.0), ('a', 'e2', 60.0)"
        )
        for stmt in next(m for m in MIGRATIONS if m.revision == "0012").statements("up"):
            conn.execute(stmt)
        since = "SELECT id, markers_since FROM harel_executions ORDER BY id"
        assert conn.execute(since).fetchall() == [("a", 50.0), ("b", None)]
        conn.execute("INSERT INTO harel_processed_events VALUES ('a', 'e3', 40.0)")  # clock back
        conn.execute("INSERT INTO harel_processed_events VALUES ('b', 'e1', 70.0)")
        conn.execute("INSERT OR IGNORE INTO harel_processed_events VALUES ('b', 'e1', 10.0)")
        conn.execute("INSERT INTO harel_processed_events VALUES ('b', 'e2', 80.0)")
        assert conn.execute(since).fetchall() == [("a", 40.0), ("b", 70.0)]
        conn.execute("SAVEPOINT s")  # a local group's member rolled back takes its update
        conn.execute("INSERT INTO harel_processed_events VALUES ('b', 'e0', 5.0)")
        conn.execute("ROLLBACK TO s")
        conn.execute("RELEASE s")
        assert conn.execute(since).fetchall() == [("a", 40.0), ("b", 70.0)]
        for stmt in next(m for m in MIGRATIONS if m.revision == "0012").statements("down"):
            conn.execute(stmt)
        assert not conn.execute("SELECT 1 FROM sqlite_master WHERE type = 'trigger'").fetchall()


# --- against the real sqld ---


def saved(store: LibsqlStore, prefix: str, n: int, stale: tuple[int, ...]) -> list[Execution]:
    """``n`` executions saved, those of ``stale`` then moved on elsewhere (their copies here
    are behind: a commit of one fails its CAS)."""
    exes = [Execution(id=f"{prefix}-{i}", definition_id="d") for i in range(n)]
    for e in exes:
        store.save(e)
    for i in stale:
        moved = store.load(f"{prefix}-{i}")
        assert moved is not None
        store.commit(moved, [])
    return exes


def grouped(store: LibsqlStore, proxy: Proxy, calls: dict[str, Any]) -> tuple[dict[str, Any], int]:
    """Each of ``calls`` (key: (function, *args)) on a thread of its own while a write of the
    store is held at the proxy, so that they wait and go together: what each returned or
    raised, and how many requests they took."""
    proxy.delay = HOLD
    holder = threading.Thread(target=store.commit, args=(Execution(id="h", definition_id="d"), []))
    holder.start()
    wait_until(lambda: proxy.in_flight == 1, "the first write sent")
    outcomes: dict[str, Any] = {}

    def run(key: str, fn: Any, *args: Any) -> None:
        try:
            outcomes[key] = fn(*args)
        except BaseException as exc:
            outcomes[key] = exc

    sent = proxy.requests
    threads = [threading.Thread(target=run, args=(key, *call)) for key, call in calls.items()]
    for t in threads:
        t.start()
    for t in (holder, *threads):
        t.join()
    return outcomes, proxy.requests - sent


@pytest.mark.sqld
@pytest.mark.slow
def test_sync_threads_a_stale_member_replays_and_fails_alone(
    proxy: Proxy, server: SqldServer
) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token) as store:
        exes = saved(store, "s", 5, (2,))
        calls = {e.id: (store.commit, e, emit(e), f"in-{e.id}") for e in exes}
        outcomes, requests = grouped(store, proxy, calls)
        assert requests == 2
        bad = outcomes.pop("s-2")
        assert isinstance(bad, StoreConflict) and (bad.expected, bad.found) == (1, 2)
        assert all(isinstance(v, list) for v in outcomes.values()), outcomes
        proxy.delay = 0
        assert store.load_for_event("s-2", "in-s-2")[1] is False
        assert all(store.load_for_event(i, f"in-{i}")[1] for i in outcomes)


@pytest.mark.sqld
@pytest.mark.slow
def test_two_commits_of_one_execution_in_one_group(proxy: Proxy, server: SqldServer) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        await store.save(Execution(id="same", definition_id="d"))
        await store.save(Execution(id="other", definition_id="d"))
        a, b, o = [await store.load(i) for i in ("same", "same", "other")]
        assert a is not None and b is not None and o is not None
        proxy.delay = HOLD
        first = asyncio.create_task(store.commit(Execution(id="h", definition_id="d"), []))
        await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "the first write")
        sent = proxy.requests
        ra, rb, ro = await asyncio.gather(
            store.commit(a, emit(a, 1), "ev-a"),
            store.commit(b, emit(b, 2), "ev-b"),
            store.commit(o, emit(o), "ev-o"),
            return_exceptions=True,
        )
        await first
        assert proxy.requests - sent == 2  # one group: optimistic, then saved
        assert isinstance(ra, list) and isinstance(ro, list)
        assert isinstance(rb, StoreConflict) and (rb.expected, rb.found) == (1, 2)
        proxy.delay = 0
        assert (await store.load_for_event("same", "ev-a"))[1]
        assert not (await store.load_for_event("same", "ev-b"))[1]
        await store.close()

    asyncio.run(main())


@pytest.mark.sqld
@pytest.mark.slow
def test_the_replay_cut_makes_every_member_unknown_and_nothing_landed(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token, timeout=5.0)
        exes = [Execution(id=f"u-{i}", definition_id="d") for i in range(4)]
        for e in exes:
            await store.save(e)
        moved = await store.load("u-1")
        assert moved is not None
        await store.commit(moved, [])
        proxy.delay = HOLD
        first = asyncio.create_task(store.commit(Execution(id="h", definition_id="d"), []))
        await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "the first write")

        def at_optimistic_answer() -> None:
            proxy.mode = "cut"  # the replay never reaches the server

        proxy.on_answer = lambda: setattr(proxy, "on_answer", at_optimistic_answer)
        results = await asyncio.gather(
            *(store.commit(e, emit(e)) for e in exes), return_exceptions=True
        )
        await first
        assert all(isinstance(r, OutcomeUnknown) for r in results), results
        assert [e.version for e in exes] == [1] * 4
        proxy.mode, proxy.delay = "forward", 0
        assert [(await store.load(e.id)).version for e in exes] == [1, 2, 1, 1]  # type: ignore[union-attr]
        await store.close()

    asyncio.run(main())
