"""The processes of `benchmarks.engine`: an engine's workers and a submitter, over whichever
harel_store is first on the path (this tree's, or an older revision's: `--against`), so
they use nothing but its public API, and `wait_for` only where it exists.

    python benchmarks/engine_worker.py worker DB NAME LOG [--async] [--poll S] [--count]
    python benchmarks/engine_worker.py submit DB PREFIX LOG --orders N [--concurrency K] [--count]

DB is a file or a server's URL (its token in ``$HAREL_AUTH_TOKEN``). A worker runs a relay
with the order workflow's three handlers until its stdin closes; the submitter places
orders, K at a time, each waited for to the end. Each appends JSON lines to LOG, written
when it ends (no I/O on the measured path): ``["commit", key, t, pid]`` when a commit that
wrote a relay item returned, ``["handle", key, t, pid]`` when its handler started (the
first call), ``["late", s]`` a timer's lateness, ``["order", id, placed, committed, done]``.
Times are CLOCK_MONOTONIC, one clock for every process of the machine.

The workflow: an order's commit forks two children (the spawn relay) and arms a reminder
(fires 0.1 s later) and a timeout (cancelled at the join). A child is created, does its
work and reports to its parent in one commit; the parent joins the reports in its context
and finishes at the second. Handlers let a StoreConflict escape (two reports at once): the
relay is what retries.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from typing import Any

from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    Event,
    Execution,
    LibsqlStore,
    Relay,
    StoreConflict,
    TimerOp,
)

REMIND = 0.1  # seconds after an order is placed
CHILDREN = ("payment", "shipping")
PID = os.getpid()
records: list[list[Any]] = []
handled: set[str] = set()  # keys whose handler started (a retried call is not a new start)


def now() -> float:
    return time.monotonic()


def kind_of(batch: Any) -> str:
    """What a write batch does, by its statements: a commit, a claim, an ack, ..."""
    names = [query.name for query, _ in batch.steps]
    if any(
        n in ("insert_execution", "update_execution") or "update_execution_" in n for n in names
    ):
        return "commit"
    for word in ("claim", "ack", "fail", "release", "extend"):
        if any(n.startswith(word) for n in names):
            return word
    return names[0] if names else "empty"


def count_transactions() -> None:
    """Each write transaction this process makes on a local file logged when it commits, as
    ``["tx", [what each batch that landed in it does]]``: a group's members rolled back to
    their savepoints are left out; a transaction that fails is not logged. Only with this
    tree's code (``--count``): another revision's insides may differ."""
    from harel_store.batch import Batch
    from harel_store.connection.local import LocalConnection

    original = LocalConnection._transaction

    def counted(self: Any, write: Any, arg: Any) -> Any:
        result = original(self, write, arg)
        try:
            if isinstance(arg, Batch):
                landed = [arg]
            else:  # a group: one (results, error) a member
                landed = [m.batch for m, (_, e) in zip(arg, result, strict=True) if e is None]
            records.append(["tx", [kind_of(batch) for batch in landed]])
        except Exception as exc:  # the count must never fail a write that landed
            records.append(["tx-uncounted", repr(exc)])
        return result

    LocalConnection._transaction = counted  # type: ignore[method-assign]


def started(key: str) -> None:
    if key not in handled:
        handled.add(key)
        records.append(["handle", key, now(), PID])


def open_store(db: str) -> Any:
    return LibsqlStore(db, auth_token=os.environ.get("HAREL_AUTH_TOKEN", ""))


def child_of(spawn: Any) -> tuple[Execution, list[tuple[str, Event]]]:
    """The child, done, and its report to its parent: its one commit."""
    child = Execution(
        id=spawn.child_id,
        definition_id=spawn.root_path,
        parent_id=spawn.parent_id,
        status="finished",
        outcome="done",
        active_path="done",
        context=spawn.context,
    )
    report = Event(name=f"{spawn.root_path}.done", id=f"{spawn.child_id}:done")
    return child, [(spawn.parent_id, report)]


def joined(exe: Execution, event: Event) -> tuple[list[Any], list[Any]]:
    """The parent's step for a child's report: (emits, timers); at the second, it finishes."""
    reports = exe.context.setdefault("joined", [])
    reports.append(event.id)
    if len(reports) < len(CHILDREN):
        return [], []
    exe.status, exe.outcome, exe.active_path = "finished", "completed", "done"
    return [(None, Event(name="order.completed"))], [TimerOp.cancel("timeout")]


def sync_worker(db: str, name: str, poll: float) -> None:
    store = open_store(db)

    def on_spawn(spawn: Any) -> None:
        started(spawn.child_id)
        child, emits = child_of(spawn)
        try:
            store.commit(child, emits, acks=(spawn,))
        except StoreConflict:  # created before (a lost lease)
            return
        records.append(["commit", emits[0][1].id, now(), PID])

    def on_outbox(entry: Any) -> None:
        if entry.target_id is None:
            return
        started(entry.event.id)
        exe, seen = store.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            return
        emits, timers = joined(exe, entry.event)
        store.commit(exe, emits, processed_event_id=entry.event.id, timers=timers, acks=(entry,))

    def on_timer(timer: Any) -> None:
        if timer.event_id not in handled:
            records.append(["late", time.time() - timer.fire_at])
        started(timer.event_id)
        exe, seen = store.load_for_event(timer.execution_id, timer.event_id)
        if exe is None or seen:
            return
        store.commit(exe, [], processed_event_id=timer.event_id, acks=(timer,))

    relay = Relay(store, name, on_spawn=on_spawn, on_outbox=on_outbox, on_timer=on_timer, poll=poll)
    thread = threading.Thread(target=relay.run)
    thread.start()
    print("ready", flush=True)
    sys.stdin.read()  # until the benchmark closes it
    relay.stop()
    thread.join()
    store.close()


async def async_worker(db: str, name: str, poll: float) -> None:
    token = os.environ.get("HAREL_AUTH_TOKEN", "")
    store = await AsyncLibsqlStore.create(db, auth_token=token)

    async def on_spawn(spawn: Any) -> None:
        started(spawn.child_id)
        child, emits = child_of(spawn)
        try:
            await store.commit(child, emits, acks=(spawn,))
        except StoreConflict:
            return
        records.append(["commit", emits[0][1].id, now(), PID])

    async def on_outbox(entry: Any) -> None:
        if entry.target_id is None:
            return
        started(entry.event.id)
        exe, seen = await store.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            return
        emits, timers = joined(exe, entry.event)
        await store.commit(
            exe, emits, processed_event_id=entry.event.id, timers=timers, acks=(entry,)
        )

    async def on_timer(timer: Any) -> None:
        if timer.event_id not in handled:
            records.append(["late", time.time() - timer.fire_at])
        started(timer.event_id)
        exe, seen = await store.load_for_event(timer.execution_id, timer.event_id)
        if exe is None or seen:
            return
        await store.commit(exe, [], processed_event_id=timer.event_id, acks=(timer,))

    relay = AsyncRelay(
        store, name, on_spawn=on_spawn, on_outbox=on_outbox, on_timer=on_timer, poll=poll
    )
    task = asyncio.create_task(relay.run())
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.read)
    relay.stop()
    await task
    await store.close()


def submit(db: str, prefix: str, orders: int, concurrency: int, gap: float) -> None:
    store = open_store(db)
    lock = threading.Lock()

    def finished(execution_id: str) -> None:
        if hasattr(store, "wait_for"):
            store.wait_for(execution_id, timeout=120)
            return
        deadline = time.monotonic() + 120  # an older store: look every millisecond
        while (exe := store.load(execution_id)) is None or exe.status == "running":
            if time.monotonic() > deadline:
                raise TimeoutError(execution_id)
            time.sleep(0.001)

    def place(i: int) -> None:
        order = Execution(id=f"{prefix}-{i}", definition_id="order", context={"joined": []})
        spawns: list[tuple[str, str, dict[str, Any]]] = [
            (f"{order.id}.{name}", name, {}) for name in CHILDREN
        ]
        placed = now()
        wall = time.time()
        timers = [
            TimerOp.schedule("remind", wall + REMIND),
            TimerOp.schedule("timeout", wall + 600),
        ]
        store.commit(order, [], timers=timers, spawns=spawns)
        committed = now()
        finished(order.id)
        done = now()
        with lock:
            records.extend(["commit", child_id, committed, PID] for child_id, _, _ in spawns)
            records.append(["order", order.id, placed, committed, done])

    def run(first: int) -> None:
        for i in range(first, orders, concurrency):
            place(i)
            if gap:
                time.sleep(gap * (0.5 + (i * 7919 % 100) / 100))  # spread across any poll

    threads = [threading.Thread(target=run, args=(k,)) for k in range(concurrency)]
    began, cpu = now(), time.process_time()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    print("took", now() - began, time.process_time() - cpu, flush=True)  # seconds, CPU seconds
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("role", choices=["worker", "submit"])
    parser.add_argument("db")
    parser.add_argument("name", help="the worker's id, or the orders' id prefix")
    parser.add_argument("log")
    parser.add_argument("--async", dest="aio", action="store_true", help="AsyncRelay")
    parser.add_argument("--poll", type=float, default=1.0)
    parser.add_argument("--count", action="store_true", help="log the write transactions")
    parser.add_argument("--orders", type=int, default=10)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--gap", type=float, default=0.0, help="seconds between a task's orders")
    args = parser.parse_args()
    if args.count:
        count_transactions()
    try:
        if args.role == "submit":
            submit(args.db, args.name, args.orders, args.concurrency, args.gap)
        elif args.aio:
            asyncio.run(async_worker(args.db, args.name, args.poll))
        else:
            sync_worker(args.db, args.name, args.poll)
    finally:
        with open(args.log, "a") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)


if __name__ == "__main__":
    main()
