"""Bounded relay reads and claims, on every kind of store (local, remote, replica, async).

A claim hands a worker the oldest rows no live lease holds, and leases them on the
database's clock; these tests move that clock by moving leases' ends back (`elapse`), as
tests/test_model.py does, and never wait on it.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from harel_store import Event, Execution, TimerOp, queues
from tests.helpers import Refusal, raises_each, raw


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


BAD_CLAIMS: list[Refusal] = [
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
]


def test_bad_claims_claim_nothing(store: Any) -> None:
    seed(store, 2)

    def nothing_claimed() -> None:
        stats = store.stats(10.0)
        assert (stats.claimed_outbox, stats.claimed_spawns, stats.claimed_timers) == (0, 0, 0)

    raises_each(BAD_CLAIMS, store, after=nothing_claimed)


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


def test_a_foreign_value_in_a_claims_written_time_or_trace_context_blocks_no_queue(
    store: Any, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A foreign client wrote a BLOB trace context or a text written time (not what the
    store writes there): the claim reads it as no context / an unknown time, logs it once,
    and hands the row out as any other; at max_attempts it becomes a dead letter."""
    # Logged once a process for each database (this test's server serves others too).
    monkeypatch.setattr(queues, "_foreign_seen", set())
    seed(store, 3)
    db = raw(store)
    db.execute("UPDATE harel_outbox SET traceparent = X'00ff' WHERE seq = 1")
    db.execute("UPDATE harel_outbox SET created_at = 'yesterday' WHERE seq = 2")
    db.execute("UPDATE harel_spawns SET traceparent = X'01' WHERE seq = 1")
    db.execute("UPDATE harel_spawns SET created_at = X'02' WHERE seq = 2")
    db.execute("UPDATE harel_timers SET traceparent = X'03' WHERE execution_id = 'e1'")
    db.commit()
    store.sync()
    with caplog.at_level(logging.WARNING, logger="harel_store"):
        outbox = store.claim_outbox("w1", limit=10, max_attempts=2)
        spawns = store.claim_spawns("w1", limit=10, max_attempts=2)
        timers = store.claim_due_timers("w1", 10.0, limit=10, max_attempts=2)
    assert [e.seq for e in outbox] == [s.seq for s in spawns] == [1, 2, 3]
    assert [t.execution_id for t in timers] == ["e0", "e1", "e2"]
    # The operator's views list them too, the foreign time as unknown.
    outbox_view, spawns_view = store.outbox_view(limit=10), store.spawns_view(limit=10)
    assert [e.seq for e in outbox_view] == [s.seq for s in spawns_view] == [1, 2, 3]
    assert outbox_view[1].created_at is None and spawns_view[1].created_at is None
    assert isinstance(outbox_view[0].created_at, float)
    assert [e._traceparent for e in outbox] == [s._traceparent for s in spawns] == [None] * 3
    assert [t._traceparent for t in timers] == [None] * 3
    for claimed in (outbox, spawns):
        assert claimed[1]._written_at is None
        assert all(isinstance(e._written_at, float) for e in (claimed[0], claimed[2]))
    messages = [r.getMessage() for r in caplog.records]
    foreign = [m for m in messages if "not what the store writes" in m]
    assert len(foreign) == 5, foreign
    assert any("outbox entry 1" in m and "traceparent" in m for m in foreign)
    assert any("spawn 2" in m and "created_at" in m for m in foreign)
    # The same rows again (their leases run out): read as before, not logged again; the
    # relay's round (claim_work) reads them so too; at max_attempts, dead letters.
    elapse(store, 60)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harel_store"):
        work = store.claim_work("w1", 10.0, limit=10, max_attempts=2)
    assert [e.seq for e in work.outbox] == [s.seq for s in work.spawns] == [1, 2, 3]
    assert len(work.timers) == 3 and work.outbox[1]._written_at is None
    assert not [r for r in caplog.records if "not what the store writes" in r.getMessage()]
    elapse(store, 60)
    assert store.claim_work("w1", 10.0, limit=10, max_attempts=2).items() == []
    dead = store.dead_letters(limit=10)
    assert sorted((d.kind, getattr(d.item, "seq", 0)) for d in dead) == [
        ("outbox", 1),
        ("outbox", 2),
        ("outbox", 3),
        ("spawn", 1),
        ("spawn", 2),
        ("spawn", 3),
        ("timer", 0),
        ("timer", 0),
        ("timer", 0),
    ]
