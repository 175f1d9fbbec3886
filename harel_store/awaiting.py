"""`wait_for`: callers wait for executions to reach a status; one reader a store serves them.

A call first reads its execution itself; if it is not there yet, it registers here and
waits. A reader thread, running while any call waits (and a moment after), waits for the
database's signals (`harel_store.wakeup`: this process's commits, other processes' through
the database's watch) and then reads. While few executions are waited for (`BY_ID`), it
reads each of them by id (a primary-key lookup each, in one statement). Beyond, it reads
what may have changed: the executions written since its last read (a little before, `LAG`:
a commit's clock is read when it writes, a moment before others see it) at a status some
call waits for, one range of an index a status, and the record of those a call waits for;
a new call's execution is read once, by id. So a change costs reads in proportion to what
changed, however many calls wait. `SWEEP` seconds after such a read, one read looks further
back (`MARGIN`), for a commit whose transaction went on for a while after it wrote the
execution. With no signal it reads every waited execution, a safety net paced like a
relay's poll: `POLL` seconds after its last read, doubling up to `POLL_LONGEST` while the
database's watch is live (a missed notification is rare then), `POLL` while it is not.
(That read also finds a commit that ended more than `MARGIN` after it wrote, or one made
while the database's clock stepped back by more.)
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
import weakref
from collections.abc import Iterable
from typing import Protocol

from harel_store.errors import StoreError
from harel_store.lazy import asyncio
from harel_store.models import Execution
from harel_store.wakeup import EXECUTION, PACE, Waiter

# The longest the reader waits for a signal before it reads every waited execution anyway (a
# missed one costs this), and that wait's longest while the watch is live; how long the
# reader outlives its last call; how long before its last read a read looks for changes (a
# commit's clock is read when it writes, a moment before others see it), and a sweep's, the
# read that comes SWEEP seconds after one that looked only LAG back.
POLL = 1.0
POLL_LONGEST = 5.0
LINGER = 2.0
LAG = 0.05
MARGIN = 2.0
SWEEP = 0.25
# Up to this many executions waited for, every read reads each by id (a primary-key lookup
# each): cheaper than what changed on a busy database, and no commit is ever missed.
BY_ID = 64
_NEW = "new call"  # a signal of the reader's own: read now
_NEVER = 1e300  # a time no execution was written at (finite: a server's JSON has no inf)

_all: weakref.WeakSet[Awaits] = weakref.WeakSet()  # every store's, for a forked child


class Call:
    """One caller's wait: for ``execution_id`` to be at one of ``statuses``. Resolved once,
    from the reader's thread, with the execution or the error that ended the wait; an async
    caller awaits ``future`` (set on its own loop)."""

    __slots__ = ("done", "error", "execution_id", "future", "result", "statuses")

    def __init__(
        self,
        execution_id: str,
        statuses: frozenset[str],
        future: asyncio.Future[Execution] | None = None,
    ) -> None:
        self.execution_id = execution_id
        self.statuses = statuses
        self.future = future
        self.done = threading.Event()
        self.result: Execution | None = None
        self.error: BaseException | None = None

    def resolve(self, result: Execution | None, error: BaseException | None = None) -> None:
        if self.done.is_set():
            return
        self.result, self.error = result, error
        self.done.set()
        future = self.future
        if future is not None:
            loop = future.get_loop()
            with contextlib.suppress(RuntimeError):  # its loop closed: nobody waits there
                loop.call_soon_threadsafe(_settle, future, result, error)

    def outcome(self) -> Execution:
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


def _settle(
    future: asyncio.Future[Execution], result: Execution | None, error: BaseException | None
) -> None:
    if future.done():  # its caller gave up (a timeout, a cancellation)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)  # type: ignore[arg-type]


class Source(Protocol):
    """What the reader asks of its store (`harel_store.store.Store`)."""

    def _awaited(self, wanted: dict[str, frozenset[str]]) -> dict[str, Execution]: ...
    def _awaited_changes(
        self, statuses: frozenset[str], since: float
    ) -> tuple[float, list[tuple[str, str]]]: ...
    def _waiter(self) -> Waiter: ...


class Awaits:
    """The calls waiting on one store, by execution, and their reader. The store is held
    weakly (a store nobody holds is collected, and closes its file, as before it had
    waiters)."""

    def __init__(self, store: Source, where: str) -> None:
        self._store = weakref.ref(store)
        self._where = where
        self._lock = threading.Lock()
        self._calls: dict[str, dict[Call, None]] = {}  # by execution, in the order they came
        # By execution, how many of its calls wait for each status (kept as calls come and
        # go: a read asks for the statuses of every execution waited for, 4 reads an order
        # in an engine, and a call leaves in a few steps however many others wait there).
        self._counts: dict[str, collections.Counter[str]] = {}
        self._statuses: collections.Counter[str] = collections.Counter()  # of every call
        self._thread: threading.Thread | None = None
        self._signals: Waiter | None = None  # the reader's, while it runs
        self._new: set[str] = set()  # executions of calls come since the last read
        self._closed = False
        _all.add(self)

    def add(self, call: Call) -> None:
        """Register ``call``; StoreError if the store is closed, or if no reader can be
        started (none runs, and no thread is to be had just now: the next call tries again)."""
        with self._lock:
            if self._closed:
                raise StoreError(f"the store on {self._where} is closed")
            if self._thread is None:
                thread = threading.Thread(
                    target=self._run, name=f"harel-store wait_for {self._where}", daemon=True
                )
                try:
                    thread.start()
                except RuntimeError as exc:  # "can't start new thread"
                    raise StoreError(
                        f"cannot wait for {call.execution_id!r} on {self._where}: {exc}"
                    ) from exc
                self._thread = thread
            self._counts.setdefault(call.execution_id, collections.Counter()).update(call.statuses)
            self._calls.setdefault(call.execution_id, {})[call] = None
            self._statuses.update(call.statuses)
            self._new.add(call.execution_id)
            signals = self._signals
        if signals is not None:
            signals.set((_NEW,))  # read now: a change since the caller's own read is not missed

    def remove(self, call: Call) -> None:
        with self._lock:
            calls = self._calls.get(call.execution_id)
            if calls is None or call not in calls:
                return
            del calls[call]
            if not calls:
                del self._calls[call.execution_id], self._counts[call.execution_id]
            else:
                counts = self._counts[call.execution_id]
                counts.subtract(call.statuses)
                for status in call.statuses:
                    if counts[status] <= 0:  # no call of this execution waits for it any more
                        del counts[status]
            self._statuses.subtract(call.statuses)
            self._statuses += collections.Counter()  # drops the statuses no call waits for

    def close(self) -> None:
        """Every call waiting ends with a StoreError; the reader stops."""
        with self._lock:
            self._closed = True
            signals, thread = self._signals, self._thread
        self._end_all(StoreError(f"the store on {self._where} closed"))
        if signals is not None:
            signals.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def _waiting(self) -> bool | None:
        """Whether a call waits; None once the reader is to stop."""
        with self._lock:
            if self._closed:
                self._thread = None
                return None
            return bool(self._calls)

    def _wanted(self, ids: Iterable[str]) -> dict[str, frozenset[str]]:
        """Under ``_lock``: the statuses wanted of the executions ``ids`` waited for."""
        counts = self._counts
        return {i: frozenset(counts[i]) for i in ids if i in counts}

    def _source(self) -> Source:
        store = self._store()
        if store is None:
            raise StoreError(f"the store on {self._where} closed")
        return store

    def _read(self, since: float | None) -> _Read:
        """What reached a wanted status, read as the module says: every waited execution
        when ``since`` is None (the first read, a poll) or when few are waited for, else
        what changed since ``since`` (the database's clock) and the calls come since the last
        read; and that clock before the read (None when read by id)."""
        store = self._source()
        with self._lock:
            statuses = frozenset(self._statuses)
            few = len(self._calls) <= BY_ID  # each by id: cheaper than what changed
            if few:
                self._new = set()
                look = self._wanted(self._counts)
        if few:
            return None, store._awaited(look) if look else {}
        now, changed = store._awaited_changes(statuses, _NEVER if since is None else since)
        with self._lock:
            new, self._new = self._new, set()
            if since is None:
                look = self._wanted(self._counts)
            else:
                status_of = dict(changed)
                look = {
                    i: wanted
                    for i, wanted in self._wanted(status_of.keys() | new).items()
                    if i in new or status_of[i] in wanted
                }
        return now, store._awaited(look) if look else {}

    def _run(self) -> None:
        try:
            waiter = self._source()._waiter()
        except BaseException:
            with self._lock:
                self._thread = None  # the next call starts a reader again
            raise
        with self._lock:
            self._signals = waiter
        try:
            self._serve(waiter)
        except BaseException:
            with self._lock:
                self._thread = None
            raise
        finally:
            with self._lock:
                self._signals = None
            waiter.close()

    def _serve(self, waiter: Waiter) -> None:
        read_at = -PACE
        idle_since: float | None = None
        due = True  # a read is due: a new call, a signal, a poll, a sweep
        clock: float | None = None  # the database's at the last read (None: read every call's)
        back = LAG  # how far before ``clock`` the next read looks
        sweep_at: float | None = None  # when a read that looked only LAG back is swept
        poll = POLL
        while True:
            waiting = self._waiting()
            if waiting is None:
                return
            if not waiting:  # no call: wait a while for one, then end
                now = time.monotonic()
                idle_since = now if idle_since is None else idle_since
                if now - idle_since >= LINGER:
                    with self._lock:
                        if not self._calls:
                            self._thread = None
                            return
                    continue
                waiter.wait(LINGER - (now - idle_since))
                waiter.take()
                due = True
                continue
            idle_since = None
            if not due:
                left = poll if sweep_at is None else min(poll, sweep_at - time.monotonic())
                waiter.wait(max(left, 0.0))
                signals = waiter.take()
                due = True
                if not signals and sweep_at is not None and left < poll:
                    back, sweep_at = MARGIN, None  # a sweep: further back, once
                elif not signals:  # a poll: every waited execution, paced like a relay's
                    clock = None
                    poll = min(poll * 2, POLL_LONGEST) if waiter.live else POLL
                elapsed = time.monotonic() - read_at
                if signals and signals <= {EXECUTION} and elapsed < PACE:
                    # Only executions changed (a server says no more): one read every PACE
                    # seconds at most, however busy the database is.
                    time.sleep(PACE - elapsed)
                continue
            due = False
            read_at = time.monotonic()
            narrow = clock is not None and back < MARGIN
            try:
                read_clock, found = self._read(None if clock is None else clock - back)
            except Exception as exc:  # the waits end with it; the reader goes on for others
                error = exc if isinstance(exc, StoreError) else StoreError(str(exc))
                if error is not exc:
                    error.__cause__ = exc
                self._end_all(error)
                clock = None
                continue
            if narrow and sweep_at is None:
                sweep_at = read_at + SWEEP
            elif not narrow:
                sweep_at = None  # this read looked back far enough
            clock, back = read_clock, LAG
            self._resolve(found)

    def _resolve(self, found: dict[str, Execution]) -> None:
        for execution_id, exe in found.items():
            with self._lock:
                calls = list(self._calls.get(execution_id, ()))
            given = False
            for call in calls:
                if exe.status not in call.statuses:
                    continue
                # Each caller gets an execution of its own to step.
                call.resolve(exe if not given else exe.model_copy(deep=True))
                given = True
                self.remove(call)

    def _end_all(self, error: StoreError) -> None:
        with self._lock:
            calls = [call for by_id in self._calls.values() for call in by_id]
            self._calls, self._counts, self._new = {}, {}, set()
            self._statuses.clear()
        for call in calls:
            call.resolve(None, error)


_Read = tuple[float | None, dict[str, Execution]]


def _forked() -> None:
    """In a forked child: the readers' threads did not come along, nor the callers'."""
    for awaits in list(_all):
        awaits._lock = threading.Lock()
        awaits._calls, awaits._counts, awaits._new = {}, {}, set()
        awaits._statuses.clear()
        awaits._thread = awaits._signals = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forked)


def wait_message(execution_id: str, statuses: frozenset[str], timeout: float) -> str:
    return (
        f"execution {execution_id!r} did not reach {' or '.join(sorted(statuses))} "
        f"within {timeout:g} s"
    )
