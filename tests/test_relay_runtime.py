"""The relay runtime (`Relay`, `AsyncRelay`) over every kind of store: a round handles each
kind and acks what returned in one `ack`; a raising handler is failed with a doubling
backoff until a claim makes its item a dead letter; a handler may consume its own item in
its commit; `stop` from a handler or another thread releases what was not handled; a
handler that outlives its lease keeps it; an idle relay wakes on a commit of this process.

Leases and backoffs run on the database's clock: the tests move it by moving claimed_until
back (`elapse`), except where a lease must really run out under a live handler.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    DueTimer,
    Event,
    Execution,
    LibsqlStore,
    OutboxEntry,
    Relay,
    SpawnEntry,
    StoreConflict,
    TimerOp,
)
from harel_store.batch import Batch
from tests.test_claims import elapse

WAIT = 10.0  # seconds a test waits for what must happen (a relay's poll is 30)


def seed(store: Any, bad: int = 0) -> None:
    """A target, three events for it (and ``bad`` more named "bad"), a spawn, a due timer."""
    store.save(Execution(id="target", definition_id="d", context={"seen": []}))
    emits = [("target", Event(name="go", id=f"ev-{i}")) for i in range(3)]
    emits += [("target", Event(name="bad", id=f"bad-{i}")) for i in range(bad)]
    store.commit(
        Execution(id="source", definition_id="d"),
        emits,
        timers=[TimerOp.schedule("t", 1.0)],
        spawns=[("child", "root", {"k": 1})],
    )


class Harness:
    """One test body over a sync store (`Relay`) or an async one (`AsyncRelay`, driven on
    the test's event loop): handlers are written as plain functions of the item."""

    def __init__(self, store: Any) -> None:
        self.store = store  # what the test body reads and writes through (sync calls)
        self.aio: AsyncLibsqlStore | None = getattr(store, "_store", None)
        self.loop: asyncio.AbstractEventLoop | None = getattr(store, "_loop", None)

    def relay(self, **options: Any) -> Any:
        handlers = {
            k: options.pop(k) for k in ("on_outbox", "on_spawn", "on_timer") if k in options
        }
        if self.aio is None:
            return Relay(self.store, "w1", **handlers, **options)
        wrapped = {k: _coroutine(h) for k, h in handlers.items()}
        return AsyncRelay(self.aio, "w1", **wrapped, **options)

    def run_once(self, relay: Any) -> int:
        if self.loop is None:
            return int(relay.run_once())
        return int(self.loop.run_until_complete(relay.run_once()))


def _coroutine(handler: Callable[[Any], object]) -> Callable[[Any], Any]:
    async def handle(item: Any) -> object:
        return handler(item)

    return handle


@pytest.fixture
def harness(store: Any) -> Harness:
    return Harness(store)


def state(store: Any) -> tuple[int, int, int]:
    return len(store.pending_outbox()), len(store.pending_spawns()), len(store.due_timers(10.0))


def test_a_round_handles_every_kind_and_acks_what_returned(harness: Harness) -> None:
    store = harness.store
    seed(store)
    seen: list[Any] = []
    relay = harness.relay(on_outbox=seen.append, on_spawn=seen.append, on_timer=seen.append)
    assert harness.run_once(relay) == 5
    kinds = [type(item) for item in seen]
    assert kinds == [OutboxEntry] * 3 + [SpawnEntry, DueTimer]
    assert state(store) == (0, 0, 0)
    assert harness.run_once(relay) == 0
    # Only the kinds with a handler are claimed.
    seed_more = store.load("source")
    store.commit(seed_more, [("target", Event(name="go"))], spawns=[("kid2", "r", {})])
    outbox_only = harness.relay(on_outbox=seen.append)
    assert harness.run_once(outbox_only) == 1
    assert state(store) == (0, 1, 0)


def test_a_raising_handler_backs_off_doubling_then_becomes_a_dead_letter(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    store = harness.store
    seed(store, bad=1)
    calls: list[str] = []

    def handle(entry: OutboxEntry) -> None:
        calls.append(entry.event.id)
        if entry.event.name == "bad":
            raise ValueError(f"cannot deliver {entry.event.id}")

    relay = harness.relay(on_outbox=handle, max_attempts=3, backoff=(100.0, 150.0))
    with caplog.at_level(logging.WARNING, logger="harel_store.relay"):
        assert harness.run_once(relay) == 4  # 3 delivered, 1 failed: all handled
        assert harness.run_once(relay) == 0  # waiting out its first backoff (100 s)
        elapse(store, 99.0)
        assert harness.run_once(relay) == 0
        elapse(store, 1.0)
        assert harness.run_once(relay) == 1  # attempt 2 fails: it waits 200 s, capped at 150
        elapse(store, 149.0)
        assert harness.run_once(relay) == 0
        elapse(store, 1.0)
        assert harness.run_once(relay) == 1  # attempt 3 fails: no wait, it is at the limit
        assert harness.run_once(relay) == 0  # that claim makes it a dead letter
    assert calls.count("bad-0") == 3
    (dead,) = store.dead_letters()
    assert (dead.item.event.id, dead.attempts) == ("bad-0", 3)
    assert dead.last_error == "ValueError: cannot deliver bad-0"
    said = [r.getMessage() for r in caplog.records if r.name == "harel_store.relay"]
    assert [m for m in said if "failed on attempt" in m] == [
        "outbox entry 4 failed on attempt 1 of 3: ValueError: cannot deliver bad-0; retry in 100 s",
        "outbox entry 4 failed on attempt 2 of 3: ValueError: cannot deliver bad-0; retry in 150 s",
        "outbox entry 4 failed on attempt 3 of 3: ValueError: cannot deliver bad-0; "
        "a dead letter at its next claim",
    ]
    assert any("outbox entry 4 is a dead letter after 3 attempts" in m for m in said)
    assert state(store) == (0, 1, 1)  # the spawn and the timer had no handler


def test_handlers_that_consume_their_items_in_their_commits(harness: Harness) -> None:
    store = harness.store
    seed(store)
    # Sync handlers through the sync view of the store: for the async kinds the facade
    # cannot be called from inside the loop, so the handlers run on the sync store.
    direct = store.sync_store if harness.aio is not None else store

    def deliver(entry: OutboxEntry) -> None:
        exe, seen = direct.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            return
        exe.context["seen"].append(entry.event.id)
        direct.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))

    def create(spawn: SpawnEntry) -> None:
        child = Execution(id=spawn.child_id, definition_id="d", parent_id=spawn.parent_id)
        with contextlib.suppress(StoreConflict):  # created by an earlier delivery
            direct.commit(child, [], acks=(spawn,))

    def fire(timer: DueTimer) -> None:
        exe, seen = direct.load_for_event(timer.execution_id, timer.event_id)
        assert exe is not None and not seen
        direct.commit(exe, [], processed_event_id=timer.event_id, acks=(timer,))

    relay = harness.relay(on_outbox=deliver, on_spawn=create, on_timer=fire)
    assert harness.run_once(relay) == 5
    target = store.load("target")
    assert target is not None and target.context["seen"] == ["ev-0", "ev-1", "ev-2"]
    assert store.load("child") is not None
    assert store.is_processed("source", DueTimer("source", "t", 1.0).event_id)
    assert state(store) == (0, 0, 0)


def test_stop_from_a_handler_releases_what_was_not_handled(harness: Harness) -> None:
    store = harness.store
    seed(store)
    seen: list[str] = []
    holder: list[Any] = []

    def handle(entry: OutboxEntry) -> None:
        seen.append(entry.event.id)
        if len(seen) == 2:
            holder[0].stop()

    relay = harness.relay(on_outbox=handle, on_spawn=lambda s: None)
    holder.append(relay)
    assert harness.run_once(relay) == 2  # the item in hand finished, then the round ended
    assert len(store.pending_outbox()) == 1
    # The rest is claimable at once by another worker, its attempt given back.
    (left,) = store.claim_outbox("w2", lease=60.0)
    assert left.event.id == "ev-2"
    assert [(e.attempts, e.claimed_by) for e in store.outbox_view()] == [(1, "w2")]
    assert [s.child_id for s in store.claim_spawns("w2")] == ["child"]


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({}, ValueError),  # no handler
        ({"on_outbox": "not callable"}, TypeError),
        ({"on_outbox": print, "batch": 0}, ValueError),
        ({"on_outbox": print, "batch": 1001}, ValueError),
        ({"on_outbox": print, "batch": 2.0}, TypeError),
        ({"on_outbox": print, "lease": 0}, ValueError),
        ({"on_outbox": print, "max_attempts": 0}, ValueError),
        ({"on_outbox": print, "backoff": (5.0, 1.0)}, ValueError),
        ({"on_outbox": print, "backoff": (-1.0, 1.0)}, ValueError),
        ({"on_outbox": print, "backoff": [1.0, 2.0]}, TypeError),
        ({"on_outbox": print, "poll": 0.0}, ValueError),
    ],
)
def test_bad_relay_arguments_are_refused(options: dict[str, Any], error: type[Exception]) -> None:
    with LibsqlStore(":memory:") as store:
        with pytest.raises(error):
            Relay(store, "w1", **options)
        with pytest.raises(ValueError):
            Relay(store, "", on_outbox=print)


def test_each_relay_takes_only_its_own_kind_of_store() -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(":memory:")
        try:
            with pytest.raises(TypeError):
                Relay(store, "w1", on_outbox=print)  # type: ignore[arg-type]
            with pytest.raises(ValueError):
                AsyncRelay(store, "w1", on_outbox=_coroutine(print), concurrency=0)
        finally:
            await store.close()

    asyncio.run(main())
    with LibsqlStore(":memory:") as sync, pytest.raises(TypeError):
        AsyncRelay(sync, "w1", on_outbox=_coroutine(print))  # type: ignore[arg-type]


def test_a_conflicting_handler_is_called_again_at_once_with_no_attempt_counted(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    store = harness.store
    seed(store)
    direct = store.sync_store if harness.aio is not None else store
    calls: list[str] = []

    def deliver(entry: OutboxEntry) -> None:
        """Another writer moves the target under the first three tries of ev-0."""
        calls.append(entry.event.id)
        exe, seen = direct.load_for_event(entry.target_id, entry.event.id)
        assert exe is not None and not seen
        if entry.event.id == "ev-0" and calls.count("ev-0") <= 3:
            other = direct.load("target")
            direct.save(other)
        direct.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))

    relay = harness.relay(on_outbox=deliver, backoff=(100.0, 100.0))
    with caplog.at_level(logging.DEBUG, logger="harel_store.relay"):
        assert harness.run_once(relay) == 3
    assert calls == ["ev-0"] * 4 + ["ev-1", "ev-2"]
    assert state(store)[0] == 0 and store.dead_letters() == []  # delivered, no backoff
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert sum("conflict" in r.getMessage() for r in caplog.records) == 3


def test_the_eleventh_conflict_in_a_row_is_an_ordinary_failure(
    harness: Harness, caplog: pytest.LogCaptureFixture
) -> None:
    store = harness.store
    seed(store)
    calls: list[str] = []

    def deliver(entry: OutboxEntry) -> None:
        calls.append(entry.event.id)
        if entry.event.id == "ev-1":
            raise StoreConflict("target", expected=1, found=2)

    relay = harness.relay(on_outbox=deliver, backoff=(100.0, 100.0))
    with caplog.at_level(logging.WARNING, logger="harel_store.relay"):
        assert harness.run_once(relay) == 3
    assert calls.count("ev-1") == 11
    (failed,) = [e for e in store.outbox_view() if e.event.id == "ev-1"]
    assert failed.attempts == 1 and failed.last_error is not None
    assert failed.last_error.startswith("StoreConflict")
    assert [r.getMessage() for r in caplog.records if "failed on attempt" in r.getMessage()] == [
        f"outbox entry {failed.seq} failed on attempt 1 of 10: {failed.last_error}; retry in 100 s"
    ]


def test_a_round_sends_no_ack_for_what_its_handlers_consumed(harness: Harness) -> None:
    store = harness.store
    seed(store)
    direct = store.sync_store if harness.aio is not None else store
    conn = direct._conn
    execute = conn.execute
    writes: list[str] = []

    def spy(request: Any) -> Any:
        if isinstance(request, Batch):
            writes.append(_first(request))
        return execute(request)

    conn.execute = spy
    if harness.aio is not None:  # the async store's writes go through its own path
        target = harness.aio._remote or harness.aio._local
        if target is not None:
            target.aexecute = _spied(target.aexecute, writes)  # type: ignore[method-assign]

    def deliver(entry: OutboxEntry) -> None:
        exe, _ = direct.load_for_event(entry.target_id, entry.event.id)
        direct.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))

    relay = harness.relay(on_outbox=deliver)
    assert harness.run_once(relay) == 3
    assert not [name for name in writes if name.startswith(("ack_", "delete_timer"))], writes
    assert state(store)[0] == 0
    # What a handler did not consume is acked by the round.
    seed_more = store.load("source")
    store.commit(seed_more, [("target", Event(name="go"))])
    assert harness.run_once(harness.relay(on_outbox=lambda entry: None)) == 1
    assert "ack_held_outbox" in writes and state(store)[0] == 0


def _spied(aexecute: Any, writes: list[str]) -> Any:
    async def spy(request: Any) -> Any:
        if isinstance(request, Batch):
            writes.append(_first(request))
        return await aexecute(request)

    return spy


def _first(batch: Batch) -> str:
    """The name of a batch's first step that a local connection runs (a step only a server
    runs, a mark of room made under a limit, comes before an ack's)."""
    return next(q.name for i, (q, _) in enumerate(batch.steps) if i not in batch.remote)
