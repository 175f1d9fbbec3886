"""Second outside review of the late flow-control commits (no triggers, room-made marks,
reranks on release, turns in ClaimedWork.items, check_int)."""

from __future__ import annotations

import copy
import enum
import pickle
from typing import Any

import pytest

from harel_store import OutboxEntry
from harel_store.checks import check_int
from tests.helpers import raw
from tests.test_flows import NOW, every, key_of, keys, stage
from tests.test_flows import store as store


def _count(store: Any, sql: str) -> Any:
    db = raw(store)
    try:
        return db.execute(sql).fetchall()
    finally:
        if store.__class__.__name__ not in ("SqliteStore",) and db is not getattr(
            getattr(getattr(store, "sync_store", store), "_conn", None), "db", None
        ):
            db.close()


def test_one_claim_work_of_every_kind_honours_a_rate_and_logs_each_claim_once(store: Any) -> None:
    """A rate of 4 per hour on key R, R with 5 of each kind: one claim_work takes 4 in all
    and logs 4 claims (a remote batch runs both variants: nothing double-logged)."""
    store.set_flow("R", rate=(4, 3600.0))
    stage(store, "R", outbox=5, spawns=5, timers=5)
    stage(store, "Q", outbox=2, spawns=2, timers=2)
    claimed = store.claim_work("w1", NOW, limit=10)
    got = keys(every(claimed))
    assert got["R"] == 4
    assert got["Q"] == 6
    (logged,) = _count(store, "SELECT count(*) FROM harel_flow_claims WHERE key = 'R'")
    assert logged[0] == 4
    again = store.claim_work("w1", NOW, limit=10)
    assert keys(every(again))["R"] == 0


def test_claims_by_one_worker_id_in_two_batches_log_each_once(store: Any) -> None:
    store.set_flow("R", rate=(10, 3600.0))
    stage(store, "R", outbox=3)
    store.claim_work("w1", NOW, limit=1)
    store.claim_work("w1", NOW, limit=1)
    store.claim_outbox("w1", limit=1)
    (logged,) = _count(store, "SELECT count(*) FROM harel_flow_claims WHERE key = 'R'")
    assert logged[0] == 3


def test_items_turns_survive_copy_and_pickle(store: Any) -> None:
    store.set_flow("H", priority=5)
    stage(store, "L", outbox=2)
    stage(store, "H", outbox=2)
    claimed = store.claim_work("w1", NOW, kinds=["outbox"], limit=10)
    assert [key_of(i) for _, i in claimed.items()] == ["H", "H", "L", "L"]
    for clone in (copy.copy(claimed), pickle.loads(pickle.dumps(claimed))):
        assert [key_of(i) for _, i in clone.items()] == ["H", "H", "L", "L"]


def test_items_built_by_hand_keep_their_seq_order() -> None:
    from harel_store import ClaimedWork, Event, WorkAhead

    entries = [OutboxEntry(s, f"k.{s}", Event(name="e", id=str(s))) for s in (3, 1, 2)]
    work = ClaimedWork(entries, [], [], WorkAhead(False, False, False, None))
    assert [i.seq for _, i in work.items()] == [1, 2, 3]


def test_check_int_bool_and_huge() -> None:
    class Big(enum.IntEnum):
        HUGE = 2**70
        OK = 5

    with pytest.raises(TypeError):
        check_int(True, "x")
    with pytest.raises(ValueError):
        check_int(Big.HUGE, "x")
    with pytest.raises(ValueError):
        check_int(-(2**63) - 1, "x")
    assert check_int(2**63 - 1, "x") == 2**63 - 1
    assert check_int(-(2**63), "x") == -(2**63)
    assert check_int(Big.OK, "x") == 5
    with pytest.raises(ValueError):
        check_int(10**4000, "x")


def test_a_release_by_a_worker_holding_nothing_changes_no_rank(store: Any) -> None:
    """Was a defect: `Queues._each(..., rerank=True)` added rerank_items_outbox with every
    seq given, whether or not release_outbox released it (that needs ``+claimed_by = ?1``
    and a live lease; the rerank checked neither). So release("w2", items w1 holds)
    returned 0 yet ranked key A's and B's live rows again from the clock, w1's held rows
    included (1 -> 19). Now the rerank runs before the release, on what the releasing
    worker holds under a live lease."""
    stage(store, "A", outbox=3)
    stage(store, "B", outbox=30)
    held = store.claim_outbox("w1", limit=2)  # A's first and B's first
    store.claim_outbox("w1", limit=20)
    before = _count(store, "SELECT seq, flow_rank FROM harel_outbox ORDER BY seq")
    assert store.release("w2", held) == 0
    after = _count(store, "SELECT seq, flow_rank FROM harel_outbox ORDER BY seq")
    assert [tuple(r) for r in after] == [tuple(r) for r in before]


def test_release_of_a_paused_keys_items_keeps_them_unclaimable(store: Any) -> None:
    stage(store, "P", outbox=3)
    stage(store, "B", outbox=30)
    held = store.claim_outbox("w1", limit=4)
    store.claim_outbox("w1", limit=20)
    store.pause_flow("P")
    released = store.release("w1", [i for i in held if key_of(i) == "P"])
    assert released == 2
    assert keys(store.claim_outbox("w2", limit=50))["P"] == 0
    store.resume_flow("P")
    assert keys(store.claim_outbox("w2", limit=50))["P"] == released
