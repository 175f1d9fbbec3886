"""Watches: how this process learns of other processes' writes to a database (the signals
of `harel_store.wakeup`), without asking the database in a loop.

- `FileWatch`, a local file: Linux's inotify reports the writes to the file's WAL as they
  happen; a commit is visible to readers only once its frames are written, synced and
  indexed, a moment after the last write, so each burst of writes is confirmed by
  ``PRAGMA data_version`` on a connection of the watch's own (it changes when another
  connection commits), looked at again with a growing pause until the burst has settled.
  Idle, it costs nothing. Without inotify (another system, or its limits reached) it looks
  at ``data_version`` every `FALLBACK_EVERY` seconds.
- `ListenWatch`, a server (sqld): its change notifications, ``GET /beta/listen?table=T``,
  server-sent events, one a committed transaction that touched the table; one stream a
  table on a thread of its own, re-established after a break with a growing pause. A server
  without them (another server, a plan without them) is asked again every
  `UNSUPPORTED_RETRY` seconds; meanwhile relays poll.

Every watch is a hint: nothing is lost when it misses a change (waiters poll as well).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import select
import sqlite3
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import quote

from harel_store.connection import http
from harel_store.wakeup import ANY, EXECUTION, OUTBOX, SETTLED, SPAWN

log = logging.getLogger("harel_store")

Signal = Callable[[frozenset[str]], None]

# --- a local file ---

# After the last write seen, data_version is looked at after these pauses, doubling, for as
# long as a commit may take to become visible (its fsync), then no more until a write.
SETTLE_FIRST = 0.0002
SETTLE_LONGEST = 0.064
SETTLE_FOR = 0.5
FALLBACK_EVERY = 0.01

_IN_MODIFY = 0x00000002
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_EVENT = struct.Struct("iIII")


def _inotify() -> Any:
    """libc's inotify functions, or None (not Linux, or no libc to be had)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.inotify_init1.argtypes = [ctypes.c_int]
        libc.inotify_add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _inotify()


class FileWatch:
    """Commits to the local file ``path`` by any process (this one's too), through a
    connection of its own over ``library`` (the one this process has the file open with).
    It stops with its last waiter: its connection must not outlive the stores of this
    process on the file (another SQLite library may open the file next)."""

    linger: float = 0.0

    def __init__(self, path: str, library: str) -> None:
        self.path = os.path.realpath(path)
        self.library = library
        self._stop_r, self._stop_w = -1, -1
        self._thread: threading.Thread | None = None
        self.live = False  # while it looks for commits
        self.failed = False  # it ended on an error: to be made again (harel_store.wakeup)

    def start(self, signal: Signal) -> None:
        """Begin watching; an error (no descriptor or thread to be had) leaves nothing open."""
        self._stop_r, self._stop_w = os.pipe()
        thread = threading.Thread(
            target=self._run, args=(signal,), name=f"harel-store watch {self.path}", daemon=True
        )
        try:
            thread.start()
        except BaseException:
            os.close(self._stop_r)
            os.close(self._stop_w)
            raise
        self._thread = thread

    def stop(self) -> None:
        if self._thread is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._stop_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join(5)
        with contextlib.suppress(OSError):
            os.close(self._stop_w)

    def _run(self, signal: Signal) -> None:
        from harel_store.connection.local import hold_file, import_libsql

        inotify = -1
        hold = None
        db: Any = None
        try:
            hold = hold_file(self.path, "libsql" if self.library == "libsql" else "sqlite")
            if self.library == "libsql":
                db = import_libsql().connect(self.path, _check_same_thread=False)
            else:
                db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            db.execute("PRAGMA busy_timeout = 0", ())
            if _LIBC is not None:
                inotify = self._watch_directory()
            self.live = True
            self._loop(signal, db, inotify)
        except Exception as exc:  # a hint lost: waiters poll, and make the watch again
            log.warning("cannot watch %s for other processes' commits: %s", self.path, exc)
            self.failed = True
            signal(frozenset((ANY,)))  # its waiters look, and make it again at their next wait
        finally:
            self.live = False
            if inotify >= 0:
                os.close(inotify)
            if db is not None:
                with contextlib.suppress(BaseException):
                    db.close()
            if hold is not None:
                hold.release()
            os.close(self._stop_r)

    def _watch_directory(self) -> int:
        """An inotify descriptor watching the file's directory for writes (the WAL is
        deleted and made anew when every connection to the file closes: its name is
        watched, not its inode); -1 when inotify cannot be had (its limits reached)."""
        fd = _LIBC.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
        if fd < 0:
            log.info(
                "no inotify for %s (%s): looking for commits every %g s",
                self.path,
                os.strerror(ctypes.get_errno()),
                FALLBACK_EVERY,
            )
            return -1
        directory = os.path.dirname(self.path) or "."
        if _LIBC.inotify_add_watch(fd, os.fsencode(directory), _IN_MODIFY) < 0:
            error = os.strerror(ctypes.get_errno())
            os.close(fd)
            log.info(
                "cannot watch %s with inotify (%s): looking for commits every %g s",
                directory,
                error,
                FALLBACK_EVERY,
            )
            return -1
        return int(fd)

    def _loop(self, signal: Signal, db: Any, inotify: int) -> None:
        wal = os.fsencode(os.path.basename(self.path) + "-wal")
        seen = _data_version(db)
        # Whatever was committed before this watch was (a watch made again) was missed: look.
        signal(frozenset((ANY,)))
        pause: float | None = None if inotify >= 0 else FALLBACK_EVERY
        settle_until = 0.0
        watched = [self._stop_r] if inotify < 0 else [self._stop_r, inotify]
        while True:
            ready = select.select(watched, [], [], pause)[0]
            if self._stop_r in ready:
                return
            now = time.monotonic()
            if inotify in ready and _wrote(inotify, wal):
                settle_until, pause = now + SETTLE_FOR, SETTLE_FIRST
            version = _data_version(db)
            if version is not None and version != seen:
                seen = version
                signal(frozenset((ANY,)))
            if inotify >= 0 and pause is not None:
                pause = None if now > settle_until else min(pause * 2, SETTLE_LONGEST)


def _data_version(db: Any) -> int | None:
    """The connection's data_version (None: not to be had just now: a lock, a recovery)."""
    try:
        (version,) = db.execute("PRAGMA data_version", ()).fetchone()
    except Exception:
        return None
    return int(version)


def _wrote(fd: int, name: bytes) -> bool:
    """Whether the inotify events waiting on ``fd`` include a write to ``name`` (all read)."""
    wrote = False
    while True:
        try:
            events = os.read(fd, 65536)
        except BlockingIOError:
            return wrote
        offset = 0
        while offset < len(events):
            _, _, _, size = _EVENT.unpack_from(events, offset)
            start = offset + _EVENT.size
            if events[start : start + size].rstrip(b"\0") == name:
                wrote = True
            offset = start + size


# --- a server ---

# The tables a relay's work and wait_for's executions live in, the changes that matter, and
# the signal each raises. Timers live in a WITHOUT ROWID table, of which sqld sends nothing:
# an armed timer is learnt from its execution's change, written in the same commit.
STREAMS = (
    ("harel_outbox", ("insert",), OUTBOX),
    ("harel_spawns", ("insert",), SPAWN),
    ("harel_executions", ("insert", "update"), EXECUTION),
    # A change of a key's settings, or room made under its limit (0011): work of any kind
    # may have become claimable.
    ("harel_flows", ("insert", "update", "delete"), ANY),
)
# sqld sends a keep-alive every 15 s: a stream silent for this long past the store's
# timeout is taken for broken.
KEEP_ALIVE = 15.0
RETRY_FIRST = 0.05
RETRY_LONGEST = 5.0
UNSUPPORTED_RETRY = 60.0
# The pauses after a notification (the last of a burst) before its change is told again
# (`ListenWatch._settle`): the first longer than the gap seen between sqld's notification and
# its commit's visibility (under 10 ms, a commit of 200 KB on a loaded machine), the second
# for a slower disk.
SETTLE_AFTER = (0.02, 0.2)


class ListenWatch:
    """sqld's change notifications of the tables in `STREAMS` at ``origin`` + ``base``
    (one stream each, on a thread of its own), through an `http.Client` made for them."""

    linger: float = 5.0

    def __init__(self, client: http.Client, base: str, where: str, timeout: float) -> None:
        self._client = client
        self._base = base.rstrip("/")
        self._where = where
        self._timeout = timeout
        self._stopped = threading.Event()
        self._lock = threading.Lock()
        self._open: set[http.Stream] = set()
        self._threads: list[threading.Thread] = []
        self._told: set[str] = set()  # what was logged once (a server without the endpoint)
        self._heard = threading.Event()  # a change was notified: tell it again, settled
        self._streaming: set[str] = set()  # the kinds whose stream is open and served

    @property
    def live(self) -> bool:
        """Whether every stream is open and served."""
        return len(self._streaming) == len(STREAMS)

    def start(self, signal: Signal) -> None:
        """Begin watching; an error (no thread to be had) stops what had started."""
        threads = [
            threading.Thread(
                target=self._settle, args=(signal,), name="harel-store listen settle", daemon=True
            )
        ]
        for table, actions, kind in STREAMS:
            query = f"table={quote(table)}" + "".join(f"&action={a}" for a in actions)
            threads.append(
                threading.Thread(
                    target=self._run,
                    args=(f"{self._base}/beta/listen?{query}", kind, signal),
                    name=f"harel-store listen {table}",
                    daemon=True,
                )
            )
        try:
            for thread in threads:
                thread.start()
                self._threads.append(thread)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        self._stopped.set()
        self._heard.set()  # the settle thread ends
        with self._lock:
            streams = list(self._open)
        for stream in streams:
            stream.close()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5)
        self._client.close()

    def _run(self, path: str, kind: str, signal: Signal) -> None:
        pause = RETRY_FIRST
        while not self._stopped.is_set():
            began = time.monotonic()
            try:
                stream = self._client.stream(path)
            except (http.HTTPFailure, OSError, RuntimeError) as exc:  # RuntimeError: stopped
                log.debug("change notifications from %s: %s", self._where, exc)
            else:
                with self._lock:
                    self._open.add(stream)
                if self._stopped.is_set():  # stopped while it opened: `stop` did not see it
                    stream.close()
                try:
                    if stream.status != 200:
                        pause = self._refused(stream)
                    else:
                        # Whatever changed while there was no stream was missed: look,
                        # and again once the server surely listens (it may subscribe only
                        # after it answered).
                        signal(frozenset((ANY,)))
                        self._heard.set()
                        self._streaming.add(kind)
                        try:
                            self._read(stream, kind, signal)
                        finally:
                            self._streaming.discard(kind)
                        if time.monotonic() - began > RETRY_LONGEST:  # it served: no flapping
                            pause = RETRY_FIRST
                except (http.HTTPFailure, OSError, ValueError) as exc:  # ValueError: TLS closed
                    if not self._stopped.is_set():
                        log.debug("change notifications from %s broke: %s", self._where, exc)
                finally:
                    with self._lock:
                        self._open.discard(stream)
                    stream.close()
            self._stopped.wait(pause * random.uniform(0.5, 1.0))
            if pause < UNSUPPORTED_RETRY:
                pause = min(pause * 2, RETRY_LONGEST)

    def _settle(self, signal: Signal) -> None:
        """Tell every change again after each pause of `SETTLE_AFTER` from its notification
        (`SETTLED`; once for a burst): sqld notifies from its commit hook, before the commit is
        visible to other readers, so a read at the notification may not see it yet."""
        while True:
            self._heard.wait()
            self._heard.clear()  # a change notified from now on is told again after these
            for pause in SETTLE_AFTER:
                if self._stopped.wait(pause):
                    return
                signal(frozenset((SETTLED,)))

    def _refused(self, stream: http.Stream) -> float:
        """Log (once) why the server refused the stream; the pause before asking again."""
        status = stream.status
        if status in (401, 403):
            message = (
                f"{self._where} refused the auth token for change notifications (HTTP {status})"
            )
        else:
            message = (
                f"{self._where} offers no change notifications (HTTP {status}): relays and "
                "wait_for poll"
            )
        if message not in self._told:
            self._told.add(message)
            log.info("%s", message)
        return UNSUPPORTED_RETRY

    def _read(self, stream: http.Stream, kind: str, signal: Signal) -> None:
        """Raise ``kind`` for each change event until the stream ends or falls silent."""
        pending = b""
        event = b""
        while not self._stopped.is_set():
            data = stream.read(KEEP_ALIVE + self._timeout)
            if not data:
                return
            pending += data
            *lines, pending = pending.split(b"\n")
            for line in lines:
                line = line.rstrip(b"\r")
                if not line:  # an event ends
                    if event == b"changes":
                        signal(frozenset((kind,)))
                        self._heard.set()
                    elif event == b"error":  # "some changes were lost"
                        signal(frozenset((ANY,)))
                    event = b""
                elif line.startswith(b"event:"):
                    event = line[6:].strip()
            if len(pending) > 65536:
                raise http.BadResponse("an event stream line over 64 KiB")
