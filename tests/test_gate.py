"""A remote claims batch runs one of each claim's twin statements on the server, as a file
does (issue 51, the server's pace): the gate after ``flows_in_use`` fails on purpose while
some key has settings, and each twin runs on its side of it.

Against the session's real sqld: which statements ran is read from each write request's
steps and the server's answer (a step that ran has a result or an error).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    StoreConflict,
    StoreError,
)
from harel_store.batch import Batch
from harel_store.connection import hrana
from harel_store.sql import QUERIES
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer
from tests.test_pace_attack import HOLD

pytestmark = pytest.mark.sqld

NAMES = {query.sql: name for name, query in QUERIES.items() if name != "ping"}  # SELECT 1
TWINS = {n for n in QUERIES if n.endswith("_flows")} | {
    "log_flow_claims_outbox",
    "log_flow_claims_spawns",
    "log_flow_claims_timers",
    "prune_flow_claims",
}  # what runs only while some key has settings
PLAIN = {n.removesuffix("_flows") for n in QUERIES if n.endswith("_flows")}


@contextmanager
def statements_run() -> Iterator[list[list[str]]]:
    """The names of the statements the server ran, one list a write request, in order."""
    ran: list[list[str]] = []
    original = hrana.HranaConnection._settle

    def settle(self: Any, todo: Any, answer: Any, started: float, tries: int) -> Any:
        body = getattr(answer, "body", None)
        if body and todo and todo[0].wire.write:
            sent = json.loads(todo[0].wire.part) if len(todo) == 1 else None
            for result in json.loads(body)["results"]:
                if sent is not None and result["type"] == "ok" and "result" in result["response"]:
                    done = result["response"]["result"]
                    steps = sent["batch"]["steps"]
                    pairs = zip(steps, done["step_results"], done["step_errors"], strict=True)
                    ran.append([NAMES[s["stmt"]["sql"]] for s, r, e in pairs if r or e])
        return (yield from original(self, todo, answer, started, tries))

    hrana.HranaConnection._settle = settle  # type: ignore[method-assign]
    try:
        yield ran
    finally:
        hrana.HranaConnection._settle = original  # type: ignore[method-assign]


@pytest.fixture
def remote(server: SqldServer) -> Iterator[LibsqlStore]:
    store = LibsqlStore(server.url, auth_token=server.token)
    yield store
    store.close()


def emit_to(store: LibsqlStore, *targets: str) -> None:
    for target in targets:
        store.commit(Execution(id=target, definition_id="d"), [(target, Event(name="go"))])


def test_with_no_flow_set_only_the_plain_statements_run(remote: LibsqlStore) -> None:
    emit_to(remote, "a", "b")
    with statements_run() as ran:
        work = remote.claim_work("w", time.time(), max_attempts=3)
    assert sorted(e.target_id or "" for e in work.outbox) == ["a", "b"]
    ((*steps,),) = ran
    assert "flows_in_use" in steps and "flows_gate" in steps
    assert not TWINS & set(steps), steps
    for name in ("claim_outbox", "claim_spawns", "claim_due_timers", "mark_dead_outbox"):
        assert name in steps
    assert steps[-2:] == ["branch_end", "commit"]
    assert len(steps) == 13  # 23 before the gate: every twin ran


def test_with_a_flow_set_only_the_honouring_statements_run(remote: LibsqlStore) -> None:
    emit_to(remote, "a", "b", "c")
    remote.set_flow("b", paused=True)
    remote.set_flow("c", priority=5)
    with statements_run() as ran:
        work = remote.claim_work("w", time.time(), max_attempts=3)
    assert sorted(e.target_id or "" for e in work.outbox) == ["a", "c"]  # b paused
    ((*steps,),) = ran
    assert "claim_outbox_flows" in steps and "prune_flow_claims" in steps
    assert not PLAIN & set(steps), steps
    assert steps[-2:] == ["branch_end", "commit"]


def test_each_claim_call_on_a_server_goes_by_the_gate(remote: LibsqlStore) -> None:
    emit_to(remote, "a")
    remote.commit(Execution(id="p", definition_id="d"), [], spawns=[("p.c", "main", {})])
    for flows in (False, True):
        if flows:
            remote.set_flow("z", priority=1)
        with statements_run() as ran:
            outbox = remote.claim_outbox("w", lease=0.01)
            spawns = remote.claim_spawns("w", lease=0.01)
            timers = remote.claim_due_timers("w", time.time(), lease=0.01)
        assert [e.target_id for e in outbox] == ["a"]
        assert [s.child_id for s in spawns] == ["p.c"]
        assert timers == []
        for steps in ran:
            assert not (PLAIN if flows else TWINS) & set(steps), steps
        time.sleep(0.05)  # the leases run out: claimed again on the next turn


@pytest.mark.parametrize("order", ["claim first", "claim after"])
def test_a_gated_claim_in_a_group_with_a_stale_commit(
    proxy: Proxy, server: SqldServer, one_flight: None, order: str
) -> None:
    """A claims batch in an optimistic group with a stale commit, before or after it: the
    group is sent again with savepoints; the claim's gate (a failure on purpose) is no
    member's failure, and a step that failed before it leaves both its sides unrun (a
    skipped gate is not a failed one: sqld's "error" condition is true for both), so that
    nothing of the first try commits. Checked with no flow set, then with one."""

    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        try:
            for flows in (False, True):
                await store.commit(Execution(id=f"t{flows}", definition_id="d"), [])
                await store.commit(
                    Execution(id=f"a{flows}", definition_id="d"),
                    [(f"a{flows}", Event(name="go"))],
                )
                if flows:
                    await store.set_flow("z", priority=1)
                stale = await store.load(f"t{flows}")
                fresh = await store.load(f"t{flows}")
                assert stale is not None and fresh is not None
                await store.commit(fresh, [])
                proxy.delay = HOLD
                first = asyncio.create_task(
                    store.commit(Execution(id=f"f{flows}", definition_id="d"), [])
                )
                await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "first sent")
                sent = proxy.requests
                calls = [
                    store.claim_outbox("w"),
                    store.commit(stale, []),
                    store.commit(Execution(id=f"n{flows}", definition_id="d"), []),
                ]
                if order == "claim after":  # the claim behind the member that fails
                    calls[0], calls[1] = calls[1], calls[0]
                results = await asyncio.gather(*calls, return_exceptions=True)
                await first
                proxy.delay = 0
                assert proxy.requests - sent == 2  # optimistic, then with savepoints
                if order == "claim after":
                    results[0], results[1] = results[1], results[0]
                claimed, conflict, made = results
                assert not isinstance(claimed, BaseException), claimed
                assert [e.target_id for e in claimed] == [f"a{flows}"]
                assert isinstance(conflict, StoreConflict)
                assert made == []
                assert await store.load(f"n{flows}") is not None
                assert (await store.load(f"t{flows}")).version == 2  # type: ignore[union-attr]
        finally:
            await store.close()

    asyncio.run(main())


def test_a_failed_gated_step_is_the_batchs_error_not_the_gates(remote: LibsqlStore) -> None:
    """A claims-shaped batch whose side taken fails for real: the error is that statement's
    (not the gate's), nothing of the batch lands, and the side not taken never ran."""
    emit_to(remote, "a")
    for flows in (False, True):
        if flows:
            remote.set_flow("z", priority=1)
        batch = Batch()
        step = batch.add("flows_in_use")
        batch.gate(step, "flows_gate")
        side = (step, 1)
        batch.add("clear_flow", "z", only_if=side)
        batch.add("set_flow", "x", None, None, 0, None, None,
                  **({"only_if": side} if flows else {"unless": side}))  # fmt: skip
        batch.add("set_flow", "y", 0, None, 0, None, None, unless=side)
        with pytest.raises(StoreError, match="NOT NULL") as refused:
            remote._conn.execute(batch)
        assert "flow key has settings" not in str(refused.value)
        assert [f.key for f in remote.flows()] == (["z"] if flows else [])  # rolled back


def test_a_local_store_ignores_the_gate(tmp_path: Any) -> None:
    store = LibsqlStore(str(tmp_path / "local.db"))
    try:
        emit_to(store, "a")
        store.set_flow("a", priority=2)
        assert [e.target_id for e in store.claim_work("w", time.time()).outbox] == ["a"]
    finally:
        store.close()


def test_a_gate_needs_a_step_of_its_batch_and_is_one() -> None:
    batch = Batch()
    with pytest.raises(ValueError, match="no step 0"):
        batch.gate(0, "flows_gate")
    step = batch.add("flows_in_use")
    batch.gate(step, "flows_gate")
    with pytest.raises(ValueError, match="one gate"):
        batch.gate(step, "flows_gate")
