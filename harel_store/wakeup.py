"""A process-wide signal: "there is work for the relays of this database".

A store raises it after a write that gives a relay something to do (a commit that emits,
spawns or arms a timer; a revive or a release); a relay waiting for its next poll wakes at
once. It carries no data and is only a hint: a relay always claims to learn what there is,
and other processes' writes reach it at its next poll. Databases are told apart by a key
their connection gives (`Connection.key`).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import defaultdict

_lock = threading.Lock()
_waiters: defaultdict[str, set[Waiter]] = defaultdict(set)


class Waiter:
    """One relay's subscription to a database's signal; a thread waits on it with `wait`, a
    task with `await_signal` (its loop is woken thread-safely)."""

    def __init__(self, key: str) -> None:
        self.key = key
        self._event = threading.Event()
        # The loop a task last awaited the signal on, and its event (one attribute, read
        # by `set` from any thread): made again when a task awaits it on another loop.
        self._async: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
        with _lock:
            _waiters[key].add(self)

    def set(self) -> None:
        """Wake whoever waits (from any thread)."""
        self._event.set()
        bound = self._async
        if bound is not None and not bound[0].is_closed():
            # The loop may close meanwhile: then nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                bound[0].call_soon_threadsafe(bound[1].set)

    def clear(self) -> None:
        """Forget a signal already seen (before looking for work, so none is missed)."""
        self._event.clear()
        bound = self._async
        if bound is not None:
            bound[1].clear()

    def wait(self, timeout: float) -> bool:
        """Block until the signal or ``timeout`` seconds; whether it came."""
        return self._event.wait(timeout)

    async def await_signal(self, timeout: float) -> bool:
        """Async version of `wait`."""
        loop = asyncio.get_running_loop()
        bound = self._async
        if bound is None or bound[0] is not loop:
            bound = self._async = (loop, asyncio.Event())
            if self._event.is_set():
                bound[1].set()
        try:
            await asyncio.wait_for(bound[1].wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def close(self) -> None:
        with _lock:
            _waiters[self.key].discard(self)
            if not _waiters[self.key]:
                del _waiters[self.key]


def notify(key: str) -> None:
    """There is work for the relays of the database ``key``."""
    if key not in _waiters:  # the common case, on every commit: nobody waits here
        return
    with _lock:
        waiting = list(_waiters.get(key, ()))
    for waiter in waiting:
        waiter.set()
