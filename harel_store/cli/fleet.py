"""``--fleet FILE``: run one command over every database of a fleet, several at once.

FILE holds one ``NAME DATABASE`` per line; a comment starts at a ``#`` that begins the line
or follows a space or tab (a ``#`` inside a path is the path's), blank lines are skipped.
DATABASE is what ``--url`` takes, its token as for ``--url`` (``authToken=`` in the URL, else
``$HAREL_AUTH_TOKEN``, else ``$TURSO_AUTH_TOKEN``); two lines naming one database (a
symlink, a relative and an absolute path) are refused, as `Fleet` refuses them. A local
file that does not exist is an error naming it, never a new empty database (a typo), unless
``migrate --create`` asks for it. Each database runs the very command ``harel-store COMMAND
...`` runs on one database, in a worker process (`Worker`: ``--jobs`` of them, each running
one database after another, its database handed over on a pipe, never on a command line);
its output comes back line by line under its name, by name whatever order they finish in,
then a summary. A database that fails does not stop the others; the exit status is the
worst of them. A usage error (exit status 2) is the command line's, the same for every
database: the first stops the run (no other database is started) and it is printed once.
``migrate`` is idempotent, so running it again picks up where a run stopped.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import queue
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from typing import IO, NamedTuple

from harel_store.cli.output import PROG, Failure, colour_on, to_json
from harel_store.connection import parse_database, show
from harel_store.connection.url import token_from_env
from harel_store.migrate import DIE_WITH, PARENT, python_child

__all__ = ["COMMANDS", "JOBS", "Worker", "read_fleet", "run", "serve"]

# What runs over a fleet.
COMMANDS = ("migrate", "status", "schema", "gc", "ls", "flow", "workers", "release")
JOBS = 4  # databases at once, unless --jobs says otherwise
_COMMENT = re.compile(r"(?:^|[ \t])#")  # a '#' that starts the line or follows a blank
USAGE = 2  # the exit status of a usage error: the command line's, not a database's


class Outcome(NamedTuple):
    """What one database's run gave: its name, exit status, stdout and stderr lines."""

    name: str
    status: int
    out: list[str]
    err: list[str]


def read_fleet(path: str) -> dict[str, str]:
    """The fleet FILE names: ``{name: database}``, checked as `Fleet` checks them (no
    database is opened). ValueError names the line of a malformed entry, never its text
    (a URL may carry a token); Failure when the file cannot be read."""
    try:
        with open(path, encoding="utf-8") as file:
            lines = file.read().splitlines()
    except (OSError, UnicodeError) as exc:
        raise Failure(f"cannot read the fleet file {path}: {exc}") from None
    databases: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        text = _COMMENT.split(line, maxsplit=1)[0].strip()
        if not text:
            continue
        fields = text.split()
        if len(fields) != 2:
            raise ValueError(
                f"{path}, line {number}: expected NAME DATABASE, found {len(fields)} fields"
            )
        name, database = fields
        if name in databases:
            raise ValueError(f"{path}, line {number}: the name {name!r:.80} is given twice")
        databases[name] = database
    from harel_store.fleet import Fleet  # and the async store: only for a fleet's commands

    try:
        Fleet(databases, auth_token=token_from_env())  # the names and URLs, checked; no I/O
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return databases


def _check(args: argparse.Namespace) -> None:
    """The usage a fleet run allows: its commands, no --url of one database, nothing that
    prints a script or the head schema instead of reading each database."""
    if args.command not in COMMANDS:
        raise ValueError(f"--fleet runs {', '.join(COMMANDS)}, not {args.command}")
    if args.url is not None or args.sync_url is not None:
        raise ValueError("--fleet names every database: give no --url or --sync-url")
    if args.command == "schema" and not args.check:
        raise ValueError("with --fleet, schema takes --check (the head schema is one for all)")
    if args.command == "migrate" and args.sql:
        raise ValueError("with --fleet, migrate takes no --sql (print one database's script)")


class Worker:
    """A process of our own that runs the command on one database after another, so the
    imports are paid once per worker, not once per database. Started on first use, and
    again after one ended under a job (``migrate --timeout`` ends its process at the
    deadline): that job's outcome is its exit status. It dies with this process (SIGTERM,
    a kill), and the migration it runs dies with it: none goes on once the command ended.
    (Linux kills it when the thread that started it ends: the thread that uses a Worker
    closes it, which waits for its process, before it ends.)"""

    def __init__(self, argv: list[str], secrets: list[str]) -> None:
        self._argv = argv
        self._secrets = secrets
        self._proc: subprocess.Popen[str] | None = None
        self._log: IO[bytes] | None = None  # the process's own stderr: what it printed itself

    def run(self, name: str, database: str) -> Outcome:
        """The command on ``database``: its exit status and output, every secret of the
        fleet file replaced (its own errors show none already)."""
        if self._proc is None:
            self._log = tempfile.TemporaryFile()  # noqa: SIM115 (closed by close())
            try:
                # It dies with this process from its first lines (`python_child`). It is
                # no run's child: a $HAREL_MIGRATE_PARENT left in this environment is not
                # passed on (`bounded_elsewhere` would refuse its migrations); it bounds
                # its migrations itself.
                env = {k: v for k, v in os.environ.items() if k != PARENT}
                self._proc = subprocess.Popen(
                    python_child(_SERVE),
                    env={**env, DIE_WITH: str(os.getpid())},
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=self._log,
                    text=True,
                    encoding="utf-8",
                    errors="replace",
                )
            except OSError as exc:
                self.close()
                return Outcome(name, 1, [], [f"{PROG}: error: cannot start a worker: {exc}"])
        proc, log = self._proc, self._log
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        assert log is not None
        start = os.fstat(log.fileno()).st_size
        job = json.dumps({"database": database, "argv": self._argv})
        try:
            proc.stdin.write(job + "\n")
            proc.stdin.flush()
            answer = proc.stdout.readline()
        except OSError:  # it ended before the job reached it
            answer = ""
        # Read where it wrote, leaving the file's offset (which it shares) where it is.
        end = os.fstat(log.fileno()).st_size
        printed = os.pread(log.fileno(), end - start, start).decode("utf-8", "replace")
        if answer:
            result = json.loads(answer)
            status, out, err = result["status"], result["out"], result["err"] + printed
        else:  # it ended under the job
            code = proc.wait()
            self.close()
            status = 128 - code if code < 0 else code or 1
            out, err = "", printed or f"{PROG}: error: ended with exit status {status}\n"
        return Outcome(name, status, self._lines(out), self._lines(err))

    def _lines(self, text: str) -> list[str]:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text.splitlines()

    def close(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # its loop ends
            proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None


# A worker's program: the command's `main` handed to the loop (this module is below it).
_SERVE = """
from harel_store.cli import main
from harel_store.cli.fleet import serve
serve(main)
"""


def serve(main: Callable[[list[str]], int]) -> None:
    """A worker's loop: one job a line on stdin (a database and the command's arguments),
    run by ``main``; its outcome a line on the channel (stdout as it was when the worker
    started). From then on the file descriptor 1 is a file of its own: what reaches it
    during a job (a child process the command runs writes there) is that job's output.
    A worker dies with the process that started it (`Worker`), and a migration's child it
    starts dies with it in turn (`run_bounded`)."""
    channel = os.fdopen(os.dup(1), "w", encoding="utf-8")
    stray = tempfile.TemporaryFile()  # noqa: SIM115 (the worker's whole life)
    os.dup2(stray.fileno(), 1)
    for line in sys.stdin:
        job = json.loads(line)
        os.environ["HAREL_DATABASE_URL"] = job["database"]
        out, err = io.StringIO(), io.StringIO()
        start = os.fstat(1).st_size
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                status = main(job["argv"])
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
        if sys.__stdout__ is not None:
            sys.__stdout__.flush()
        end = os.fstat(1).st_size
        printed = os.pread(1, end - start, start).decode("utf-8", "replace")
        result = {"status": status, "out": out.getvalue() + printed, "err": err.getvalue()}
        channel.write(json.dumps(result) + "\n")
        channel.flush()


def missing(database: str) -> bool:
    """Whether ``database`` is a local file that does not exist (no server is asked)."""
    local = parse_database(database).local
    return local is not None and local != ":memory:" and not os.path.exists(local)


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``harel-store --fleet FILE COMMAND ...``: COMMAND on every database of FILE;
    ``argv`` is the command line without --fleet and --jobs (what each database runs)."""
    _check(args)
    databases = read_fleet(args.fleet)
    rest = list(argv)
    secrets = sorted(
        {parse_database(db).auth_token for db in databases.values()} - {""}, key=len, reverse=True
    )
    names = sorted(databases)
    outcomes: dict[str, Outcome] = {}
    create = args.command == "migrate" and bool(getattr(args, "create", False))
    todo: queue.SimpleQueue[str] = queue.SimpleQueue()
    for name in names:
        if not create and missing(databases[name]):  # a typo, not a database to make
            how = f"{PROG} --fleet {shlex.quote(args.fleet)} migrate --create"
            why = f"{show(databases[name])} does not exist: create it with `{how}`"
            outcomes[name] = Outcome(name, 1, [], [f"{PROG}: error: {why}"])
        else:
            todo.put(name)
    done: queue.SimpleQueue[Outcome | None] = queue.SimpleQueue()  # None: a thread ended
    stop = threading.Event()

    def work() -> None:
        worker = Worker(rest, secrets)
        try:
            while not stop.is_set():
                try:
                    name = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    done.put(worker.run(name, databases[name]))
                except Exception as exc:  # never a database without its outcome
                    done.put(Outcome(name, 1, [], [f"{PROG}: error: {type(exc).__name__}"]))
        finally:
            worker.close()
            done.put(None)

    threads = [
        threading.Thread(target=work, name="harel-fleet", daemon=True)
        for _ in range(min(args.jobs or JOBS, todo.qsize()))
    ]
    for thread in threads:
        thread.start()
    shown = _Shown(names, outcomes, bool(getattr(args, "json", False)))
    ended = 0
    try:
        shown.flush()
        while ended < len(threads):
            outcome = done.get()
            if outcome is None:
                ended += 1
                continue
            outcomes[outcome.name] = outcome
            if outcome.status == USAGE:
                stop.set()  # the command line is wrong: no other database is started
            shown.flush()
    finally:
        stop.set()  # an interrupted run starts no other database
        for thread in threads:
            thread.join()
        shown.end()
    return shown.finish(args.command)


class _Shown:
    """The outcomes printed by name, each once every name before it is done (whatever order
    they finish in), a progress line on a terminal meanwhile; a usage error held back until
    the end, where it is printed once if it is all there is."""

    def __init__(self, names: list[str], outcomes: dict[str, Outcome], as_json: bool) -> None:
        self._names = names
        self._outcomes = outcomes
        self._as_json = as_json
        self._next = 0  # the first name not printed yet
        self._progress = colour_on(sys.stderr)

    def flush(self) -> None:
        if self._progress:
            print("\r\x1b[2K", end="", file=sys.stderr)
        while self._next < len(self._names):
            outcome = self._outcomes.get(self._names[self._next])
            if outcome is None or outcome.status == USAGE:
                break
            _show(outcome, self._as_json)
            self._next += 1
        if self._progress:
            line = f"{len(self._outcomes)}/{len(self._names)} databases done"
            print(f"\r\x1b[2K{line}", end="", file=sys.stderr, flush=True)

    def end(self) -> None:
        if self._progress:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)

    def finish(self, command: str) -> int:
        """The rest, by name, and the summary; the exit status. A usage error that every
        database that met one met alike is printed once, as the command prints it alone;
        when it is all there is, there is no summary either."""
        found = list(self._outcomes.values())
        usage = {tuple(o.err) for o in found if o.status == USAGE}
        once = usage.pop() if len(usage) == 1 else None
        for name in self._names[self._next :]:
            outcome = self._outcomes.get(name)
            if outcome is not None and (once is None or outcome.status != USAGE):
                _show(outcome, self._as_json)
        for line in once or ():
            print(line, file=sys.stderr)
        if once is not None and all(o.status == USAGE for o in found):
            return USAGE
        not_run = len(self._names) - len(found)
        return _summary(found, command, self._as_json, not_run)


def _show(outcome: Outcome, as_json: bool) -> None:
    """One database's output: each line under its name (with --json, one JSON document of
    its name, exit status and output), its errors on stderr."""
    name = outcome.name
    if as_json:
        output: list[object] = []
        for line in outcome.out:
            try:
                output.append(json.loads(line))
            except ValueError:
                output.append(line)
        doc = {"database": name, "exit_status": outcome.status, "output": output}
        print(to_json(doc, separators=(",", ":")), flush=True)
    else:
        for line in outcome.out:
            print(f"{name}: {line}")
        sys.stdout.flush()
    for line in outcome.err:
        print(f"{name}: {line}", file=sys.stderr)
    if outcome.status and not outcome.err:
        print(f"{name}: {PROG}: failed (exit status {outcome.status})", file=sys.stderr)
    sys.stderr.flush()


def _summary(outcomes: list[Outcome], command: str, as_json: bool, not_run: int = 0) -> int:
    """The summary line (on stdout; with --json, on stderr) and the worst exit status."""
    failed = sorted((o for o in outcomes if o.status), key=lambda o: o.name)
    total = len(outcomes) + not_run
    line = f"{PROG} {command}: {total} database{'' if total == 1 else 's'}, "
    line += f"{len(outcomes) - len(failed)} ok, {len(failed)} failed"
    if failed:
        line += ": " + ", ".join(f"{o.name} (exit status {o.status})" for o in failed)
    if not_run:
        line += f"; {not_run} not run (stopped at a usage error)"
    print(line, file=sys.stderr if as_json else sys.stdout)
    return max((o.status for o in outcomes), default=0)
