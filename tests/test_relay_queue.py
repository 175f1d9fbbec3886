"""The relay's primitives on every kind of store (local, remote, replica, async): items
consumed by the commit that handles them, acks of any mix in one transaction, attempts
counted by claims, dead letters, a holder's fail and extend, and the stable id of a timer's
firing.

Leases run on the database's clock, which a test cannot set: as in tests/test_claims.py the
clock moves by moving every lease's end back (`elapse`), never by waiting.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from typing import Any

import pytest

from harel_store import (
    ClaimedWork,
    DeadLetter,
    DueTimer,
    Event,
    Execution,
    OutboxEntry,
    SpawnEntry,
    StoreConflict,
    TimerOp,
    WorkAhead,
)
from harel_store.checks import MAX_ERROR
from tests.helpers import Refusal, raises_each
from tests.test_claims import elapse, move_back
from tests.test_contract import snapshot


def seed(store: Any) -> Execution:
    """A source that emitted two events for "target", spawned a child and armed two timers
    (one due at 1.0, one at 2.0); "target" exists. Returns the source."""
    source = Execution(id="source", definition_id="d")
    store.commit(
        source,
        [("target", Event(name="a", id="ev-a")), ("target", Event(name="b", id="ev-b"))],
        timers=[TimerOp.schedule("t1", 1.0), TimerOp.schedule("t2", 2.0)],
        spawns=[("child", "root", {"k": 1})],
    )
    store.save(Execution(id="target", definition_id="d"))
    return source


def claimed(store: Any, worker: str = "w1", **options: Any) -> list[Any]:
    """Whatever ``worker`` claims of the three kinds, outbox first."""
    return [
        *store.claim_outbox(worker, **options),
        *store.claim_spawns(worker, **options),
        *store.claim_due_timers(worker, 10.0, **options),
    ]


def state(store: Any) -> tuple[list[int], list[int], list[tuple[str, str, float]]]:
    return (
        [e.seq for e in store.pending_outbox()],
        [s.seq for s in store.pending_spawns()],
        [tuple(t) for t in store.due_timers(10.0)],
    )


# --- the timer's named tuple and its event id ---


def test_due_timers_are_named_tuples_with_a_stable_event_id(store: Any) -> None:
    seed(store)
    due = store.due_timers(10.0)
    assert due == [("source", "t1", 1.0), ("source", "t2", 2.0)]  # still tuples
    assert all(isinstance(t, DueTimer) for t in due)
    assert [t.path for t in store.claim_due_timers("w", 10.0)] == ["t1", "t2"]
    event = Event(name="fire", id=due[0].event_id)  # a valid Event.id
    assert event.id == DueTimer("source", "t1", 1).event_id  # an int time is the same time
    assert len({t.event_id for t in due}) == 2


def test_a_timers_event_id_is_the_same_in_any_process() -> None:
    timer = DueTimer("exe-1", "main.remind", 1_795_914_574.474491)
    code = (
        "from harel_store import DueTimer;"
        "print(DueTimer('exe-1', 'main.remind', 1795914574.474491).event_id)"
    )
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert other.stdout.strip() == timer.event_id


def test_a_timers_event_id_tells_every_firing_apart() -> None:
    at = 1_795_914_574.474491
    firings = [
        DueTimer("a", "b", at),
        DueTimer("a", "b", math.nextafter(at, math.inf)),  # one ulp later
        DueTimer("a", "b", math.nextafter(at, -math.inf)),
        DueTimer("a", "b", 0.1 + 0.2),
        DueTimer("a", "b", 0.3),
        DueTimer("a|b", "c", at),  # no collision through a separator
        DueTimer("a", "b|c", at),
        DueTimer("a", 'b", "c', at),
        DueTimer('a", "b', "c", at),
        DueTimer("b", "a", at),
        DueTimer("a" * 512, "p" * 512, at),
    ]
    ids = [t.event_id for t in firings]
    assert len(set(ids)) == len(ids)
    for timer in firings:
        assert Event(name="fire", id=timer.event_id).id == timer.event_id
    assert DueTimer("a", "b", -0.0).event_id == DueTimer("a", "b", 0.0).event_id  # equal tuples


# --- consumed in the commit that handles them ---


def test_a_commit_consumes_its_acks_in_the_same_transaction(store: Any) -> None:
    seed(store)
    first, second, spawn, t1, t2 = claimed(store)
    target = store.load("target")
    seqs = store.commit(
        target,
        [(None, Event(name="done"))],
        processed_event_id=first.event.id,
        acks=(first, spawn, t1),
    )
    assert seqs == [3]  # the outbox seqs of this commit's own emits, as without acks
    assert state(store) == ([second.seq, 3], [], [("source", "t2", 2.0)])
    assert store.is_processed("target", "ev-a")
    # An item already gone is no error (a repeat after a lost lease acks nothing).
    store.commit(target, [], acks=(first, spawn, t1, t2))
    assert state(store) == ([second.seq, 3], [], [])


def test_a_spawned_child_is_created_and_its_spawn_consumed_in_one_commit(store: Any) -> None:
    seed(store)
    (spawn,) = store.claim_spawns("w1")
    child = Execution(id=spawn.child_id, definition_id="d", parent_id=spawn.parent_id)
    store.commit(child, [], acks=(spawn,))
    assert store.load("child") is not None and store.pending_spawns() == []
    again = Execution(id=spawn.child_id, definition_id="d", parent_id=spawn.parent_id)
    with pytest.raises(StoreConflict):  # a repeat after a lost lease: the child exists
        store.commit(again, [], acks=(spawn,))


def test_a_conflicting_commit_consumes_nothing(store: Any) -> None:
    seed(store)
    items = claimed(store)
    stale = store.load("target")
    store.save(store.load("target"))
    before = snapshot(store)
    with pytest.raises(StoreConflict):
        store.commit(stale, [(None, Event(name="x"))], acks=items)
    assert snapshot(store) == before
    assert stale.version == 1


def test_a_rearmed_timer_is_spared_by_the_ack_of_its_old_firing(store: Any) -> None:
    source = seed(store)
    t1 = store.claim_due_timers("w1", 10.0, limit=1)[0]
    store.commit(source, [], timers=[TimerOp.schedule("t1", 5.0)])  # re-armed meanwhile
    store.commit(store.load("target"), [], acks=(t1,))
    assert store.timers_of("source") == [("t2", 2.0), ("t1", 5.0)]
    # The same commit may re-arm the path it fires: the new time stays armed.
    t1 = store.claim_due_timers("w1", 10.0, limit=5)[0]
    assert t1 == ("source", "t2", 2.0)
    source = store.load("source")
    store.commit(source, [], timers=[TimerOp.schedule("t2", 7.0)], acks=(t1,))
    assert store.timers_of("source") == [("t1", 5.0), ("t2", 7.0)]


# --- ack: any mix, one transaction ---


def test_ack_removes_any_mix_and_counts_what_it_removed(store: Any) -> None:
    seed(store)
    first, second, spawn, t1, t2 = claimed(store)
    assert store.ack([]) == 0
    assert store.ack([first, spawn, t1, first]) == 3  # a duplicate counts once
    assert store.ack([first, spawn, t1]) == 0  # already gone
    assert store.ack([DueTimer("source", "t2", 9.0)]) == 0  # not armed at that time
    assert state(store) == ([second.seq], [], [("source", "t2", 2.0)])
    assert store.ack(x for x in [second, t2]) == 2  # any iterable
    assert state(store) == ([], [], [])


def test_ack_outbox_ack_spawn_and_delete_timer_are_acks_of_one(store: Any) -> None:
    seed(store)
    store.ack_outbox(1)
    store.ack_outbox(1)
    store.ack_spawn(1)
    store.delete_timer("source", "t1", 1.0)
    store.ack_outbox(0)  # no entry has such a seq: nothing to do
    store.ack_outbox(-2)  # nor this one (it does not name entry 2)
    assert state(store) == ([2], [], [("source", "t2", 2.0)])


BAD_ITEMS: list[tuple[Any, type[Exception]]] = [
    ([("source", "t1", 1.0)], TypeError),  # a bare tuple, not a DueTimer
    ([42], TypeError),
    (["outbox 1"], TypeError),
    ([None], TypeError),
    (OutboxEntry(1, "target", Event(name="a")), TypeError),  # one item, not a list of them
    ("abc", TypeError),
    ([OutboxEntry("1", "target", Event(name="a"))], TypeError),  # type: ignore[arg-type]
    ([SpawnEntry(2**64, "p", "c", "r", {})], ValueError),
    ([DueTimer("source", "t1", float("nan"))], ValueError),
    ([DueTimer("", "t1", 1.0)], ValueError),
    ([DueTimer("source", 7, 1.0)], TypeError),  # type: ignore[arg-type]
]


def test_bad_items_raise_and_write_nothing(store: Any) -> None:
    seed(store)
    good = store.claim_outbox("w1", limit=1)  # a good item beside the bad ones
    before = snapshot(store)
    cases: list[Refusal] = []
    for items, error in BAD_ITEMS:
        mixed = [*good, *items] if isinstance(items, list) else items
        cases += [
            (lambda m=mixed: store.ack(m), error),
            (
                lambda m=mixed: store.commit(
                    store.load("target"), [(None, Event(name="x"))], acks=m
                ),
                error,
            ),
            (lambda m=mixed: store.fail("w1", m, error="boom"), error),
            (lambda m=mixed: store.extend("w1", m, lease=60.0), error),
            (lambda m=mixed: store.revive(m), error),
        ]

    def unchanged() -> None:
        assert snapshot(store) == before

    raises_each(cases, after=unchanged)


BAD_CALLS: list[Refusal] = [
    (lambda s, e: s.fail("w1", e, error=3), TypeError),
    (lambda s, e: s.fail("w1", e, error=None), TypeError),
    (lambda s, e: s.fail("w1", e, error="x", retry_in=-1.0), ValueError),
    (lambda s, e: s.fail("w1", e, error="x", retry_in=math.inf), ValueError),
    (lambda s, e: s.fail("w1", e, error="x", retry_in="1"), TypeError),
    (lambda s, e: s.fail("", e, error="x"), ValueError),
    (lambda s, e: s.extend("w1", e, lease=0.0), ValueError),
    (lambda s, e: s.extend("w1", e, lease=math.nan), ValueError),
    (lambda s, e: s.extend(None, e, lease=1.0), TypeError),
    (lambda s, e: s.claim_outbox("w1", max_attempts=0), ValueError),
    (lambda s, e: s.claim_spawns("w1", max_attempts="3"), TypeError),
    (lambda s, e: s.claim_due_timers("w1", 1.0, max_attempts=True), TypeError),
    (lambda s, e: s.dead_letters(kind="outboxes"), ValueError),
    (lambda s, e: s.dead_letters(limit=0), ValueError),
    (lambda s, e: s.dead_letters(limit=1001), ValueError),
]


def test_bad_arguments_write_nothing(store: Any) -> None:
    seed(store)
    entries = store.claim_outbox("w1")
    before = snapshot(store)

    def unchanged() -> None:
        assert snapshot(store) == before

    raises_each(BAD_CALLS, store, entries, after=unchanged)


# --- attempts and dead letters ---


def test_every_claim_counts_an_attempt_across_lapsed_leases(store: Any) -> None:
    seed(store)
    for expected in (1, 2, 3):
        assert len(claimed(store, f"w{expected}", lease=10.0)) == 5
        elapse(store, 10.0)
        view = store.outbox_view()
        assert [e.attempts for e in view] == [expected, expected]
        assert [s.attempts for s in store.spawns_view()] == [expected]
        assert [t.attempts for t in store.timers_view()] == [expected, expected]


def test_a_claim_at_max_attempts_makes_dead_letters_never_handed_out_again(
    store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    seed(store)
    for _ in range(3):
        assert len(claimed(store, max_attempts=3, lease=10.0)) == 5
        elapse(store, 10.0)
    with caplog.at_level(logging.WARNING, logger="harel_store.relay"):
        assert claimed(store, max_attempts=3) == []  # this claim met them at 3: dead
    said = [r.getMessage() for r in caplog.records if r.name == "harel_store.relay"]
    assert len(said) == 5 and all("dead letter after 3 attempts" in m for m in said), said
    assert claimed(store) == []  # not even by a claim without a limit
    assert claimed(store, "w9", max_attempts=100) == []
    assert state(store) == ([], [], [])  # not pending either
    dead = store.dead_letters()
    assert [(d.kind, d.attempts, d.last_error) for d in dead] == [
        ("outbox", 3, None),
        ("outbox", 3, None),
        ("spawn", 3, None),
        ("timer", 3, None),
        ("timer", 3, None),
    ]
    assert isinstance(dead[0], DeadLetter)
    assert dead == [
        *store.dead_letters(kind="outbox"),
        *store.dead_letters(kind="spawn"),
        *store.dead_letters(kind="timer"),
    ]
    assert [type(d.item) for d in dead] == [OutboxEntry] * 2 + [SpawnEntry] + [DueTimer] * 2
    assert dead[0].item.event.id == "ev-a" and dead[2].item.context == {"k": 1}
    assert [d.item for d in store.dead_letters(limit=2)] == [d.item for d in dead[:2]]
    stats = store.stats(10.0)
    assert (stats.dead_outbox, stats.dead_spawns, stats.dead_timers) == (2, 1, 2)
    assert (stats.pending_outbox, stats.pending_spawns, stats.timers_due) == (0, 0, 0)
    assert store.dead_letter("outbox", 1) == dead[0] and store.dead_letter("outbox", 9) is None
    assert store.dead_letter("timer", ("source", "t2")) == dead[4]


def test_revive_makes_a_dead_letter_claimable_at_once_and_ack_discards_one(store: Any) -> None:
    seed(store)
    claimed(store, max_attempts=1)
    elapse(store, 30.0)
    assert claimed(store, max_attempts=1) == []
    first, second, spawn, t1, t2 = (d.item for d in store.dead_letters())
    assert store.revive([first, spawn, t1]) == 3
    assert store.ack([second, t2]) == 2  # discarded
    assert store.dead_letters() == []
    assert state(store) == ([first.seq], [spawn.seq], [tuple(t1)])
    assert claimed(store, "w2", max_attempts=1) == [first, spawn, t1]  # attempts back to 0
    assert [e.attempts for e in store.outbox_view()] == [1]
    assert store.revive([first]) == 1  # a live row too: attempts 0, its claim dropped
    assert store.claim_outbox("w3", max_attempts=1) == [first]


def test_revive_dead_letter_revives_only_what_is_still_dead(store: Any) -> None:
    """Each kind by its key, as the console's Revive: True and claimable at once while
    dead; False, and a worker's claim left alone, once it lives again (a second click)."""
    seed(store)
    claimed(store, max_attempts=1)
    elapse(store, 30.0)
    assert claimed(store, max_attempts=1) == []
    first, second, spawn, t1, t2 = (d.item for d in store.dead_letters())
    keys = [("outbox", first.seq), ("spawn", spawn.seq), ("timer", tuple(t1)[:2])]
    assert [store.revive_dead_letter(kind, key) for kind, key in keys] == [True] * 3
    assert claimed(store, "w2", max_attempts=1) == [first, spawn, t1]
    assert [store.revive_dead_letter(kind, key) for kind, key in keys] == [False] * 3
    assert claimed(store, "w3") == []  # w2's claims stand
    assert store.revive_dead_letter("outbox", 999) is False
    assert store.revive_dead_letter("outbox", 0) is False
    with pytest.raises(ValueError):
        store.revive_dead_letter("nope", 1)
    with pytest.raises(TypeError):
        store.revive_dead_letter("timer", "x")
    assert [d.item for d in store.dead_letters()] == [second, t2]


def test_rearming_a_dead_timer_makes_it_live_at_its_new_time(store: Any) -> None:
    source = seed(store)
    store.claim_due_timers("w1", 10.0, max_attempts=1)
    elapse(store, 30.0)
    assert store.claim_due_timers("w1", 10.0, max_attempts=1) == []
    assert len(store.dead_letters(kind="timer")) == 2
    store.commit(source, [], timers=[TimerOp.schedule("t1", 3.0), TimerOp.cancel("t2")])
    assert store.dead_letters() == []
    assert store.claim_due_timers("w1", 10.0, max_attempts=1) == [("source", "t1", 3.0)]


def test_purge_removes_the_dead_letters_an_execution_owns(store: Any) -> None:
    seed(store)
    claimed(store, max_attempts=1)
    elapse(store, 30.0)
    claimed(store, max_attempts=1)
    assert store.purge("target", 1) and store.purge("source", 1)
    assert store.dead_letters() == [] and state(store) == ([], [], [])


def age_the_dead(store: Any) -> None:
    """The dead letters so far died a second earlier (the database's clock counts in
    milliseconds: two claims may share one)."""
    move_back(store, "dead_at", 1.0)


def test_dead_letters_come_oldest_first_in_the_order_they_died(store: Any) -> None:
    seed(store)
    store.claim_due_timers("w1", 10.0, max_attempts=1, limit=1)
    elapse(store, 30.0)
    store.claim_due_timers("w1", 10.0, max_attempts=1)  # t1 dies; t2 claimed
    age_the_dead(store)
    elapse(store, 30.0)
    claimed(store, max_attempts=1)  # the outbox and the spawn claimed, t2 dies
    age_the_dead(store)
    elapse(store, 30.0)
    claimed(store, max_attempts=1)  # the outbox and the spawn die
    kinds = [(d.kind, getattr(d.item, "seq", None) or d.item[1]) for d in store.dead_letters()]
    assert kinds == [("timer", "t1"), ("timer", "t2"), ("outbox", 1), ("outbox", 2), ("spawn", 1)]


# --- fail and extend: only the holder ---


def test_fail_records_the_error_and_holds_the_row_back_only_for_its_holder(store: Any) -> None:
    seed(store)
    first, second, spawn, t1, t2 = claimed(store, lease=1000.0)
    assert store.fail("w2", [first, spawn, t1], error="not mine") == 0  # w2 holds none
    assert store.fail("w1", [first, spawn, t1], error="boom", retry_in=100.0) == 3
    assert store.fail("w1", [first], error="again") == 0  # no longer held by anyone
    assert [e.last_error for e in store.outbox_view()] == ["boom", None]
    assert [(e.claimed_by, e.attempts) for e in store.outbox_view()] == [(None, 1), ("w1", 1)]
    assert store.stats(10.0).claimed_outbox == 1  # a failed row waiting has no holder
    elapse(store, 99.0)
    assert claimed(store, "w2") == []  # waiting out its retry_in (and w1 holds the rest)
    elapse(store, 1.0)
    assert claimed(store, "w2") == [first, spawn, t1]
    assert [s.last_error for s in store.spawns_view()] == ["boom"]
    assert [t.last_error for t in store.timers_view()] == ["boom", None]
    assert store.fail("w2", [first, spawn, t1], error="now") == 3  # retry_in 0: at once
    assert claimed(store, "w3") == [first, spawn, t1]
    assert store.fail("w1", [second, t2], error="late", retry_in=0.0) == 2


def test_an_error_of_any_size_or_content_is_stored_bounded_and_escaped(store: Any) -> None:
    seed(store)
    (first, second) = store.claim_outbox("w1")
    huge = "Traceback\x00 " + "é\ud800" * 10_000
    assert store.fail("w1", [first], error=huge) == 1
    assert store.fail("w1", [second], error="quote ' \" ; DROP TABLE harel_outbox; --") == 1
    stored_huge, stored_sql = (e.last_error for e in store.outbox_view())
    assert len(stored_huge) <= MAX_ERROR and stored_huge.startswith("Traceback\\x00 é\\ud800")
    assert stored_huge.endswith("more characters)")
    assert stored_sql == "quote ' \" ; DROP TABLE harel_outbox; --"
    claimed(store, "w2", max_attempts=1)  # they die, keeping the errors
    assert [d.last_error for d in store.dead_letters()] == [stored_huge, stored_sql]


def test_extend_renews_only_the_leases_its_worker_still_holds(store: Any) -> None:
    seed(store)
    first, second, spawn, t1, t2 = claimed(store, lease=10.0)
    store.ack([second])
    elapse(store, 5.0)
    assert store.extend("w2", [first, spawn, t1], lease=100.0) == []
    given = [t1, second, spawn, first, t2]
    assert store.extend("w1", given, lease=100.0) == [t1, spawn, first, t2]  # in order given
    elapse(store, 50.0)  # past the old lease, within the new one
    assert claimed(store, "w2") == []
    elapse(store, 50.0)
    assert store.extend("w1", [first], lease=100.0) == []  # lost: the lease ran out
    assert claimed(store, "w2") == [first, spawn, t1, t2]


def test_attempts_of_reads_each_items_claims_in_one_read(store: Any) -> None:
    seed(store)
    first, second, spawn, t1, t2 = claimed(store, lease=10.0)
    elapse(store, 10.0)
    claimed(store, "w2", limit=1)  # the first of each kind claimed again
    gone = [OutboxEntry(99, "target", Event(name="x")), DueTimer("source", "t1", 9.0)]
    assert store.attempts_of([t2, first, spawn, second, t1, *gone]) == [1, 2, 2, 1, 2, 0, 0]
    assert store.attempts_of([]) == []


# --- a relay's look and its round: peek_work and claim_work ---


def test_peek_work_says_what_is_claimable_and_writes_nothing(store: Any) -> None:
    nothing = store.peek_work(10.0)
    assert nothing == WorkAhead(False, False, False, None)
    seed(store)
    before = snapshot(store)
    assert store.peek_work(0.5) == WorkAhead(True, True, False, 1.0)
    assert store.peek_work(1.0) == WorkAhead(True, True, True, 2.0)
    assert store.peek_work(10.0) == WorkAhead(True, True, True, None)
    assert snapshot(store) == before  # a look writes nothing
    # A row held by a live lease, or waiting out a fail's retry, is not claimable.
    claimed(store, lease=60.0)
    assert store.peek_work(10.0) == WorkAhead(False, False, False, None)


def test_claim_work_claims_each_kind_asked_and_says_what_is_left(store: Any) -> None:
    seed(store)
    first = store.claim_work("w1", 1.0, kinds=("outbox", "timer"), limit=1)
    assert [e.event.id for e in first.outbox] == ["ev-a"]
    assert first.spawns == [] and [(t.path, t.fire_at) for t in first.timers] == [("t1", 1.0)]
    assert first.ahead == WorkAhead(True, True, False, 2.0)  # ev-b and the spawn are left
    assert [(kind, type(item)) for kind, item in first.items()] == [
        ("outbox", OutboxEntry),
        ("timer", DueTimer),
    ]
    rest = store.claim_work("w2", 10.0, lease=60.0)
    assert [e.event.id for e in rest.outbox] == ["ev-b"]
    assert [s.child_id for s in rest.spawns] == ["child"]
    assert [t.path for t in rest.timers] == ["t2"]
    assert rest.ahead == WorkAhead(False, False, False, None)
    # Each claim counted an attempt, as the claims of one kind do.
    assert [(e.event.id, e.attempts, e.claimed_by) for e in store.outbox_view()] == [
        ("ev-a", 1, "w1"),
        ("ev-b", 1, "w2"),
    ]
    assert store.claim_work("w3", 10.0) == ClaimedWork([], [], [], rest.ahead)


def test_claim_work_makes_dead_letters_at_max_attempts(store: Any) -> None:
    seed(store)
    store.claim_work("w1", 10.0, kinds=["outbox"], lease=1.0, max_attempts=1)
    elapse(store, 2.0)
    again = store.claim_work("w1", 10.0, kinds=["outbox"], max_attempts=1)
    assert again.outbox == [] and not again.ahead.outbox
    assert sorted(d.item.event.id for d in store.dead_letters()) == ["ev-a", "ev-b"]


BAD_WORK: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"kinds": ()}, ValueError),
    ({"kinds": ("outbox", "mail")}, ValueError),
    ({"kinds": "outbox"}, TypeError),
    ({"limit": 0}, ValueError),
    ({"lease": -1.0}, ValueError),
    ({"max_attempts": 0}, ValueError),
]


def test_claim_work_refuses_bad_arguments_and_writes_nothing(store: Any) -> None:
    seed(store)
    before = snapshot(store)
    cases: list[Refusal] = [
        (lambda options=options: store.claim_work("w1", 10.0, **options), error)
        for options, error in BAD_WORK
    ]
    cases += [
        (lambda: store.claim_work("", 10.0), ValueError),
        (lambda: store.peek_work(math.nan), ValueError),
    ]

    def unchanged() -> None:
        assert snapshot(store) == before

    raises_each(cases, after=unchanged)
