"""A program's ``main`` run in the test's own process, as a child process would run it.

A process that loads the package costs 0.3 to 1 s of CPU to start (pydantic and the models,
Alembic and SQLAlchemy), and the tests ran the console script and Alembic's command line
hundreds of times. `in_process` runs the same ``main`` in the test's process instead, with
what a process would have: its environment, directory and ``sys.argv``, an empty stdin,
stdout and stderr captured from the descriptors up (a child it starts writes there), the
text codecs and Python's default warning filters and logging, a setting the package reads
once a process read afresh, and a process's exit status. Everything is put back after the
call, and the test fails if the call left a file open, a thread that would keep a process
from ending, or a signal handler. `tests.test_in_process` holds each of these against a
real process.

What only a real process shows stays in one: its start (imports, the entry point), what
happens at its exit (atexit, destructors), signals, and a bound that kills the process.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import io
import locale
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO

# Imported before any call (with SQLAlchemy): Alembic adds a handler to its logger and
# SQLAlchemy sets its logger's level when imported, and a call puts the logging back as it
# was before it; a first import inside a call would be taken down with the rest.
from alembic.config import CommandLine, Config

from harel_store import migrate

# Python's warning filters in a process started without -W or -X dev (the list
# `warnings.filters` starts with), beside the test run's own ("error").
_DEFAULT_FILTERS: tuple[tuple[str, type[Warning], str], ...] = (
    ("default", DeprecationWarning, "__main__"),
    ("ignore", DeprecationWarning, ""),
    ("ignore", PendingDeprecationWarning, ""),
    ("ignore", ImportWarning, ""),
    ("ignore", ResourceWarning, ""),
)


def in_process(
    main: Callable[[list[str]], int | None],
    argv: list[str],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """``main(argv[1:])`` run in this process as ``subprocess.run(argv, cwd=cwd, env=env,
    capture_output=True, text=True)`` would run a program that calls it: ``env`` (None:
    this one's) is the environment, ``cwd`` the directory, ``argv`` is ``sys.argv``; the
    exit status is what ``main`` returns, a SystemExit's code (as a process's: -1 is 255),
    1 for an exception and -2 for a KeyboardInterrupt, whose traceback goes to stderr.
    What the command left for the garbage collector is collected, as a process's exit
    would free it (a ResourceWarning is ignored, as in a process).

    The test fails if the call leaves a regular file open (a database connection not
    closed: the test may read the file next with another SQLite library, which one process
    must never do while the other has it open), a non-daemon thread running (a process
    would not end) or a SIGINT, SIGTERM or SIGALRM handler changed. No timeout of its own:
    a command that hangs is stopped by pytest-timeout, as any test is (a process could be
    killed; a call in this one can not be)."""
    handlers = {n: signal.getsignal(n) for n in (signal.SIGINT, signal.SIGTERM, signal.SIGALRM)}
    threads = _non_daemon_threads()
    files = _open_files()
    with (
        tempfile.TemporaryFile() as out,
        tempfile.TemporaryFile() as err,
        _process_state(argv, cwd, env),
        _collected(),
    ):
        with _streams(out.fileno(), err.fileno()) as stderr:
            try:
                status = _exit_status(main(argv[1:]), stderr)
            except SystemExit as exc:
                status = _exit_status(exc.code, stderr)
            except KeyboardInterrupt:  # a process ends by the signal: -SIGINT
                traceback.print_exc(file=stderr)
                status = -int(signal.SIGINT)
            except Exception:
                traceback.print_exc(file=stderr)
                status = 1
        stdout, stderr_text = _text(out), _text(err)
    assert {n: signal.getsignal(n) for n in handlers} == handlers, f"{argv}: a handler set"
    assert _non_daemon_threads() <= threads, f"{argv}: a thread left running"
    left = _open_files() - files
    assert not left, f"{argv} left open: {sorted(left)}"
    return subprocess.CompletedProcess(argv, status, stdout, stderr_text)


def alembic_in_process(
    command: list[str], *, cwd: Path | None = None, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """``command``, ``python -m alembic ...`` (`tests.helpers.ALEMBIC` and its arguments),
    run in this process as `in_process` runs a program: Alembic's command line, its ini's
    logging, its exit status (a failure's is 255, with ``FAILED: ...`` on stdout)."""
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

    return in_process(alembic, [command[0], *command[3:]], cwd=cwd, env=env)


@contextlib.contextmanager
def _collected() -> Iterator[None]:
    """What the block left for the garbage collector collected at its end (here, under the
    command's warning filters). The objects from before it are frozen meanwhile: a full
    collection of this process takes ~60 ms, one of the block's objects ~1 ms."""
    gc.freeze()
    try:
        yield
        gc.collect()
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _process_state(
    argv: list[str], cwd: Path | None, env: Mapping[str, str] | None
) -> Iterator[None]:
    """The environment, directory, argv, warning filters and logging of a new process, and
    the package's once-a-process settings unread; all as they were after the block."""
    saved_env, here, saved_argv = dict(os.environ), Path.cwd(), sys.argv
    bounded, death = migrate._bounded, death_signal()
    try:
        with _logging_of_a_new_process(), warnings.catch_warnings():
            warnings.resetwarnings()
            for action, category, module in reversed(_DEFAULT_FILTERS):
                warnings.filterwarnings(action, category=category, module=module)
            warnings.showwarning = _show_warning  # not into pytest's record of them
            _set_environment(dict(os.environ if env is None else env))
            if cwd is not None:
                os.chdir(cwd)
            sys.argv = list(argv)
            migrate._bounded = None  # $HAREL_MIGRATE_PARENT, read once a process: unread
            yield
    finally:
        migrate._bounded = bounded
        migrate._on_parent_death(death)
        sys.argv = saved_argv
        os.chdir(here)
        _set_environment(saved_env)


def _show_warning(
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: IO[str] | None = None,
    line: str | None = None,
) -> None:
    """A warning printed as a process prints it, on (the command's) stderr."""
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@contextlib.contextmanager
def _logging_of_a_new_process() -> Iterator[None]:
    """Logging as a new process has it: no handler on the root logger, which is at WARNING,
    so that a record reaches stderr through `logging.lastResort` (here, pytest's capture
    handlers sit on the root). After the block every logger's level, handlers and flags
    are what they were, and a handler that existed is never closed by the block (Alembic's
    ini, through `logging.config.fileConfig`, closes every handler there is)."""
    manager = logging.Logger.manager
    kept = [
        (lg, lg.level, lg.handlers[:], lg.propagate, lg.disabled)
        for lg in [logging.root, *manager.loggerDict.values()]
        if isinstance(lg, logging.Logger)
    ]
    existing = {name for name, lg in manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    with logging._lock:  # type: ignore[attr-defined]
        handler_list = logging._handlerList[:]  # type: ignore[attr-defined]
        logging._handlerList.clear()  # type: ignore[attr-defined]
        named = dict(logging._handlers)  # type: ignore[attr-defined]
    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    try:
        yield
    finally:
        with logging._lock:  # type: ignore[attr-defined]
            logging._handlerList[:0] = handler_list  # type: ignore[attr-defined]
            logging._handlers.update(named)  # type: ignore[attr-defined]
        for lg, level, handlers, propagate, disabled in kept:
            lg.setLevel(level)
            lg.handlers[:] = handlers
            lg.propagate, lg.disabled = propagate, disabled
        for name, lg in list(manager.loggerDict.items()):
            if name not in existing and isinstance(lg, logging.Logger):
                lg.setLevel(logging.NOTSET)  # made in the block: as a logger is made
                lg.handlers.clear()
                lg.propagate, lg.disabled = True, False


def death_signal() -> int:
    """The signal this process gets when its parent ends (PR_GET_PDEATHSIG; 0 off Linux):
    a migration against a server, bounded by its parent, sets it."""
    if sys.platform != "linux":
        return 0
    value = ctypes.c_int()
    ctypes.CDLL(None).prctl(2, ctypes.byref(value))
    return value.value


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
    """stdin empty, stdout and stderr (as descriptors 1 and 2 too) into ``out`` and ``err``,
    with the codecs a child process of this one would have; yields the new sys.stderr."""
    saved = sys.stdin, sys.stdout, sys.stderr
    _flush()
    saved_fds: list[int] = []
    try:
        saved_fds.append(os.dup(1))
        saved_fds.append(os.dup(2))
        os.dup2(out, 1)
        os.dup2(err, 2)
        sys.stdin = io.TextIOWrapper(io.BytesIO(), "utf-8")
        sys.stdout = _text_stream(out, sys.__stdout__)
        sys.stderr = _text_stream(err, sys.__stderr__)
        yield sys.stderr
    finally:
        _flush()  # before the descriptors go back
        sys.stdin, sys.stdout, sys.stderr = saved
        for fd, old in zip((1, 2), saved_fds, strict=False):
            try:
                os.dup2(old, fd)
            finally:
                os.close(old)


def _text_stream(fd: int, like: IO[str] | None) -> io.TextIOWrapper:
    """A text stream on ``fd`` with the encoding and error handler of ``like`` (this
    process's own stdout or stderr, which a child started with the same locale shares)."""
    encoding = getattr(like, "encoding", None) or "utf-8"
    errors = getattr(like, "errors", None) or "strict"
    raw = io.FileIO(fd, "w", closefd=False)
    return io.TextIOWrapper(raw, encoding, errors, write_through=True)  # type: ignore[arg-type]


def _flush() -> None:
    """Every stream that writes to descriptor 1 or 2: sys.__stdout__ and sys.__stderr__ too
    (what a library took at its import, as Alembic's Config does for its default). A stream
    the command closed has nothing left to write."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        if stream is not None:
            with contextlib.suppress(ValueError, OSError):
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
    """What ``subprocess.run(text=True)`` reads of what was written: the locale's encoding,
    strict, universal newlines."""
    file.seek(0)
    data = file.read().decode(locale.getpreferredencoding(False))
    return data.replace("\r\n", "\n").replace("\r", "\n")


def _open_files() -> set[tuple[str, str]]:
    """The regular files this process has open, with their descriptors."""
    found = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("/") and os.path.isfile(target):
                found.add((fd, target))
    return found
