"""One relay for a whole fleet (issue 39, build item 3): a loop per database, woken by its
own database, each item acked, failed or released in the database it was claimed from; a
handler that delivers to an execution of another database commits there (deduplicated by
the event's id) and the relay acks the item in its source."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    AsyncFleet,
    AsyncRelay,
    Event,
    Execution,
    Fleet,
    LibsqlStore,
    OutboxEntry,
    Relay,
    SpawnEntry,
    TimerOp,
)


def databases(tmp_path: Path, n: int = 3) -> dict[str, str]:
    return {f"db{i}": str(tmp_path / f"db{i}.db") for i in range(n)}


def ids_in_each(fleet: Any, per: int = 1) -> dict[str, list[str]]:
    """``per`` root ids routed to each database of the fleet."""
    found: dict[str, list[str]] = {name: [] for name in fleet.names}
    i = 0
    while any(len(ids) < per for ids in found.values()):
        name = fleet.route(f"order-{i}")
        if len(found[name]) < per:
            found[name].append(f"order-{i}")
        i += 1
    return found


def deliver_to(fleet: Fleet, got: list[tuple[str, str]]) -> Any:
    """A handler that delivers an entry to its target, wherever it lives: acked in the
    target's commit when that is the entry's own database, else by the relay's round."""

    def deliver(entry: OutboxEntry) -> None:
        target = fleet.store_for(entry.target_id or "")
        exe, seen = target.load_for_event(entry.target_id or "", entry.event.id)
        assert exe is not None and not seen
        same = fleet.route(entry.target_id or "") == fleet.route(entry.event.data["from"])
        target.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,) if same else ())
        got.append((entry.target_id or "", fleet.route(entry.target_id or "")))

    return deliver


def test_one_round_serves_every_database_and_acks_in_each_source(tmp_path: Path) -> None:
    with Fleet(databases(tmp_path)) as fleet:
        ids = ids_in_each(fleet, per=2)
        every = [i for name in fleet.names for i in ids[name]]
        for exe_id in every:
            fleet.store_for(exe_id).save(Execution(id=exe_id, definition_id="order"))
        # Each root emits to the next root (another database for most), spawns a child
        # (its own database) and arms a timer that is due.
        for source, target in zip(every, every[1:] + every[:1], strict=True):
            store = fleet.store_for(source)
            exe = store.load(source)
            assert exe is not None
            event = Event(name="ping", id=f"ping-{source}", data={"from": source})
            store.commit(
                exe,
                [(target, event)],
                spawns=[(f"{source}.child", "start", {})],
                timers=[TimerOp.schedule("t", time.time() - 1)],
            )
        got: list[tuple[str, str]] = []
        spawned: list[SpawnEntry] = []
        fired: list[str] = []
        relay = Relay(
            fleet,
            "w",
            on_outbox=deliver_to(fleet, got),
            on_spawn=spawned.append,
            on_timer=lambda t: fired.append(t.execution_id),
        )
        assert relay.run_once() == 3 * len(every)
        assert sorted(target for target, _ in got) == sorted(every)
        assert all(fleet.route(target) == name for target, name in got)
        assert sorted(s.child_id for s in spawned) == sorted(f"{i}.child" for i in every)
        assert sorted(fired) == sorted(every)
        for name in fleet.names:  # every item gone from its own database
            store = fleet.store(name)
            assert store.pending_outbox() == store.pending_spawns() == []
            assert store.due_timers(time.time()) == []
            for exe_id in ids[name]:
                exe = store.load(exe_id)
                assert exe is not None and exe.version == 3  # saved, committed, delivered to
        assert relay.run_once() == 0


def test_a_failed_item_is_failed_in_its_own_database(tmp_path: Path) -> None:
    with Fleet(databases(tmp_path, 2)) as fleet:
        ids = ids_in_each(fleet)
        for name in fleet.names:
            exe = Execution(id=ids[name][0], definition_id="d")
            fleet.store(name).commit(exe, [(None, Event(name="boom" if name == "db1" else "ok"))])

        def deliver(entry: OutboxEntry) -> None:
            if entry.event.name == "boom":
                raise RuntimeError("no")

        relay = Relay(fleet, "w", on_outbox=deliver, max_attempts=1)
        assert relay.run_once() == 2
        assert fleet.store("db0").pending_outbox() == []
        (kept,) = fleet.store("db1").pending_outbox()
        assert kept.event.name == "boom" and fleet.store("db1").attempts_of([kept]) == [1]


def test_a_stop_in_one_databases_round_ends_run_once(tmp_path: Path) -> None:
    with Fleet(databases(tmp_path, 2)) as fleet:
        for name, (exe_id,) in ids_in_each(fleet).items():
            events = [(None, Event(name=f"{name}-{i}")) for i in range(3)]
            fleet.store(name).commit(Execution(id=exe_id, definition_id="d"), events)
        got: list[str] = []

        def deliver(entry: OutboxEntry) -> None:
            got.append(entry.event.name)
            relay.stop()

        relay = Relay(fleet, "w", on_outbox=deliver)
        assert relay.run_once() == 1 and got == ["db0-0"]
        assert len(fleet.store("db0").pending_outbox()) == 2  # released, not handled
        assert len(fleet.store("db1").pending_outbox()) == 3  # its round never began
        assert relay.run_once() == 1  # a new call runs again


def test_run_is_woken_by_each_database_and_stops(tmp_path: Path) -> None:
    """poll is 30 s: a commit to any database is handled within a second and a half."""
    with Fleet(databases(tmp_path)) as fleet:
        got: list[tuple[str, float]] = []
        arrived = threading.Event()

        def deliver(entry: OutboxEntry) -> None:
            got.append((entry.event.name, time.monotonic()))
            arrived.set()

        relay = Relay(fleet, "w", on_outbox=deliver, poll=30.0)
        runner = threading.Thread(target=relay.run)
        runner.start()
        try:
            time.sleep(0.3)  # every loop waiting
            for name in reversed(fleet.names):
                with LibsqlStore(databases(tmp_path)[name]) as other:  # as another process
                    sent = time.monotonic()
                    arrived.clear()
                    other.commit(
                        Execution(id=f"x-{name}", definition_id="d"), [(None, Event(name=name))]
                    )
                    assert arrived.wait(1.5)
                    assert got[-1][0] == name and got[-1][1] - sent < 1.5
        finally:
            relay.stop()
            runner.join(10)
        assert not runner.is_alive()
        assert [n for n, _ in got] == list(reversed(fleet.names))


def test_the_async_relay_serves_an_async_fleet(tmp_path: Path) -> None:
    async def main() -> None:
        async with AsyncFleet(databases(tmp_path)) as fleet:
            ids = ids_in_each(fleet)
            for name, (exe_id,) in ids.items():
                store = await fleet.store(name)
                await store.commit(
                    Execution(id=exe_id, definition_id="d"), [(None, Event(name=name))]
                )
            got: list[str] = []

            async def deliver(entry: OutboxEntry) -> None:
                got.append(entry.event.name)

            relay = AsyncRelay(fleet, "w", on_outbox=deliver, poll=30.0)
            assert await relay.run_once() == 3
            assert sorted(got) == fleet.names
            runner = asyncio.ensure_future(relay.run())
            await asyncio.sleep(0.3)
            store = await fleet.store("db2")
            exe = await store.load(ids["db2"][0])
            assert exe is not None
            await store.commit(exe, [(None, Event(name="again"))])
            for _ in range(150):
                if "again" in got:
                    break
                await asyncio.sleep(0.01)
            assert "again" in got
            relay.stop()
            await asyncio.wait_for(runner, 10)
            for name in fleet.names:
                assert await (await fleet.store(name)).pending_outbox() == []

    asyncio.run(main())


def test_a_relay_takes_a_fleet_of_its_own_kind(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="AsyncFleet"):
        AsyncRelay(Fleet(databases(tmp_path)), "w", on_outbox=lambda e: None)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Fleet"):
        Relay(AsyncFleet(databases(tmp_path)), "w", on_outbox=lambda e: None)  # type: ignore[arg-type]
