"""Claims are first in, first out across every execution, so a burst of work passes stage by
stage (issue 36; docs/how-to/relays.md, "Claim order").

The claim-level tests run on every kind of store; the relay's on both local drivers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, OutboxEntry, Relay, SqliteStore


def emit(store: Any, execution_id: str, name: str) -> None:
    """One commit of ``execution_id`` (created at its first) emitting ``name`` to itself."""
    exe = store.load(execution_id) or Execution(id=execution_id, definition_id="order")
    store.commit(exe, [(execution_id, Event(name=name))])


def test_claims_hand_out_the_oldest_entries_of_any_execution(store: Any) -> None:
    """Entries of four executions, written interleaved: whichever worker claims, it gets
    the oldest unclaimed ones, in the order they were written, not an execution's run."""
    written = []
    for stage in range(3):
        for order in "abcd":
            emit(store, order, f"{order}{stage}")
            written.append(f"{order}{stage}")
    claimed: list[str] = []
    for number in range(4):  # two workers, taking turns
        batch = store.claim_outbox(f"w{number % 2}", limit=3, lease=60.0)
        claimed += [entry.event.name for entry in batch]
    assert claimed == written


def test_a_failed_entry_keeps_its_place_at_the_head(store: Any) -> None:
    for order in "abc":
        emit(store, order, order)
    first = store.claim_outbox("w1", limit=1, lease=60.0)
    assert [e.event.name for e in first] == ["a"]
    assert store.fail("w1", first, error="down", retry_in=0.0) == 1
    emit(store, "d", "d")  # written after a's failure: still behind it
    assert [e.event.name for e in store.claim_outbox("w2", limit=10, lease=60.0)] == list("abcd")


@pytest.mark.parametrize("make", [LibsqlStore, SqliteStore], ids=["libsql", "sqlite"])
def test_a_burst_passes_through_a_relay_stage_by_stage(make: Any, tmp_path: Path) -> None:
    """30 orders placed at once, three hops each through the outbox, a relay claiming 7 a
    round: every first hop is handled before any second, every second before any third,
    each stage in the order the orders were placed."""
    orders, stages = [f"o{i:02}" for i in range(30)], 3
    with make(tmp_path / "state.db") as store:
        handled: list[tuple[int, str]] = []

        def hop(entry: OutboxEntry) -> None:
            assert entry.target_id is not None
            exe, seen = store.load_for_event(entry.target_id, entry.event.id)
            if exe is None or seen:
                return
            stage = int(entry.event.payload["stage"])
            handled.append((stage, exe.id))
            emits = (
                [(exe.id, Event(name="hop", payload={"stage": stage + 1}))]
                if stage < stages
                else []
            )
            store.commit(exe, emits, processed_event_id=entry.event.id, acks=(entry,))

        for order in orders:  # the burst
            store.commit(
                Execution(id=order, definition_id="order"),
                [(order, Event(name="hop", payload={"stage": 1}))],
            )
        relay = Relay(store, "worker-1", on_outbox=hop, batch=7)
        while relay.run_once():
            pass
        assert handled == [(stage, order) for stage in range(1, stages + 1) for order in orders]
        assert store.pending_outbox() == []
