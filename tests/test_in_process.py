"""`tests.in_process` against a real process: the same program, run both ways, gives the
same exit status and output; and the test's process is as it was after the call."""

from __future__ import annotations

import gc
import logging
import logging.config
import os
import signal
import socket
import subprocess
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harel_store import migrate
from tests.in_process import death_signal, in_process

ROOT = Path(__file__).resolve().parent.parent
Program = Callable[[list[str]], int | None]


def both(program: Program, *, env: dict[str, str] | None = None) -> Any:
    """``program`` run in a real process and in this one: what each gave (the completed
    run's status and output, or the exception's type), which must be the same."""
    name = program.__name__
    code = f"import sys; from tests.test_in_process import {name} as p; sys.exit(p(sys.argv[1:]))"
    argv = [sys.executable, "-c", code]

    def outcome(run: Callable[[], subprocess.CompletedProcess[str]]) -> Any:
        try:
            done = run()
        except UnicodeDecodeError as exc:
            return type(exc)
        return done.returncode, done.stdout, _traceback_ends(done.stderr)

    real = outcome(
        lambda: subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    )
    here = outcome(lambda: in_process(program, ["-c"], cwd=ROOT, env=env))
    assert here == real
    return real


def _traceback_ends(text: str) -> str:
    """A traceback as its first and last lines: the frames between differ (the caller's)."""
    start = text.find("Traceback (most recent call last):\n")
    if start < 0:
        return text
    return text[:start] + "Traceback (most recent call last):\n...\n" + text.splitlines()[-1] + "\n"


# --- the programs, each run both ways ---


def logs(argv: list[str]) -> int:
    logging.getLogger("harel_store.probe").info("not shown: below WARNING")
    logging.getLogger("harel_store.probe").warning("a round failed: boom")
    return 0


def warns(argv: list[str]) -> int:
    warnings.warn("careful", UserWarning, stacklevel=1)
    warnings.warn("old", DeprecationWarning, stacklevel=1)  # silent outside __main__
    print("done")
    return 0


def names_itself(argv: list[str]) -> int:
    print(sys.argv[0], sys.argv[1:] == argv)
    return 3


def prints_an_undecodable_name(argv: list[str]) -> int:
    print("name-\udcff.db")
    return 0


def closes_stdout(argv: list[str]) -> int:
    print("before")
    sys.stdout.close()
    return 0


def interrupted(argv: list[str]) -> int:
    raise KeyboardInterrupt


def reads_the_migration_parent(argv: list[str]) -> int:
    migrate.bounded_elsewhere()  # $HAREL_MIGRATE_PARENT names no parent: ValueError
    return 0


def drops_a_socket(argv: list[str]) -> int:
    """Unclosed, in a reference cycle: a process frees it at exit and says nothing."""
    sock = socket.socket()
    cycle: list[Any] = [sock]
    cycle.append(cycle)
    return 0


def configures_logging(argv: list[str]) -> int:
    """As Alembic's ini does through fileConfig (which closes every handler there is)."""
    logging.config.dictConfig(
        {
            "version": 1,
            "disable_existing_loggers": False,
            "handlers": {"h": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr"}},
            "root": {"handlers": ["h"], "level": "INFO"},
            "loggers": {"alembic": {"level": "INFO"}},
        }
    )
    logging.getLogger("harel_store.probe").info("configured")
    return 0


def starts_a_child(argv: list[str]) -> int:
    subprocess.run([sys.executable, "-c", "print('from a child')"], check=True)
    print("from the parent", file=sys.stderr)
    return 0


# --- the tests ---


def test_a_logged_warning_reaches_stderr() -> None:
    assert both(logs) == (0, "", "a round failed: boom\n")


def test_a_warning_is_printed_and_the_program_goes_on() -> None:
    status, out, err = both(warns)
    assert (status, out) == (0, "done\n") and "UserWarning: careful" in err
    assert "old" not in err


def test_argv_is_the_programs() -> None:
    assert both(names_itself) == (3, "-c True\n", "")


def test_stdout_has_a_process_codec() -> None:
    both(prints_an_undecodable_name)  # whatever the locale makes of it, the same


def test_a_program_that_closes_stdout() -> None:
    before = os.fstat(1)
    assert both(closes_stdout) == (0, "before\n", "")
    assert os.fstat(1) == before


def test_an_interrupt_is_the_signals_exit_status() -> None:
    status, _, err = both(interrupted)
    assert status == -2 and err.rstrip().endswith("KeyboardInterrupt")


def test_a_setting_read_once_a_process_is_read_afresh_and_put_back() -> None:
    """$HAREL_MIGRATE_PARENT, which a process reads once (and a run's child links its
    death to its parent's): read by the command as by a new process, whatever this one
    read; this process's reading and its death signal as they were after."""
    bounded, death = migrate._bounded, death_signal()
    migrate._bounded = False  # as if this process had read it, unset
    try:
        env = {**os.environ, migrate.PARENT: "0"}
        status, _, err = both(reads_the_migration_parent, env=env)
        assert status == 1 and "does not name the parent" in err
        # Naming this process's parent: the command is a bounded run's child.
        env[migrate.PARENT] = str(os.getppid())
        assert in_process(reads_the_migration_parent, ["-c"], env=env).returncode == 0
        assert (migrate._bounded, death_signal()) == (False, death)
    finally:
        migrate._bounded = bounded


def test_what_a_program_left_to_the_collector_is_collected_in_its_call() -> None:
    """Not in a later test, whose warning filter ("error") would fail it."""
    assert both(drops_a_socket) == (0, "", "")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        gc.collect()
    assert [w for w in seen if issubclass(w.category, ResourceWarning)] == []


def test_loggers_a_first_import_sets_up_stay() -> None:
    """Alembic adds a handler to its logger and SQLAlchemy sets its level when imported: a
    first call that imports them (in a process that has not) must not take that down."""
    code = (
        "import logging\n"
        "from tests.in_process import in_process\n"
        "def imports(argv):\n"
        "    import alembic.config\n"
        "assert in_process(imports, ['-c']).returncode == 0\n"
        "alembic, sqlalchemy = logging.getLogger('alembic'), logging.getLogger('sqlalchemy')\n"
        "print([type(h).__name__ for h in alembic.handlers], sqlalchemy.level)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout) == (0, "['NullHandler'] 30\n"), done.stderr


def test_logging_set_up_by_a_program_is_taken_down_and_closes_nothing(tmp_path: Path) -> None:
    import alembic.config  # noqa: F401  (its logger's handler, set when imported)

    ours = logging.FileHandler(tmp_path / "ours.log", mode="w")
    logging.getLogger("harel_store.probe").addHandler(ours)
    alembic_handlers = logging.getLogger("alembic").handlers[:]
    root = logging.root.level, logging.root.handlers[:]
    try:
        assert both(configures_logging) == (0, "", "configured\n")
        assert (logging.root.level, logging.root.handlers) == root
        assert logging.getLogger("alembic").handlers == alembic_handlers
        logging.getLogger("harel_store.probe").warning("still written")
        ours.flush()
        assert "still written" in (tmp_path / "ours.log").read_text()
    finally:
        logging.getLogger("harel_store.probe").removeHandler(ours)
        ours.close()


def test_a_childs_output_is_the_programs() -> None:
    assert both(starts_a_child) == (0, "from a child\n", "from the parent\n")


def test_a_file_left_open_fails_the_test(tmp_path: Path) -> None:
    held: list[Any] = []

    def leaves_a_file(argv: list[str]) -> int:
        held.append(open(tmp_path / "held.db", "wb"))  # noqa: SIM115
        return 0

    with pytest.raises(AssertionError, match="left open"):
        in_process(leaves_a_file, ["leaves"])
    held[0].close()


def test_a_handler_left_set_fails_the_test() -> None:
    def sets_a_handler(argv: list[str]) -> int:
        signal.signal(signal.SIGALRM, lambda *_: None)
        return 0

    previous = signal.getsignal(signal.SIGALRM)
    try:
        with pytest.raises(AssertionError, match="a handler set"):
            in_process(sets_a_handler, ["sets"])
    finally:
        signal.signal(signal.SIGALRM, previous)


def test_a_thread_left_running_fails_the_test() -> None:
    stop = threading.Event()

    def leaves_a_thread(argv: list[str]) -> int:
        threading.Thread(target=stop.wait).start()
        return 0

    try:
        with pytest.raises(AssertionError, match="thread left running"):
            in_process(leaves_a_thread, ["leaves"])
    finally:
        stop.set()
