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
        self._loop: asyncio.AbstractEventLoop | None = None
        self._aevent: asyncio.Event | None = None
        with _lock:
            _waiters[key].add(self)

    def set(self) -> None:
        """Wake whoever waits (from any thread)."""
        self._event.set()
        loop, aevent = self._loop, self._aevent
        if loop is not None and aevent is not None and not loop.is_closed():
            # The loop may close meanwhile: then nobody waits there any more.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(aevent.set)

    def clear(self) -> None:
        """Forget a signal already seen (before looking for work, so none is missed)."""
        self._event.clear()
        if self._aevent is not None:
            self._aevent.clear()

    def wait(self, timeout: float) -> bool:
        """Block until the signal or ``timeout`` seconds; whether it came."""
        return self._event.wait(timeout)

    async def await_signal(self, timeout: float) -> bool:
        """Async version of `wait`."""
        if self._aevent is None:
            self._loop, self._aevent = asyncio.get_running_loop(), asyncio.Event()
            if self._event.is_set():
                self._aevent.set()
        try:
            await asyncio.wait_for(self._aevent.wait(), timeout)
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
