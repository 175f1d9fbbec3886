"""The quick-start job: an order workflow driven through the store, printed as it goes.

An order forks into two child executions (payment, shipping) through the spawn relay; a
reminder timer fires; the children report back through the outbox; the parent joins and
finishes. Every step is one ``commit`` with a trace entry, as an engine would write it, and
the relays run as an engine runs them: rounds of a `Relay`.
"""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from typing import Any, TextIO

from harel_store.errors import StoreConflict
from harel_store.models import (
    DefinitionRecord,
    DueTimer,
    Event,
    Execution,
    OutboxEntry,
    SpawnEntry,
    TimerOp,
)
from harel_store.relay import Relay
from harel_store.store import Store

ORDER_MACHINE: dict[str, Any] = {
    "id": "order",
    "states": {
        "placed": {"parallel": ["payment", "shipping"], "after": {"0.3s": "remind"}},
        "done": {"final": True},
    },
}


def _step(event: str, source: str, target: str, **extra: Any) -> dict[str, Any]:
    return {"event": event, "transition": f"{source} -> {target}", "at": time.time(), **extra}


def run(store: Store, out: TextIO) -> str:
    """Drive one order to completion through ``store``; return the order's id."""

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    source = json.dumps(ORDER_MACHINE, sort_keys=True)
    record = store.publish_definition(
        DefinitionRecord(
            definition_id="order",
            version=1,
            digest=hashlib.sha256(source.encode()).hexdigest(),
            source={"order.json": ORDER_MACHINE},
            published_at=time.time(),
        )
    )
    say(f"published definition order v{record.version} ({record.digest[:12]})")

    order = Execution(
        id=f"order-{uuid.uuid4().hex[:8]}",
        definition_id="order",
        active_path="new",
        context={"items": 3, "total": 42.5},
    )
    store.save(order)
    say(f"created {order.id} at version {order.version}")

    # The fork: both children and the reminder timer commit with the parent's advance.
    place = Event(name="place")
    order.active_path = "placed"
    store.commit(
        order,
        [],
        processed_event_id=place.id,
        timers=(TimerOp.schedule("placed.remind", time.time() + 0.3),),
        spawns=(
            (f"{order.id}.payment", "payment", {"amount": 42.5}),
            (f"{order.id}.shipping", "shipping", {"items": 3}),
        ),
        trace=_step("place", "new", "placed"),
    )
    say(f"{order.id}: place -> placed (v{order.version}), forked 2 children, timer armed")

    # The relays, as an engine runs them: one Relay, a handler per kind, each consuming its
    # item in the commit that handles it (acks=), so a repeat after a lost lease is harmless.
    def create_child(spawn: SpawnEntry) -> None:  # the child's insert CAS, and the spawn
        child = Execution(
            id=spawn.child_id,
            definition_id="order",
            parent_id=spawn.parent_id,
            active_path=spawn.root_path,
            context=spawn.context,
        )
        try:
            store.commit(child, [], acks=(spawn,))
        except StoreConflict:  # created before: the round's ack consumes the spawn
            return
        say(f"spawn relay: created {child.id}")

    def fire(timer: DueTimer) -> None:  # the firing's event_id is its dedupe marker
        exe, seen = store.load_for_event(timer.execution_id, timer.event_id)
        if exe is None or seen:
            return
        store.commit(
            exe,
            [],
            processed_event_id=timer.event_id,
            trace=_step(f"timer:{timer.path}", "placed", "placed", note="reminder sent"),
            acks=(timer,),
        )
        say(f"timer {timer.path} fired for {timer.execution_id}")

    joined: list[str] = []

    def deliver(entry: OutboxEntry) -> None:  # the event's id is its dedupe marker
        if entry.target_id is None:  # no target: published (the round's ack consumes it)
            say(f"outbox relay: published #{entry.seq} {entry.event.name} {entry.event.payload}")
            return
        exe, seen = store.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            return
        joined.append(entry.event.name)
        emits: list[tuple[str | None, Event]] = []
        if len(joined) == 2:  # the join: both regions are done
            exe.status, exe.outcome, exe.finished_at = "finished", "completed", time.time()
            exe.active_path = "done"
            emits = [(None, Event(name="order.completed", payload={"order": exe.id}))]
        store.commit(
            exe,
            emits,
            processed_event_id=entry.event.id,
            trace=_step(entry.event.name, "placed", exe.active_path or ""),
            acks=(entry,),
        )
        say(f"outbox relay: delivered #{entry.seq} {entry.event.name} to {entry.target_id}")

    relay = Relay(store, "demo-relay", on_outbox=deliver, on_spawn=create_child, on_timer=fire)
    relay.run_once()  # the two spawns (the reminder is not due yet)

    time.sleep(0.35)
    relay.run_once()  # the reminder

    for child_id, done in ((f"{order.id}.payment", "paid"), (f"{order.id}.shipping", "shipped")):
        member = store.load(child_id)
        assert member is not None
        member.status, member.outcome, member.finished_at = "finished", done, time.time()
        seqs = store.commit(
            member,
            [(order.id, Event(name=done, payload={"from": child_id}))],
            trace=_step("work", member.active_path or "", "done"),
        )
        say(f"{child_id}: finished ({done}), emitted outbox #{seqs[0]} to the parent")

    while relay.run_once():  # the children's events, then the order's completion
        pass

    say(f"trace of {order.id}:")
    for step in store.read_trace(order.id):
        say(f"  {step['index']}: {step['event']:<10} {step['transition']}")
    say("executions:")
    for s in store.list_executions(definition_id="order", limit=10).items:
        if s.id.startswith(order.id):
            say(f"  {s.id:<32} v{s.version} {s.status:<9} {s.outcome or ''}")
    return order.id
