"""The quick-start job: an order workflow driven through the store, printed as it goes.

An order forks into two child executions (payment, shipping, each of its own definition)
through the spawn relay; a reminder timer fires; the children report back through the
outbox; the parent joins them, its join kept in its own context (any worker, or a restart,
sees how far it got), cancels its timeout and finishes; a submitter waits for it with
`wait_for`. Every step is one ``commit`` with a trace entry, as an engine writes it, and
the relays run as an engine runs them: a `Relay` running in a thread of its own, woken by
each commit. What the relay's handlers did is printed by the main thread, in order.
"""

from __future__ import annotations

import hashlib
import json
import queue
import threading
import time
import uuid
from typing import Any, TextIO

from harel_store.errors import StoreConflict, StoreError
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

MACHINES: dict[str, dict[str, Any]] = {
    "order": {
        "states": {
            "placed": {
                "parallel": ["payment", "shipping"],
                "after": {"0.3s": "remind", "30s": "timeout"},
                "join": "done",
            },
            "done": {"final": True},
        },
    },
    "payment": {"states": {"charging": {"on": {"charged": "paid"}}, "paid": {"final": True}}},
    "shipping": {"states": {"packing": {"on": {"packed": "shipped"}}, "shipped": {"final": True}}},
}
# What each child reports to its parent when it finishes.
REPORTS = {"payment": "paid", "shipping": "shipped"}
WAIT = 10.0  # seconds: far more than any step takes


def _step(event: str, source: str, target: str, **extra: Any) -> dict[str, Any]:
    return {"event": event, "transition": f"{source} -> {target}", "at": time.time(), **extra}


def _publish(store: Store, definition_id: str) -> DefinitionRecord:
    source = {"machine": MACHINES[definition_id]}
    digest = hashlib.sha256(json.dumps(source, sort_keys=True).encode()).hexdigest()
    record = DefinitionRecord(
        definition_id=definition_id,
        version=1,
        digest=digest,
        source=source,
        published_at=time.time(),
    )
    return store.publish_definition(record)


def run(store: Store, out: TextIO) -> str:
    """Drive one order to completion through ``store``; return the order's id."""

    def say(text: str) -> None:
        print(text, file=out, flush=True)

    for definition_id in MACHINES:
        record = _publish(store, definition_id)
        say(f"published definition {definition_id} v{record.version} ({record.digest[:12]})")

    # The handlers run on the relay's thread; what they did is told to the main thread,
    # which prints it in order.
    news: queue.Queue[str] = queue.Queue()

    def create_child(spawn: SpawnEntry) -> None:  # the child's insert CAS, and the spawn
        start = "charging" if spawn.root_path == "payment" else "packing"
        child = Execution(
            id=spawn.child_id,
            definition_id=spawn.root_path,  # each child runs its own statechart
            parent_id=spawn.parent_id,
            active_path=start,
            context=spawn.context,
        )
        try:
            store.commit(child, [], acks=(spawn,), trace=_step("spawned", "-", start))
        except StoreConflict:  # created before (a lost lease): the round's ack consumes it
            return
        news.put(f"spawn relay: created {child.id} ({child.definition_id})")

    def fire(timer: DueTimer) -> None:  # the firing's event_id is its dedupe marker
        exe, seen = store.load_for_event(timer.execution_id, timer.event_id)
        if exe is None or seen:
            return
        store.commit(
            exe,
            [(None, Event(name="reminder.sent", payload={"order": exe.id}))],
            processed_event_id=timer.event_id,
            trace=_step(f"timer:{timer.path}", "placed", "placed"),
            acks=(timer,),
        )
        late = (time.time() - timer.fire_at) * 1000
        news.put(f"timer {timer.path} fired for {timer.execution_id}, {late:.0f} ms after its time")

    def deliver(entry: OutboxEntry) -> None:  # the event's id is its dedupe marker
        if entry.target_id is None:  # to the outside world: published (the round acks it)
            news.put(f"outbox relay: published {entry.event.name} {entry.event.payload}")
            return
        exe, seen = store.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            return
        # The join lives in the parent's context: whichever worker delivers the second
        # report sees the first (a StoreConflict, two reports at once, is retried by the
        # relay, which calls this again: it reloads).
        joined = exe.context.setdefault("joined", [])
        joined.append(entry.event.name)
        emits: list[tuple[str | None, Event]] = []
        timers: list[TimerOp] = []
        if len(joined) == len(REPORTS):  # the join: both regions are done
            exe.status, exe.outcome, exe.finished_at = "finished", "completed", time.time()
            exe.active_path = "done"
            emits = [(None, Event(name="order.completed", payload={"order": exe.id}))]
            timers = [TimerOp.cancel("placed.timeout")]
        store.commit(
            exe,
            emits,
            processed_event_id=entry.event.id,
            timers=timers,
            trace=_step(entry.event.name, "placed", exe.active_path or ""),
            acks=(entry,),
        )
        joins = f"joined {len(joined)} of {len(REPORTS)}"
        if exe.status == "finished":
            joins += f": {exe.id} finished, its timeout cancelled"
        news.put(f"outbox relay: delivered {entry.event.name} to {exe.id} ({joins})")

    def told(count: int) -> None:
        for _ in range(count):
            try:
                say(news.get(timeout=WAIT))
            except queue.Empty:
                raise StoreError(f"the demo's relay did nothing for {WAIT:g} s") from None

    relay = Relay(store, "demo-relay", on_outbox=deliver, on_spawn=create_child, on_timer=fire)
    worker = threading.Thread(target=relay.run, name="demo relay")
    worker.start()
    try:
        order = Execution(
            id=f"order-{uuid.uuid4().hex[:8]}",
            definition_id="order",
            active_path="new",
            context={"items": 3, "total": 42.5, "joined": []},
        )
        store.save(order)
        say(f"created {order.id} at version {order.version}")

        # The fork: both children and the timers commit with the parent's advance.
        place = Event(name="place")
        order.active_path = "placed"
        store.commit(
            order,
            [],
            processed_event_id=place.id,
            timers=(
                TimerOp.schedule("placed.remind", time.time() + 0.3),
                TimerOp.schedule("placed.timeout", time.time() + 30),
            ),
            spawns=[(f"{order.id}.{name}", name, {"order": order.id}) for name in REPORTS],
            trace=_step("place", "new", "placed"),
        )
        say(f"{order.id}: place -> placed (v{order.version}), forked 2 children, timers armed")
        told(len(REPORTS))  # the spawn relay creates the children
        told(1)  # the reminder fires 0.3 s later, woken by its timer (and its email is sent)
        told(1)

        # Each child does its work and reports to its parent (an engine would step it on
        # an event of its own).
        for name, report in REPORTS.items():
            child = store.wait_for(f"{order.id}.{name}", status="running", timeout=WAIT)
            child.status, child.outcome, child.finished_at = "finished", report, time.time()
            child.active_path = report
            seqs = store.commit(
                child,
                [(order.id, Event(name=report, payload={"from": child.id}))],
                trace=_step("work", "-", report),
            )
            say(f"{child.id}: finished ({report}), reported to the parent (outbox #{seqs[0]})")
            told(1)
        told(1)  # the order's completion, published

        done = store.wait_for(order.id, timeout=WAIT)  # what a submitter does
        say(f"wait_for: {done.id} is {done.status} ({done.outcome}) at version {done.version}")
    finally:
        relay.stop()
        worker.join()

    say(f"trace of {order.id}:")
    for step in store.read_trace(order.id):
        say(f"  {step['index']}: {step['event']:<20} {step['transition']}")
    say("executions:")
    for s in store.list_executions(id_prefix=order.id, limit=10).items:
        say(f"  {s.id:<32} {s.definition_id:<9} v{s.version} {s.status:<9} {s.outcome or ''}")
    return order.id
