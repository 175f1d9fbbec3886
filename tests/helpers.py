"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from harel_store import AsyncLibsqlStore
from harel_store.batch import Batch
from harel_store.connection import HranaConnection, LocalConnection
from harel_store.store import Store

ROOT = Path(__file__).resolve().parent.parent
# The command line an operator runs, on the repository's alembic.ini.
ALEMBIC = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]

# Alembic's command line, once for each argv of the JSON list in argv[1], in one interpreter:
# a walk of many steps pays Python's and Alembic's start once, and each step is still a
# command of its own (its own env.py run, engine and transaction). A step ["copy", A, B]
# copies the file A to B (no connection is open between two commands).
STEPS = """
import json, shutil, sys
from alembic.config import main
for argv in json.loads(sys.argv[1]):
    if argv[0] == "copy":
        shutil.copyfile(argv[1], argv[2])
    else:
        main(argv=argv)
"""


def alembic_steps(*steps: tuple[Path, str, str]) -> None:
    """Run ``alembic -x url=DB COMMAND TARGET`` for each (db, command, target), in order, in
    one child process; a step (db, "copy", path) copies the file db to path."""
    argvs = [
        ["copy", str(db), step[1]]
        if step[0] == "copy"
        else [*ALEMBIC[3:], "-x", f"url={db}", *step]
        for db, *step in steps
    ]
    done = subprocess.run(
        [sys.executable, "-c", STEPS, json.dumps(argvs)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, f"alembic_steps{steps}:\n{done.stderr}"


def in_process(
    main: Callable[[list[str]], int],
    argv: list[str],
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``main(argv[1:])`` run in this process, as a process running ``argv`` would run it,
    without a process's start (half a second of CPU for the console script): its
    environment is this one without $HAREL_* plus ``env``, in ``cwd``, with an empty stdin;
    its stdout and stderr (the descriptors too: a child it starts writes there) are
    captured as text; its exit status is what ``main`` returns, a SystemExit's code, or 1
    for an exception, whose traceback goes to its stderr. All of it is put back after.

    The test fails if the call leaves a file open (a database connection not closed: the
    test may read the file next with another SQLite library, which one process must never
    do while the other has it open), a thread running that would keep a process from
    ending, or a signal handler set. Run what
    needs a process of its own (its start, signals, a bound that kills the process) in a
    real one."""
    changes = {k: None for k in os.environ if k.startswith("HAREL_")} | dict(env or {})
    saved_env = {k: os.environ.get(k) for k in changes}
    saved_env.setdefault("RUST_LOG", os.environ.get("RUST_LOG"))  # main sets it
    handlers = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    threads = _non_daemon_threads()
    files = _open_files()
    here = Path.cwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            _set_environment(changes)
            if cwd is not None:
                os.chdir(cwd)
            with _streams(out.fileno(), err.fileno()) as stderr:
                try:
                    status = main(argv[1:])
                except SystemExit as exc:
                    status = _exit_status(exc.code, stderr)
                except Exception:
                    traceback.print_exc(file=stderr)
                    status = 1
        finally:
            os.chdir(here)
            _set_environment(saved_env)
        stdout, stderr_text = _text(out), _text(err)
    assert {n: signal.getsignal(n) for n in handlers} == handlers, f"{argv}: a handler set"
    assert _non_daemon_threads() <= threads, f"{argv}: a thread left running"
    left = _open_files() - files
    assert not left, f"{argv} left open: {sorted(left)}"
    return subprocess.CompletedProcess(argv, status, stdout, stderr_text)


def _non_daemon_threads() -> set[threading.Thread]:
    """The threads that would keep a process from ending."""
    return {t for t in threading.enumerate() if not t.daemon}


def _set_environment(values: dict[str, str | None]) -> None:
    for key, value in values.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


@contextlib.contextmanager
def _streams(out: int, err: int) -> Iterator[io.TextIOWrapper]:
    """stdin empty, stdout and stderr (as descriptors 1 and 2 too) into ``out`` and ``err``;
    yields the new sys.stderr."""
    saved = sys.stdin, sys.stdout, sys.stderr
    saved_fds = os.dup(1), os.dup(2)
    sys.stdout.flush()
    sys.stderr.flush()

    def text(fd: int, errors: str) -> io.TextIOWrapper:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw, "utf-8", errors, write_through=True)  # type: ignore[arg-type]

    try:
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = io.TextIOWrapper(io.BytesIO(), "utf-8")
        sys.stdout, sys.stderr = text(out, "strict"), text(err, "backslashreplace")
        yield sys.stderr
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        sys.stdin, sys.stdout, sys.stderr = saved
        for fd, old in zip((1, 2), saved_fds, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _exit_status(code: object, stderr: io.TextIOWrapper) -> int:
    """A process's exit status for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=stderr)
    return 1


def _text(file: IO[bytes]) -> str:
    """What ``subprocess.run(text=True)`` reads of what was written (universal newlines)."""
    file.seek(0)
    return file.read().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")


def _open_files() -> set[tuple[str, str]]:
    """The regular files this process has open, with their descriptors."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/") and os.path.isfile(target):
                found.add((fd, target))
    return found


class SyncFacade:
    """Drives an AsyncLibsqlStore from a sync test body, on one private event loop."""

    def __init__(self, store: AsyncLibsqlStore, loop: asyncio.AbstractEventLoop) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(attr(*args, **kwargs))

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)

    @property
    def sync_store(self) -> Store:
        return self._store._s  # type: ignore[no-any-return]


def raw(store: Any) -> Any:
    """A DB-API connection to the store's database (to stage faults a caller could not
    cause): a local store's own; for a remote store or a replica, a libsql connection of
    the test's own to the primary, where the writes land."""
    inner = store.sync_store if hasattr(store, "sync_store") else store
    conn = inner._conn
    if isinstance(conn, LocalConnection):
        return conn.db
    primary = conn if isinstance(conn, HranaConnection) else conn._primary
    import libsql

    token = primary._secrets[0] if primary._secrets else ""
    return libsql.connect(primary.url, auth_token=token)


# Rows of the three tables migration 0003 rebuilds, as a database at 0002 holds them.
ROWS_0003: dict[str, list[tuple[Any, ...]]] = {
    "harel_processed_events": [("a", "ev-1"), ("a", "ev-2"), ("b", "ev-1")],
    "harel_timers": [("a", "t1", 10.5), ("b", "t1", 2.25), ("b", "t2", 1e9)],
    "harel_trace": [("a", 0, '{"s":0}'), ("a", 1, '{"s":1}'), ("b", 7, '{"s":7}')],
}


def stage_0003(conn: Any) -> None:
    """Write ROWS_0003 through a DB-API connection (sqlite3 or libsql) and commit."""
    for table, rows in ROWS_0003.items():
        for row in rows:
            marks = ", ".join("?" * len(row))
            conn.execute(f"INSERT INTO {table} VALUES ({marks})", row)
    conn.commit()


def rows_0003(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
    """What the tables of ROWS_0003 hold in the columns staged, in primary-key order."""
    return {
        table: [
            tuple(r)[: len(rows[0])]
            for r in conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
        ]
        for table, rows in ROWS_0003.items()
    }


def check_0003_rows(store: Any) -> None:
    """The store reads the rows staged by stage_0003 after migrating them."""
    assert store.due_timers(11.0) == [("b", "t1", 2.25), ("a", "t1", 10.5)]
    assert store.is_processed("a", "ev-2") and not store.is_processed("b", "ev-2")
    assert store.read_trace("a") == [{"s": 0, "index": 0}, {"s": 1, "index": 1}]
    store.append_trace("b", {"s": 8})  # the ring goes on from the last index it holds
    assert store.read_trace("b") == [{"s": 7, "index": 7}, {"s": 8, "index": 8}]


# Tests that left SIGINT otherwise than they found it in the main thread (its handler, or
# blocked): put back after each by conftest, and named here (a test of interrupts says them).
SIGINT_LEFT: list[str] = []


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.002)


def shell_env(*first: Path, **extra: str) -> dict[str, str]:
    """The environment a documented shell line runs in: this venv's commands on PATH (after
    ``first``), none of the caller's databases or tokens, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    path = [*map(str, first), str(Path(sys.executable).parent), env.get("PATH", "")]
    return {**env, "PATH": os.pathsep.join(path), **extra}


def refused_batch() -> Batch:
    """A write the database refuses (not a conflict): the remote guard's malformed JSON,
    raised since the statement before it changed no row."""
    batch = Batch()
    batch.add("cancel_timer", "nobody", "nothing")
    batch.add("guard_changed")
    return batch


_REFUSING: list[socket.socket] = []  # held to the end of the process


def refused_port() -> int:
    """A loopback port where a connection is refused, for as long as this process runs: bound
    here and never listened on. A port merely free a moment ago can be taken meanwhile by
    another test's server or a client's own ephemeral port (seen in CI: a proxy "closed the
    connection", a test server read a CONNECT), which this one cannot."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    port: int = sock.getsockname()[1]
    return port


Refusal = tuple[Callable[..., object], type[BaseException] | tuple[type[BaseException], ...]]


def raises_each(cases: list[Refusal], *args: Any, after: Callable[[], None] | None = None) -> None:
    """Each case's ``call(*args)`` raises its error (a subclass too, as `pytest.raises`), and
    ``after()`` then holds (nothing written, the store still usable); a failure says which
    case by its index. The cases of bad arguments run one after another on one store (of
    each kind): one store each cost a store's setup each, a server's or a replica's for six
    of the seven kinds, for a check made before any statement."""
    for i, (call, error) in enumerate(cases):
        try:
            with pytest.raises(error):
                call(*args)
            if after is not None:
                after()
        except BaseException as exc:
            exc.add_note(f"bad-argument case {i} of {len(cases)}, expecting {error}")
            raise
