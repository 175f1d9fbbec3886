"""The relay runtime: the worker that runs the outbox, the spawns and the timers.

`Relay` (threads) and `AsyncRelay` (coroutines) are clients of the store's public methods
and nothing else: each round claims a batch of each kind that has a handler, calls the
handler for each item, acks the items whose handler returned in one `ack`, `fail`s those
whose handler raised with a doubling backoff, and releases what it claimed and did not
get to (a `stop`). While a round works, a keeper renews the leases of the batch in hand.
An idle relay sleeps up to ``poll`` seconds, and wakes at once when a store of this process
commits work for it (`harel_store.wakeup`).

Delivery is at least once: a handler should consume its item in the commit that handles
it (``commit(..., processed_event_id=..., acks=(item,))``), which makes a repeat after a
lost lease harmless; the round's `ack` of an item already consumed removes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, Generic, TypeVar

from harel_store import queues
from harel_store.aio import AsyncLibsqlStore
from harel_store.checks import check_finite, check_id, check_max_attempts, check_timeout
from harel_store.errors import StoreError
from harel_store.models import DueTimer, OutboxEntry, RelayItem, SpawnEntry
from harel_store.store import MAX_PAGE, Store
from harel_store.wakeup import Waiter

log = logging.getLogger("harel_store.relay")

H = TypeVar("H")


class _Options(Generic[H]):
    """What both relays take, checked before anything runs."""

    def __init__(
        self,
        worker: str,
        handlers: dict[str, H | None],
        batch: int,
        lease: float,
        max_attempts: int | None,
        backoff: tuple[float, float],
        poll: float,
    ) -> None:
        self.worker = check_id(worker, "worker")
        self.handlers = {kind: h for kind, h in handlers.items() if h is not None}
        if not self.handlers:
            raise ValueError("a relay needs a handler: on_outbox, on_spawn or on_timer")
        for kind, handler in self.handlers.items():
            if not callable(handler):
                raise TypeError(f"on_{kind} must be callable, not {type(handler).__name__}")
        if isinstance(batch, bool) or not isinstance(batch, int):
            raise TypeError(f"batch must be an int, not {type(batch).__name__}")
        if not 1 <= batch <= MAX_PAGE:
            raise ValueError(f"batch must be between 1 and {MAX_PAGE}, not {batch}")
        self.batch = batch
        self.lease = check_timeout(lease, "lease")
        self.max_attempts = check_max_attempts(max_attempts)
        if not (isinstance(backoff, tuple) and len(backoff) == 2):
            raise TypeError(f"backoff must be a (first, longest) pair of seconds, not {backoff!r}")
        first, longest = (check_finite(b, "backoff") for b in backoff)
        if not 0 <= first <= longest:
            raise ValueError(
                f"backoff must be (first, longest) with 0 <= first <= longest: {backoff}"
            )
        self.backoff = (first, longest)
        self.poll = check_timeout(poll, "poll")

    def retry_in(self, attempts: int) -> float:
        """The wait before the next attempt, after ``attempts`` of them failed: doubling from
        backoff[0] up to backoff[1]; none once the item is at max_attempts (the next claim
        makes it a dead letter)."""
        if self.max_attempts is not None and attempts >= self.max_attempts:
            return 0.0
        first, longest = self.backoff
        return min(first * 2.0 ** min(attempts - 1, 64), longest)

    def claims(self, store: Any) -> list[tuple[str, Callable[[], Any]]]:
        """Each kind with a handler and its claim (a call on the sync or the async store)."""
        options = {"limit": self.batch, "lease": self.lease, "max_attempts": self.max_attempts}
        calls = {
            "outbox": lambda: store.claim_outbox(self.worker, **options),
            "spawn": lambda: store.claim_spawns(self.worker, **options),
            "timer": lambda: store.claim_due_timers(self.worker, time.time(), **options),
        }
        return [(kind, calls[kind]) for kind in self.handlers]


def _error(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class _Round:
    """One round's outcome: what returned, what raised (with why), what was not reached."""

    def __init__(self, claimed: Sequence[RelayItem]) -> None:
        self.claimed = list(claimed)
        self.done: list[RelayItem] = []
        self.failed: list[tuple[RelayItem, str]] = []
        self.lost: set[int] = set()  # ids of items whose lease the keeper could not renew

    @property
    def handled(self) -> int:
        return len(self.done) + len(self.failed)

    def held(self) -> list[RelayItem]:
        """What the keeper renews: every item claimed that it has not lost."""
        return [i for i in self.claimed if id(i) not in self.lost]

    def renewed(self, renew: Sequence[RelayItem], held: Sequence[RelayItem]) -> None:
        """Of ``renew``, what `extend` did not return (``held``) is lost: not ours now."""
        kept = {id(i) for i in held}
        self.lost |= {id(i) for i in renew if id(i) not in kept}

    def left(self) -> list[RelayItem]:
        """Claimed, not handled, still ours: to release."""
        reached = {id(item) for item in self.done} | {id(item) for item, _ in self.failed}
        return [i for i in self.held() if id(i) not in reached]


def _retries(
    options: _Options[Any], failed: list[tuple[RelayItem, str]], attempts: list[int]
) -> dict[tuple[str, float], list[RelayItem]]:
    """The failed items grouped by (error, retry_in), for one `fail` each; each logged."""
    groups: dict[tuple[str, float], list[RelayItem]] = {}
    limit = options.max_attempts
    for (item, error), count in zip(failed, attempts, strict=True):
        if count < 1:  # gone meanwhile (consumed, purged): nothing to fail
            continue
        retry = options.retry_in(count)
        groups.setdefault((error, retry), []).append(item)
        last = limit is not None and count >= limit
        log.warning(
            "%s failed on attempt %d%s: %s; %s",
            queues.describe(item),
            count,
            "" if limit is None else f" of {limit}",
            error,
            "a dead letter at its next claim" if last else f"retry in {retry:g} s",
        )
    return groups


class Relay:
    """Runs a store's relays in this thread: ``on_outbox(entry)``, ``on_spawn(spawn)`` and
    ``on_timer(timer)`` (timers due by the wall clock) for every item claimed as ``worker``.

    ``batch`` items of each kind a round, each under a ``lease`` of seconds (renewed while
    the round works); an item whose handler raised is claimable again after a backoff that
    doubles with each attempt from ``backoff[0]`` to at most ``backoff[1]`` seconds, and a
    claim makes it a dead letter after ``max_attempts`` (None: never). ``poll``: the longest
    an idle relay sleeps. ValueError/TypeError for bad arguments, before anything runs.
    """

    def __init__(
        self,
        store: Store,
        worker: str,
        *,
        on_outbox: Callable[[OutboxEntry], object] | None = None,
        on_spawn: Callable[[SpawnEntry], object] | None = None,
        on_timer: Callable[[DueTimer], object] | None = None,
        batch: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = 10,
        backoff: tuple[float, float] = (1.0, 300.0),
        poll: float = 1.0,
    ) -> None:
        if not isinstance(store, Store):
            raise TypeError(f"Relay runs over a LibsqlStore or SqliteStore, not {store!r:.60}")
        handlers = {"outbox": on_outbox, "spawn": on_spawn, "timer": on_timer}
        self._o: _Options[Callable[[Any], object]] = _Options(
            worker, handlers, batch, lease, max_attempts, backoff, poll
        )
        self._store = store
        self._stopping = threading.Event()
        self._waiter: Waiter | None = None  # while run() runs

    def __repr__(self) -> str:
        return f"Relay({self._store!r}, {self._o.worker!r})"

    def stop(self) -> None:
        """Make `run` (or the round under way) return after the item in hand (acked if its
        handler returned); what was claimed and not handled is released. From any thread,
        or from a handler."""
        self._stopping.set()
        if (waiter := self._waiter) is not None:
            waiter.set()

    def run(self) -> None:
        """Run rounds until `stop`; while there is nothing to do, sleep up to ``poll``
        seconds, or until a store of this process commits work for this database. A
        round's store error (a server gone) is logged and the round tried again after
        ``poll``; a handler's exception never ends it (KeyboardInterrupt and kin do)."""
        self._waiter = waiter = Waiter(self._store.database_key)
        try:
            while not self._stopping.is_set():
                waiter.clear()  # a commit from here on wakes the wait below
                try:
                    handled = self._round()
                except StoreError as exc:
                    log.warning("relay %s: a round failed: %s", self._o.worker, exc)
                    handled = 0
                if not handled and not self._stopping.is_set():
                    waiter.wait(self._o.poll)
        finally:
            self._waiter = None
            waiter.close()
            self._stopping.clear()  # run() may be called again

    def run_once(self) -> int:
        """One round: claim, handle, ack, fail, release. Returns how many items were
        handled (their handler returned or raised)."""
        self._stopping.clear()
        return self._round()

    def _round(self) -> int:
        claimed = []
        for kind, claim in self._o.claims(self._store):
            if self._stopping.is_set():
                break
            claimed += [(self._o.handlers[kind], item) for item in claim()]
        if not claimed:
            return 0
        outcome = _Round([item for _, item in claimed])
        try:
            with self._keeper(outcome):
                for handler, item in claimed:
                    if self._stopping.is_set():
                        break
                    if id(item) in outcome.lost:
                        continue
                    try:
                        handler(item)
                    except Exception as exc:  # KeyboardInterrupt and kin end the relay
                        outcome.failed.append((item, _error(exc)))
                    else:
                        outcome.done.append(item)
        finally:
            self._settle(outcome)
        return outcome.handled

    def _settle(self, outcome: _Round) -> None:
        store, worker = self._store, self._o.worker
        if outcome.done:
            store.ack(outcome.done)
        if outcome.failed:
            attempts = store.attempts_of([item for item, _ in outcome.failed])
            for (error, retry), items in _retries(self._o, outcome.failed, attempts).items():
                store.fail(worker, items, error=error, retry_in=retry)
        left = outcome.left()
        if left:
            store.release(worker, left)

    @contextlib.contextmanager
    def _keeper(self, outcome: _Round) -> Iterator[None]:
        """Renew the leases of the batch in hand every third of a lease until the round
        ends (a thread of its own: one handler may outlast a lease)."""
        ended = threading.Event()

        def keep() -> None:
            while not ended.wait(self._o.lease / 3):
                renew = outcome.held()
                try:
                    held = self._store.extend(self._o.worker, renew, lease=self._o.lease)
                except Exception as exc:  # the round goes on; the next renewal may succeed
                    log.warning("could not renew the leases of %s: %s", self._o.worker, exc)
                    continue
                outcome.renewed(renew, held)

        keeper = threading.Thread(
            target=keep, name=f"harel-relay-keeper-{self._o.worker}", daemon=True
        )
        keeper.start()
        try:
            yield
        finally:
            ended.set()
            keeper.join()


AsyncHandler = Callable[[Any], Awaitable[object]]


class AsyncRelay:
    """Async version of `Relay`, over an `AsyncLibsqlStore`, with coroutine handlers: up to
    ``concurrency`` of them in flight at once. `stop` may be called from any thread."""

    def __init__(
        self,
        store: AsyncLibsqlStore,
        worker: str,
        *,
        on_outbox: Callable[[OutboxEntry], Awaitable[object]] | None = None,
        on_spawn: Callable[[SpawnEntry], Awaitable[object]] | None = None,
        on_timer: Callable[[DueTimer], Awaitable[object]] | None = None,
        batch: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = 10,
        backoff: tuple[float, float] = (1.0, 300.0),
        poll: float = 1.0,
        concurrency: int = 16,
    ) -> None:
        if not isinstance(store, AsyncLibsqlStore):
            raise TypeError(f"AsyncRelay runs over an AsyncLibsqlStore, not {store!r:.60}")
        handlers = {"outbox": on_outbox, "spawn": on_spawn, "timer": on_timer}
        self._o: _Options[AsyncHandler] = _Options(
            worker, handlers, batch, lease, max_attempts, backoff, poll
        )
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {concurrency}")
        self._concurrency = concurrency
        self._store = store
        self._stopping = threading.Event()
        self._waiter: Waiter | None = None

    def __repr__(self) -> str:
        return f"AsyncRelay({self._store!r}, {self._o.worker!r})"

    def stop(self) -> None:
        """Async version of `Relay.stop` (a plain call, from any thread or a handler)."""
        self._stopping.set()
        if (waiter := self._waiter) is not None:
            waiter.set()

    async def run(self) -> None:
        """Async version of `Relay.run`."""
        self._waiter = waiter = Waiter(self._store.database_key)
        try:
            while not self._stopping.is_set():
                waiter.clear()
                try:
                    handled = await self._round()
                except StoreError as exc:
                    log.warning("relay %s: a round failed: %s", self._o.worker, exc)
                    handled = 0
                if not handled and not self._stopping.is_set():
                    await waiter.await_signal(self._o.poll)
        finally:
            self._waiter = None
            waiter.close()
            self._stopping.clear()

    async def run_once(self) -> int:
        """Async version of `Relay.run_once`: the kinds claimed at once, then up to
        ``concurrency`` handlers in flight."""
        self._stopping.clear()
        return await self._round()

    async def _round(self) -> int:
        kinds = self._o.claims(self._store)
        batches = await asyncio.gather(*(claim() for _, claim in kinds))
        claimed = [
            (self._o.handlers[kind], item)
            for (kind, _), items in zip(kinds, batches, strict=True)
            for item in items
        ]
        if not claimed:
            return 0
        outcome = _Round([item for _, item in claimed])
        slots = asyncio.Semaphore(self._concurrency)

        async def handle(handler: AsyncHandler, item: RelayItem) -> None:
            async with slots:
                if self._stopping.is_set() or id(item) in outcome.lost:
                    return
                try:
                    await handler(item)
                except Exception as exc:
                    outcome.failed.append((item, _error(exc)))
                else:
                    outcome.done.append(item)

        keeper = asyncio.ensure_future(self._keep(outcome))
        try:
            await asyncio.gather(*(handle(h, item) for h, item in claimed))
        finally:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self._settle(outcome)
        return outcome.handled

    async def _settle(self, outcome: _Round) -> None:
        store, worker = self._store, self._o.worker
        writes: list[Awaitable[Any]] = []
        if outcome.done:
            writes.append(store.ack(outcome.done))
        if outcome.failed:
            attempts = await store.attempts_of([item for item, _ in outcome.failed])
            for (error, retry), items in _retries(self._o, outcome.failed, attempts).items():
                writes.append(store.fail(worker, items, error=error, retry_in=retry))
        left = outcome.left()
        if left:
            writes.append(store.release(worker, left))
        await asyncio.gather(*writes)

    async def _keep(self, outcome: _Round) -> None:
        while True:
            await asyncio.sleep(self._o.lease / 3)
            renew = outcome.held()
            try:
                held = await self._store.extend(self._o.worker, renew, lease=self._o.lease)
            except Exception as exc:  # the round goes on; the next renewal may succeed
                log.warning("could not renew the leases of %s: %s", self._o.worker, exc)
                continue
            outcome.renewed(renew, held)
