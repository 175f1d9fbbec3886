"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator, Mapping
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


def alembic_steps(*steps: tuple[Path, str, str]) -> None:
    """Run ``alembic -x url=DB COMMAND TARGET`` for each (db, command, target), in order, in
    this process (`alembic_in_process`: each a command of its own, its own env.py run,
    engine and transaction); a step (db, "copy", path) copies the file db to path (no
    connection is open between two commands)."""
    for db, *step in steps:
        if step[0] == "copy":
            shutil.copyfile(db, step[1])
            continue
        done = alembic_in_process([*ALEMBIC, "-x", f"url={db}", *step])
        assert done.returncode == 0, f"alembic_steps{steps}:\n{done.stderr}"


def in_process(
    main: Callable[[list[str]], int | None],
    argv: list[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``main(argv[1:])`` run in this process as ``subprocess.run(argv, cwd=cwd, env=env,
    capture_output=True, text=True)`` would run a program that calls it, without a
    process's start (half a second of CPU for the console script, a second for Alembic's):
    the environment is ``env`` (None: this one's), the directory ``cwd``, stdin is empty,
    stdout and stderr are captured (the descriptors too: a child it starts writes there),
    the exit status is what ``main`` returns, a SystemExit's code (as a process's: -1 is
    255), or 1 for an exception, whose traceback goes to stderr. The environment, the
    directory, the streams and the logging configuration (Alembic's ini sets one up) are
    put back after.

    The test fails if the call leaves a file open (a database connection not closed: the
    test may read the file next with another SQLite library, which one process must never
    do while the other has it open), a thread running that would keep a process from
    ending, or a signal handler set. Run in a real process what needs one: its start, a
    setting a process reads once, signals, a bound that kills the process."""
    wanted = dict(os.environ if env is None else env)
    saved_env = dict(os.environ)
    handlers = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM)}
    threads = _non_daemon_threads()
    files = _open_files()
    here = Path.cwd()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err, _logging_kept():
        try:
            _set_environment(wanted)
            if cwd is not None:
                os.chdir(cwd)
            with _streams(out.fileno(), err.fileno()) as stderr:
                try:
                    status = _exit_status(main(argv[1:]), stderr)
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


@contextlib.contextmanager
def _logging_kept() -> Iterator[None]:
    """Every logger's level, handlers and flags as they were before the block."""
    loggers = [logging.root, *logging.Logger.manager.loggerDict.values()]
    kept = [
        (lg, lg.level, lg.handlers[:], lg.propagate, lg.disabled)
        for lg in loggers
        if isinstance(lg, logging.Logger)
    ]
    known = set(logging.Logger.manager.loggerDict)
    try:
        yield
    finally:
        for lg, level, handlers, propagate, disabled in kept:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
        for name in set(logging.Logger.manager.loggerDict) - known:
            new = logging.Logger.manager.loggerDict[name]
            if isinstance(new, logging.Logger):  # made during the block: as if never set
                new.setLevel(logging.NOTSET)
                new.handlers.clear()
                new.propagate, new.disabled = True, False


def alembic_in_process(
    command: list[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command``, ``python -m alembic ...`` (`ALEMBIC` and its arguments), run in this
    process as `in_process` runs a program: Alembic's command line, its ini's logging, its
    exit status (a failure's is 255, with ``FAILED: ...`` on stdout)."""
    from alembic.config import CommandLine, Config

    assert command[1:3] == ["-m", "alembic"], command

    def alembic(argv: list[str]) -> None:
        # CommandLine.main, but its Config writes to this sys.stdout: Config's default is
        # the sys.stdout of when alembic was imported (in a test run, pytest's capture).
        line = CommandLine(prog="alembic")
        options = line.parser.parse_args(argv)
        if not hasattr(options, "cmd"):
            line.parser.error("too few arguments")
        toml, ini = line._inis_from_config(options)
        config = Config(
            file_=ini, toml_file=toml, ini_section=options.name, cmd_opts=options, stdout=sys.stdout
        )
        line.run_cmd(config, options)

    return in_process(alembic, ["alembic", *command[3:]], cwd=cwd, env=env)


def _non_daemon_threads() -> set[threading.Thread]:
    """The threads that would keep a process from ending."""
    return {t for t in threading.enumerate() if not t.daemon}


def _set_environment(values: Mapping[str, str]) -> None:
    """os.environ made ``values``, changing only what differs."""
    for key in [k for k in os.environ if k not in values]:
        del os.environ[key]
    for key, value in values.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


@contextlib.contextmanager
def _streams(out: int, err: int) -> Iterator[io.TextIOWrapper]:
    """stdin empty, stdout and stderr (as descriptors 1 and 2 too) into ``out`` and ``err``;
    yields the new sys.stderr."""
    saved = sys.stdin, sys.stdout, sys.stderr
    _flush()
    saved_fds = os.dup(1), os.dup(2)

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
        _flush()  # before the descriptors go back
        sys.stdin, sys.stdout, sys.stderr = saved
        for fd, old in zip((1, 2), saved_fds, strict=True):
            os.dup2(old, fd)
            os.close(old)


def _flush() -> None:
    """Every stream that writes to descriptor 1 or 2: sys.__stdout__ too, which Alembic's
    Config writes to (its default, taken when alembic was imported)."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            stream.flush()


def _exit_status(code: object, stderr: io.TextIOWrapper) -> int:
    """A process's exit status for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
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
