"""A hostile review of the gate (remote claims run one of each claim's twins on the server:
`Batch.gate`, `_Wire.place`, branch_end) against the session's real sqld.

Groups are formed without timing: the plans of several store operations are driven up to
their write, and their batches go to `HranaConnection._send` as one group (the path a
group commit takes: optimistic, then again with savepoints if a member failed), each plan
then handed its own outcome. A test that fails shows a defect; the others are checks that
held and guard something the change relies on.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, StoreConflict, StoreError
from harel_store.batch import Batch, Conflicted, Plan
from harel_store.connection import hrana
from harel_store.connection.hrana import HranaConnection, _Pending, _Wire
from harel_store.sql import Query
from tests import test_gate
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld

remote = test_gate.remote  # a store on the session's sqld, a test

NAMES, TWINS, PLAIN = test_gate.NAMES, test_gate.TWINS, test_gate.PLAIN
BOOM = (
    "CREATE TRIGGER boom BEFORE UPDATE OF claimed_by ON harel_outbox "
    "WHEN NEW.claimed_by = 'boom' BEGIN SELECT RAISE(ABORT, 'boom: the claim fails'); END"
)


# --- driving plans as one group ---


def adhoc(sql: str, kind: str = "!") -> tuple[Query, tuple[()]]:
    return Query("adhoc", kind, sql), ()


def rows(store: LibsqlStore, sql: str) -> list[tuple[Any, ...]]:
    return store._conn.execute(adhoc(sql, ""))  # type: ignore[no-any-return]


def raw(batch: Batch) -> Plan[Any]:
    """A plan that writes one batch and returns its results."""
    return (yield batch)


def up_to_write(conn: Any, plan: Plan[Any]) -> Batch:
    request = next(plan)
    while not isinstance(request, Batch):
        request = plan.send(conn.execute(request))
    return request


def finish(conn: Any, plan: Plan[Any], result: Any, error: BaseException | None) -> Any:
    """Hand ``plan`` the outcome of its write and drive it to its end: its value, or the
    exception it raised."""
    try:
        request = plan.throw(error) if error is not None else plan.send(result)
        while True:
            try:
                answer = conn.execute(request)
            except BaseException as exc:
                request = plan.throw(exc)
            else:
                request = plan.send(answer)
    except StopIteration as stop:
        return stop.value
    except Exception as exc:
        return exc


def as_group(store: LibsqlStore, plans: list[Plan[Any]], left: tuple[int, ...] = ()) -> list[Any]:
    """The plans' writes sent as one group (`HranaConnection._send`): what each plan came to.
    The members of ``left`` are writes whose async caller was cancelled meanwhile."""
    conn = store._conn
    assert isinstance(conn, HranaConnection)
    group = [_Pending(_Wire(up_to_write(conn, plan))) for plan in plans]
    loop = asyncio.new_event_loop()
    try:
        for i in left:
            future = group[i].future = loop.create_future()
            future.cancel()
        conn._send(group)
    finally:
        loop.close()
    return [finish(conn, plan, p.result, p.error) for plan, p in zip(plans, group, strict=True)]


@contextmanager
def wire_log(store: LibsqlStore) -> Iterator[list[tuple[list[str], dict[str, Any]]]]:
    """Every write request the store's connection sends: the names of its statements and
    the server's answer to the batch (its first result)."""
    conn = store._conn
    assert isinstance(conn, HranaConnection)
    sent: list[tuple[list[str], dict[str, Any]]] = []
    original = conn._client.post

    def post(path: str, body: bytes) -> Any:
        response = original(path, body)
        request = json.loads(body)["requests"][0]
        if request["type"] == "batch":
            names = [
                NAMES.get(step["stmt"]["sql"], step["stmt"]["sql"][:40])
                for step in request["batch"]["steps"]
            ]
            sent.append((names, json.loads(response.body)["results"][0]))
        return response

    conn._client.post = post  # type: ignore[method-assign]
    try:
        yield sent
    finally:
        conn._client.post = original  # type: ignore[method-assign]


def ran(names: list[str], first: dict[str, Any]) -> list[str]:
    """The statements of a batch that ran (a result or an error)."""
    result = first["response"]["result"]
    pairs = zip(names, result["step_results"], result["step_errors"], strict=True)
    return [name for name, r, e in pairs if r is not None or e is not None]


def emit_to(store: LibsqlStore, *targets: str) -> None:
    for target in targets:
        store.commit(Execution(id=f"e-{target}", definition_id="d"), [(target, Event(name="go"))])


def one_by_one(store: LibsqlStore, plans: list[Any]) -> list[Any]:
    """Each plan run on ``store`` in turn: its result, or the exception it raised."""
    outcomes: list[Any] = []
    for plan in plans:
        try:
            outcomes.append(store._run(plan))
        except Exception as exc:
            outcomes.append(exc)
    return outcomes


def holders(store: LibsqlStore) -> dict[str, tuple[str | None, int]]:
    """Each live outbox entry's target: (who holds it, its attempts)."""
    found = rows(store, "SELECT target_id, claimed_by, attempts FROM harel_outbox WHERE seq > 0")
    return {target: (by, attempts) for target, by, attempts in found}


def stale_copy(store: LibsqlStore, name: str) -> Execution:
    """An execution whose copy here is behind the database (its commit conflicts)."""
    store.commit(Execution(id=name, definition_id="d"), [])
    stale = store.load(name)
    fresh = store.load(name)
    assert stale is not None and fresh is not None
    store.commit(fresh, [])
    return stale


def refused_flow(key: str) -> Batch:
    """A write that fails for real (a NOT NULL priority)."""
    batch = Batch()
    batch.add("set_flow", key, None, None, 0, None, None)
    return batch


# --- 1. every arrangement of a claim among members that land, conflict and fail ---


MEMBERS = ("good", "stale", "error")


@pytest.mark.parametrize("claim", ["claim", "failing claim"])
@pytest.mark.parametrize("flows", [False, True], ids=["no flow", "flows"])
def test_every_arrangement_of_a_claim_in_a_group_commits_exactly_its_landed_members(
    remote: LibsqlStore, flows: bool, claim: str
) -> None:
    """A claim (or one whose statement fails for real: a trigger refuses worker 'boom') in
    every order among a write that lands, a stale commit and a refused write, up to four
    members: each member's outcome is its own, what landed is exactly the members that did
    (no partial commit of the first, optimistic try), the claim ran only the statements of
    its side, and a group with a failing member took two requests, one without took one."""
    if claim == "failing claim":
        rows(remote, BOOM)
    if flows:
        remote.set_flow("p", paused=True)
        emit_to(remote, "p")
    stale = stale_copy(remote, "t")
    worker = "boom" if claim == "failing claim" else "w"
    n = 0
    for size in range(0, len(MEMBERS) + 1):
        for others in itertools.permutations(MEMBERS, size):
            for at in range(size + 1):
                order = [*others[:at], "claim", *others[at:]]
                n += 1
                target = f"k{n}"
                emit_to(remote, target)
                plans: list[Plan[Any]] = []
                for member in order:
                    if member == "claim":
                        plans.append(LibsqlStore.claim_outbox.plan(remote, worker, lease=60))
                    elif member == "good":
                        exe = Execution(id=f"g{n}", definition_id="d")
                        plans.append(LibsqlStore.commit.plan(remote, exe, []))
                    elif member == "stale":
                        plans.append(LibsqlStore.commit.plan(remote, stale, []))
                    else:
                        plans.append(raw(refused_flow(f"x{n}")))
                with wire_log(remote) as sent:
                    outcomes = dict(zip(order, as_group(remote, plans), strict=True))
                where = f"{order} (flows: {flows})"
                failing = {"stale", "error"} & set(order) or claim == "failing claim"
                assert len(sent) == (2 if failing and len(order) > 1 else 1), where
                got = outcomes["claim"]
                held = holders(remote)
                if claim == "claim":
                    assert not isinstance(got, BaseException), (where, got)
                    assert [e.target_id for e in got] == [target], where
                    assert held[target] == ("w", 1), where
                else:
                    assert isinstance(got, StoreError) and "boom" in str(got), (where, got)
                    assert held[target] == (None, 0), where  # nothing of the claim landed
                if flows:
                    assert held["p"] == (None, 0), where  # paused: never claimed
                if "good" in order:
                    assert isinstance(outcomes["good"], list), (where, outcomes["good"])
                    assert remote.load(f"g{n}") is not None, where
                if "stale" in order:
                    assert isinstance(outcomes["stale"], StoreConflict), where
                if "error" in order:
                    assert isinstance(outcomes["error"], StoreError), where
                    assert "NOT NULL" in str(outcomes["error"]), where
                    assert "flow key has settings" not in str(outcomes["error"]), where
                names, first = sent[-1]
                done = set(ran(names, first))
                assert not (PLAIN if flows else TWINS) & done, (where, done)
                assert ("claim_outbox_flows" if flows else "claim_outbox") in done, where
    assert rows(remote, "SELECT version FROM harel_executions WHERE id = 't'") == [(2,)]
    assert not rows(remote, "SELECT key FROM harel_flows WHERE key LIKE 'x%'")


# --- 2. what a member before the claim did to the flows, in the same transaction ---


def flows_plans(store: LibsqlStore, stale: Execution, how: str) -> list[Plan[Any]]:
    """A group where a member before the claim changes the flows: the claim must see it (the
    gate reads the transaction's own state, as the file's flows_in_use does)."""
    change: Any = {
        "pause": lambda: LibsqlStore.pause_flow.plan(store, "a"),
        "clear the only key": lambda: LibsqlStore.clear_flow.plan(store, "z"),
        "limit": lambda: LibsqlStore.set_flow.plan(store, "a", concurrency=1),
    }[how]
    return [
        change(),
        LibsqlStore.commit.plan(store, stale, []),  # fails: the group goes again, saved
        LibsqlStore.claim_outbox.plan(store, "w", lease=60),
    ]


@pytest.mark.parametrize("how", ["pause", "clear the only key", "limit"])
def test_a_flow_change_earlier_in_the_group_is_what_the_claim_honours(
    remote: LibsqlStore, tmp_path: Any, how: str
) -> None:
    """The same operations on a local file (one after the other) and as one remote group
    with a member that fails: the claim takes the same items."""
    claimed = {}
    local = LibsqlStore(str(tmp_path / "local.db"))
    try:
        for store in (local, remote):
            if how == "clear the only key":
                store.set_flow("z", priority=1)
            store.commit(
                Execution(id="a.x", definition_id="d"),
                [(f"a.{i}", Event(name="go", id=f"a{i}")) for i in range(3)]
                + [("b.0", Event(name="go", id="b0"))],
            )
            stale = stale_copy(store, "t")
            plans = flows_plans(store, stale, how)
            if store is local:
                outcomes = one_by_one(local, plans)
            else:
                with wire_log(remote) as sent:
                    outcomes = as_group(remote, plans)
                assert len(sent) == 2  # optimistic, then saved
            assert isinstance(outcomes[1], StoreConflict)
            assert not isinstance(outcomes[2], BaseException), outcomes[2]
            claimed[store is local] = sorted(e.target_id or "" for e in outcomes[2])
    finally:
        local.close()
    assert claimed[False] == claimed[True]
    expect = {"pause": ["b.0"], "clear the only key": ["a.0", "a.1", "a.2", "b.0"],
              "limit": ["a.0", "b.0"]}[how]  # fmt: skip
    assert claimed[True] == expect


# --- 3. several claims in one group ---


@pytest.mark.parametrize("limit", ["concurrency", "rate"])
def test_two_claims_in_a_group_with_a_failing_member_between_share_a_keys_limit(
    remote: LibsqlStore, limit: str
) -> None:
    """Two workers' claims, a stale commit between them: optimistic, then saved. The key's
    limit of one counts what the first claim took in the same transaction, the first try's
    claims left nothing behind (one attempt each, one row of the rate log)."""
    remote.commit(
        Execution(id="k.x", definition_id="d"),
        [(f"k.{i}", Event(name="go", id=f"k{i}")) for i in range(3)],
    )
    if limit == "concurrency":
        remote.set_flow("k", concurrency=1)
    else:
        remote.set_flow("k", rate=(1, 60.0))
    stale = stale_copy(remote, "t")
    plans = [
        LibsqlStore.claim_outbox.plan(remote, "w1", lease=60),
        LibsqlStore.commit.plan(remote, stale, []),
        LibsqlStore.claim_outbox.plan(remote, "w2", lease=60),
    ]
    with wire_log(remote) as sent:
        first, conflict, second = as_group(remote, plans)
    assert len(sent) == 2
    assert isinstance(conflict, StoreConflict)
    assert [e.target_id for e in first] == ["k.0"]
    assert second == []
    assert holders(remote) == {"k.0": ("w1", 1), "k.1": (None, 0), "k.2": (None, 0)}
    logged = rows(remote, "SELECT count(*) FROM harel_flow_claims")
    assert logged == [(1 if limit == "rate" else 0,)]


# --- 4. the claim alone again after the others left ---


@pytest.mark.parametrize("flows", [False, True], ids=["no flow", "flows"])
@pytest.mark.parametrize("claim_first", [True, False], ids=["claim first", "claim after"])
def test_a_claim_left_alone_by_the_replay_is_laid_out_alone_and_read_right(
    remote: LibsqlStore, flows: bool, claim_first: bool
) -> None:
    """A group of a claim and a stale commit whose async caller was cancelled: the failed
    optimistic try withdraws the stale one, and the claim goes again alone (laid out anew:
    its positions, sides, gate and commit of that layout)."""
    emit_to(remote, "a", "b")
    if flows:
        remote.set_flow("b", paused=True)
    stale = stale_copy(remote, "t")
    plans = [
        LibsqlStore.claim_work.plan(remote, "w", time.time(), lease=60, max_attempts=3),
        LibsqlStore.commit.plan(remote, stale, []),
    ]
    if not claim_first:
        plans.reverse()
    with wire_log(remote) as sent:
        outcomes = as_group(remote, plans, left=(1 if claim_first else 0,))
    work = outcomes[0 if claim_first else 1]
    withdrawn = outcomes[1 if claim_first else 0]
    assert isinstance(withdrawn, StoreError) and "withdrawn" in str(withdrawn)
    assert not isinstance(work, BaseException), work
    assert sorted(e.target_id or "" for e in work.outbox) == (["a"] if flows else ["a", "b"])
    assert work.ahead.outbox is False
    assert len(sent) == 2
    names, first = sent[1]
    assert names[0] == "begin" and "savepoint" not in names  # alone
    done = ran(names, first)
    assert not (PLAIN if flows else TWINS) & set(done), done
    assert done[-2:] == ["branch_end", "commit"]


# --- 5. a statement after the claim fails, on the side taken ---


CLOCK_BOOM = (
    "CREATE TRIGGER boom_{what} BEFORE {what} ON harel_flow_clock "
    "BEGIN SELECT RAISE(ABORT, 'boom: the clock'); END"
)
LOG_BOOM = (
    "CREATE TRIGGER boom_log BEFORE INSERT ON harel_flow_claims "
    "BEGIN SELECT RAISE(ABORT, 'boom: the rate log'); END"
)


@pytest.mark.parametrize("where", ["advance_clock", "log_flow_claims"])
@pytest.mark.parametrize("arrangement", ["alone", "claim first", "claim after"])
def test_a_step_failing_after_the_claim_on_its_side_undoes_the_claim_alone(
    remote: LibsqlStore, where: str, arrangement: str
) -> None:
    """The claim statement ran and changed rows; a later statement of the side taken fails
    (the flow clock's advance, or, with a rate set, the rate log): the claim fails with that
    error and none of its rows stay claimed; a write grouped with it lands."""
    emit_to(remote, "a.0")
    if where == "advance_clock":
        rows(remote, CLOCK_BOOM.format(what="INSERT"))
        rows(remote, CLOCK_BOOM.format(what="UPDATE"))
        remote.set_flow("z", priority=1)  # the flows side: advance_clock_flows
    else:
        remote.set_flow("a", rate=(5, 60.0))
        rows(remote, LOG_BOOM)
    plans: list[Plan[Any]] = [LibsqlStore.claim_outbox.plan(remote, "w", lease=60)]
    if arrangement != "alone":
        good = LibsqlStore.commit.plan(remote, Execution(id="g", definition_id="d"), [])
        plans = [*plans, good] if arrangement == "claim first" else [good, *plans]
    outcomes = as_group(remote, plans)
    claim = outcomes[0 if arrangement != "claim after" else 1]
    message = "boom: the clock" if where == "advance_clock" else "boom: the rate log"
    assert isinstance(claim, StoreError) and message in str(claim), claim
    assert holders(remote) == {"a.0": (None, 0)}
    assert rows(remote, "SELECT count(*) FROM harel_flow_claims") == [(0,)]
    if arrangement != "alone":
        assert remote.load("g") is not None


# --- 6. pipelined async claims of a limited key ---


def test_pipelined_async_claims_of_many_workers_keep_a_keys_limit(server: SqldServer) -> None:
    """Sixteen workers claim at once from an async store (pipelined requests, groups among
    them): the key's concurrency limit of two holds across all of them, every other item is
    claimed once, and the paused key's never."""

    async def main() -> None:
        from harel_store import AsyncLibsqlStore

        store = await AsyncLibsqlStore.create(server.url, auth_token=server.token)
        try:
            for key in ("k", "p", "o"):
                await store.commit(
                    Execution(id=f"{key}.x", definition_id="d"),
                    [(f"{key}.{i}", Event(name="go", id=f"{key}{i}")) for i in range(6)],
                )
            await store.set_flow("k", concurrency=2)
            await store.pause_flow("p")
            claims = await asyncio.gather(
                *(store.claim_outbox(f"w{i}", limit=2, lease=60) for i in range(16))
            )
            taken = [e.target_id or "" for claim in claims for e in claim]
            assert len(taken) == len(set(taken))
            assert sorted(t for t in taken if t.startswith("k.")) == ["k.0", "k.1"]
            assert not [t for t in taken if t.startswith("p.")]
            assert sorted(t for t in taken if t.startswith("o.")) == [f"o.{i}" for i in range(6)]
        finally:
            await store.close()

    asyncio.run(main())


# --- 7. what `_settle` makes of answers with a gate (no server) ---


def offline() -> HranaConnection:
    return HranaConnection(
        "http://127.0.0.1:9", "test", auth_token="", timeout=1.0, busy_timeout=5.0
    )


def claims_batch() -> Batch:
    plan = LibsqlStore.claim_work.plan(None, "w", 0.0, max_attempts=3)  # type: ignore[arg-type]
    batch = next(plan)
    assert isinstance(batch, Batch) and batch.gated is not None
    return batch


def reply(results: list[Any], errors: list[Any]) -> Any:
    from harel_store.connection import http

    batch = {"type": "batch", "result": {"step_results": results, "step_errors": errors}}
    body = {
        "baton": None,
        "base_url": None,
        "results": [
            {"type": "ok", "response": batch},
            {"type": "ok", "response": {"type": "close"}},
        ],
    }
    return http.Response(200, {}, json.dumps(body).encode())


def settle_once(conn: HranaConnection, group: list[_Pending], answer: Any) -> Any:
    gen = conn._settle(group, answer, time.monotonic(), 0)
    while True:
        try:
            next(gen)
        except StopIteration as stop:
            return stop.value


OK = {"cols": [], "rows": [], "affected_row_count": 0, "last_insert_rowid": None}
GATE_ERROR = {"message": "SQLite error: malformed JSON", "code": "SQLITE_ERROR"}


def test_busy_at_the_begin_of_a_group_with_gates_is_retried_optimistic_not_replayed() -> None:
    conn = offline()
    group = [_Pending(_Wire(claims_batch())), _Pending(_Wire(claims_batch()))]
    hrana._body(group)
    n = group[0].wire.commit + 2
    errors: list[Any] = [None] * n
    errors[0] = {"message": "database is locked", "code": "SQLITE_BUSY"}
    results: list[Any] = [None] * n
    results[n - 1] = None
    again, pause = settle_once(conn, group, reply(results, errors))
    assert again == group and pause > 0
    assert not any(p.wire.saved for p in group)


def test_a_reply_where_only_the_gate_failed_and_nothing_committed_is_no_gate_error() -> None:
    """A reply that makes no sense (every step ran, only the gate failed, the COMMIT neither
    ran nor failed): the write's outcome is unknown; the gate's failure is never the
    error reported."""
    conn = offline()
    (pending,) = group = [_Pending(_Wire(claims_batch()))]
    hrana._body(group)
    wire = pending.wire
    n = wire.commit + 2
    results: list[Any] = [OK] * n
    errors: list[Any] = [None] * n
    (gate,) = wire.gates
    results[gate], errors[gate] = None, GATE_ERROR
    results[wire.commit] = None
    settle_once(conn, group, reply(results, errors))
    from harel_store import OutcomeUnknown

    assert isinstance(pending.error, OutcomeUnknown), pending.error
    assert "malformed JSON" not in str(pending.error)


# --- 8. claim_work of every kind, dead letters and the peek, in a group ---


@pytest.mark.parametrize("flows", [False, True], ids=["no flow", "flows"])
def test_claim_work_of_every_kind_in_a_replayed_group_as_on_a_file(
    remote: LibsqlStore, tmp_path: Any, flows: bool
) -> None:
    """claim_work (every kind, max_attempts 1: an entry claimed once before becomes a dead
    letter) between a stale commit and a refused write, optimistic then saved, against the
    same calls one after the other on a file: the same items of each kind, the same dead
    letters, the same peek at what is left."""
    from harel_store.models import TimerOp

    seen = {}
    local = LibsqlStore(str(tmp_path / "local.db"))
    try:
        for store in (local, remote):
            if flows:
                store.set_flow("p", paused=True)
                store.set_flow("h", priority=3)
            store.commit(Execution(id="old.x", definition_id="d"), [("old.0", Event(name="go"))])
            assert len(store.claim_outbox("early", lease=0.01)) == 1
            for key in ("a", "p", "h"):
                store.commit(
                    Execution(id=f"{key}.x", definition_id="d"),
                    [(f"{key}.0", Event(name="go", id=f"{key}-e"))],
                    spawns=[(f"{key}.c", "root", {})],
                    timers=[TimerOp.schedule("t", 1.0), TimerOp.schedule("later", 4e9)],
                )
            stale = stale_copy(store, "t")
            time.sleep(0.02)  # the early claim's lease ran out: old.0 is at max_attempts
            plans = [
                LibsqlStore.commit.plan(store, stale, []),
                LibsqlStore.claim_work.plan(store, "w", time.time(), lease=60, max_attempts=1),
                raw(refused_flow("x")),
            ]
            if store is local:
                outcomes = one_by_one(local, plans)
            else:
                with wire_log(remote) as sent:
                    outcomes = as_group(remote, plans)
                assert len(sent) == 2
            conflict, work, refused = outcomes
            assert isinstance(conflict, StoreConflict) and isinstance(refused, StoreError)
            assert not isinstance(work, BaseException), work
            seen[store is local] = (
                [e.target_id for e in work.outbox],
                [s.child_id for s in work.spawns],
                [t.execution_id for t in work.timers],
                work.ahead,
                [(d.kind, getattr(d.item, "target_id", None)) for d in store.dead_letters()],
            )
    finally:
        local.close()
    assert seen[False] == seen[True]
    outbox, spawns, timers, ahead, dead = seen[True]
    keys = ["h", "a"] if flows else ["a", "p", "h"]
    assert sorted(outbox) == sorted(f"{k}.0" for k in keys)
    assert sorted(spawns) == sorted(f"{k}.c" for k in keys)
    assert sorted(timers) == sorted(f"{k}.x" for k in keys)
    assert dead == [("outbox", "old.0")]
    assert (ahead.outbox, ahead.spawns, ahead.timers) == (False, False, False)


# --- 9. a guard on a side of the gate (Batch.gate as a general API) ---


def sided_guard_batch(side: int, passes: bool) -> Batch:
    """flows_in_use gated; on ``side`` a guarded UPDATE of the flow clock that changes a row
    (``passes``) or none; on the other side a plain write; the conflict read reads the
    clock."""
    batch = Batch()
    flows = batch.add("flows_in_use")
    batch.gate(flows, "flows_gate")
    kind = "outbox" if passes else "nothing"
    guarded = adhoc(f"UPDATE harel_flow_clock SET rank = rank + 1 WHERE kind = '{kind}'")
    other = adhoc("UPDATE harel_flow_clock SET rank = rank + 100 WHERE kind = 'spawn'")
    for s in (0, 1):
        batch.steps.append(guarded if s == side else other)
        index = len(batch.steps) - 1
        batch.only_if[index] = (flows, 1, s == 0)
        if s == side:
            batch.guards[index] = None
    batch.conflict = adhoc("SELECT kind, rank FROM harel_flow_clock ORDER BY kind", "")
    return batch


def clock(store: LibsqlStore) -> dict[str, int]:
    return dict(rows(store, "SELECT kind, rank FROM harel_flow_clock"))


@pytest.mark.parametrize("flows", [False, True], ids=["no flow", "flows"])
@pytest.mark.parametrize("side", [0, 1])
@pytest.mark.parametrize("passes", [True, False], ids=["guard passes", "guard fails"])
def test_a_guard_on_a_side_conflicts_only_on_the_side_taken(
    remote: LibsqlStore, flows: bool, side: int, passes: bool
) -> None:
    if flows:
        remote.set_flow("z", priority=1)
    before = clock(remote)
    taken = 1 if flows else 0
    conn = remote._conn
    try:
        results = conn.execute(sided_guard_batch(side, passes))
    except Conflicted as conflict:
        assert side == taken and not passes
        assert conflict.found == sorted(before.items())
        assert clock(remote) == before  # nothing of it landed
        return
    assert side != taken or passes
    after = clock(remote)
    if side == taken:
        assert after == {**before, "outbox": before["outbox"] + 1}
    else:
        assert after == {**before, "spawn": before["spawn"] + 100}
    assert results[1 + (1 - taken)] is None  # the side not taken: no result, as on a file


def test_the_conflict_read_does_not_run_after_a_commit_whose_guard_was_on_the_side_not_taken(
    remote: LibsqlStore,
) -> None:
    """sqld's "error" condition holds for a step never run: a guard on the side not taken is
    one, so the conflict read (run "if a guard failed") runs after every successful commit
    of such a batch, alone as an autocommit read after the COMMIT, and inside the group's
    transaction in a saved layout: a wasted statement (no caller of the store has a guard on
    a side yet: latent)."""
    with wire_log(remote) as sent:
        remote._conn.execute(sided_guard_batch(1, True))  # no flow: side 0 taken
    names, first = sent[-1]
    done = ran(names, first)
    assert done[-1] != "adhoc" and "SELECT kind, rank" not in done[-1], done


# --- 10. async relays against sqld while commits go in the same groups ---


def test_async_relays_honour_the_flows_while_their_claims_share_groups_with_commits(
    server: SqldServer,
) -> None:
    """Two AsyncRelays of one async store, while forty tasks commit events to four keys
    (their claims, acks and the commits go in shared, pipelined requests): every event of a
    key not paused is handled once, the paused key's never, the key limited to one never
    has two in hand."""
    from harel_store import AsyncLibsqlStore, AsyncRelay

    async def main() -> None:
        store = await AsyncLibsqlStore.create(server.url, auth_token=server.token)
        handled: list[str] = []
        in_hand = {"k": 0}
        most = {"k": 0}

        async def on_outbox(entry: Any) -> None:
            key = (entry.target_id or "").partition(".")[0]
            if key == "k":
                in_hand["k"] += 1
                most["k"] = max(most["k"], in_hand["k"])
            await asyncio.sleep(0.002)
            if key == "k":
                in_hand["k"] -= 1
            handled.append(entry.target_id or "")

        try:
            await store.set_flow("p", paused=True)
            await store.set_flow("k", concurrency=1)
            await store.set_flow("h", priority=5)
            relays = [AsyncRelay(store, f"r{i}", on_outbox=on_outbox, poll=0.05) for i in (1, 2)]
            tasks = [asyncio.ensure_future(r.run()) for r in relays]
            await asyncio.gather(
                *(
                    store.commit(
                        Execution(id=f"{key}.x{i}", definition_id="d"),
                        [(f"{key}.{i}", Event(name="go", id=f"{key}-{i}"))],
                    )
                    for i in range(10)
                    for key in ("a", "k", "p", "h")
                )
            )
            deadline = time.monotonic() + 4
            while len(handled) < 30 and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            for r in relays:
                r.stop()
            await asyncio.gather(*tasks)
        finally:
            await store.close()
        assert sorted(handled) == sorted(f"{k}.{i}" for k in "akh" for i in range(10))
        assert most["k"] == 1

    asyncio.run(main())


# --- 11. random gated batches, alone and in groups, against a file ---


def random_step(rng: Any, batch: Batch, n: int) -> int:
    """Append a statement on table fz: a write, a guarded write, a guard changing no row, or
    an error; return its index."""
    index = len(batch.steps)
    what = rng.choices(["write", "guard", "no row", "error"], [6, 2, 1, 1])[0]
    if what == "error":
        batch.steps.append(adhoc("SELECT json('not json')", "$"))
    elif what == "no row":
        batch.steps.append(adhoc("UPDATE fz SET v = v WHERE k = 'none'"))
        batch.guards[index] = None
    else:
        batch.steps.append(adhoc(f"INSERT INTO fz VALUES ('{n}-{index}', {index})"))
        if what == "guard":
            batch.guards[index] = None
    return index


def random_batch(rng: Any, n: int) -> Batch:
    """A gated batch of ad-hoc statements: a few before the gated flows_in_use, then some on
    side 0, on side 1 or on both (unsided), some guarded, a few failing."""
    batch = Batch()
    for _ in range(rng.randrange(3)):
        random_step(rng, batch, n)
    flows = batch.add("flows_in_use")
    batch.gate(flows, "flows_gate")
    for _ in range(rng.randrange(6)):
        index = random_step(rng, batch, n)
        side = rng.choice([0, 1, None])
        if side is not None:
            batch.only_if[index] = (flows, 1, side == 0)
    if rng.random() < 0.5:
        batch.conflict = adhoc("SELECT count(*) FROM fz", "$")
    return batch


def outcome(run: Any) -> Any:
    try:
        return ("ok", run())
    except Conflicted as conflict:
        return ("conflict", conflict.step, conflict.found)
    except StoreError as exc:
        return ("error", "malformed JSON" in str(exc))


@pytest.mark.parametrize("flows", [False, True], ids=["no flow", "flows"])
def test_random_gated_batches_alone_and_grouped_do_what_a_file_does(
    remote: LibsqlStore, tmp_path: Any, flows: bool
) -> None:
    import random

    rng = random.Random(20261206 + flows)
    local = LibsqlStore(str(tmp_path / "local.db"))
    try:
        for store in (local, remote):
            setup = Batch()
            setup.steps.append(adhoc("CREATE TABLE IF NOT EXISTS fz (k TEXT PRIMARY KEY, v INT)"))
            setup.steps.append(adhoc("DELETE FROM fz"))
            store._conn.execute(setup)
            if flows:
                store.set_flow("z", priority=1)
        n = 0
        for _ in range(40):
            batches = []
            for _ in range(rng.choice([1, 1, 2, 3, 4])):
                n += 1
                batches.append(random_batch(rng, n))
            expected = [outcome(lambda b=b: local._conn.execute(b)) for b in batches]
            if len(batches) == 1:
                got = [outcome(lambda b=batches[0]: remote._conn.execute(b))]
            else:
                conn = remote._conn
                assert isinstance(conn, HranaConnection)
                group = [_Pending(_Wire(b)) for b in batches]
                conn._send(group)
                got = [outcome(p.outcome) for p in group]
            for b, e, g in zip(batches, expected, got, strict=True):
                if e[0] == "conflict" and g[0] == "conflict":
                    e, g = e[:2], g[:2]  # what the read finds differs: others of a group
                assert g == e, (b.steps, b.only_if, b.guards)
            assert rows(remote, "SELECT * FROM fz ORDER BY k") == rows(
                local, "SELECT * FROM fz ORDER BY k"
            )
    finally:
        local.close()
