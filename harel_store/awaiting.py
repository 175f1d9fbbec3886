"""`wait_for`: callers wait for executions to reach a status; one reader a store serves them.

A call first reads its execution itself; if it is not there yet, it registers here and
waits. A reader thread, running while any call waits (and a moment after), waits for the
database's signals (`harel_store.wakeup`: this process's commits, other processes' through
the database's watch) and then reads the status of every execution waited for in one read,
and the record of each that reached a status its caller waits for. So a thousand callers
cost one read a change, not a thousand; with no signal it reads every `POLL` seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import weakref
from typing import Protocol

from harel_store.errors import StoreError
from harel_store.models import Execution
from harel_store.wakeup import EXECUTION, PACE, Waiter

# The longest the reader waits for a signal before it reads anyway (a missed one costs this),
# and how long it outlives its last call.
POLL = 1.0
LINGER = 2.0
_NEW = "new call"  # a signal of the reader's own: read now


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
    def _waiter(self) -> Waiter: ...


class Awaits:
    """The calls waiting on one store, and their reader. The store is held weakly (a store
    nobody holds is collected, and closes its file, as before it had waiters)."""

    def __init__(self, store: Source, where: str) -> None:
        self._store = weakref.ref(store)
        self._where = where
        self._lock = threading.Lock()
        self._calls: dict[Call, None] = {}  # in the order they came
        self._thread: threading.Thread | None = None
        self._signals: Waiter | None = None  # the reader's, while it runs
        self._closed = False

    def add(self, call: Call) -> None:
        with self._lock:
            if self._closed:
                raise StoreError(f"the store on {self._where} is closed")
            self._calls[call] = None
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name=f"harel-store wait_for {self._where}", daemon=True
                )
                self._thread.start()
            signals = self._signals
        if signals is not None:
            signals.set((_NEW,))  # read now: a change since the caller's own read is not missed

    def remove(self, call: Call) -> None:
        with self._lock:
            self._calls.pop(call, None)

    def close(self) -> None:
        """Every call waiting ends with a StoreError; the reader stops."""
        with self._lock:
            self._closed = True
            calls, self._calls = list(self._calls), {}
            signals, thread = self._signals, self._thread
        for call in calls:
            call.resolve(None, StoreError(f"the store on {self._where} closed"))
        if signals is not None:
            signals.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(5)

    def _wanted(self) -> dict[str, frozenset[str]] | None:
        """The statuses wanted by execution id; None once the reader is to stop."""
        with self._lock:
            if self._closed:
                self._thread = None
                return None
            wanted: dict[str, frozenset[str]] = {}
            for call in self._calls:
                wanted[call.execution_id] = wanted.get(call.execution_id, frozenset()) | (
                    call.statuses
                )
            return wanted

    def _read(self, wanted: dict[str, frozenset[str]]) -> dict[str, Execution]:
        store = self._store()
        if store is None:
            raise StoreError(f"the store on {self._where} closed")
        return store._awaited(wanted)

    def _run(self) -> None:
        store = self._store()
        if store is None:
            return
        waiter = store._waiter()
        del store
        with self._lock:
            self._signals = waiter
        try:
            self._serve(waiter)
        finally:
            with self._lock:
                self._signals = None
            waiter.close()

    def _serve(self, waiter: Waiter) -> None:
        read_at = -PACE
        idle_since: float | None = None
        due = True  # a read is due: a new call, a signal, a poll
        while True:
            wanted = self._wanted()
            if wanted is None:
                return
            if not wanted:  # no call: wait a while for one, then end
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
                waiter.wait(POLL)
                signals = waiter.take()
                due = True
                since = time.monotonic() - read_at
                if signals and signals <= {EXECUTION} and since < PACE:
                    # Only executions changed (a server says no more): one read every PACE
                    # seconds at most, however busy the database is.
                    time.sleep(PACE - since)
                continue
            due = False
            read_at = time.monotonic()
            try:
                found = self._read(wanted)
            except Exception as exc:  # the waits end with it; the reader goes on for others
                error = exc if isinstance(exc, StoreError) else StoreError(str(exc))
                if error is not exc:
                    error.__cause__ = exc
                self._end_all(error)
                continue
            self._resolve(found)

    def _resolve(self, found: dict[str, Execution]) -> None:
        if not found:
            return
        with self._lock:
            calls = [c for c in self._calls if c.execution_id in found]
        given: set[str] = set()
        for call in calls:
            exe = found[call.execution_id]
            if exe.status not in call.statuses:
                continue
            # Each caller gets an execution of its own to step.
            call.resolve(exe if call.execution_id not in given else exe.model_copy(deep=True))
            given.add(call.execution_id)
            self.remove(call)

    def _end_all(self, error: StoreError) -> None:
        with self._lock:
            calls, self._calls = list(self._calls), {}
        for call in calls:
            call.resolve(None, error)


def wait_message(execution_id: str, statuses: frozenset[str], timeout: float) -> str:
    return (
        f"execution {execution_id!r} did not reach {' or '.join(sorted(statuses))} "
        f"within {timeout:g} s"
    )
