"""An embedded replica: reads from a local replica file, writes to its primary.

A write goes to the primary as one Hrana batch (`HranaConnection`), so the version CAS is
decided there, in one round trip. libsql's replica sync keeps the file in step with the
primary, but it has no timeout and holds the GIL while it waits on the network: it runs in
a helper process (`replica_helper`) that a `Syncer` thread drives and ends at a deadline,
starting a new one when it is needed again. This process reads the file itself, through
the stdlib's sqlite3 (one SQLite library per file in a process), and never writes it.

After a write of ours lands (or loses its CAS, or its fate is unknown) a sync begins at
once, in the background; the next read waits for it, so it sees the write (or the version
that won), for up to ``timeout``: past it, or if the sync fails, StoreError, and the read
after tries again. A read while no write of ours is missing is answered from the file at
once, whether or not the primary answers.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from contextlib import suppress
from pathlib import Path
from types import ModuleType
from typing import Any

from harel_store.batch import Batch, Conflicted, Fresh, Request, statement
from harel_store.connection.hrana import HranaConnection
from harel_store.connection.local import LocalConnection, open_file
from harel_store.connection.watch import ListenWatch
from harel_store.errors import OutcomeUnknown, StoreError, scrub, translate

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: no lock, and no guard against two stores on one file
    fcntl = None

log = logging.getLogger("harel_store")
HELPER = str(Path(__file__).with_name("replica_helper.py"))
# What a new helper may take to start (Python, then libsql's import), beyond ``timeout``.
START_GRACE = 0.5
# The share of ``timeout`` a helper spends retrying a sync sqld asks to be retried.
RETRY_SHARE = 0.8
# How long a closing store lets its helper finish a sync before it kills it.
END_WAIT = 0.5


class ReplicaConnection:
    def __init__(self, local: LocalConnection, primary: HranaConnection, syncer: Syncer) -> None:
        self.where = f"{local.where} (replica of {primary.where})"
        self.key = primary.key  # its writes land on the primary
        self._local = local
        self._primary = primary
        self._syncer = syncer

    @property
    def behind(self) -> bool:
        """Whether a write of ours landed (or may have) that the file may not hold yet."""
        return self._syncer.behind

    def execute(self, request: Request) -> Any:
        if isinstance(request, Fresh):  # the file may lag: the primary has every commit
            return self._primary.execute(request.statement)
        if not isinstance(request, Batch):
            self._syncer.catch_up(time.monotonic() + self._syncer.timeout)
            return self._local.execute(request)
        try:
            result = self._primary.execute(request)
        except (Conflicted, OutcomeUnknown):
            self._syncer.wrote()  # the caller's reload then sees what the primary holds
            raise
        self._syncer.wrote()
        return result

    def watch(self) -> ListenWatch:
        """The primary's change notifications: the writes land there."""
        return self._primary.watch()

    def sync(self) -> None:
        """Pull the primary's latest state into the local file, within ``timeout``."""
        self._syncer.sync(time.monotonic() + self._syncer.timeout)

    def close(self) -> None:
        self._syncer.close()
        self._local.close()
        self._primary.close()


class _Late(Exception):
    """The helper did not answer by the deadline."""


class _Helper:
    """One helper process, started with its configuration, and its pipes."""

    def __init__(self, config: dict[str, Any], lock: int) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, HELPER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            pass_fds=(lock,),  # the file's lock lasts while the helper does
        )
        self.pid = self._proc.pid
        self._pending = b""
        self.send(json.dumps(config))

    def send(self, line: str) -> None:
        assert self._proc.stdin is not None
        with suppress(OSError, ValueError):  # it exited, or is ending: no answer says so
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()

    def answer(self, deadline: float) -> dict[str, Any]:
        """The helper's next answer; _Late past the deadline, StoreError if it exited."""
        assert self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise _Late
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self._proc.wait()
                raise StoreError(f"the replica's sync helper exited (status {code})")
            self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        reply = json.loads(line)
        assert isinstance(reply, dict)
        return reply

    def stop(self) -> None:
        """Ask it to exit once it has answered (the end of its input); from any thread."""
        assert self._proc.stdin is not None
        with suppress(OSError, ValueError):
            self._proc.stdin.close()

    def kill(self) -> None:
        """From any thread."""
        self._proc.kill()

    def end(self, wait: float) -> None:
        """Let it exit for up to ``wait`` seconds, then kill it; close its pipes."""
        self.stop()
        try:
            self._proc.wait(wait)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        assert self._proc.stdout is not None
        self._proc.stdout.close()


class Syncer:
    """Runs the replica's syncs, one at a time, on a thread of its own, each in the helper
    process and bounded by ``timeout``; a helper that misses the deadline (or dies) is
    ended, and the next sync starts a new one.

    Syncs are numbered as they begin. A write needs the first sync that begins after it
    (`wrote`); every caller waiting meanwhile shares it. ``interval`` (seconds) adds a sync
    whenever that long has passed since the last began, for nobody in particular.
    """

    def __init__(
        self,
        path: str,
        url: str,
        where: str,
        *,
        auth_token: str,
        timeout: float,
        interval: float | None,
    ) -> None:
        self.timeout = timeout
        self._where = where
        self._secrets = (auth_token,) if auth_token else ()
        self._path = path
        self._config = {
            "path": path,
            "url": url,
            "token": auth_token,
            "parent": os.getpid(),
            # A sync sqld answers "not yet" is tried again, leaving time to say why it failed.
            "retry_for": timeout * RETRY_SHARE,
        }
        self._interval = interval
        self._lock = _lock(path, timeout)
        self._cond = threading.Condition()
        self._begun = 0  # syncs begun
        self._done = 0  # the newest sync that succeeded
        self._wanted = 0  # the newest sync asked for
        self._need = 0  # the sync that the newest write of ours needs
        self._failure: tuple[int, StoreError] | None = None
        self._closed = False
        self._helper: _Helper | None = None
        # The helpers start from this thread: on Linux one dies with the thread that
        # started it (PR_SET_PDEATHSIG), and this one lives as long as the store.
        self._thread = threading.Thread(
            target=self._run, name=f"harel-store replica sync {where}", daemon=True
        )
        self._thread.start()

    @property
    def behind(self) -> bool:
        return self._done < self._need

    def _want(self) -> int:
        """Ask for a sync that begins from now on; its number (the condition is held)."""
        self._wanted = self._begun + 1
        self._cond.notify_all()
        return self._wanted

    def wrote(self) -> None:
        """A write of ours landed on the primary (or may have): reads wait for a sync."""
        with self._cond:
            self._need = max(self._need, self._want())

    def catch_up(self, deadline: float) -> None:
        """Return once the file holds every write of ours (at once when it does)."""
        if self._done < self._need:
            self._wait(self._need, deadline, None)

    def begin(self) -> int:
        """Ask for a sync that begins from now on; its number, for `wait`."""
        with self._cond:
            return self._want()

    def sync(self, deadline: float) -> None:
        """Return once a sync that began after this call succeeded."""
        self.wait(self.begin(), deadline)

    def wait(self, need: int, deadline: float) -> None:
        """Return once sync ``need`` (from `begin`) or a later one succeeded."""
        self._wait(need, deadline, need - 1)

    def _wait(self, need: int, deadline: float, began: int | None) -> None:
        """Wait for sync ``need``; a failure of one that began after sync ``began`` (None:
        the last begun now) is raised, an earlier one's is retried."""
        with self._cond:
            if began is None:
                began = self._begun
            while self._done < need:
                if self._closed:
                    raise StoreError(f"the store on {self._where} is closed")
                if self._failure is not None and self._failure[0] >= need:
                    epoch, error = self._failure
                    if epoch > began:  # a sync tried since this call began failed
                        raise error
                    need = self._want()  # one that failed earlier: try again
                left = deadline - time.monotonic()
                if left <= 0:
                    raise StoreError(
                        f"the replica {self._path} did not catch up with {self._where} "
                        f"within {self.timeout:g} s"
                    )
                self._cond.wait(left)

    def _run(self) -> None:
        last = time.monotonic()
        failing = False
        while True:
            with self._cond:
                while not self._closed and self._wanted <= self._begun:
                    if self._interval is None:
                        self._cond.wait()
                        continue
                    left = last + self._interval - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                if self._closed:
                    break
                self._begun += 1
                epoch, asked = self._begun, self._wanted >= self._begun
            last = time.monotonic()
            failure = self._sync()
            with self._cond:
                if failure is None:
                    self._done = epoch
                else:
                    self._failure = (epoch, failure)
                self._cond.notify_all()
            if failure is not None and not asked and not failing:
                log.warning("a background sync failed (retried every interval): %s", failure)
            failing = failure is not None
        self._end_helper(wait=END_WAIT)

    def _sync(self) -> StoreError | None:
        """One sync in the helper (a new one if it is gone): None, or why it failed."""
        try:
            if self._helper is None:
                deadline = time.monotonic() + self.timeout + START_GRACE
                self._helper = _Helper(self._config, self._lock)  # it syncs once open
            else:
                deadline = time.monotonic() + self.timeout
                self._helper.send("sync")
            reply = self._helper.answer(deadline)
        except _Late:
            self._end_helper(wait=0)
            return StoreError(
                f"no answer from {self._where} to the replica's sync within {self.timeout:g} s"
            )
        except (StoreError, OSError) as exc:
            self._end_helper(wait=0)
            return exc if isinstance(exc, StoreError) else StoreError(f"the replica's sync: {exc}")
        if "error" not in reply:
            return None
        self._end_helper(wait=0)  # a new one for the next sync: no driver state carried over
        text = scrub(str(reply["error"]), self._secrets)
        if reply.get("type") == "PanicException":
            return StoreError(f"the libsql driver failed (a panic) in the replica's sync: {text}")
        error = translate(StoreError(text), quoted=self._path)
        if type(error) is StoreError:
            error = StoreError(f"the replica {self._path} cannot sync with {self._where}: {text}")
        return error

    def _end_helper(self, wait: float) -> None:
        helper, self._helper = self._helper, None
        if helper is not None:
            helper.end(wait)

    def close(self) -> None:
        """End the thread and the helper: a sync in flight has END_WAIT to finish."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for helper_ends in (_Helper.stop, _Helper.kill):
            helper = self._helper
            if helper is not None:
                helper_ends(helper)  # the thread, waiting for its answer, sees it gone
            self._thread.join(END_WAIT)
            if not self._thread.is_alive():
                break
        os.close(self._lock)


def _lock(path: str, wait: float) -> int:
    """An exclusive lock on the replica file (``PATH-lock``) within ``wait`` seconds, or
    StoreError: libsql's replica sync assumes it alone writes the file, and two of them on
    one file have corrupted it. (A store killed a moment ago may hold it still: its helper
    lets go once it has died too.)"""
    flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(f"{path}-lock", flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # never lock (nor create) what a symbolic link names
            raise StoreError(
                f"cannot open {path}: its lock file {path}-lock is a symbolic link; a replica's"
                " lock file is a plain file (remove the link)"
            ) from exc
        raise StoreError(f"cannot open {path}: {exc.strerror}") from exc
    if fcntl is None:
        return fd
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except OSError as exc:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise StoreError(
                    f"the replica {path} is open in another store (of this process or "
                    "another): an embedded replica's file is its own, give each store a "
                    "file of its own"
                ) from exc
            time.sleep(0.01)


def open_replica(
    path: str | Path,
    sync_url: str,
    where: str,
    *,
    auth_token: str,
    sync_interval: float | None,
    timeout: float,
    busy_timeout: float,
) -> ReplicaConnection:
    """Open (or create) the replica file and pull the primary's state into it: one request
    to the primary, then the first sync, each within ``timeout``."""
    primary = HranaConnection(
        sync_url, where, auth_token=auth_token, timeout=timeout, busy_timeout=busy_timeout
    )
    try:
        syncer = Syncer(  # it takes the file's lock first
            str(path),
            sync_url,
            where,
            auth_token=auth_token,
            timeout=timeout,
            interval=sync_interval,
        )
    except BaseException:
        primary.close()
        raise
    try:
        first = syncer.begin()  # the helper starts meanwhile
        # A refused token shows in libsql's sync only as a handshake timeout (the cause
        # goes to the Rust log): the primary says so itself, so ask it too.
        primary.execute(statement("ping"))
        syncer.wait(first, time.monotonic() + timeout + START_GRACE)
        local = open_file(path, driver="sqlite", synchronous="FULL", busy_timeout=busy_timeout)
    except BaseException:
        syncer.close()
        primary.close()
        raise
    local.db.execute("PRAGMA query_only = ON", ())  # the primary takes every write
    return ReplicaConnection(local, primary, syncer)
