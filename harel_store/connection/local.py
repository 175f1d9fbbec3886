"""A database file (or ``:memory:``) on this machine, over libsql or the stdlib's sqlite3.

A batch runs between ``BEGIN IMMEDIATE`` and ``COMMIT`` on the one DB-API connection; a
guard step is checked by its row count. One request at a time: a lock serializes them, so
one thread's transaction never commits another's half-written batch.

A request that finds the file locked by another connection (SQLITE_BUSY) is tried again
here, after a pause in Python, for up to ``busy_timeout``, not in the driver: libsql holds
the GIL through its own busy wait, which froze every thread of the process (and an event
loop) while another process held the lock. The pauses start at a tenth of a millisecond,
where SQLite's own start at one: a write waiting for another process's commit goes as soon
as it can.
"""

from __future__ import annotations

import collections
import copy
import os
import random
import sqlite3
import sys
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any, Literal, Protocol, TypeVar
from urllib.parse import quote

from harel_store.batch import Batch, Conflicted, Fresh, Request, Statement, shape, statement
from harel_store.checks import check_finite
from harel_store.connection.watch import FileWatch
from harel_store.errors import (
    OutcomeUnknown,
    StoreBusy,
    StoreError,
    is_driver_error,
    translate,
)
from harel_store.lazy import asyncio
from harel_store.sql import Query, RowError
from harel_store.wakeup import Watch

Synchronous = Literal["FULL", "NORMAL", "EXTRA", "OFF"]
T = TypeVar("T")
R = TypeVar("R")
_BEGIN, _SAVEPOINT, _RELEASE, _ROLLBACK_TO = (
    statement(name) for name in ("begin", "savepoint", "release_savepoint", "rollback_to_savepoint")
)
# The most batches one group commit carries (`LocalConnection._write`).
GROUP_MAX = 64
# The pauses of a request that found the file locked: doubling from the first to the
# longest (each taken at 50 to 100 %), until busy_timeout. A try costs some microseconds;
# a longer pause would let another writer that frees the lock and takes it again soon (a
# retention pass, harel_store.pace) keep the waiter out for several of its writes.
BUSY_FIRST = 0.0001
BUSY_LONGEST = 0.001
# SQLite's busy_timeout is a 32-bit count of milliseconds; past it the pragma wraps to 0.
MAX_BUSY_TIMEOUT = (2**31 - 1) / 1000


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class DBAPI(Protocol):
    """The part of DB-API that both drivers give and the store uses."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Cursor: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def close(self) -> None: ...


class _Member:
    """A batch waiting for its group commit, and its outcome once written: its result or
    its error."""

    __slots__ = ("batch", "future", "outcome", "withdrawn")

    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.outcome: tuple[Any, BaseException | None] | None = None
        self.withdrawn = False  # its caller no longer waits for it: no group takes it
        self.future: asyncio.Future[None] | None = None  # an async caller's, when it waits

    def result(self) -> Any:
        assert self.outcome is not None
        result, error = self.outcome
        if error is not None:
            raise error
        return result


class _LoopWrites:
    """The async writes of one event loop: whether one is under way, and those waiting."""

    __slots__ = ("busy", "sender", "waiting")

    def __init__(self) -> None:
        self.busy = False
        self.sender: asyncio.Task[None] | None = None
        self.waiting: collections.deque[_Member] = collections.deque()


# What a group wrote, when it is not its result (`LocalConnection._transaction`).
_NOT_WRITTEN, _UNKNOWN = object(), object()


def _copy(error: BaseException) -> BaseException:
    """The group's failure for one more member: its own copy (one exception raised in several
    threads would gather all their tracebacks)."""
    try:
        return copy.copy(error)
    except Exception:
        return error


class LocalConnection:
    """Requests run on one DB-API connection, one at a time; writes that arrive together
    commit together (`_write`)."""

    library: Library = "sqlite"

    def __init__(
        self, db: DBAPI, where: str, hold: FileHold | None = None, busy_timeout: float = 5.0
    ) -> None:
        self.db = db
        self.where = where
        self.busy_timeout = busy_timeout
        # This file's claim for its SQLite library (`hold_file`), given up when it closes or,
        # for a store never closed, when it is collected (its driver connection with it).
        self._release = weakref.finalize(self, hold.release) if hold is not None else None
        # What tells this database apart in the process (harel_store.wakeup): its file, or
        # this very connection for an in-memory one.
        self.key = f":memory:{id(self)}" if where == ":memory:" else os.path.realpath(where)
        self._lock = threading.RLock()
        self._queue: collections.deque[_Member] = collections.deque()  # batches to write
        self._loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWrites] = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        self._landed: Any = _NOT_WRITTEN  # what the last transaction wrote (`_transaction`)
        self._writing: list[_Member] = []  # the group it wrote, until told (`_settle`)

    def execute(self, request: Request) -> Any:
        if isinstance(request, Batch):
            return self._write(request)
        if isinstance(request, Fresh):
            request = request.statement
        with self._lock:
            return self._retried(self._read, request)

    def _execute(self, query: Query, params: Any) -> Cursor:
        return self.db.execute(query.sql, params)

    @staticmethod
    def _result(query: Query, cur: Cursor) -> Any:
        if query.kind == "!":
            return cur.rowcount
        return shape(query, cur.fetchall(), 0)

    def _read(self, request: Statement) -> Any:
        return self._result(request[0], self._execute(*request))

    def _retried(self, run: Callable[[T], R], arg: T) -> R:
        """``run(arg)`` with the store's errors, tried again while the file is locked by
        another connection (nothing of the request was done: a batch rolled back), after a
        pause in which the GIL is free, until ``busy_timeout``."""
        if self._closed:
            raise StoreError(f"the store on {self.where} is closed")
        pause, deadline = BUSY_FIRST, time.monotonic() + self.busy_timeout
        while True:
            try:
                return run(arg)
            except (StoreError, Conflicted):
                raise
            except RowError as exc:
                raise StoreError(str(exc)) from None
            except BaseException as exc:
                if not is_driver_error(exc):
                    raise  # KeyboardInterrupt and the like
                error = self._error(exc)
                wait = pause * random.uniform(0.5, 1.0)
                if not isinstance(error, StoreBusy) or time.monotonic() + wait > deadline:
                    raise error from exc
            time.sleep(wait)
            pause = min(pause * 2, BUSY_LONGEST)

    def _error(self, exc: BaseException) -> StoreError:
        """A driver's error in the store's words."""
        error = translate(exc, quoted=self.where)
        if type(error) is StoreError and "readonly database" in str(error):
            why = not_writable(self.where) if self.where != ":memory:" else None
            if why is not None:  # SQLite opened it read-only: say why
                error = StoreError(f"cannot write {self.where}: {why}")
        return error

    def _write(self, batch: Batch) -> Any:
        member = _Member(batch)
        self._written([member])
        return member.result()

    def _written(self, members: list[_Member]) -> None:
        """Write ``members`` (in groups with whatever else waits); each has its outcome when
        this returns. An interrupt of this thread (KeyboardInterrupt, SystemExit) while they
        wait or are written is its own: those not written yet are withdrawn, so that no later
        group writes what its caller was never told of."""
        try:
            self._queue.extend(members)
            with self._lock:
                queue, first = self._queue, members[0]
                # Alone, and not written by a leader interrupted before it told the queue:
                # written as it is (the common case), else with the group machinery.
                alone = len(queue) == 1 and queue[0] is first and first.outcome is None
                if alone and not self._writing:
                    self._write_alone(first)
                else:
                    self._lead(members)
        except BaseException:
            self._withdraw(members)  # interrupted while it waited for the connection
            raise

    def _write_alone(self, member: _Member) -> None:
        """Write ``member``, the only batch waiting, as it is (the connection held)."""
        try:
            member.outcome = (self._retried(self._batch, member.batch), None)
        except Exception as exc:  # the store's error: nothing was written
            member.outcome = (None, exc)
        finally:
            self._landed = _NOT_WRITTEN  # nobody else to tell what it wrote
            self._queue.popleft()

    @staticmethod
    def _withdraw(members: list[_Member]) -> None:
        """No group takes ``members`` from now on (a leader that took one already tells it
        its outcome; its caller, interrupted, no longer reads it)."""
        for member in members:
            member.withdrawn = True

    def _lead(self, mine: list[_Member]) -> None:
        """Group commit, the connection held: batches that arrive while another transaction
        is being written wait in the queue; whichever waiting thread gets the connection
        next writes the queue's batches (up to GROUP_MAX) in one transaction, one fsync for
        all (`_group`), until the last of ``mine`` has its outcome (a thread ahead of it may
        have written it). An interrupt of this thread is its own: the others of its group
        are told what the transaction did (`_settle`), or wait for the next leader when
        nothing was written; ``mine`` not written yet are withdrawn."""
        try:
            self._settle()  # the group of a leader that an interrupt stopped half-way
            while mine[-1].outcome is None:
                self._write_group()
        except BaseException:  # an interrupt (the store's errors are outcomes)
            self._withdraw(mine)  # under the lock: no later group takes them
            raise

    def _write_group(self) -> None:
        """Write the next group, the batches waiting at the head of the queue (up to
        GROUP_MAX): each has its outcome when this returns. A batch leaves the queue only
        once it has its outcome (or its caller withdrew it), so that an interrupt anywhere
        leaves none both out of the queue and unanswered."""
        queue = self._queue
        # Only the holder of the connection takes from the queue's head (others append), so
        # these indexes stay valid.
        waiting = (queue[i] for i in range(min(len(queue), GROUP_MAX)))
        group = [m for m in waiting if m.outcome is None and not m.withdrawn]
        if not group:  # never: the caller's batch waits there (no empty transaction, ever)
            raise RuntimeError("a group commit found no batch waiting")
        self._landed = _NOT_WRITTEN  # first: ``_writing`` is never told another's result
        self._writing = group
        try:
            if len(group) == 1:
                self._retried(self._batch, group[0].batch)
            else:
                self._retried(self._group, group)
        except Exception as exc:  # the store's error: nothing of the group was written
            for i, member in enumerate(group):
                member.outcome = (None, exc if i == 0 else _copy(exc))
        finally:
            self._settle()

    def _settle(self) -> None:
        """Tell the members of the group last written (``_writing``) what its transaction
        did, as `_transaction` left it in ``_landed``: its COMMIT ran, each its result; the
        connection cannot say, OutcomeUnknown; nothing was written, nothing (they wait for the
        next group, but those given the store's error). Then the batches at the head of the
        queue that have their outcome leave it. Its leader does this when the transaction
        ends; an interrupt may stop it half-way, and then the next holder of the connection
        does it again, before it takes a group (done twice, it tells the same)."""
        group, landed = self._writing, self._landed
        if not group:  # a lone write's: nobody to tell
            pass
        elif landed is _UNKNOWN:
            unknown = OutcomeUnknown(
                f"the write to {self.where} was interrupted in another thread; it may or "
                "may not have landed: reload to learn which"
            )
            for member in group:
                member.outcome = (None, _copy(unknown))
        elif landed is not _NOT_WRITTEN:
            outcomes: list[tuple[Any, BaseException | None]]
            outcomes = [(landed, None)] if len(group) == 1 else landed
            for member, outcome in zip(group, outcomes, strict=True):
                member.outcome = outcome
        self._landed = _NOT_WRITTEN  # first: with ``_writing`` still there, it tells nothing
        self._writing = []
        queue = self._queue
        while queue and (queue[0].outcome is not None or queue[0].withdrawn):
            queue.popleft()

    async def aexecute(self, request: Request) -> Any:
        """Async version of `execute`, in a worker thread. The batches that an event loop's
        tasks send while one of its writes is under way wait, and go to one worker together
        (one group commit) when it ends; a lone batch goes at once."""
        loop = asyncio.get_running_loop()
        if not isinstance(request, Batch):
            return await loop.run_in_executor(None, self.execute, request)
        member = _Member(request)
        writes = self._loop_writes(loop)
        if writes.busy:
            member.future = loop.create_future()
            writes.waiting.append(member)
            await member.future
            return member.result()
        writes.busy = True
        try:
            await loop.run_in_executor(None, self._written, [member])
        finally:
            if writes.waiting:  # they came meanwhile: the next group, not this caller's turn
                writes.sender = loop.create_task(self._asend(loop, writes))
            else:
                writes.busy = False
        return member.result()

    async def _asend(self, loop: asyncio.AbstractEventLoop, writes: _LoopWrites) -> None:
        """Write the batches waiting on ``loop``, a group at a time, until none waits."""
        waiting = writes.waiting
        try:
            while waiting:
                group = [waiting.popleft() for _ in range(min(len(waiting), GROUP_MAX))]
                try:
                    await loop.run_in_executor(None, self._written, group)
                finally:
                    for member in group:
                        self._answer(member)
        finally:
            writes.busy, writes.sender = False, None
            while waiting:  # the loop is closing: these were never written
                self._answer(waiting.popleft())

    def _answer(self, member: _Member) -> None:
        """Wake the member's caller (it has its outcome)."""
        if member.outcome is None:
            error = StoreError(f"the write to {self.where} was not made: its event loop stopped")
            member.outcome = (None, error)
        if member.future is not None and not member.future.done():
            member.future.set_result(None)

    def _loop_writes(self, loop: asyncio.AbstractEventLoop) -> _LoopWrites:
        writes = self._loops.get(loop)
        if writes is None:
            writes = self._loops.setdefault(loop, _LoopWrites())
        return writes

    def _steps(self, batch: Batch) -> list[Any]:
        """The batch's steps, in the transaction begun; Conflicted (nothing undone yet) when a
        guard step fails."""
        results: list[Any] = []
        conditional, guards = batch.only_if or batch.remote, batch.guards  # most: no condition
        for index, (query, params) in enumerate(batch.steps):
            if conditional and batch.skips(index, results):
                results.append(None)
                continue
            # No cursor outlives its step: an unfinished one would block the COMMIT.
            result = self._result(query, self._execute(query, params))
            if index in guards and not batch.guarded(index, result):  # "!": rows changed
                raise Conflicted(index, None)
            results.append(result)
        return results

    def _found(self, batch: Batch, conflict: Conflicted) -> Conflicted:
        """The conflict with what the batch's ``conflict`` statement reads now."""
        if batch.conflict is None:
            return conflict
        return Conflicted(conflict.step, self._read(batch.conflict))

    def _batch(self, batch: Batch) -> list[Any]:
        """One batch, one transaction."""
        try:
            return self._transaction(self._steps, batch)
        except Conflicted as conflict:
            raise self._found(batch, conflict) from None

    def _transaction(self, write: Callable[[T], R], arg: T) -> R:
        """``write(arg)`` between BEGIN IMMEDIATE and COMMIT; rolled back if anything fails.
        It leaves in ``_landed`` what it wrote, for `_settle` to tell the group, after an
        interrupt (not the driver's error) too, wherever it came: the result if the COMMIT ran,
        `_NOT_WRITTEN`, or `_UNKNOWN` when the connection cannot say."""
        result: Any = _NOT_WRITTEN
        self._landed = _NOT_WRITTEN
        try:
            self._execute(*_BEGIN)
            written = write(arg)
            result = written  # set before the COMMIT: if it ran, this is what it wrote
            self._commit()
            self._landed = written
            return written
        except BaseException as exc:
            if not is_driver_error(exc):
                self._landed = _NOT_WRITTEN if result is _NOT_WRITTEN else self._committed(result)
            if not isinstance(exc, Exception):
                # An interrupt between a statement's execute and its fetch: its cursor, still
                # running it, lives in the traceback's frames; freed, the statement ends
                # (SQLite opens no savepoint while a write statement runs).
                traceback.clear_frames(exc.__traceback__)
            with suppress(Exception):  # rolled back already, or the connection is gone
                self.db.rollback()
            raise

    def _committed(self, result: Any) -> Any:
        """After an interrupt that came once the COMMIT was due: ``result`` if it ran (the
        transaction is over), `_NOT_WRITTEN` if not (still open), `_UNKNOWN` if the
        connection cannot say."""
        try:
            open_ = self.db.in_transaction  # type: ignore[attr-defined]
        except BaseException:
            return _UNKNOWN
        return _NOT_WRITTEN if open_ else result

    def _group(self, group: list[_Member]) -> list[tuple[Any, BaseException | None]]:
        """Several batches, one transaction. Each is written as it comes; if one fails (its
        guard, or the database refuses it), the whole transaction is rolled back and
        written again with each batch in its own savepoint (`_saved`), so that the failed
        one is undone alone. A savepoint costs two statements a batch, ~8 % of a commit's
        time: paid only when a member fails. The file locked by another connection, or a
        failed COMMIT, is every member's failure (all of it rolled back; `_retried` tries
        the whole group again while the file is busy)."""
        try:
            return self._transaction(self._written_as_one, group)
        except BaseException as exc:
            if not self._alone(exc):
                raise
            return self._saved(group)

    def _saved(self, group: list[_Member]) -> list[tuple[Any, BaseException | None]]:
        """`_group` with each batch in its own savepoint: one that fails is undone alone and
        fails alone, with its conflict read as the batches before it left the rows."""
        return self._transaction(self._written_in_savepoints, group)

    def _written_as_one(self, group: list[_Member]) -> list[tuple[Any, BaseException | None]]:
        return [(self._steps(member.batch), None) for member in group]

    def _written_in_savepoints(
        self, group: list[_Member]
    ) -> list[tuple[Any, BaseException | None]]:
        return [self._member(member) for member in group]

    def _member(self, member: _Member) -> tuple[Any, BaseException | None]:
        """One batch of a group in its own savepoint: its results, or its failure undone."""
        self._execute(*_SAVEPOINT)
        try:
            outcome: tuple[Any, BaseException | None] = (self._steps(member.batch), None)
        except BaseException as exc:
            if not self._alone(exc):
                raise
            self._undo()  # before the conflict read: it sees the rows as the others left them
            if isinstance(exc, Conflicted):
                return None, self._found(member.batch, exc)
            return None, StoreError(str(exc)) if isinstance(exc, RowError) else self._error(exc)
        self._execute(*_RELEASE)
        return outcome

    def _alone(self, exc: BaseException) -> bool:
        """Whether ``exc`` fails one batch of a group, not the group: its guard, a row that
        does not fit, a statement the database refuses (not the file busy, not an
        interrupt)."""
        if isinstance(exc, (Conflicted, RowError)):
            return True
        return is_driver_error(exc) and not isinstance(self._error(exc), StoreBusy)

    def _undo(self) -> None:
        """Undo the member's savepoint (its writes) and leave it."""
        self._execute(*_ROLLBACK_TO)
        self._execute(*_RELEASE)

    def _commit(self) -> None:
        self.db.commit()

    def sync(self) -> None:
        """Nothing to pull: the file is the database."""

    def watch(self) -> Watch | None:
        """Other processes' commits to the file (none can reach an in-memory database)."""
        # The file as resolved when the store opened (`key`), not ``where`` now: a relative
        # path would name another file after a chdir.
        return None if self.where == ":memory:" else FileWatch(self.key, self.library)

    def close(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                # A libsql connection may fail any call, even close (pyo3's PanicException
                # is a BaseException).
                with suppress(BaseException):
                    self.db.close()
                if self._release is not None:
                    self._release()


class LibsqlConnection(LocalConnection):
    """A local connection over libsql, whose ints are made exact.

    libsql 0.1.8 binds an int outside 32 bits as a REAL, which rounds past 2**53: two
    versions of a definition would collide, a stale writer's CAS would match. Such an int
    is bound as its decimal text instead, which SQLite reads back as the exact INTEGER
    wherever the store uses one: stored in or compared with an INTEGER column (affinity),
    or in arithmetic.
    """

    library: Library = "libsql"

    def _execute(self, query: Query, params: Any) -> Cursor:
        if int in map(type, params):  # a check at C speed: most statements bind no int
            for p in params:
                if type(p) is int and not -(2**31) <= p < 2**31:
                    params = [_exact(p) for p in params]
                    break
        return self.db.execute(query.sql, params)


def _exact(param: Any) -> Any:
    return str(param) if type(param) is int and not -(2**31) <= param < 2**31 else param


def check_local_options(synchronous: str, busy_timeout: float) -> None:
    if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ValueError(f"synchronous must be FULL, NORMAL, EXTRA or OFF, not {synchronous!r}")
    if not 0 <= check_finite(busy_timeout, "busy_timeout") <= MAX_BUSY_TIMEOUT:
        raise ValueError(
            f"busy_timeout must be 0 to {MAX_BUSY_TIMEOUT:.0f} seconds, not {busy_timeout!r}"
        )


def _pragmas(db: DBAPI, database: str | Path, synchronous: str, busy_timeout: float) -> None:
    """WAL (readers never block the writer) and the chosen durability; the driver's busy
    wait only while these run (the switch to WAL may wait for another process), then none:
    `LocalConnection.execute` waits for a busy file itself."""
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}", ())
    if str(database) != ":memory:":
        db.execute("PRAGMA journal_mode = WAL", ()).fetchall()
    db.execute(f"PRAGMA synchronous = {synchronous}", ())
    db.execute("PRAGMA busy_timeout = 0", ())


def import_libsql() -> Any:
    """Import libsql with its Rust log off unless RUST_LOG is set.

    libsql's client logs to stdout (a replica's handshakes at INFO, its retries at ERROR)
    and reads RUST_LOG once, when it is imported; failures reach the caller as exceptions
    anyway. The variable is set only around the import, so child processes do not inherit it.
    """
    if "libsql" in sys.modules or "RUST_LOG" in os.environ:
        import libsql
    else:
        os.environ["RUST_LOG"] = "off"
        try:
            import libsql
        finally:
            del os.environ["RUST_LOG"]
    return libsql


def _opened(db: DBAPI, database: str | Path, synchronous: str, busy_timeout: float) -> DBAPI:
    try:
        _pragmas(db, database, synchronous, busy_timeout)
    except BaseException:
        with suppress(BaseException):
            db.close()
        raise
    return db


# --- one SQLite library a file in this process ---
#
# Each SQLite library (libsql's, the stdlib's sqlite3, libsql-experimental's under
# sqlalchemy-libsql) is a copy of SQLite with its own list of the files it has open, and POSIX
# locks are the process's, not the copy's: when a connection of one library closes and that
# library has no other on the file, it takes itself for the file's last user, checkpoints and
# deletes the -wal and -shm files from under the other library's connections, whose commits
# then go to an unlinked WAL that no other process sees and a crash loses. So a file open in
# this process through one library is refused to the others until every connection of that
# library on it has closed. Files are told apart by (st_dev, st_ino), as SQLite does: a
# symlink or another hard link to a file is that file.

Library = Literal["libsql", "sqlite"]
LIBRARIES: dict[str, str] = {
    "libsql": "libsql (LibsqlStore, the harel-store CLI, Alembic's env)",
    "sqlite": "the stdlib's sqlite3 (SqliteStore, an embedded replica's file)",
}
_held: dict[tuple[int, int], tuple[str, int]] = {}  # file -> (library, connections)
_held_lock = threading.Lock()


class FileHold:
    """A connection's claim on a local file for its library; `release` gives it up (once)."""

    def __init__(self, key: tuple[int, int] | None) -> None:
        self._key = key

    def release(self) -> None:
        with _held_lock:
            key, self._key = self._key, None
            if key is not None:
                library, count = _held[key]
                if count > 1:
                    _held[key] = (library, count - 1)
                else:
                    del _held[key]


def _identity(path: str) -> tuple[int, int] | None:
    """The file's (st_dev, st_ino), created empty if missing (SQLite takes an empty file for
    a new database), so that its identity is known before any library opens it; None when it
    cannot be had: the driver then fails to open it too, and says why."""
    try:
        info = os.stat(path)
    except FileNotFoundError:
        try:
            os.close(os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644))
            info = os.stat(path)
        except OSError:
            return None
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None
    return info.st_dev, info.st_ino


def holder(path: str | Path) -> str | None:
    """The library ("libsql", "sqlite") this process has ``path`` open with, if any."""
    try:
        info = os.stat(path)
    except (OSError, ValueError):
        return None
    with _held_lock:
        held = _held.get((info.st_dev, info.st_ino))
    return held[0] if held is not None else None


def hold_file(path: str | Path, library: Library) -> FileHold:
    """Claim the local file ``path`` for ``library`` before that library opens it (opening and
    closing a connection is already what deletes another library's WAL). StoreError if a
    connection of the other library in this process has it open; any number of one
    library's stay allowed, and the file is free again once the last of them has closed."""
    where = str(path)
    if where in ("", ":memory:"):
        return FileHold(None)
    with _held_lock:
        key = _identity(where)
        if key is None:
            return FileHold(None)
        other, count = _held.get(key, (library, 0))
        if other != library:
            raise StoreError(
                f"cannot open {where} with {LIBRARIES[library]}: this process has it open "
                f"with {LIBRARIES[other]}. Two SQLite libraries on one file in one process "
                "lose commits (closing one deletes the other's WAL): close the other first, "
                "or open the file with one store class"
            )
        _held[key] = (library, count + 1)
        return FileHold(key)


def open_file(
    database: str | Path,
    *,
    driver: Library,
    synchronous: str,
    busy_timeout: float,
) -> LocalConnection:
    """A local database file (or ``:memory:``) with WAL, a busy timeout and ``synchronous``
    (checked by the caller: `check_local_options`). StoreError, before the file is opened,
    if the other driver has it open in this process (`hold_file`)."""
    hold = hold_file(database, driver)
    try:
        if driver == "libsql":
            db = import_libsql().connect(str(database), _check_same_thread=False)
            opened = _opened(db, database, synchronous, busy_timeout)
            return LibsqlConnection(opened, str(database), hold, busy_timeout)
        db = sqlite3.connect(
            str(database),
            isolation_level=None,
            check_same_thread=False,
            timeout=busy_timeout,
        )
        opened = _opened(db, database, synchronous, busy_timeout)
        return LocalConnection(opened, str(database), hold, busy_timeout)
    except BaseException as exc:
        hold.release()
        if not is_driver_error(exc):
            raise
        error = translate(exc, quoted=str(database))
        if type(error) is StoreError:  # not busy: the file itself is the trouble
            error = StoreError(f"cannot open {database}: {why_not(str(error), database)}")
        raise error from exc


def open_reader(path: str | Path, *, busy_timeout: float = 5.0) -> LocalConnection:
    """The existing local file ``path`` for reading only (SQLite refuses any write on it),
    over the SQLite library this process already has it open with, if any, else libsql: what
    the CLI's read commands use, so that they work on read-only media too.

    A WAL database is read through its ``-shm`` file, which SQLite must create when it is
    missing: where it cannot (a read-only file system, a directory this user may not write),
    a database whose ``-wal`` file is missing or empty (and no ``-shm``: no writer has it
    open) is the file alone, and is opened immutable (no locks, no -shm); one whose ``-wal``
    holds commits cannot be read there, a StoreError saying so."""
    given, where = str(path), os.path.abspath(path)
    library: Library = "sqlite" if holder(where) == "sqlite" else "libsql"
    hold = hold_file(where, library)
    uri = f"file:{quote(where)}?mode=ro"
    try:
        try:
            return _read_only(uri, given, library, hold, busy_timeout)
        except BaseException as exc:
            if not is_driver_error(exc):
                raise
            failure = translate(exc, quoted=where)
            reason = _no_files_beside(where)
            if reason is None or "not a database" in str(failure).lower():
                raise StoreError(f"cannot open {given}: {why_not(str(failure), where)}") from exc
            wal, shm = _size(f"{where}-wal"), _size(f"{where}-shm")
            if wal > 0 and shm == 0:
                name = os.path.basename(where)
                raise StoreError(
                    f"cannot read {given}: {reason.partition(' (')[0]}, so SQLite cannot create"
                    f" {name}-shm there, without which it cannot read the commits in {name}-wal:"
                    f" copy {name} and {name}-wal to a writable directory and read the copy"
                ) from exc
            if wal or shm:  # a -shm: a writer may have it open; -1: cannot be told
                raise StoreError(f"cannot open {given}: {why_not(str(failure), where)}") from exc
        try:  # the file is the whole database, and nothing here can change it
            return _read_only(f"{uri}&immutable=1", given, library, hold, busy_timeout)
        except BaseException as exc:
            if not is_driver_error(exc):
                raise
            failure = translate(exc, quoted=where)
            raise StoreError(f"cannot open {given}: {why_not(str(failure), where)}") from exc
    except BaseException:
        hold.release()
        raise


def _size(path: str) -> int:
    """The size of the file ``path``: 0 if there is none, -1 if it cannot be told."""
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return 0
    except OSError:
        return -1


def _read_only(
    uri: str, where: str, library: Library, hold: FileHold, busy_timeout: float
) -> LocalConnection:
    """A connection to ``uri``, proved able to read (the drivers open files lazily)."""
    if library == "sqlite":
        db: DBAPI = sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    else:
        db = import_libsql().connect(uri, _check_same_thread=False)
    try:
        db.execute("SELECT count(*) FROM sqlite_schema", ()).fetchall()
    except BaseException:
        with suppress(BaseException):
            db.close()
        raise
    kind = LocalConnection if library == "sqlite" else LibsqlConnection
    return kind(db, where, hold, busy_timeout)


def not_writable(path: str | Path) -> str | None:
    """Why this process may not write the database ``path`` (nor the ``-wal`` and ``-shm``
    files SQLite keeps beside it), in the store's words; None when nothing stops it."""
    where = os.path.abspath(path)
    if os.path.exists(where) and not os.access(where, os.W_OK):
        return _no_files_beside(where) or "the file is not writable by this user"
    return _no_files_beside(where)


def _no_files_beside(where: str) -> str | None:
    """Why no file (a -wal, a -shm) can be created beside ``where``; None if one can."""
    directory = os.path.dirname(where)
    with suppress(OSError, ValueError):
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "it is on a read-only file system"
    if os.path.isdir(directory) and not os.access(directory, os.W_OK | os.X_OK):
        return (
            "its directory is not writable by this user (SQLite keeps the -wal and -shm files"
            " beside the database)"
        )
    return None


def why_not(text: str, path: str | Path | None = None) -> str:
    """Why a file did not open, in the store's words (the drivers say it three ways)."""
    lowered = text.lower()
    if "not a database" in lowered:
        return "it is not a SQLite database"
    cannot_open = "unable to open" in lowered or lowered.rstrip().endswith(": 14")  # CANTOPEN
    if cannot_open or "readonly database" in lowered:  # SQLITE_READONLY: cannot write it
        reason = not_writable(path) if path not in (None, "", ":memory:") else None
        if reason is not None:
            return reason
    if cannot_open:
        return "the file cannot be opened or created there (no such directory, or no permission)"
    return text
