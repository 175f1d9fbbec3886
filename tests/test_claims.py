"""Bounded relay reads and claims, on every kind of store (local, remote, replica, async).

A claim hands a worker the oldest rows no live lease holds, and leases them on the
database's clock; these tests move that clock by moving leases' ends back (`elapse`), as
tests/test_model.py does, and never wait on it.
"""

from __future__ import annotations

from typing import Any

import pytest

from harel_store import Event, Execution, TimerOp
from tests.helpers import raw


def seed(store: Any, n: int) -> None:
    """``n`` executions, each with one emit, one spawn and one timer due at its number."""
    for i in range(n):
        store.commit(
            Execution(id=f"e{i}", definition_id="d"),
            [(f"t{i}", Event(name="go", id=f"ev{i}"))],
            timers=[TimerOp.schedule("tick", float(i))],
            spawns=[(f"c{i}", "r", {"i": i})],
        )


def move_back(store: Any, column: str, seconds: float) -> None:
    """A time the database's clock wrote in every relay table, ``seconds`` earlier."""
    db = raw(store)
    for table in ("harel_outbox", "harel_spawns", "harel_timers"):
        db.execute(f"UPDATE {table} SET {column} = {column} - {seconds}")
    db.commit()
    store.sync()


def elapse(store: Any, seconds: float) -> None:
    """Every lease runs ``seconds`` further towards its end."""
    move_back(store, "claimed_until", seconds)


def test_bounded_reads_give_the_oldest_first(store: Any) -> None:
    seed(store, 5)
    assert [e.seq for e in store.pending_outbox(limit=2)] == [1, 2]
    assert [e.seq for e in store.pending_outbox()] == [1, 2, 3, 4, 5]
    assert [s.child_id for s in store.pending_spawns(limit=3)] == ["c0", "c1", "c2"]
    assert len(store.pending_spawns(limit=None)) == 5
    assert store.due_timers(3.0, limit=2) == [("e0", "tick", 0.0), ("e1", "tick", 1.0)]
    assert len(store.due_timers(3.0)) == 4


def test_a_claim_goes_to_one_worker_until_its_lease_runs_out(store: Any) -> None:
    seed(store, 5)
    first = store.claim_outbox("w1", limit=3, lease=60.0)
    assert [e.seq for e in first] == [1, 2, 3] and first[0].event.id == "ev0"
    assert [e.seq for e in store.claim_outbox("w2", limit=3, lease=60.0)] == [4, 5]
    assert store.claim_outbox("w3") == []
    assert store.claim_outbox("w1") == []  # its own claims are not handed out twice either
    assert len(store.pending_outbox()) == 5  # claimed entries are still pending
    store.ack_outbox(2)  # delivered: gone for good
    elapse(store, 59.0)
    assert store.claim_outbox("w3") == []
    elapse(store, 1.0)  # the leases ran out: the rest is claimable again, oldest first
    assert [e.seq for e in store.claim_outbox("w3", limit=10)] == [1, 3, 4, 5]
    stats = store.stats(0.0)
    assert (stats.pending_outbox, stats.claimed_outbox) == (4, 4)


def test_spawns_are_claimed_like_the_outbox(store: Any) -> None:
    seed(store, 3)
    claimed = store.claim_spawns("w1", limit=2, lease=5.0)
    assert [(s.seq, s.child_id, s.context) for s in claimed] == [
        (1, "c0", {"i": 0}),
        (2, "c1", {"i": 1}),
    ]
    assert [s.seq for s in store.claim_spawns("w2", lease=5.0)] == [3]
    store.ack_spawn(1)
    elapse(store, 5.0)
    assert [s.seq for s in store.claim_spawns("w2")] == [2, 3]
    assert store.stats(0.0).claimed_spawns == 2


def test_due_timers_are_claimed_soonest_first_and_a_rearm_frees_one(store: Any) -> None:
    seed(store, 4)
    assert store.claim_due_timers("w1", 1.5, limit=5) == [("e0", "tick", 0.0), ("e1", "tick", 1.0)]
    assert store.claim_due_timers("w2", 10.0, limit=1) == [("e2", "tick", 2.0)]
    assert store.claim_due_timers("w2", 10.0) == [("e3", "tick", 3.0)]
    assert store.claim_due_timers("w3", 10.0) == []
    assert store.stats(10.0).claimed_timers == 4

    # e0's timer re-armed while w1 holds it: due anew, at its new time, and unclaimed
    exe = store.load("e0")
    store.commit(exe, [], timers=[TimerOp.schedule("tick", 5.0)])
    assert store.claim_due_timers("w3", 10.0) == [("e0", "tick", 5.0)]
    store.delete_timer("e0", "tick", 0.0)  # w1's late delete spares the re-armed timer
    assert store.timers_of("e0") == [("tick", 5.0)]
    store.delete_timer("e1", "tick", 1.0)
    assert [t[0] for t in store.due_timers(10.0)] == ["e2", "e3", "e0"]


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda s: s.claim_outbox(""), ValueError),
        (lambda s: s.claim_outbox(None), TypeError),
        (lambda s: s.claim_outbox("w", limit=0), ValueError),
        (lambda s: s.claim_outbox("w", limit=1001), ValueError),
        (lambda s: s.claim_outbox("w", limit=2.0), TypeError),
        (lambda s: s.claim_spawns("w", lease=0), ValueError),
        (lambda s: s.claim_spawns("w", lease=float("nan")), ValueError),
        (lambda s: s.claim_spawns("w", lease="30"), TypeError),
        (lambda s: s.claim_due_timers("w", float("inf")), ValueError),
        (lambda s: s.claim_due_timers("w\x00", 1.0), ValueError),
        (lambda s: s.pending_outbox(limit=0), ValueError),
        (lambda s: s.pending_spawns(limit=True), TypeError),
        (lambda s: s.due_timers(1.0, limit=-1), ValueError),
    ],
)
def test_bad_claims_claim_nothing(store: Any, call: Any, error: type[Exception]) -> None:
    seed(store, 2)
    with pytest.raises(error):
        call(store)
    stats = store.stats(10.0)
    assert (stats.claimed_outbox, stats.claimed_spawns, stats.claimed_timers) == (0, 0, 0)


def test_a_corrupt_row_is_skipped_by_the_claim_not_the_whole_relay(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    seed(store, 4)
    db = raw(store)
    db.execute("UPDATE harel_outbox SET event = '{broken' WHERE seq = 2")
    db.execute("UPDATE harel_spawns SET context = '[]' WHERE seq = 3")
    db.commit()
    store.sync()
    assert [e.seq for e in store.claim_outbox("w1", limit=10)] == [1, 3, 4]
    assert [s.seq for s in store.claim_spawns("w1", limit=10)] == [1, 2, 4]
    named = [r.getMessage() for r in caplog.records if r.name == "harel_store"]
    assert any("outbox entry 2" in m for m in named) and any("spawn 3" in m for m in named)
    assert store.stats(0.0).claimed_outbox == 4  # the corrupt one stays under the lease
    store.ack_outbox(2)  # an operator deals with it
    assert store.stats(0.0).pending_outbox == 3
