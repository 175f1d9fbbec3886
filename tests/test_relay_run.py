"""The relay runtime's loop: `Relay.run` in a thread of its own (stop from another thread,
the wake-up on a commit of this process with a 30 s poll, a handler that outlives its
lease, run again after stop, KeyboardInterrupt), and `AsyncRelay` on its event loop
(concurrency bounded, run and stop), on the sync kinds of store and on both async ones.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    DueTimer,
    Event,
    Execution,
    OutboxEntry,
    Relay,
    TimerOp,
)
from tests.test_relay_runtime import WAIT, seed

SYNC_KINDS = ["libsql-file", "sqlite-file", "libsql-remote", "libsql-replica"]


@pytest.fixture(params=SYNC_KINDS)
def kind(request: pytest.FixtureRequest) -> str:  # overrides conftest's kind for these tests
    return str(request.param)


@pytest.fixture
def running(open_store: Any) -> Iterator[tuple[Any, list[OutboxEntry], Callable[..., Relay]]]:
    """A store, what its relay handled, and a function that starts one ``Relay.run`` in a
    thread (stopped and joined at the end)."""
    store = open_store()
    handled: list[OutboxEntry] = []
    started: list[tuple[Relay, threading.Thread]] = []

    def start(**options: Any) -> Relay:
        options.setdefault("on_outbox", handled.append)
        relay = Relay(store, "w1", **options)
        thread = threading.Thread(target=relay.run, daemon=True)
        thread.start()
        started.append((relay, thread))
        return relay

    yield store, handled, start
    for relay, thread in started:
        relay.stop()
        thread.join(WAIT)
        assert not thread.is_alive(), "run() did not return after stop()"


def until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.002)


def test_an_idle_relay_wakes_on_a_commit_of_this_process(running: Any) -> None:
    store, handled, start = running
    store.save(Execution(id="target", definition_id="d"))
    start(poll=30.0)
    time.sleep(0.1)  # the relay's first round found nothing: it waits up to 30 s
    source = Execution(id="source", definition_id="d")
    for i in range(3):
        store.commit(source, [("target", Event(name="go", id=f"ev-{i}"))])
        until(lambda i=i: len(handled) == i + 1, f"event {i} delivered within {WAIT} s")
    until(lambda: store.pending_outbox() == [], "every delivered entry acked")


def test_stop_from_another_thread_ends_run(running: Any) -> None:
    _, _, start = running
    relay = start(poll=30.0)
    time.sleep(0.1)
    relay.stop()  # the fixture checks that run() returned


def test_a_handler_that_outlives_its_lease_keeps_it(running: Any) -> None:
    store, handled, start = running
    seed(store)
    stolen: list[OutboxEntry] = []

    def slow(entry: OutboxEntry) -> None:
        # Two leases of 1 s: renewed meanwhile (every third of one), never handed out. A
        # lease of 0.3 s lapsed on a loaded machine, where a replica's renewal took longer.
        time.sleep(2.0)
        stolen.extend(store.claim_outbox("w2"))
        handled.append(entry)

    start(on_outbox=slow, lease=1.0, poll=30.0)
    until(lambda: len(handled) == 3, "the slow handler finished every entry")
    until(lambda: store.pending_outbox() == [], "every entry acked")
    assert stolen == []


def test_run_again_after_stop(running: Any) -> None:
    store, handled, _ = running
    relay = Relay(store, "w1", on_outbox=handled.append, poll=30.0)
    first = threading.Thread(target=relay.run, daemon=True)
    first.start()
    time.sleep(0.05)
    relay.stop()
    first.join(WAIT)
    assert not first.is_alive()
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    store.save(Execution(id="target", definition_id="d"))
    store.commit(Execution(id="source", definition_id="d"), [("target", Event(name="go"))])
    until(lambda: len(handled) == 1, "delivered by the second run()")
    relay.stop()
    thread.join(WAIT)
    assert not thread.is_alive()


# --- AsyncRelay: concurrency and run() on its loop ---


@pytest.mark.parametrize("where", ["file", "remote"])
def test_async_relay_keeps_at_most_concurrency_handlers_in_flight(
    where: str, tmp_path: Any, request: pytest.FixtureRequest
) -> None:
    options: dict[str, Any] = {}
    database: Any = tmp_path / "a.db"
    if where == "remote":
        from tests.conftest import reset_remote

        server = request.getfixturevalue("sqld")
        reset_remote(server)
        database, options = server.url, {"auth_token": server.token}

    async def main() -> None:
        store = await AsyncLibsqlStore.create(database, **options)
        try:
            await store.save(Execution(id="target", definition_id="d"))
            events = [(f"target-{i % 8}", Event(name="go", id=f"ev-{i}")) for i in range(40)]
            await store.commit(Execution(id="source", definition_id="d"), events)
            in_flight = peak = 0
            busy: set[str | None] = set()  # the executions a handler is stepping
            done: list[str] = []

            async def handle(entry: OutboxEntry) -> None:
                nonlocal in_flight, peak
                assert entry.target_id not in busy  # one item of an execution at a time
                busy.add(entry.target_id)
                in_flight += 1
                peak = max(peak, in_flight)
                await asyncio.sleep(0.01)
                in_flight -= 1
                busy.discard(entry.target_id)
                if entry.event.id == "ev-7":
                    raise RuntimeError("boom")
                done.append(entry.event.id)

            relay = AsyncRelay(store, "w1", on_outbox=handle, concurrency=4, batch=25)
            assert await relay.run_once() == 25
            assert await relay.run_once() == 15
            assert peak == 4
            assert sorted(done) == sorted(f"ev-{i}" for i in range(40) if i != 7)
            (failed,) = await store.outbox_view()
            assert (failed.event.id, failed.last_error) == ("ev-7", "RuntimeError: boom")

            # run() wakes on a commit of this process and returns after stop().
            second = AsyncRelay(store, "w2", on_outbox=handle, poll=30)
            runner = asyncio.ensure_future(second.run())
            await asyncio.sleep(0.05)
            await store.commit(
                Execution(id="late", definition_id="d"), [("target", Event(name="go", id="late"))]
            )
            deadline = time.monotonic() + WAIT
            while "late" not in done:
                assert time.monotonic() < deadline, "the async relay never woke"
                await asyncio.sleep(0.002)
            assert not runner.done()
            second.stop()
            await asyncio.wait_for(runner, WAIT)
        finally:
            await store.close()

    asyncio.run(main())


def test_keyboard_interrupt_ends_the_round_and_releases_the_rest(open_store: Any) -> None:
    store = open_store()
    seed(store)

    def handle(entry: OutboxEntry) -> None:
        if entry.event.id == "ev-1":
            raise KeyboardInterrupt

    relay = Relay(store, "w1", on_outbox=handle)
    with pytest.raises(KeyboardInterrupt):
        relay.run_once()
    # ev-0 returned (acked); ev-1 and ev-2 were not handled: released, no attempt counted.
    assert [(e.event.id, e.attempts, e.claimed_by) for e in store.outbox_view()] == [
        ("ev-1", 0, None),
        ("ev-2", 0, None),
    ]


# --- a relay's edges (issue "Hardening, round 4", classes 1, 3, 4 and 5) ---


def test_a_second_concurrent_run_is_refused_and_stop_ends_the_first(running: Any) -> None:
    _, _, start = running
    relay = start(poll=30.0)
    time.sleep(0.1)
    with pytest.raises(RuntimeError, match="running already"):
        relay.run()
    relay.stop()  # the fixture checks that the first run() returned

    async def main() -> None:
        store = await AsyncLibsqlStore.create(":memory:")
        relay = AsyncRelay(store, "w1", on_outbox=_noop, poll=30.0)
        first = asyncio.ensure_future(relay.run())
        await asyncio.sleep(0.05)
        with pytest.raises(RuntimeError, match="running already"):
            await relay.run()
        relay.stop()
        await asyncio.wait_for(first, WAIT)
        await store.close()

    asyncio.run(main())


async def _noop(item: Any) -> None:
    return None


def test_a_timer_its_handler_consumed_and_rearmed_at_the_same_time_stays(open_store: Any) -> None:
    store = open_store()
    exe = Execution(id="exe", definition_id="d")
    store.commit(exe, [], timers=[TimerOp.schedule("t", 5.0)])

    def fire(timer: DueTimer) -> None:
        exe = store.load(timer.execution_id)
        again = TimerOp.schedule(timer.path, timer.fire_at)  # the same time: a new firing
        store.commit(exe, [], processed_event_id=timer.event_id, timers=[again], acks=(timer,))

    assert Relay(store, "w1", on_timer=fire).run_once() == 1
    # The round's own ack would have removed the new timer: it sends none for what the
    # handler consumed.
    assert store.timers_of("exe") == [("t", 5.0)]


def test_a_timer_its_handler_rearmed_at_the_same_time_without_consuming_it_stays(
    open_store: Any,
) -> None:
    store = open_store()
    exe = Execution(id="exe", definition_id="d")
    store.commit(exe, [], timers=[TimerOp.schedule("t", 5.0)])
    fired: list[DueTimer] = []

    def fire(timer: DueTimer) -> None:
        fired.append(timer)
        if len(fired) == 1:  # re-armed, not consumed: the re-arm drops the relay's claim
            store.commit(store.load("exe"), [], timers=[TimerOp.schedule("t", timer.fire_at)])

    relay = Relay(store, "w1", on_timer=fire)
    assert relay.run_once() == 1
    # The round's ack removes only what the relay still holds: the re-armed timer stays,
    # and fires again.
    assert store.timers_of("exe") == [("t", 5.0)]
    assert relay.run_once() == 1
    assert store.timers_of("exe") == []
    assert len(fired) == 2


def test_an_interrupt_in_a_round_whose_settling_fails_goes_on(
    open_store: Any, caplog: pytest.LogCaptureFixture
) -> None:
    store = open_store()
    seed(store)

    def handle(entry: OutboxEntry) -> None:
        store.close()  # the round's release will fail: the store is closed
        raise KeyboardInterrupt

    with (
        caplog.at_level(logging.WARNING, logger="harel_store.relay"),
        pytest.raises(KeyboardInterrupt),
    ):
        Relay(store, "w1", on_outbox=handle).run_once()
    assert "could not settle its round as it ended" in caplog.text


def test_a_cancelled_async_round_releases_what_its_claim_brought(server: Any, proxy: Any) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        try:
            await store.save(Execution(id="target", definition_id="d"))
            events = [("target", Event(name="go", id=f"ev-{i}")) for i in range(3)]
            await store.commit(Execution(id="source", definition_id="d"), events)
            relay = AsyncRelay(store, "w1", on_outbox=_noop, max_attempts=2)
            proxy.delay = 0.3  # the claim is on its way when the round is cancelled
            round_ = asyncio.ensure_future(relay.run_once())
            await asyncio.sleep(0.1)
            round_.cancel()
            with pytest.raises(asyncio.CancelledError):
                await round_
            proxy.delay = 0.0
            rows = await store.outbox_view()
            # Claimed, then given back: claimable at once, the attempt not counted.
            assert [(e.event.id, e.claimed_by, e.attempts) for e in rows] == [
                ("ev-0", None, 0),
                ("ev-1", None, 0),
                ("ev-2", None, 0),
            ]
        finally:
            await store.close()

    asyncio.run(main())
