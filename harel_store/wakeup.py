"""Wake-ups: "this database changed", as hints, from this process and from every other.

A store raises a signal after its own writes (`notify`: an execution changed, and which
kinds of relay work its commit wrote); a database's *watch* (`harel_store.connection.watch`:
a local file's commits by any process, a server's change notifications) raises them for
every other writer. Relays and `wait_for` wait on a `Waiter`, which gathers the signals
raised since they last looked. A signal carries no data and is only a hint: whoever wakes
still reads to learn what there is, and a missed one costs at most a poll.

One watch a database a process, shared by every waiter of it: started with the first
waiter, stopped when the last one leaves, or a little after (its ``linger``: a server's
streams, so that short waits do not reconnect each time). Databases are told apart by a key
their connection gives (`Connection.key`).

A watch that fails to start (no descriptor, no thread to be had just now), or whose thread
fails later, is not kept: its waiters go on with this process's signals and their polls,
and make it again at their next wait, at most every `WATCH_RETRY` seconds (a wait ends that
often while they have none). A forked child keeps no watch of its parent's (their threads
did not come with it): its waiters make their own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Protocol

from harel_store.lazy import asyncio

# What a signal says changed. The first three are new work of that kind for the relays (an
# emit, a spawn, an armed timer); EXECUTION: an execution was written; ANY: something may
# have changed (a commit seen on a file, a stream to a server re-established).
OUTBOX, SPAWN, TIMER, EXECUTION, ANY = "outbox", "spawn", "timer", "execution", "any"

# The least time between two reads asked for by executions' changes alone (a server's
# notifications say no more than that the table changed): a waiter reads at most this often,
# however busy the database is.
PACE = 0.005
# The least time between two tries of a waiter to start its database's watch after one failed.
WATCH_RETRY = 1.0
# A server's change, told again this long after its notification: sqld notifies from its
# commit hook, so a read at once may come before the commit is visible (raised by watches).
SETTLED = "settled"

log = logging.getLogger("harel_store")


class Watch(Protocol):
    """Something that raises the signals of other processes' writes to one database. It may
    also say ``live`` (it hears every commit as it comes: the waiters' safety reads are
    paced further apart) and ``failed`` (it ended on an error: it is made again)."""

    linger: float  # seconds it outlives its last waiter

    def start(self, signal: Callable[[frozenset[str]], None]) -> None:
        """Begin watching; call ``signal`` (from any thread) with what changed."""

    def stop(self) -> None:
        """Stop watching (from any thread); no signal is raised afterwards."""


WatchFactory = Callable[[], "Watch | None"]


class _Watched:
    """A running watch and how many waiters it serves."""

    __slots__ = ("idle", "users", "watch")

    def __init__(self, watch: Watch) -> None:
        self.watch = watch
        self.users = 0
        self.idle: threading.Timer | None = None  # its stop, while nobody waits

    @property
    def failed(self) -> bool:
        """Whether the watch ended on its own, on an error (its thread could not open the
        file, say): it raises no signal any more and is to be made again."""
        return bool(getattr(self.watch, "failed", False))


_lock = threading.Lock()
_waiters: dict[str, set[Waiter]] = {}
_watches: dict[str, _Watched] = {}


class Waiter:
    """One subscriber's view of a database's signals: what was signalled since it last
    looked (`take`), and a wait for the next one, by a thread (`wait`) or a task
    (`await_signal`, its loop woken thread-safely). ``watch`` makes the database's watch
    when this process has none running yet (None: this process's own writes only)."""

    def __init__(self, key: str, watch: WatchFactory | None = None) -> None:
        self.key = key
        self._signals: set[str] = set()
        self._lock = threading.Lock()
        self._event = threading.Event()
        # The loop a task last awaited the signal on, and its event (one attribute, read
        # by `set` from any thread): made again when a task awaits it on another loop.
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        self._closed = False
        self._watch = watch
        self._watched: _Watched | None = None  # the watch it joined
        self._watch_tried = -WATCH_RETRY  # monotonic time of the last failed start
        with _lock:
            _waiters.setdefault(key, set()).add(self)
        try:
            self._use_watch()
        except BaseException:
            self.close()
            raise

    def _use_watch(self) -> None:
        """Join the database's watch (started if this process has none running, or made
        again if the one it has failed); a failure to start it is logged and tried again
        at a later wait, `WATCH_RETRY` seconds on."""
        if self._watch is None or self._closed:
            return
        if self._watched is not None and not self._watched.failed:
            return
        now = time.monotonic()
        if now - self._watch_tried < WATCH_RETRY:
            return
        self._watch_tried = now
        with _lock:
            stale, self._watched = self._watched, None
            idle = _leave_watch(self.key, stale) if stale is not None else None
        if idle is not None:
            idle.stop()
        try:
            watched = _use_watch(self.key, self._watch)
        except Exception as exc:  # a hint lost for now: this process's signals and polls
            log.warning(
                "cannot watch %s for other processes' commits (tried again): %s", self.key, exc
            )
            return
        if watched is None:  # a database nobody else can write to
            self._watch = None
            return
        with _lock:
            if self._closed:  # closed meanwhile, by another thread
                idle = _leave_watch(self.key, watched)
            else:
                self._watched, idle = watched, None
        if idle is not None:
            idle.stop()

    def _retry_in(self) -> float:
        """Seconds until its watch may be made again (`WATCH_RETRY` after the last try)."""
        return max(self._watch_tried + WATCH_RETRY - time.monotonic(), 0.001)

    def _watched_well(self) -> bool:
        """Whether this waiter's watch runs (or it needs none): else its waits end every
        `WATCH_RETRY` seconds to make it again."""
        return self._watch is None or (self._watched is not None and not self._watched.failed)

    @property
    def live(self) -> bool:
        """Whether this waiter hears other processes' commits as they come (its watch runs
        and says it is live); False for a database without a watch."""
        watched = self._watched
        return watched is not None and bool(getattr(watched.watch, "live", False))

    @property
    def alone(self) -> bool:
        """Whether no other process can write to its database (in memory): every change is
        this process's own, and is heard."""
        return self._watch is None

    def __enter__(self) -> Waiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def set(self, signals: Iterable[str] = ()) -> None:
        """Record ``signals`` and wake whoever waits (from any thread); with none, only
        wake (a stop)."""
        with self._lock:
            self._signals.update(signals)
            self._event.set()
        bound = self._async
        if bound is not None and not bound[0].is_closed():
            # The loop may close meanwhile: then nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                bound[0].call_soon_threadsafe(bound[1].set)

    def take(self) -> frozenset[str]:
        """What was signalled since the last `take`, forgotten here (a signal raised from now
        on wakes the next wait)."""
        with self._lock:
            signals = frozenset(self._signals)
            self._signals.clear()
            self._event.clear()
            bound = self._async
            if bound is not None:
                bound[1].clear()
        return signals

    def wait(self, timeout: float) -> bool:
        """Block until a signal (or a `set`) since the last `take`, or ``timeout`` seconds;
        whether one came."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            self._use_watch()
            left = deadline - time.monotonic()
            if self._watched_well():
                return self._event.wait(max(left, 0.0))
            if self._event.wait(max(min(left, self._retry_in()), 0.0)):
                return True
            if time.monotonic() >= deadline:
                return False

    async def await_signal(self, timeout: float) -> bool:
        """Async version of `wait`."""
        loop = asyncio.get_running_loop()
        bound = self._async
        if bound is None or bound[0] is not loop:
            bound = self._async = (loop, asyncio.Event())
            if self._event.is_set():
                bound[1].set()
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            self._use_watch()
            left = deadline - time.monotonic()
            well = self._watched_well()
            try:
                await asyncio.wait_for(
                    bound[1].wait(), max(left if well else min(left, self._retry_in()), 0.0)
                )
            except asyncio.TimeoutError:
                if well or time.monotonic() >= deadline:
                    return False
                continue
            return True

    def close(self) -> None:
        """Unsubscribe (a second close is a no-op); the watch stops a while after its
        last waiter leaves."""
        with _lock:
            if self._closed:
                return
            self._closed = True
            waiting = _waiters.get(self.key)
            if waiting is not None:
                waiting.discard(self)
                if not waiting:
                    del _waiters[self.key]
            watched, self._watched = self._watched, None
            idle = _leave_watch(self.key, watched) if watched is not None else None
        if idle is not None:
            idle.stop()


def _use_watch(key: str, make: WatchFactory) -> _Watched | None:
    """One waiter more of ``key``'s watch, started if none runs or the one registered
    failed; None for a database without. A watch that fails to start is not kept: the
    error is raised, and the next waiter tries again."""
    stale: Watch | None = None
    try:
        with _lock:
            watched = _watches.get(key)
            if watched is not None and watched.failed:
                del _watches[key]  # its waiters leave it at their next wait
                stale, watched = watched.watch, None
            if watched is None:
                watch = make()
                if watch is None:
                    return None
                watch.start(lambda signals: notify(key, signals))  # cleans up after itself
                watched = _watches[key] = _Watched(watch)
            watched.users += 1
            if watched.idle is not None:
                watched.idle.cancel()
                watched.idle = None
            return watched
    finally:
        if stale is not None:
            stale.stop()


def _leave_watch(key: str, watched: _Watched) -> Watch | None:
    """Under ``_lock``: one waiter of ``watched`` fewer; at none, if it is ``key``'s watch,
    the watch to stop now (the caller stops it, outside the lock) or its stop scheduled
    after its linger."""
    watched.users -= 1
    if watched.users or _watches.get(key) is not watched:
        return None
    if not watched.watch.linger:
        del _watches[key]
        return watched.watch
    idle = threading.Timer(watched.watch.linger, _stop_idle, (key, watched))
    idle.daemon = True
    try:
        idle.start()
    except RuntimeError:  # no thread to be had: stop it now
        del _watches[key]
        return watched.watch
    watched.idle = idle
    return None


def _stop_idle(key: str, watched: _Watched) -> None:
    with _lock:
        if watched.users or _watches.get(key) is not watched:
            return
        del _watches[key]
    watched.watch.stop()


def notify(key: str, signals: Iterable[str]) -> None:
    """Tell the waiters of the database ``key`` in this process that ``signals`` changed."""
    if key not in _waiters:  # the common case, on every commit: nobody waits here
        return
    with _lock:
        waiting = list(_waiters.get(key, ()))
    if waiting:
        signals = frozenset(signals)
        for waiter in waiting:
            waiter.set(signals)


def _forked() -> None:
    """In a forked child: the parent's watches and their threads did not come along, nor
    the threads of its waiters. Start afresh (a waiter kept by the forking thread asks for
    a watch of its own at its next wait)."""
    global _lock
    _lock = threading.Lock()  # another thread of the parent may have held it
    for waiting in _waiters.values():
        for waiter in waiting:
            waiter._lock = threading.Lock()
            waiter._watched = None
            waiter._watch_tried = -WATCH_RETRY
    _watches.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)
