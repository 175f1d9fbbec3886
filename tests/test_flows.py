"""Flow control (issue 49): flow keys, and the claims that honour their settings.

Every outbox entry, spawn and timer carries a flow key (by default the root key of the
execution it concerns; ``""`` for an entry with no target). A claim serves the keys
round-robin within a priority, first in first out inside a key, higher priorities first;
it leaves the items of a paused key, at most ``concurrency`` of a key's items are held at
once (all kinds together), at most ``count`` are claimed in any ``seconds``. A relay
started under a worker id first takes back what that id held. These tests hold the claims
to that contract on every kind of store, across processes, and on a database migrated
from 0010.

Leases run on the database's clock: the tests move it by moving leases' ends back
(`elapse`), except where a window or a lease must really pass.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import signal
import sqlite3
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    AsyncRelay,
    DueTimer,
    Event,
    Execution,
    Flow,
    LibsqlStore,
    OutboxEntry,
    Relay,
    SpawnEntry,
    SqliteStore,
    TimerOp,
    WorkAhead,
    WorkerHold,
)
from harel_store.checks import MAX_ID_LENGTH
from harel_store.sql import HEAD
from tests.helpers import alembic_steps, raw
from tests.test_claims import elapse
from tests.workers.common import spawn

NOW = 1e11  # the timer sweep's now in the claims: every timer these tests arm is due
WAIT = 10.0  # seconds a test waits for what must happen
NOTHING = WorkAhead(False, False, False, None)
_commits = itertools.count()


# --- staging and reading items by flow key ---


def stage(
    store: Any,
    key: str,
    *,
    outbox: int = 0,
    spawns: int = 0,
    timers: int = 0,
    fire_at: float = 1.0,
) -> None:
    """One commit writing items of flow ``key`` (its root key): ``outbox`` entries (to
    ``KEY.<n>-<i>``, or with no target for key ``""``), ``spawns`` (children
    ``KEY.c<n>-<i>``) and ``timers`` of the committing execution ``KEY.x<n>`` (paths
    ``p<i>``, due at ``fire_at + i``, long past on any clock)."""
    n = next(_commits)
    targets = [None if key == "" else f"{key}.{n}-{i}" for i in range(outbox)]
    store.commit(
        Execution(id=f"{key}.x{n}", definition_id="d"),
        [(target, Event(name="go", id=f"ev-{n}-{i}")) for i, target in enumerate(targets)],
        spawns=[(f"{key}.c{n}-{i}", "root", {}) for i in range(spawns)],
        timers=[TimerOp.schedule(f"p{i}", fire_at + i) for i in range(timers)],
    )


def key_of(item: Any) -> str:
    """The root key of the execution an item concerns (what these tests' items are keyed
    by)."""
    if isinstance(item, OutboxEntry):
        return "" if item.target_id is None else item.target_id.partition(".")[0]
    if isinstance(item, SpawnEntry):
        return item.child_id.partition(".")[0]
    assert isinstance(item, DueTimer)
    return item.execution_id.partition(".")[0]


def keys(items: Iterable[Any]) -> Counter[str]:
    return Counter(key_of(item) for item in items)


def every(claimed: Any) -> list[Any]:
    """The items of a `ClaimedWork`."""
    return [item for _, item in claimed.items()]


def flow(store: Any, key: str) -> Flow | None:
    found = [f for f in store.flows() if f.key == key]
    assert len(found) <= 1
    return found[0] if found else None


@pytest.fixture
def store(open_store: Any) -> Any:
    """conftest's store of each kind (on the test server, conftest's reset_remote seeds the
    flow clock's rows as a migrated database has them)."""
    return open_store()


@pytest.fixture(params=["no-settings", "some-settings"])
def settings(request: pytest.FixtureRequest) -> str:
    """Whether some flow key (not one the test's items have) has settings: the claims then
    run their statements that honour flows, which must serve the others as the plain ones
    do."""
    return str(request.param)


def other_settings(store: Any, settings: str) -> None:
    if settings == "some-settings":
        store.set_flow("unrelated", priority=0)


# --- round-robin across keys, first in first out inside one ---


def test_a_claim_serves_keys_round_robin_not_by_backlog(store: Any, settings: str) -> None:
    """The issue's example: key A has 1,000 entries pending, key B (written after) 10; a
    claim of 20 returns 10 of each, each key's oldest, and the next claim goes on with A."""
    other_settings(store, settings)
    stage(store, "A", outbox=1000)
    stage(store, "B", outbox=10)
    first = store.claim_outbox("w1", limit=20)
    assert keys(first) == {"A": 10, "B": 10}
    pending = store.pending_outbox(limit=1010)
    a_seqs = [e.seq for e in pending if key_of(e) == "A"]
    b_seqs = [e.seq for e in pending if key_of(e) == "B"]
    assert [e.seq for e in first if key_of(e) == "A"] == a_seqs[:10]
    assert [e.seq for e in first if key_of(e) == "B"] == b_seqs
    second = store.claim_outbox("w1", limit=20)
    assert [e.seq for e in second] == a_seqs[10:30]


def test_three_keys_take_turns_first_in_first_out_inside_each(store: Any, settings: str) -> None:
    """Claims of one entry at a time over keys A, B, C (three each, written interleaved):
    A, B, C, A, B, C, ... each key's in the order it was written. Spawns likewise."""
    other_settings(store, settings)
    for _ in range(3):
        for key in "ABC":
            stage(store, key, outbox=1, spawns=1)
    order = [store.claim_outbox("w1", limit=1) for _ in range(10)]
    assert [len(c) for c in order] == [1] * 9 + [0]
    claimed = [c[0] for c in order[:9]]
    assert [key_of(e) for e in claimed] == list("ABC" * 3)
    for key in "ABC":  # first in, first out inside a key
        seqs = [e.seq for e in claimed if key_of(e) == key]
        assert seqs == sorted(seqs)
    spawns = [store.claim_spawns("w1", limit=1)[0] for _ in range(9)]
    assert [key_of(s) for s in spawns] == list("ABC" * 3)
    # More than one a claim: the first of each key, then the second of each, ...
    for _ in range(3):
        for key in "ABC":
            stage(store, key, outbox=1)
    four = store.claim_outbox("w1", limit=4)
    assert keys(four) == {"A": 2, "B": 1, "C": 1}


def test_a_key_that_arrives_later_joins_the_round_robin_at_once(store: Any, settings: str) -> None:
    """A key written while another has a long backlog half-claimed is not queued behind
    that backlog: the next claim serves both."""
    other_settings(store, settings)
    stage(store, "A", outbox=100)
    store.ack(store.claim_outbox("w1", limit=10))
    stage(store, "B", outbox=5)
    assert keys(store.claim_outbox("w1", limit=10)) == {"A": 5, "B": 5}


def test_entries_with_no_target_are_flow_key_empty_string(store: Any, settings: str) -> None:
    """An outbox entry with no target has flow key "": it takes its turn like any key, and
    settings of "" (here: paused) apply to it alone."""
    other_settings(store, settings)
    stage(store, "", outbox=6)
    stage(store, "A", outbox=6)
    first = store.claim_outbox("w1", limit=4)
    assert keys(first) == {"": 2, "A": 2}
    assert all(e.target_id is None for e in first if key_of(e) == "")
    paused = store.pause_flow("")
    assert (paused.key, paused.paused, paused.pending, paused.held) == ("", True, 4, 2)
    assert keys(store.claim_outbox("w1", limit=10)) == {"A": 4}
    assert store.claim_outbox("w2", limit=10) == []
    store.resume_flow("")
    assert keys(store.claim_outbox("w1", limit=10)) == {"": 4}


def test_spawns_and_due_timers_are_served_round_robin_too(store: Any, settings: str) -> None:
    """Spawns as the outbox; due timers ranked in their key soonest first: a claim of four
    over A (five due at 1..5) and B (two due at 10, 11) takes two of each, soonest first."""
    other_settings(store, settings)
    stage(store, "A", spawns=20, timers=5, fire_at=1.0)
    stage(store, "B", spawns=2, timers=2, fire_at=10.0)
    assert keys(store.claim_spawns("w1", limit=4)) == {"A": 2, "B": 2}
    timers = store.claim_due_timers("w1", NOW, limit=4)
    assert [(key_of(t), t.fire_at) for t in timers] == [
        ("A", 1.0),
        ("A", 2.0),
        ("B", 10.0),
        ("B", 11.0),
    ]


UNPAUSE: dict[str, Callable[[Any, str], object]] = {
    "resume_flow": lambda store, key: store.resume_flow(key),
    "set_flow": lambda store, key: store.set_flow(key, priority=0),
    "clear_flow": lambda store, key: store.clear_flow(key),
}


@pytest.mark.parametrize("unpause", list(UNPAUSE))
def test_a_resumed_key_takes_turns_with_the_others(store: Any, unpause: str) -> None:
    """A key paused while another's items were claimed, then unpaused (resume_flow, a
    set_flow not paused, clear_flow): claims of 20 over it (100 pending) and the other (40
    pending) serve both in turns, 10 each give or take the one turn a key joining from where
    the claims stand may take (guarantees.md, "Turns are per rank"), not every claim to the
    resumed key until its backlog caught up. Spawns likewise."""
    store.pause_flow("A")
    stage(store, "A", outbox=100, spawns=100)
    stage(store, "B", outbox=100, spawns=100)
    for _ in range(3):  # B's items go on while A is paused
        store.ack(store.claim_outbox("w1", limit=20))
        store.ack(store.claim_spawns("w1", limit=20))
    UNPAUSE[unpause](store, "A")
    for _ in range(2):
        for claimed in (store.claim_outbox("w1", limit=20), store.claim_spawns("w1", limit=20)):
            counts = keys(claimed)
            assert sum(counts.values()) == 20 and 9 <= counts["B"] <= 11, counts
            store.ack(claimed)


def test_a_key_behind_a_higher_priority_is_not_starved_by_an_older_backlog(store: Any) -> None:
    """Keys of the same priority take turns however long one of them waited behind a higher
    priority: A (default priority, 30 pending) and B (written after the claims served the
    high-priority key H) share the next claim, 10 each."""
    store.set_flow("H", priority=1)
    stage(store, "H", outbox=30)
    stage(store, "A", outbox=30)
    assert keys(store.claim_outbox("w1", limit=30)) == {"H": 30}
    stage(store, "B", outbox=10)
    assert keys(store.claim_outbox("w1", limit=20)) == {"A": 10, "B": 10}


def test_a_key_whose_limit_is_lifted_takes_turns_with_the_others(store: Any) -> None:
    """A key held to one item at a time while another's items were claimed keeps ranks from
    when it was written; when its limit is lifted (set_flow without one, or clear_flow) its
    backlog is ranked again from where the claims stand, and the next claims serve both in
    turns (not every claim to it until it caught up)."""
    for lift in (lambda: store.set_flow("A"), lambda: store.clear_flow("A")):
        store.set_flow("A", concurrency=1)
        stage(store, "A", outbox=100)
        stage(store, "B", outbox=100)
        for _ in range(3):
            claimed = store.claim_outbox("w1", limit=20)
            assert keys(claimed) == {"A": 1, "B": 19}
            store.ack(claimed)
        lift()
        for _ in range(2):
            counts = keys(claimed := store.claim_outbox("w1", limit=20))
            assert sum(counts.values()) == 20 and 9 <= counts["B"] <= 11, counts
            store.ack(claimed)
        store.ack(store.pending_outbox())
        store.clear_flow("A")


def test_a_relay_handles_a_rounds_items_in_their_turns(store: Any) -> None:
    """A claim hands its items out oldest first (the lists of ClaimedWork), but a relay
    handles them as the claim took them (ClaimedWork.items: priority, then rank): a key
    that came after another's burst goes second in the round, not after the burst; a key
    with a higher priority first. Outbox entries and spawns alike."""
    stage(store, "A", outbox=5, spawns=5)
    stage(store, "B", outbox=1, spawns=1)
    work = store.claim_work("w1", NOW)
    assert [key_of(e) for e in work.outbox] == ["A"] * 5 + ["B"]  # oldest first
    order = [key_of(item) for kind, item in work.items() if kind == "outbox"]
    assert order == ["A", "B", "A", "A", "A", "A"]
    assert [key_of(item) for kind, item in work.items() if kind == "spawn"] == order
    store.release("w1", [item for _, item in work.items()])
    store.set_flow("B", priority=1)
    work = store.claim_work("w1", NOW)
    assert [key_of(item) for _, item in work.items()][:2] == ["B", "A"]


# --- priority ---


def test_a_higher_priority_key_is_claimed_first(store: Any) -> None:
    """B and C (priority 5) before A (default), round-robin between B and C; A once they
    have none left. Every kind."""
    stage(store, "A", outbox=10, spawns=4, timers=4)
    stage(store, "B", outbox=10, spawns=1, timers=1)
    stage(store, "C", outbox=10, spawns=1, timers=1)
    store.set_flow("B", priority=5)
    store.set_flow("C", priority=5)
    assert keys(store.claim_outbox("w1", limit=12)) == {"B": 6, "C": 6}
    assert keys(store.claim_outbox("w1", limit=12)) == {"B": 4, "C": 4, "A": 4}
    assert keys(store.claim_spawns("w1", limit=3)) == {"B": 1, "C": 1, "A": 1}
    assert keys(store.claim_due_timers("w1", NOW, limit=3)) == {"B": 1, "C": 1, "A": 1}


def test_a_higher_priority_key_at_its_limit_leaves_the_claim_to_the_others(store: Any) -> None:
    """H (priority 5, concurrency 1) is served first, but only within its limit: the rest
    of a claim goes to the keys after it."""
    stage(store, "H", outbox=10, spawns=3)
    stage(store, "A", outbox=10, spawns=3)
    store.set_flow("H", priority=5, concurrency=1)
    assert keys(store.claim_outbox("w1", limit=5)) == {"H": 1, "A": 4}
    assert keys(store.claim_spawns("w1", limit=5)) == {"A": 3}


def test_a_negative_priority_comes_after_the_keys_without_settings(store: Any) -> None:
    """L (priority -1, its items written first) waits for A and B (no settings)."""
    stage(store, "L", outbox=10, spawns=3, timers=3)
    stage(store, "A", outbox=3, spawns=1, timers=1)
    stage(store, "B", outbox=3, spawns=1, timers=1)
    store.set_flow("L", priority=-1)
    assert keys(store.claim_outbox("w1", limit=8)) == {"A": 3, "B": 3, "L": 2}
    work = store.claim_work("w2", NOW, limit=3)
    assert keys(work.spawns) == {"A": 1, "B": 1, "L": 1}
    assert keys(work.timers) == {"A": 1, "B": 1, "L": 1}


# --- pause ---


def test_a_paused_keys_items_are_never_claimed(store: Any) -> None:
    """P's outbox entries, spawns and due timers stay put while it is paused, by every claim
    of every worker; Q's go as ever. flows() shows them pending."""
    stage(store, "P", outbox=3, spawns=2, timers=2)
    stage(store, "Q", outbox=1, spawns=1, timers=1)
    paused = store.pause_flow("P")
    assert (paused.paused, paused.pending, paused.held) == (True, 7, 0)
    work = store.claim_work("w1", NOW, limit=100)
    assert keys(every(work)) == {"Q": 3}
    assert work.ahead == NOTHING
    assert store.claim_outbox("w2") == []
    assert store.claim_spawns("w2") == []
    assert store.claim_due_timers("w2", NOW) == []
    assert every(store.claim_work("w3", NOW)) == []
    assert flow(store, "P") == Flow("P", 0, None, True, None, 7, 0)


def test_pause_and_resume_keep_the_other_settings(store: Any) -> None:
    """pause_flow and resume_flow toggle ``paused`` alone. A key with no settings paused gets
    the defaults, paused; resuming a key with none returns None and writes nothing."""
    store.set_flow("P", priority=3, concurrency=4, rate=(10, 60.0))
    expected = Flow("P", 3, 4, True, (10, 60.0), 0, 0)
    assert store.pause_flow("P") == expected
    assert store.flows() == [expected]
    assert store.pause_flow("P") == expected  # again: the same
    assert store.resume_flow("P") == expected._replace(paused=False)
    assert store.flows() == [expected._replace(paused=False)]
    assert store.resume_flow("nobody") is None
    assert store.flows() == [expected._replace(paused=False)]
    assert store.pause_flow("N") == Flow("N", 0, None, True, None, 0, 0)
    assert [f.key for f in store.flows()] == ["N", "P"]
    assert store.resume_flow("N") == Flow("N", 0, None, False, None, 0, 0)


def test_due_timers_of_a_paused_key_fire_once_it_is_resumed(store: Any) -> None:
    """A relay passes over a paused key's due timers (they wait, not dropped nor dead) and
    fires them at its first round after the resume."""
    stage(store, "P", timers=2)
    store.pause_flow("P")
    fired: list[DueTimer] = []
    assert once(store, "w1", on_timer=fired.append) == 0
    assert once(store, "w1", on_timer=fired.append) == 0
    assert len(store.due_timers(NOW)) == 2 and store.dead_letters() == []
    store.resume_flow("P")
    assert once(store, "w1", on_timer=fired.append) == 2
    assert [(key_of(t), t.path) for t in fired] == [("P", "p0"), ("P", "p1")]
    assert store.due_timers(NOW) == []


def test_peek_work_sees_nothing_while_only_paused_work_is_left(store: Any) -> None:
    """peek_work reports only what a claim could take: nothing while P's items are all that
    is left, every kind once P is resumed, nothing again once it is paused again."""
    stage(store, "P", outbox=1, spawns=1, timers=1)
    stage(store, "Q", outbox=1)
    store.pause_flow("P")
    assert store.peek_work(NOW).outbox  # Q's entry
    assert keys(every(store.claim_work("w1", NOW))) == {"Q": 1}
    assert store.peek_work(NOW) == NOTHING
    stage(store, "P", timers=1, fire_at=2 * NOW)  # not due: still told, as the next timer
    assert store.peek_work(NOW) == WorkAhead(False, False, False, 2 * NOW)
    store.resume_flow("P")
    assert store.peek_work(NOW) == WorkAhead(True, True, True, 2 * NOW)
    store.pause_flow("P")
    assert store.peek_work(NOW) == WorkAhead(False, False, False, 2 * NOW)


# --- concurrency ---


def test_a_concurrency_limit_counts_every_kind_of_the_key_together(store: Any) -> None:
    """K (concurrency 3) with 2 entries, 2 spawns, 2 due timers: one claim_work takes its 2
    entries and 1 spawn, no timer, while L's all go; another worker then gets none of K's;
    after an ack there is room for one more."""
    stage(store, "K", outbox=2, spawns=2, timers=2)
    stage(store, "L", outbox=2, spawns=2, timers=2)
    store.set_flow("K", concurrency=3)
    work = store.claim_work("w1", NOW, limit=10)
    assert (keys(work.outbox), keys(work.spawns), keys(work.timers)) == (
        {"K": 2, "L": 2},
        {"K": 1, "L": 2},
        {"L": 2},
    )
    assert flow(store, "K") == Flow("K", 0, 3, False, None, 3, 3)
    assert work.ahead == NOTHING  # L's all claimed, K at its limit
    assert every(store.claim_work("w2", NOW, limit=10)) == []
    assert store.claim_due_timers("w2", NOW) == []
    store.ack([work.outbox[0]])
    assert store.peek_work(NOW) == WorkAhead(False, True, True, None)
    (timer,) = store.claim_due_timers("w2", NOW)
    assert key_of(timer) == "K"
    assert store.claim_spawns("w2") == []
    assert flow(store, "K") == Flow("K", 0, 3, False, None, 2, 3)


def test_an_item_failed_and_waiting_for_its_retry_is_not_held(store: Any) -> None:
    """A failed item waits for its retry held by nobody: it leaves its key's room."""
    stage(store, "K", outbox=3)
    store.set_flow("K", concurrency=1)
    (first,) = store.claim_outbox("w1", limit=10)
    assert store.claim_outbox("w1", limit=10) == []
    assert store.fail("w1", [first], error="boom", retry_in=600.0) == 1
    assert flow(store, "K") == Flow("K", 0, 1, False, None, 3, 0)
    (second,) = store.claim_outbox("w1", limit=10)
    assert second.seq > first.seq


def test_concurrency_zero_holds_nothing(store: Any) -> None:
    """concurrency=0: nothing of the key is claimed, as paused, and peek_work says so."""
    stage(store, "Z", outbox=2, spawns=1, timers=1)
    assert store.set_flow("Z", concurrency=0) == Flow("Z", 0, 0, False, None, 4, 0)
    assert every(store.claim_work("w1", NOW)) == []
    assert store.peek_work(NOW) == NOTHING
    store.set_flow("Z", concurrency=1)
    assert len(every(store.claim_work("w1", NOW))) == 1


def test_items_held_before_the_key_got_a_limit_count_against_it(store: Any) -> None:
    """Three of K's entries claimed while K had no settings, then a limit of 2: K is over
    it, nothing more is claimed until two of them are acked (or their leases run out)."""
    stage(store, "K", outbox=6)
    held = store.claim_outbox("w1", limit=3)
    assert store.set_flow("K", concurrency=2).held == 3
    assert store.claim_outbox("w2") == []
    store.ack(held[:1])
    assert store.claim_outbox("w2") == []  # 2 held: at the limit
    store.ack(held[1:])
    assert len(store.claim_outbox("w2")) == 2


def test_a_lease_that_ran_out_gives_its_room_back(store: Any) -> None:
    """A worker that died holding K's item (concurrency 1): once its lease ran out the item
    is not held and is claimed again, before K's later ones."""
    stage(store, "K", outbox=2)
    store.set_flow("K", concurrency=1)
    (lost,) = store.claim_outbox("w1", lease=30.0)
    assert store.claim_outbox("w2") == []
    elapse(store, 30.0)
    assert flow(store, "K") == Flow("K", 0, 1, False, None, 2, 0)
    assert [e.seq for e in store.claim_outbox("w2")] == [lost.seq]


CLAIM: dict[str, Callable[..., list[Any]]] = {
    "outbox": lambda store, worker, **options: store.claim_outbox(worker, **options),
    "spawn": lambda store, worker, **options: store.claim_spawns(worker, **options),
    "timer": lambda store, worker, **options: store.claim_due_timers(worker, NOW, **options),
}


def at_max_attempts(store: Any, how: str, item: str) -> Any:
    """Key A with 5 items of kind ``item`` (older, or sooner due) that no claim may take
    (``how``: A paused, or at its limit, 1, held by w9), and B's one item claimed and
    failed once: at max_attempts 1. Returns B's item."""
    counts = {"outbox": 0, "spawns": 0, "timers": 0}
    counts[{"outbox": "outbox", "spawn": "spawns", "timer": "timers"}[item]] = 5
    stage(store, "A", **counts, fire_at=1.0)
    counts = {name: min(count, 1) for name, count in counts.items()}
    stage(store, "B", **counts, fire_at=10.0)
    claim = CLAIM[item]
    if how == "paused":
        store.pause_flow("A")
    else:
        store.set_flow("A", concurrency=1)
        claim(store, "w9", limit=1)
    (mine,) = claim(store, "w1", max_attempts=1)
    assert key_of(mine) == "B"
    store.fail("w1", [mine], error="boom", retry_in=0.0)
    return mine


@pytest.mark.parametrize("item", list(CLAIM))
@pytest.mark.parametrize("how", ["paused", "at-limit"])
def test_an_item_at_max_attempts_behind_work_no_claim_may_take_becomes_dead(
    store: Any, how: str, item: str
) -> None:
    """A claim at max_attempts does not hand out B's item (its attempts reached it): it
    makes it a dead letter, however many of A's older items it may not take. Every kind."""
    mine = at_max_attempts(store, how, item)
    assert CLAIM[item](store, "w1", limit=2, max_attempts=1) == []
    # Before 59212e8 the sweep looked at the oldest `limit` claimable rows, flows ignored:
    # A's items filled it, and B's was neither claimed nor made dead, claim after claim.
    assert [(d.kind, d.item) for d in store.dead_letters()] == [(item, mine)]
    assert store.peek_work(NOW) == NOTHING


@pytest.mark.parametrize("kind", ["libsql-file", "sqlite-file"])
@pytest.mark.parametrize("how", ["paused", "at-limit"])
@pytest.mark.parametrize("item", list(CLAIM))
def test_a_relay_does_not_spin_on_an_item_at_max_attempts(store: Any, how: str, item: str) -> None:
    """A relay (max_attempts 1, 2 items a round, poll 30 s) over the state above: it makes
    B's item a dead letter and sleeps, a few claims in half a second, not hundreds."""
    at_max_attempts(store, how, item)
    claims: list[float] = []
    claim_work = store.claim_work

    def counted(*args: Any, **options: Any) -> Any:
        claims.append(time.monotonic())
        return claim_work(*args, **options)

    store.claim_work = counted  # the relay's rounds call the store's claim_work
    handlers = {f"on_{kind}": lambda item: None for kind in ("outbox", "spawn", "timer")}
    relay = Relay(store, "w1", **handlers, batch=2, max_attempts=1, poll=30.0)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.5)
    finally:
        relay.stop()
        thread.join(WAIT)
    assert not thread.is_alive()
    # Before 59212e8: hundreds of claims (claim_work's ahead said B's item was claimable).
    assert len(claims) <= 5, f"{len(claims)} claims in 0.5 s"
    assert len(store.dead_letters()) == 1


# --- rate ---


def test_a_rate_counts_claims_of_every_kind_and_acks_give_none_back(store: Any) -> None:
    """rate=(3, 600): three claims of K's items, of any kind, in the window; acks do not
    make room. Once the window is over (its claims moved back), three more."""
    stage(store, "K", outbox=4, spawns=4, timers=4)
    store.set_flow("K", rate=(3, 600.0))
    timers = store.claim_due_timers("w1", NOW, limit=2)
    assert len(timers) == 2
    assert len(store.claim_spawns("w1", limit=5)) == 1
    assert store.claim_outbox("w1") == []
    store.ack(timers)
    assert every(store.claim_work("w2", NOW)) == []
    assert store.peek_work(NOW) == NOTHING
    db = raw(store)
    db.execute("UPDATE harel_flow_claims SET claimed_at = claimed_at - 601")
    db.commit()
    store.sync()
    work = store.claim_work("w2", NOW, limit=10)
    assert (len(work.outbox), len(work.spawns), len(work.timers)) == (3, 0, 0)


def test_a_rate_window_passes_on_the_clock(store: Any) -> None:
    """rate=(2, 0.5): two claims, then none, then two once half a second went by."""
    stage(store, "R", outbox=6)
    store.set_flow("R", rate=(2, 0.5))
    first = store.claim_outbox("w1", limit=10)
    assert len(first) == 2
    store.ack(first)
    assert store.claim_outbox("w1", limit=10) == []
    time.sleep(0.6)
    assert len(store.claim_outbox("w1", limit=10)) == 2
    assert store.claim_outbox("w1", limit=10) == []


# --- settings: set, clear, list, refuse ---


def test_set_flow_replaces_every_setting(store: Any) -> None:
    """A second set_flow leaves nothing of the first: the defaults it does not name are the
    defaults, not what the key had."""
    stage(store, "K", outbox=5)
    full = store.set_flow("K", priority=2, concurrency=3, paused=True, rate=(5, 10.0))
    assert full == Flow("K", 2, 3, True, (5, 10.0), 5, 0)
    assert store.set_flow("K", concurrency=1) == Flow("K", 0, 1, False, None, 5, 0)
    assert store.set_flow("K") == Flow("K", 0, None, False, None, 5, 0)
    assert store.flows() == [Flow("K", 0, None, False, None, 5, 0)]
    assert len(store.claim_outbox("w1")) == 5  # no limit left


def test_clear_flow_restores_the_defaults(store: Any) -> None:
    """clear_flow: True if the key had settings; it is no longer listed and its items are
    claimed as any key's (here: no longer paused nor limited)."""
    stage(store, "K", outbox=5)
    store.set_flow("K", priority=-5, concurrency=1, rate=(1, 600.0))
    assert len(store.claim_outbox("w1")) == 1
    assert store.claim_outbox("w1") == []
    assert store.clear_flow("K") is True
    assert store.flows() == []
    assert store.clear_flow("K") is False
    assert store.clear_flow("never") is False
    assert len(store.claim_outbox("w1", limit=2)) == 2
    # Set again: the rate's window starts afresh (the claims counted before are forgotten).
    store.set_flow("K", rate=(1, 600.0))
    assert len(store.claim_outbox("w1")) == 1
    assert store.claim_outbox("w1") == []


def test_flows_counts_pending_and_held_items_of_every_kind(store: Any) -> None:
    """pending: outbox entries and spawns neither held nor dead (a failed one waiting for
    its retry included) and due timers not held; held: claimed under a live lease. A timer
    not due yet is neither; another key's items are not counted."""
    stage(store, "K", outbox=3, spawns=2, timers=2)
    stage(store, "K", timers=1, fire_at=4e9)  # not due (year 2096)
    stage(store, "L", outbox=4, spawns=4, timers=4)
    store.set_flow("K")
    assert flow(store, "K") == Flow("K", 0, None, False, None, 7, 0)
    (entry,) = store.claim_outbox("w1", limit=1)
    (spawned,) = store.claim_spawns("w1", limit=1)
    timers = store.claim_due_timers("w1", NOW, limit=1)
    assert flow(store, "K") == Flow("K", 0, None, False, None, 4, 3)
    store.fail("w1", [entry], error="later", retry_in=600.0)
    assert flow(store, "K") == Flow("K", 0, None, False, None, 5, 2)
    store.ack([spawned, *timers])
    assert flow(store, "K") == Flow("K", 0, None, False, None, 5, 0)
    # The failed entry, once dead (claimed at its max_attempts), is pending no more.
    elapse(store, 600.0)
    store.claim_outbox("w2", limit=10, max_attempts=1)
    assert [d.item.seq for d in store.dead_letters(kind="outbox")] == [entry.seq]
    assert flow(store, "K") == Flow("K", 0, None, False, None, 2, 2)


BAD_SETTINGS: list[tuple[Callable[[Any], object], type[Exception]]] = [
    (lambda s: s.set_flow("K", concurrency=-1), ValueError),
    (lambda s: s.set_flow("K", concurrency=1.0), TypeError),
    (lambda s: s.set_flow("K", concurrency="2"), TypeError),
    (lambda s: s.set_flow("K", concurrency=True), TypeError),
    (lambda s: s.set_flow("K", concurrency=2**63), ValueError),
    (lambda s: s.set_flow("K", priority=True), TypeError),
    (lambda s: s.set_flow("K", priority=1.5), TypeError),
    (lambda s: s.set_flow("K", priority=-(2**63) - 1), ValueError),
    (lambda s: s.set_flow("K", paused=1), TypeError),
    (lambda s: s.set_flow("K", rate=(0, 1.0)), ValueError),
    (lambda s: s.set_flow("K", rate=(-1, 1.0)), ValueError),
    (lambda s: s.set_flow("K", rate=(1.0, 1.0)), TypeError),
    (lambda s: s.set_flow("K", rate=(True, 1.0)), TypeError),
    (lambda s: s.set_flow("K", rate=(1, 0)), ValueError),
    (lambda s: s.set_flow("K", rate=(1, -1.0)), ValueError),
    (lambda s: s.set_flow("K", rate=(1, math.inf)), ValueError),
    (lambda s: s.set_flow("K", rate=(1, math.nan)), ValueError),
    (lambda s: s.set_flow("K", rate=(1, True)), TypeError),
    (lambda s: s.set_flow("K", rate=(1, "1")), TypeError),
    (lambda s: s.set_flow("K", rate=(1,)), TypeError),
    (lambda s: s.set_flow("K", rate=(1, 1.0, 1)), TypeError),
    (lambda s: s.set_flow("K", rate="2/1"), TypeError),
    (lambda s: s.set_flow("K", rate=2), TypeError),
    (lambda s: s.set_flow(None), TypeError),
    (lambda s: s.set_flow(1), TypeError),
    (lambda s: s.set_flow(b"K"), TypeError),
    (lambda s: s.set_flow("K\x00L"), ValueError),
    (lambda s: s.set_flow("\ud800"), ValueError),
    (lambda s: s.set_flow("K" * (MAX_ID_LENGTH + 1)), ValueError),
    (lambda s: s.pause_flow(None), TypeError),
    (lambda s: s.pause_flow("K\x00"), ValueError),
    (lambda s: s.resume_flow(7), TypeError),
    (lambda s: s.resume_flow("\x00"), ValueError),
    (lambda s: s.clear_flow(None), TypeError),
    (lambda s: s.clear_flow("K\x00"), ValueError),
    (lambda s: s.release_worker(""), ValueError),
    (lambda s: s.release_worker(None), TypeError),
    (lambda s: s.release_worker("w\x00"), ValueError),
]


def test_bad_settings_raise_and_write_nothing(store: Any) -> None:
    """Every bad value is a TypeError or ValueError before anything is written: K keeps its
    settings (a key that has settings, paused: a bad resume does not resume it), and no key
    appears; the held item stays held."""
    stage(store, "K", outbox=2)
    store.set_flow("K", priority=1, concurrency=2, paused=False, rate=(3, 4.0))
    store.claim_outbox("w", limit=1)
    store.pause_flow("K")
    before = store.flows()
    assert before == [Flow("K", 1, 2, True, (3, 4.0), 1, 1)]
    for call, error in BAD_SETTINGS:
        with pytest.raises(error):
            call(store)
        assert store.flows() == before, call
    assert [h.held for h in store.workers()] == [{"outbox": 1}]


# --- the flow_key function ---


def tenant(execution_id: str) -> str:
    """A flow key function: the tenant before the first ":"."""
    return execution_id.partition(":")[0]


def test_a_flow_key_function_gives_each_item_its_key(open_store: Any) -> None:
    """flow_key(execution id) keys each item: an entry by its target, a spawn by its child,
    a timer by its execution; it is not called for an entry with no target (key "")."""
    calls: list[Any] = []

    def by_tenant(execution_id: str) -> str:
        calls.append(execution_id)
        return tenant(execution_id)

    store = open_store(flow_key=by_tenant)
    store.commit(
        Execution(id="t1:order.1", definition_id="d"),
        [("t1:a.b", Event(name="go")), ("t2:x", Event(name="go")), (None, Event(name="out"))],
        spawns=[("t2:kid.1", "root", {})],
        timers=[TimerOp.schedule("p", 1.0)],
    )
    assert None not in calls
    assert sorted(set(calls)) == ["t1:a.b", "t1:order.1", "t2:kid.1", "t2:x"]
    for key in ("t1", "t2", ""):
        store.pause_flow(key)
    assert [(f.key, f.pending) for f in store.flows()] == [("", 1), ("t1", 2), ("t2", 2)]
    assert store.peek_work(NOW) == NOTHING
    store.resume_flow("t2")
    work = store.claim_work("w1", NOW)
    assert [e.target_id for e in work.outbox] == ["t2:x"]
    assert [s.child_id for s in work.spawns] == ["t2:kid.1"]
    assert work.timers == []
    store.resume_flow("t1")
    assert [t.execution_id for t in store.claim_due_timers("w1", NOW)] == ["t1:order.1"]


FAILING_KEYS: list[tuple[Callable[[str], Any], type[Exception]]] = [
    (lambda eid: 42, TypeError),
    (lambda eid: None, TypeError),
    (lambda eid: b"k", TypeError),
    (lambda eid: "k\x00", ValueError),
    (lambda eid: "k" * (MAX_ID_LENGTH + 1), ValueError),
    (lambda eid: 1 / 0, ZeroDivisionError),
]


def test_a_flow_key_function_that_fails_fails_the_commit_and_writes_nothing(
    open_store: Any,
) -> None:
    """A flow_key function returning no valid key (or raising) fails the commit before
    anything is written: no execution, no entry, no spawn, no timer. Only items that call
    it fail: a commit of no targeted item goes through."""
    for n, (function, error) in enumerate(FAILING_KEYS):
        store = open_store(flow_key=function)
        for emits, spawns, timers in [
            ([("t", Event(name="go"))], [], []),
            ([], [("kid", "root", {})], []),
            ([], [], [TimerOp.schedule("p", 1.0)]),
        ]:
            exe = Execution(id=f"exe{n}", definition_id="d")
            with pytest.raises(error):
                store.commit(exe, emits, spawns=spawns, timers=timers)
            assert store.load(f"exe{n}") is None, (n, emits, spawns, timers)
        assert store.pending_outbox() == [] and store.pending_spawns() == []
        assert store.due_timers(NOW) == []
        store.commit(Execution(id=f"exe{n}", definition_id="d"), [(None, Event(name="out"))])
        assert [e.target_id for e in store.claim_outbox("w1")] == [None]
        store.ack_outbox(store.pending_outbox()[0].seq)
        store.close()  # a replica's file is one store's at a time


def test_a_commit_that_only_cancels_timers_calls_no_flow_key_function(open_store: Any) -> None:
    """Cancelling a timer writes no item, so it needs no key: a failing flow_key function
    does not fail such a commit (nor one of no item at all)."""
    store = open_store(flow_key=lambda eid: 1 / 0)
    exe = Execution(id="exe", definition_id="d")
    store.commit(exe, [], timers=[TimerOp.cancel("p")])
    store.commit(exe, [])
    assert store.load("exe").version == 2  # type: ignore[union-attr]


def test_a_flow_key_that_is_not_a_function_is_refused_at_open(open_store: Any) -> None:
    with pytest.raises(TypeError, match="flow_key"):
        open_store(flow_key="tenant")


# --- workers and failover ---


def test_workers_lists_what_each_worker_holds(store: Any) -> None:
    """workers(): each worker with items under a live lease, its count of each kind (kinds
    it holds none of absent), its latest lease's end on the database's clock. A failed item
    and a lease that ran out are nobody's."""
    stage(store, "K", outbox=4, spawns=2, timers=2)
    assert store.workers() == []
    before = time.time()
    store.claim_outbox("w1", limit=2, lease=10.0)
    store.claim_spawns("w1", limit=1, lease=30.0)
    store.claim_due_timers("w1", NOW, limit=1, lease=20.0)
    (failed,) = store.claim_outbox("w2", limit=1, lease=60.0)
    store.claim_outbox("w2", limit=1, lease=60.0)
    after = time.time()
    w1, w2 = store.workers()
    assert isinstance(w1, WorkerHold)
    assert (w1.worker, w1.held) == ("w1", {"outbox": 2, "spawn": 1, "timer": 1})
    assert (w2.worker, w2.held) == ("w2", {"outbox": 2})
    assert before + 30 - 1 < w1.lease_until < after + 30 + 1  # its spawn's: the latest
    assert before + 60 - 1 < w2.lease_until < after + 60 + 1
    store.fail("w2", [failed], error="later", retry_in=600.0)
    assert [(h.worker, h.held) for h in store.workers()] == [
        ("w1", {"outbox": 2, "spawn": 1, "timer": 1}),
        ("w2", {"outbox": 1}),
    ]
    elapse(store, 30.0)
    assert [(h.worker, h.held) for h in store.workers()] == [("w2", {"outbox": 1})]


def test_release_worker_gives_back_every_item_and_its_attempt(store: Any) -> None:
    """release_worker(W): every item W holds, every kind, claimable at once by anyone, the
    claim's attempt given back (a failed item waiting for its retry, and another worker's,
    are not W's)."""
    stage(store, "K", outbox=4, spawns=1, timers=1)
    held = every(store.claim_work("w1", NOW, limit=2))
    assert len(held) == 4
    (failed,) = store.claim_outbox("w1", limit=1)
    store.fail("w1", [failed], error="later", retry_in=600.0)
    assert len(store.claim_outbox("w2", limit=1)) == 1
    assert store.release_worker("w1") == 4
    assert store.attempts_of(held) == [0, 0, 0, 0]
    assert store.attempts_of([failed]) == [1]
    assert [h.worker for h in store.workers()] == ["w2"]
    assert sorted(map(repr, every(store.claim_work("w3", NOW, limit=10)))) == sorted(
        map(repr, held)
    )
    assert store.release_worker("w1") == 0
    assert store.release_worker("nobody") == 0


def coroutine(handler: Callable[[Any], object]) -> Callable[[Any], Any]:
    async def handle(item: Any) -> object:
        return handler(item)

    return handle


def once(store: Any, worker: str, **handlers: Any) -> int:
    """One round of a relay of ``store`` as ``worker`` (`Relay`, or `AsyncRelay` on the
    async store's loop): how many items it handled."""
    aio, loop = getattr(store, "_store", None), getattr(store, "_loop", None)
    if aio is None:
        return int(Relay(store, worker, **handlers).run_once())
    relay = AsyncRelay(aio, worker, **{name: coroutine(h) for name, h in handlers.items()})
    return int(loop.run_until_complete(relay.run_once()))


def run_relay(store: Any, worker: str, done: Callable[[], bool], **options: Any) -> float:
    """Run a relay of ``store`` as ``worker`` (its ``run``: `Relay` in a thread, or
    `AsyncRelay` on the async store's loop), poll 30 s, ``options`` (its handlers written as
    plain functions), until ``done()``; stop it; return the seconds it took (failing after
    WAIT)."""
    aio, loop = getattr(store, "_store", None), getattr(store, "_loop", None)
    start = time.monotonic()
    if aio is None:
        relay = Relay(store, worker, poll=30.0, **options)
        thread = threading.Thread(target=relay.run, daemon=True)
        thread.start()
        try:
            while not done():
                assert time.monotonic() - start < WAIT, f"the relay {worker} never finished"
                time.sleep(0.002)
            return time.monotonic() - start
        finally:
            relay.stop()
            thread.join(WAIT)
            assert not thread.is_alive()

    async def main() -> float:
        wrapped = {k: coroutine(v) if k.startswith("on_") else v for k, v in options.items()}
        relay = AsyncRelay(aio, worker, poll=30.0, **wrapped)
        task = asyncio.ensure_future(relay.run())
        try:
            while not done():
                assert time.monotonic() - start < WAIT, f"the relay {worker} never finished"
                await asyncio.sleep(0.002)
            return time.monotonic() - start
        finally:
            relay.stop()
            await asyncio.wait_for(task, WAIT)

    assert loop is not None
    return float(loop.run_until_complete(main()))


def test_a_relay_started_under_a_worker_id_first_takes_back_what_it_held(store: Any) -> None:
    """Items held under 30 s leases by w1 (a process that died): a relay started as w1
    handles them at once; run_once of another worker id gets none of them."""
    stage(store, "K", outbox=2, spawns=1, timers=1)
    held = every(store.claim_work("w1", NOW, lease=30.0))
    assert len(held) == 4
    handled: list[Any] = []
    handlers = {"on_outbox": handled.append, "on_spawn": handled.append}
    handlers["on_timer"] = handled.append
    assert once(store, "w2", **handlers) == 0
    took = run_relay(store, "w1", lambda: len(handled) == 4, **handlers)
    assert took < 5.0
    assert sorted(map(repr, handled)) == sorted(map(repr, held))
    assert store.workers() == []


class Idle:
    """A `Relay` (poll 30 s) of a sync store run in a thread, and what it handled."""

    def __init__(self, store: Any) -> None:
        self.handled: list[OutboxEntry] = []
        self.relay = Relay(store, "w1", on_outbox=self.handled.append, poll=30.0)
        self.thread = threading.Thread(target=self.relay.run, daemon=True)
        self.thread.start()
        time.sleep(0.3)  # its first rounds found nothing it may claim: it waits

    def woken(self, count: int, by: str) -> None:
        """``count`` items handled within 1.5 s (the change ``by`` woke the relay)."""
        changed = time.monotonic()
        while len(self.handled) < count:
            took = time.monotonic() - changed
            assert took < 1.5, f"{by}: {len(self.handled)} of {count} handled after {took:.2f} s"
            time.sleep(0.002)

    def stop(self) -> None:
        self.relay.stop()
        self.thread.join(WAIT)
        assert not self.thread.is_alive()


SYNC_KINDS = ["libsql-file", "sqlite-file", "libsql-remote", "libsql-replica"]


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_an_idle_relay_wakes_when_a_change_of_flows_makes_room(store: Any) -> None:
    """A relay whose only work is K's, paused, at its limit or held by another worker,
    sleeps; a change of flows of this process (a resume, a higher limit, a release_worker
    of the other worker) wakes it: it handles what is there within 1.5 s."""
    stage(store, "K", outbox=1)
    store.pause_flow("K")
    idle = Idle(store)
    try:
        assert idle.handled == []
        store.resume_flow("K")
        idle.woken(1, "a resume")
        store.set_flow("K", concurrency=0)
        stage(store, "K", outbox=1)
        time.sleep(0.3)
        assert len(idle.handled) == 1
        store.set_flow("K", concurrency=1)
        idle.woken(2, "a higher limit")
    finally:
        idle.stop()
    stage(store, "K", outbox=1)
    (held,) = store.claim_outbox("w9")
    idle = Idle(store)
    try:
        assert len(idle.handled) == 0
        assert store.release_worker("w9") == 1
        idle.woken(1, "a release_worker")
    finally:
        idle.stop()
    assert [e.seq for e in idle.handled] == [held.seq]


@pytest.mark.parametrize("kind", SYNC_KINDS)
def test_an_ack_that_makes_room_wakes_a_relay_at_the_limit(store: Any) -> None:
    """K (concurrency 1): w9 holds one of its items, so a relay with only K's work sleeps;
    w9's ack makes room, and the relay handles K's other items within 1.5 s (not at its
    poll, 30 s)."""
    stage(store, "K", outbox=3)
    store.set_flow("K", concurrency=1)
    (held,) = store.claim_outbox("w9")
    idle = Idle(store)
    try:
        assert idle.handled == []
        store.ack([held])
        # Before 59212e8 a server's watch heard inserts only: on a server (and a replica)
        # the relay slept until its poll.
        idle.woken(2, "an ack of w9's item")
    finally:
        idle.stop()


def test_a_relay_restarted_under_its_id_keeps_each_attempt(store: Any) -> None:
    """The release a relay makes as it starts keeps each claim's attempt (a poison item that
    killed its worker still reaches max_attempts): w1 held K's entry (its first attempt) and
    died; a relay restarted as w1 with max_attempts=1 makes it a dead letter rather than
    handle it. (release_worker, an operator's, gives the attempt back: tested above.)"""
    stage(store, "K", outbox=1)
    (entry,) = store.claim_outbox("w1", lease=30.0)
    handled: list[OutboxEntry] = []
    until = time.monotonic() + 0.5
    run_relay(
        store, "w1", lambda: time.monotonic() > until, on_outbox=handled.append, max_attempts=1
    )
    assert handled == []
    assert [(d.item.seq, d.attempts) for d in store.dead_letters()] == [(entry.seq, 1)]
    assert store.workers() == []


# --- across processes ---

DRIVERS = {"libsql": LibsqlStore, "sqlite": SqliteStore}


def readline(child: subprocess.Popen[str], errors: Path) -> str:
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.wait(WAIT)
        pytest.fail(f"the worker said nothing:\n{errors.read_text()}")
    return line


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_a_relay_restarted_under_its_id_handles_what_the_killed_one_held(
    driver: str, tmp_path: Path
) -> None:
    """A relay process claims every item under 30 s leases and is killed -9 holding them.
    They stay held (another worker id's relay gets none); a relay started under the dead
    one's id handles them within a second or so, not 30."""
    db = tmp_path / "flows.db"
    with DRIVERS[driver](db) as store:
        stage(store, "K", outbox=3, spawns=1, timers=1)
        errors = tmp_path / "stderr"
        with errors.open("w") as err:
            child = spawn("flow", "hold", driver, str(db), "w1", stdout=subprocess.PIPE, stderr=err)
            try:
                assert readline(child, errors) == "held 5\n"
            finally:
                child.send_signal(signal.SIGKILL)
                child.wait()
                assert child.stdout is not None
                child.stdout.close()
        assert child.returncode == -signal.SIGKILL
        assert [(h.worker, h.held) for h in store.workers()] == [
            ("w1", {"outbox": 3, "spawn": 1, "timer": 1})
        ]
        handled: list[Any] = []
        handlers = {"on_outbox": handled.append, "on_spawn": handled.append}
        handlers["on_timer"] = handled.append
        assert Relay(store, "w2", **handlers).run_once() == 0
        assert every(store.claim_work("w3", NOW)) == []
        took = run_relay(store, "w1", lambda: len(handled) == 5, **handlers)
        assert took < 5.0, f"the restarted relay took {took:.1f} s"
        assert keys(handled) == {"K": 5} and store.workers() == []


def overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant (an end before a start at the same time)."""
    marks = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    most = now = 0
    for _, step in marks:
        now += step
        most = max(most, now)
    return most


@pytest.mark.slow
@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_a_concurrency_limit_holds_across_processes(driver: str, tmp_path: Path) -> None:
    """Four processes claim, handle (30 ms each) and ack K's 40 items (concurrency 2) as
    fast as they can: at no instant are more than 2 held, by their own logs (each interval
    within the time the database had the item held) and by flows() sampled meanwhile; and
    2 is reached. Each item handled once."""
    db, go = tmp_path / "flows.db", tmp_path / "go"
    with DRIVERS[driver](db) as store:
        stage(store, "K", outbox=20, spawns=10, timers=10)
        store.set_flow("K", concurrency=2)
        children = []
        for n in range(4):
            log, err = tmp_path / f"w{n}.log", tmp_path / f"w{n}.err"
            args = ("limit", driver, str(db), f"w{n}", "K", str(log), str(go))
            with err.open("w") as errors:
                children.append(spawn("flow", *args, stdout=subprocess.PIPE, stderr=errors))
        try:
            for n, child in enumerate(children):
                assert readline(child, tmp_path / f"w{n}.err") == "ready\n"
            go.touch()
            sampled: list[int] = []
            deadline = time.monotonic() + 90
            while any(child.poll() is None for child in children):
                assert time.monotonic() < deadline, "the workers never finished"
                (k,) = store.flows()
                sampled.append(k.held)
                time.sleep(0.001)
            outs = [child.communicate(timeout=WAIT)[0] for child in children]
        finally:
            for child in children:
                if child.poll() is None:
                    child.kill()
                    child.communicate()
        for n, child in enumerate(children):
            assert child.returncode == 0, (tmp_path / f"w{n}.err").read_text()
        assert sum(int(out.split()[-1]) for out in outs) == 40
        lines = [
            line.split()
            for n in range(4)
            for line in (tmp_path / f"w{n}.log").read_text().splitlines()
        ]
        assert Counter(kind for kind, *_ in lines) == {"outbox": 20, "spawn": 10, "timer": 10}
        assert len({(kind, item) for kind, item, *_ in lines}) == 40  # each one once
        assert overlap([(float(start), float(end)) for *_, start, end in lines]) == 2
        assert max(sampled) == 2, Counter(sampled)
        assert store.flows() == [Flow("K", 0, 2, False, None, 0, 0)]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["libsql-file", "sqlite-file", "libsql-remote"])
def test_a_resume_from_another_process_wakes_a_waiting_relay(
    store: Any, kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A relay (poll 30 s) idle with only a paused key's items to do: another process
    resumes the key, and the relay handles them within 1.5 s of that commit."""
    if kind == "libsql-remote":
        server = request.getfixturevalue("sqld")
        database = server.url
        request.getfixturevalue("monkeypatch").setenv("HAREL_FLOW_TOKEN", server.token)
    else:
        database = str(tmp_path / "state.db")  # conftest's open_store
    stage(store, "P", outbox=2)
    store.pause_flow("P")
    handled: list[OutboxEntry] = []
    relay = Relay(store, "w1", on_outbox=handled.append, poll=30.0)
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        time.sleep(0.3)  # its first rounds found nothing to claim: it waits
        assert handled == []
        errors = tmp_path / "stderr"
        driver = kind.split("-")[0]
        with errors.open("w") as err:
            child = spawn(
                "flow", "resume", driver, database, "P", stdout=subprocess.PIPE, stderr=err
            )
            assert readline(child, errors) == "resumed\n"
            resumed = time.monotonic()
            child.communicate(timeout=WAIT)
        # Before 59212e8 a server's watch did not hear a change of flows: on a server the
        # relay slept until its poll ("a change of flows is a commit that wakes relays").
        while len(handled) < 2:
            took = time.monotonic() - resumed
            assert took < 1.5, f"{len(handled)} of 2 handled {took:.2f} s after the resume"
            time.sleep(0.002)
    finally:
        relay.stop()
        thread.join(WAIT)
    assert not thread.is_alive()


# --- migration 0011 ---


@pytest.mark.slow
@pytest.mark.parametrize("how", ["libsql", "sqlite", "alembic"])
def test_0011_keys_and_ranks_the_items_stored_before_it(how: str, tmp_path: Path) -> None:
    """A database at 0010 with outbox entries (targets A.1, B, A.2, none, A.3), spawns and
    timers, upgraded to head (by the store, or alembic): each item has its root key, each
    key's entries and spawns ranks 1, 2, 3, ... by seq; the claims serve them round-robin.
    Alembic's downgrade back to 0010 keeps every item."""
    db = tmp_path / "old.db"
    alembic_steps((db, "upgrade", "0010"))
    with closing(sqlite3.connect(db)) as conn, conn:
        for target in ("A.1", "B", "A.2", None, "A.3"):
            conn.execute(
                "INSERT INTO harel_outbox (target_id, source_id, event) VALUES (?, 's', ?)",
                (target, '{"name":"go","id":"ev"}'),
            )
        for child in ("A.k1", "A.k2", "B.k"):
            conn.execute(
                "INSERT INTO harel_spawns (parent_id, child_id, root_path, context) "
                "VALUES ('p', ?, 'r', '{}')",
                (child,),
            )
        for execution, fire_at in (("A.t", 1.0), ("B", 2.0), ("A", 3.0)):
            conn.execute(
                "INSERT INTO harel_timers (execution_id, path, fire_at) VALUES (?, 'p', ?)",
                (execution, fire_at),
            )
    if how == "alembic":
        alembic_steps((db, "upgrade", "head"))
    opener = SqliteStore if how == "sqlite" else LibsqlStore
    with opener(db) as store:
        assert store.schema_revision == HEAD
        conn = raw(store)
        outbox = conn.execute("SELECT seq, flow_key, flow_rank FROM harel_outbox ORDER BY seq")
        assert [tuple(r) for r in outbox.fetchall()] == [
            (1, "A", 1),
            (2, "B", 1),
            (3, "A", 2),
            (4, "", 1),
            (5, "A", 3),
        ]
        spawns = conn.execute("SELECT flow_key, flow_rank FROM harel_spawns ORDER BY seq")
        assert [tuple(r) for r in spawns.fetchall()] == [("A", 1), ("A", 2), ("B", 1)]
        timers = conn.execute("SELECT flow_key FROM harel_timers ORDER BY fire_at")
        assert [r[0] for r in timers.fetchall()] == ["A", "B", "A"]
        for key in ("A", "B", ""):
            store.set_flow(key)
        assert [(f.key, f.pending) for f in store.flows()] == [("", 1), ("A", 7), ("B", 3)]
        assert [e.seq for e in store.claim_outbox("w1", limit=3)] == [1, 2, 4]
        assert [s.child_id for s in store.claim_spawns("w1", limit=2)] == ["A.k1", "B.k"]
        store.pause_flow("A")
        assert [t.execution_id for t in store.claim_due_timers("w1", NOW)] == ["B"]
    # The cursors hold the closed store's connection open, and its lock on the file: SQLite
    # would then keep the descriptor of the downgrade's own connection open after it closed
    # (a POSIX lock is the process's: closing any descriptor of the file would drop it).
    del conn, outbox, spawns, timers
    if how == "alembic":  # and back: the items stay, claims and all, without their flows
        alembic_steps((db, "downgrade", "0010"))
        with closing(sqlite3.connect(db)) as conn:
            names = {r[0] for r in conn.execute("SELECT name FROM sqlite_master")}
            assert not {n for n in names if "flow" in n}
            rows = conn.execute("SELECT seq, claimed_by FROM harel_outbox ORDER BY seq")
            assert rows.fetchall() == [(1, "w1"), (2, "w1"), (3, None), (4, "w1"), (5, None)]
            assert conn.execute("SELECT count(*) FROM harel_spawns").fetchone() == (3,)
            assert conn.execute("SELECT count(*) FROM harel_timers").fetchone() == (3,)
