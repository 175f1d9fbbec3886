"""The relay runtime: the worker that runs the outbox, the spawns and the timers.

`Relay` (threads) and `AsyncRelay` (coroutines) are clients of the store: each round claims
what there is of each kind that has a handler (`claim_work`: one write, which also says
what is left), calls the handler for each item, acks in one write the items whose handler
returned and that it still holds (but those its handler consumed in its own commit: nothing
is left to remove; one re-armed or claimed by another worker since is spared),
`fail`s those whose handler raised with a doubling backoff, and releases what it claimed
and did not get to (a `stop`). A handler that raises `StoreConflict` (another writer moved
the execution it stepped) is called again at once. While a round works, a keeper renews
the leases of the batch in hand.

Between rounds a relay waits for its database's signals (`harel_store.wakeup`): this
process's commits, and every other process's through the database's watch (a file's
writes, a server's change notifications). It claims at once the kinds a signal names, reads
what is claimable (`peek_work`, which writes nothing) when a signal names nothing in
particular, wakes for the soonest armed timer it knows of and for its own failed items'
retries, and looks every ``poll`` seconds in case a signal was missed.

A relay starts by releasing what its worker id held (as `release_worker`, each claim's
attempt kept: an item that killed its worker still reaches its ``max_attempts``): one worker
id names one process at a time, so a worker restarted under its id after a crash takes up
its items at once rather than after their leases. Claims honour the flows (`set_flow`).

Delivery is at least once: a handler should consume its item in the commit that handles
it (``commit(..., processed_event_id=..., acks=(item,))``), which makes a repeat after a
lost lease harmless.

Over a fleet (`Fleet`, `AsyncFleet`), a relay runs one such loop per database (a thread
each; a task each for `AsyncRelay`), with the same handlers and options: each loop is woken
by its own database, and acks, fails, extends and releases in the database it claimed from.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterator, Sequence
from typing import Any, Generic, TypeVar

from harel_store import queues, telemetry
from harel_store.aio import AsyncLibsqlStore
from harel_store.batch import settle
from harel_store.checks import check_finite, check_id, check_max_attempts, check_timeout
from harel_store.errors import StoreConflict, StoreError
from harel_store.fleet import AsyncFleet, Fleet
from harel_store.lazy import asyncio
from harel_store.models import (
    ClaimedWork,
    DeadKind,
    DueTimer,
    OutboxEntry,
    RelayItem,
    SpawnEntry,
    WorkAhead,
)
from harel_store.store import MAX_PAGE, Store
from harel_store.wakeup import ANY, EXECUTION, SETTLED, TIMER, Waiter

log = logging.getLogger("harel_store.relay")

H = TypeVar("H")

# A handler that raised StoreConflict is called again at once, this many times in a round.
CONFLICT_RETRIES = 10
# A server says only that an execution changed, which may have armed a timer: a relay looks
# (a read) at most this long after its last look for that alone. A timer another process
# arms is learnt this late at worst, a busy relay claiming (and so looking) meanwhile.
TIMER_LOOK = 0.05


class _Options(Generic[H]):
    """What both relays take, checked before anything runs."""

    def __init__(
        self,
        worker: str,
        handlers: dict[DeadKind, H | None],
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

    def arguments(self) -> dict[str, Any]:
        """The keyword arguments that make a relay with these options (over a fleet: each
        database's)."""
        options: dict[str, Any] = {f"on_{kind}": h for kind, h in self.handlers.items()}
        options.update(batch=self.batch, lease=self.lease, max_attempts=self.max_attempts)
        options.update(backoff=self.backoff, poll=self.poll)
        return options

    def retry_in(self, attempts: int) -> float:
        """The wait before the next attempt, after ``attempts`` of them failed: doubling from
        backoff[0] up to backoff[1]; none once the item is at max_attempts (the next claim
        makes it a dead letter)."""
        if self.max_attempts is not None and attempts >= self.max_attempts:
            return 0.0
        first, longest = self.backoff
        return min(first * 2.0 ** min(attempts - 1, 64), longest)

    def claim(self, store: Any, kinds: Collection[DeadKind], limit: int | None = None) -> Any:
        """The round's claim of ``kinds``, up to ``limit`` (at most ``batch``) of each (a
        call on the sync or the async store)."""
        return store.claim_work(
            self.worker,
            time.time(),
            kinds=kinds,
            limit=min(limit or self.batch, self.batch),
            lease=self.lease,
            max_attempts=self.max_attempts,
        )


class _Schedule:
    """What a relay knows of its database between rounds, and so what it does next: the
    kinds to claim at once (``todo``), whether to read what is claimable first (``look``;
    ``look_paced``: `TIMER_LOOK` after the last look), the soonest timer not yet due and the
    soonest retry of its own failed items (wall clock), and when it last looked."""

    def __init__(self, kinds: Collection[DeadKind], poll: float) -> None:
        self.kinds = frozenset(kinds)
        self.poll = poll
        self.todo: set[DeadKind] = set()
        self.look = True  # what is there to claim? (a read: an idle relay writes nothing)
        self.look_paced = False
        self.next_timer: float | None = None
        self.retry_at: float | None = None
        self.looked_at = time.monotonic()

    def learn(self, ahead: WorkAhead) -> None:
        """What the database said is claimable (a peek, or after a round's claims)."""
        self.todo = {kind for kind in self.kinds if ahead.ready(kind)}
        self.next_timer = ahead.next_timer_at if "timer" in self.kinds else None
        self.looked_at = time.monotonic()
        self.look = self.look_paced = False

    def failed(self) -> None:
        """A round or a peek failed: try again after a poll."""
        self.todo.clear()
        self.looked_at = time.monotonic()
        self.look = self.look_paced = False

    def retry(self, seconds: float) -> None:
        """Items of this relay became claimable again ``seconds`` from now."""
        at = time.time() + seconds
        self.retry_at = at if self.retry_at is None else min(self.retry_at, at)

    def heard(self, signals: frozenset[str]) -> None:
        """Signals since the last look: new work of a kind is claimed at once; an armed
        timer, or a change of unknown kind, is read first; an execution's change may have
        armed a timer (a server names no more), read `TIMER_LOOK` after the last look; so is a
        server's change told again once settled (`SETTLED`: a read at its notification may
        have come before the commit was visible, and missed what it wrote)."""
        self.todo |= {kind for kind in self.kinds if kind in signals and kind != "timer"}
        if ANY in signals or (TIMER in signals and "timer" in self.kinds):
            self.look = True
        elif SETTLED in signals or (EXECUTION in signals and "timer" in self.kinds):
            self.look_paced = True

    def next(self) -> tuple[str, float]:
        """What to do now: ``("claim", 0)``, ``("peek", 0)``, or ``("wait", seconds)``."""
        wall, now = time.time(), time.monotonic()
        if self.next_timer is not None and wall >= self.next_timer:
            self.todo.add("timer")
            self.next_timer = None
        if self.retry_at is not None and wall >= self.retry_at:
            self.look, self.retry_at = True, None
        if now - self.looked_at >= self.poll:
            self.look = True
        if self.todo:
            return "claim", 0.0
        if self.look or (self.look_paced and now - self.looked_at >= TIMER_LOOK):
            return "peek", 0.0
        wait = self.looked_at + self.poll - now
        for at in (self.next_timer, self.retry_at):
            if at is not None:
                wait = min(wait, at - wall)
        if self.look_paced:
            wait = min(wait, self.looked_at + TIMER_LOOK - now)
        return "wait", max(wait, 0.0)


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
        self.cancelled = False  # an AsyncRelay round cancels its handlers (it is cancelled)

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
        # Done and released are counted by _settle; dead by the claim that sets it aside.
        telemetry.count((item,), "failed")
        log.warning(
            "%s failed on attempt %d%s: %s; %s",
            queues.describe(item),
            count,
            "" if limit is None else f" of {limit}",
            error,
            "a dead letter at its next claim" if last else f"retry in {retry:g} s",
        )
    return groups


def _released(worker: str, count: int) -> None:
    """Say what a relay starting as ``worker`` released of what that id held: a worker
    restarted under its id (one id names one process at a time) does not wait out the
    leases of the one that died."""
    if count:
        log.info("relay %s: released what this worker id held before it started: %d", worker, count)


def _unsettled(worker: str, exc: Exception) -> None:
    """A round ended by an interrupt could not ack, fail or release what it held: the
    interrupt goes on (the rows wait out their leases)."""
    log.warning("relay %s: could not settle its round as it ended: %s", worker, exc)


def _raise_first(tasks: Sequence[asyncio.Task[None]]) -> None:
    """Raise what the first of ``tasks`` (all done) to end with an exception raised."""
    for task in tasks:
        if not task.cancelled() and (exc := task.exception()) is not None:
            raise exc


async def _pause(waiter: Waiter, seconds: float) -> None:
    """`Waiter.await_signal`, in a task of its own: a cancellation of the caller always goes
    on. (Before Python 3.12, `asyncio.wait_for` returns the result of an inner wait that
    ended just as it was cancelled, and so swallows the cancellation: a signal at that moment,
    a round ending, say, left a cancelled relay running.)"""
    waiting = asyncio.ensure_future(waiter.await_signal(seconds))
    try:
        await asyncio.wait((waiting,))
    finally:
        waiting.cancel()


def _cancelling() -> bool:
    """Whether the running task itself is asked to stop (asyncio.run's end cancels every
    task left, handlers too), not merely handed the CancelledError of something another
    task cancelled. (Python 3.11+; before, unknown: False.)"""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling is not None and cancelling())


def _conflicted(item: RelayItem, tries: int, exc: StoreConflict) -> bool:
    """Whether to call the handler again at once after its ``tries``-th conflict in a row."""
    if tries > CONFLICT_RETRIES:
        return False
    log.debug("%s: conflict %d, handled again: %s", queues.describe(item), tries, exc)
    return True


class Relay:
    """Runs a store's relays in this thread: ``on_outbox(entry)``, ``on_spawn(spawn)`` and
    ``on_timer(timer)`` (timers due by the wall clock) for every item claimed as ``worker``.

    ``batch`` items of each kind a round, each under a ``lease`` of seconds (renewed while
    the round works); an item whose handler raised is claimable again after a backoff that
    doubles with each attempt from ``backoff[0]`` to at most ``backoff[1]`` seconds, and a
    claim makes it a dead letter after ``max_attempts`` (None: never). A handler that raises
    `StoreConflict` is called again at once, up to 10 times in a round, with no attempt
    counted. ``poll``: the longest an idle relay waits before it looks at the database
    anyway (it is woken sooner by any process's commit, and by its soonest timer).
    ValueError/TypeError for bad arguments, before anything runs.

    Over a `Fleet`: one loop per database of the fleet, each in a thread of its own (a
    database is opened when its loop starts), the rounds of each acking in its own database.
    """

    def __init__(
        self,
        store: Store | Fleet,
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
        if not isinstance(store, (Store, Fleet)):
            raise TypeError(
                f"Relay runs over a LibsqlStore, a SqliteStore or a Fleet, not {store!r:.60}"
            )
        handlers: dict[DeadKind, Any] = {"outbox": on_outbox, "spawn": on_spawn, "timer": on_timer}
        self._o: _Options[Callable[[Any], object]] = _Options(
            worker, handlers, batch, lease, max_attempts, backoff, poll
        )
        self._fleet = store if isinstance(store, Fleet) else None
        if not isinstance(store, Fleet):
            self._store = store
        self._loops: dict[str, Relay] = {}  # over a fleet: each database's, once opened
        self._stopping = threading.Event()
        self._running = threading.Lock()
        self._waiter: Waiter | None = None  # while run() runs

    def __repr__(self) -> str:
        return f"Relay({self._fleet or self._store!r}, {self._o.worker!r})"

    def stop(self) -> None:
        """Make `run` (or the round under way) return after the item in hand (acked if its
        handler returned); what was claimed and not handled is released. From any thread,
        or from a handler."""
        self._stopping.set()
        if (waiter := self._waiter) is not None:
            waiter.set()
        for loop in list(self._loops.values()):
            loop.stop()

    def _loop(self, fleet: Fleet, name: str) -> Relay:
        """The relay of the fleet's database ``name`` (opened now, if it was not)."""
        loop = self._loops.get(name)
        if loop is None:
            loop = Relay(fleet.store(name), self._o.worker, **self._o.arguments())
            self._loops[name] = loop
            if self._stopping.is_set():
                loop.stop()
        return loop

    def _run_fleet(self, fleet: Fleet) -> None:
        """`run` over a fleet: a loop per database in a thread of its own until `stop`. A
        database that cannot be opened is tried again after ``poll``; an interrupt in any
        loop stops them all and goes on from here."""
        ended: list[BaseException] = []

        def serve(name: str) -> None:
            while not self._stopping.is_set():
                try:
                    loop = self._loop(fleet, name)
                except StoreError as exc:
                    log.warning("relay %s: database %s: %s", self._o.worker, name, exc)
                    self._stopping.wait(self._o.poll)
                    continue
                try:
                    loop.run()
                except BaseException as exc:  # a handler's interrupt, say: all stop
                    ended.append(exc)
                    self.stop()
                return

        threads = [
            threading.Thread(target=serve, args=(name,), name=f"harel-relay-{name}", daemon=True)
            for name in fleet.names
        ]
        for thread in threads:
            thread.start()
        try:
            self._stopping.wait()
        finally:
            self.stop()
            for thread in threads:
                thread.join()
        if ended:
            raise ended[0]

    def run(self) -> None:
        """Run rounds until `stop`. Between them, wait for work: woken by any process's
        commit to the database, by the soonest armed timer, or after ``poll`` seconds. A
        round's store error (a server gone) is logged and the round tried again after
        ``poll``; a handler's exception never ends it (KeyboardInterrupt and kin do).
        RuntimeError if this relay is running already (in another thread)."""
        if not self._running.acquire(blocking=False):
            raise RuntimeError(f"{self!r} is running already: one run() at a time")
        try:
            if self._fleet is not None:
                return self._run_fleet(self._fleet)
            self._waiter = waiter = self._store._waiter()
            schedule = _Schedule(self._o.handlers, self._o.poll)
            failover = True
            try:
                while not self._stopping.is_set():
                    schedule.heard(waiter.take())
                    action, wait = schedule.next()
                    try:
                        if failover:  # what this worker id held before it started
                            _released(self._o.worker, self._store._restarted(self._o.worker))
                            failover = False
                        if action == "claim":
                            self._round(schedule, schedule.todo)
                        elif action == "peek":
                            schedule.learn(self._store.peek_work(time.time()))
                        else:
                            waiter.wait(wait)
                    except StoreError as exc:
                        log.warning("relay %s: a round failed: %s", self._o.worker, exc)
                        schedule.failed()
            finally:
                self._waiter = None
                waiter.close()
        finally:
            self._stopping.clear()  # run() may be called again
            self._running.release()

    def run_once(self) -> int:
        """One round: claim (every kind), handle, ack, fail, release. Returns how many items
        were handled (their handler returned or raised). Over a fleet: a round in each
        database, one after another."""
        self._stopping.clear()
        if (fleet := self._fleet) is not None:
            handled = 0
            for name in fleet.names:
                if self._stopping.is_set():  # a stop during one database's round ends it
                    break
                handled += self._loop(fleet, name).run_once()
            return handled
        return self._round(_Schedule(self._o.handlers, self._o.poll), self._o.handlers)

    def _round(self, schedule: _Schedule, kinds: Collection[DeadKind]) -> int:
        claimed: ClaimedWork = self._o.claim(self._store, kinds)
        schedule.learn(claimed.ahead)
        items = claimed.items()
        if not items:
            return 0
        outcome = _Round([item for _, item in items])
        with queues.Holding(self._store.database_key, outcome.claimed) as holding:
            try:
                with self._keeper(outcome):
                    for kind, item in items:
                        if self._stopping.is_set():
                            break
                        if id(item) not in outcome.lost:
                            self._handle(self._o.handlers[kind], kind, item, outcome)
            except BaseException:  # KeyboardInterrupt and kin: settled, and they go on
                try:
                    self._settle(outcome, holding, schedule)
                except Exception as exc:
                    _unsettled(self._o.worker, exc)
                raise
            self._settle(outcome, holding, schedule)
        return outcome.handled

    @staticmethod
    def _handle(
        handler: Callable[[Any], object], kind: DeadKind, item: RelayItem, outcome: _Round
    ) -> None:
        tries = 0
        while True:
            try:
                with telemetry.handling(kind, item, queues.describe):
                    handler(item)
            except StoreConflict as exc:
                tries += 1
                if _conflicted(item, tries, exc):
                    continue
                outcome.failed.append((item, _error(exc)))
            except Exception as exc:  # KeyboardInterrupt and kin end the relay
                outcome.failed.append((item, _error(exc)))
            else:
                outcome.done.append(item)
            return

    def _settle(self, outcome: _Round, holding: queues.Holding, schedule: _Schedule) -> None:
        store, worker = self._store, self._o.worker
        done = holding.unconsumed(outcome.done)
        if done:
            store._ack_held(worker, done)
        if outcome.failed:
            attempts = store.attempts_of([item for item, _ in outcome.failed])
            for (error, retry), items in _retries(self._o, outcome.failed, attempts).items():
                store.fail(worker, items, error=error, retry_in=retry)
                schedule.retry(retry)
        left = outcome.left()
        telemetry.count(outcome.done, "done")
        telemetry.count(left, "released")
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
    ``concurrency`` of them in flight at once. `stop` may be called from any thread.

    Over an `AsyncFleet`: one loop per database of the fleet, each a task of its own (with
    its own ``concurrency``)."""

    def __init__(
        self,
        store: AsyncLibsqlStore | AsyncFleet,
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
        if not isinstance(store, (AsyncLibsqlStore, AsyncFleet)):
            raise TypeError(
                f"AsyncRelay runs over an AsyncLibsqlStore or an AsyncFleet, not {store!r:.60}"
            )
        handlers: dict[DeadKind, Any] = {"outbox": on_outbox, "spawn": on_spawn, "timer": on_timer}
        self._o: _Options[AsyncHandler] = _Options(
            worker, handlers, batch, lease, max_attempts, backoff, poll
        )
        if isinstance(concurrency, bool) or not isinstance(concurrency, int):
            raise TypeError(f"concurrency must be an int, not {type(concurrency).__name__}")
        if concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, not {concurrency}")
        self._concurrency = concurrency
        self._fleet = store if isinstance(store, AsyncFleet) else None
        if not isinstance(store, AsyncFleet):
            self._store = store
        self._loops: dict[str, AsyncRelay] = {}  # over a fleet: as Relay's
        self._stopping = threading.Event()
        self._running = False
        self._waiter: Waiter | None = None
        self._in_hand = 0  # items claimed and not yet done with
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}  # by execution: lock, users

    def __repr__(self) -> str:
        return f"AsyncRelay({self._fleet or self._store!r}, {self._o.worker!r})"

    def stop(self) -> None:
        """Async version of `Relay.stop` (a plain call, from any thread or a handler)."""
        self._stopping.set()
        if (waiter := self._waiter) is not None:
            waiter.set()
        for loop in list(self._loops.values()):
            loop.stop()

    async def _loop(self, fleet: AsyncFleet, name: str) -> AsyncRelay:
        """As `Relay._loop`."""
        loop = self._loops.get(name)
        if loop is None:
            store = await fleet.store(name)
            arguments = self._o.arguments() | {"concurrency": self._concurrency}
            loop = AsyncRelay(store, self._o.worker, **arguments)
            loop = self._loops.setdefault(name, loop)  # another task may have made it
            if self._stopping.is_set():
                loop.stop()
        return loop

    async def _run_fleet(self, fleet: AsyncFleet) -> None:
        """`run` over a fleet: a task per database until `stop` (as `Relay._run_fleet`); a
        cancellation, or an error that ends one, ends them all."""

        async def serve(name: str) -> None:
            while not self._stopping.is_set():
                try:
                    loop = await self._loop(fleet, name)
                except StoreError as exc:
                    log.warning("relay %s: database %s: %s", self._o.worker, name, exc)
                    await asyncio.sleep(self._o.poll)
                    continue
                await loop.run()
                return

        tasks = [asyncio.ensure_future(serve(name)) for name in fleet.names]
        try:
            await asyncio.gather(*tasks)
        finally:
            self.stop()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def run(self) -> None:
        """Async version of `Relay.run`. Rounds overlap: what comes while a round's
        handlers run is claimed at once, up to ``batch`` items in hand in all (``concurrency``
        of them in their handlers)."""
        if self._running:
            raise RuntimeError(f"{self!r} is running already: one run() at a time")
        if self._fleet is not None:
            self._running = True
            try:
                return await self._run_fleet(self._fleet)
            finally:
                self._stopping.clear()
                self._running = False
        self._running = True
        rounds: set[asyncio.Task[int]] = set()
        slots = asyncio.Semaphore(self._concurrency)  # shared by the rounds in flight
        try:
            self._waiter = waiter = self._store._waiter()
            schedule = _Schedule(self._o.handlers, self._o.poll)
            self._in_hand = 0
            failover = True

            def ended(task: asyncio.Task[int]) -> None:
                rounds.discard(task)
                if not task.cancelled() and isinstance(task.exception(), StoreError):
                    log.warning("relay %s: a round failed: %s", self._o.worker, task.exception())

            try:
                while not self._stopping.is_set():
                    schedule.heard(waiter.take())
                    action, wait = schedule.next()
                    free = self._o.batch - self._in_hand
                    if action == "claim" and free <= 0:
                        action, wait = "wait", self._o.poll  # until an item is done with
                    try:
                        if failover:  # as Relay.run
                            worker = self._o.worker
                            _released(worker, await self._store._restarted(worker))
                            failover = False
                        if action == "claim":
                            claimed = await self._claim(schedule, set(schedule.todo), free)
                            items = claimed.items()
                            if items:
                                task = asyncio.create_task(self._work(items, schedule, slots))
                                rounds.add(task)
                                task.add_done_callback(ended)
                        elif action == "peek":
                            schedule.learn(await self._store.peek_work(time.time()))
                        else:
                            await _pause(waiter, wait)
                    except StoreError as exc:
                        log.warning("relay %s: a round failed: %s", self._o.worker, exc)
                        schedule.failed()
            finally:
                # The rounds in flight end after the items in hand (a cancellation cancels
                # them; either way what they did not reach is released).
                if not self._stopping.is_set():
                    for task in rounds:
                        task.cancel()
                if rounds:
                    await asyncio.wait(list(rounds))
                self._waiter = None
                waiter.close()
        finally:
            self._stopping.clear()
            self._running = False

    async def run_once(self) -> int:
        """Async version of `Relay.run_once`: one claim of every kind, then up to
        ``concurrency`` handlers in flight. Over a fleet: a round in each database, at
        once."""
        self._stopping.clear()
        if (fleet := self._fleet) is not None:
            loops = [await self._loop(fleet, name) for name in fleet.names]
            return sum(await asyncio.gather(*(loop.run_once() for loop in loops)))
        schedule = _Schedule(self._o.handlers, self._o.poll)
        items = (await self._claim(schedule, self._o.handlers)).items()
        if not items:
            return 0
        return await self._work(items, schedule, asyncio.Semaphore(self._concurrency))

    async def _claim(
        self, schedule: _Schedule, kinds: Collection[DeadKind], limit: int | None = None
    ) -> ClaimedWork:
        """The round's claim, learnt from; its items counted in hand until each is done with.
        A claim under way when the caller is cancelled is waited for, and what it claimed
        released, before the cancellation goes on: nothing sits out a lease unhandled."""
        task, cancelled = await settle(self._o.claim(self._store, kinds, limit))
        if cancelled is not None:
            if not task.cancelled() and task.exception() is None:
                taken = [item for _, item in task.result().items()]
                if taken:
                    with contextlib.suppress(StoreError):
                        await self._store.release(self._o.worker, taken)
            raise cancelled
        claimed: ClaimedWork = task.result()
        schedule.learn(claimed.ahead)
        self._in_hand += len(claimed.items())
        return claimed

    @contextlib.asynccontextmanager
    async def _one_at_a_time(self, item: RelayItem) -> AsyncIterator[None]:
        """The items of one execution are handled one after another in this relay: a second
        would conflict with the first (two reports to one parent) and wait for it anyway."""
        execution = queues.execution_of(item)
        if execution is None:  # an event for the outside world: no execution stepped
            yield
            return
        lock, waiting = self._locks.get(execution, (asyncio.Lock(), 0))
        self._locks[execution] = (lock, waiting + 1)
        try:
            async with lock:
                yield
        finally:
            lock, waiting = self._locks[execution]
            if waiting > 1:
                self._locks[execution] = (lock, waiting - 1)
            else:
                del self._locks[execution]

    def _done_with(self, item: RelayItem) -> None:
        """An item claimed is done with (handled, or not reached): room for another."""
        self._in_hand -= 1
        if (waiter := self._waiter) is not None:
            waiter.set()  # the loop may claim more

    async def _work(
        self,
        items: list[tuple[DeadKind, RelayItem]],
        schedule: _Schedule,
        slots: asyncio.Semaphore,
    ) -> int:
        """Handle what a claim brought, up to ``slots`` at once; ack, fail, release."""
        outcome = _Round([item for _, item in items])

        async def handle(handler: AsyncHandler, kind: DeadKind, item: RelayItem) -> None:
            try:
                async with self._one_at_a_time(item), slots:
                    if self._stopping.is_set() or id(item) in outcome.lost:
                        return
                    tries = 0
                    while True:
                        try:
                            with telemetry.handling(kind, item, queues.describe):
                                await handler(item)
                        except StoreConflict as exc:
                            tries += 1
                            if _conflicted(item, tries, exc):
                                continue
                            outcome.failed.append((item, _error(exc)))
                        except asyncio.CancelledError as exc:
                            if outcome.cancelled or _cancelling():
                                raise  # the round's or this task's own (a shutdown): released
                            # Something the handler awaited was cancelled by another task.
                            outcome.failed.append((item, _error(exc)))
                        except Exception as exc:
                            outcome.failed.append((item, _error(exc)))
                        else:
                            outcome.done.append(item)
                        return
            finally:
                self._done_with(item)

        with queues.Holding(self._store.database_key, outcome.claimed) as holding:
            keeper = asyncio.ensure_future(self._keep(outcome))
            handlers = [
                asyncio.ensure_future(handle(self._o.handlers[k], k, item)) for k, item in items
            ]
            try:
                # Every handler ends before the round settles (gather would hand on the first
                # to raise while the others still run, and the round release their items).
                await asyncio.wait(handlers)
                _raise_first(handlers)  # a handler's KeyboardInterrupt and kin
            except BaseException:  # a cancellation and kin: settled, and they go on
                outcome.cancelled = True
                for task in handlers:
                    task.cancel()
                await settle(asyncio.wait(handlers))  # a second cancellation waits too
                keeper.cancel()
                try:
                    await self._settle(outcome, holding, schedule)
                except Exception as exc:
                    _unsettled(self._o.worker, exc)
                raise
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
            await self._settle(outcome, holding, schedule)
        return outcome.handled

    async def _settle(self, outcome: _Round, holding: queues.Holding, schedule: _Schedule) -> None:
        store, worker = self._store, self._o.worker
        writes: list[Awaitable[Any]] = []
        done = holding.unconsumed(outcome.done)
        if done:
            writes.append(store._ack_held(worker, done))
        if outcome.failed:
            attempts = await store.attempts_of([item for item, _ in outcome.failed])
            for (error, retry), items in _retries(self._o, outcome.failed, attempts).items():
                writes.append(store.fail(worker, items, error=error, retry_in=retry))
                schedule.retry(retry)
        left = outcome.left()
        telemetry.count(outcome.done, "done")
        telemetry.count(left, "released")
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
