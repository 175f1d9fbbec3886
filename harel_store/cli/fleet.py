"""``--fleet FILE``: run one command over every database of a fleet, several at once.

FILE holds one ``NAME DATABASE`` per line (``#`` starts a comment line; blank lines are
skipped); DATABASE is what ``--url`` takes, its token as for ``--url`` (``authToken=`` in the
URL, else ``$HAREL_AUTH_TOKEN``, else ``$TURSO_AUTH_TOKEN``). Each database runs the very
command ``harel-store COMMAND ...`` runs on one database, in a process of its own (its
database handed over in the environment, never on a command line), at most ``--jobs`` at
once; its output comes back line by line under its name, then a summary. A database that
fails does not stop the others; the exit status is the worst of them. ``migrate`` is
idempotent, so running it again picks up where a run stopped.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import NamedTuple

from harel_store.cli.output import PROG, Failure, colour_on, to_json
from harel_store.connection import parse_database
from harel_store.connection.url import token_from_env
from harel_store.fleet import Fleet

__all__ = ["COMMANDS", "JOBS", "read_fleet", "run"]

COMMANDS = ("migrate", "status", "schema", "gc", "ls")  # what runs over a fleet
JOBS = 4  # databases at once, unless --jobs says otherwise
_TOP = ("--fleet", "--jobs")  # the top-level options that take a value


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
        text = line.strip()
        if not text or text.startswith("#"):
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
    try:
        Fleet(databases, auth_token=token_from_env())  # the names and URLs, checked; no I/O
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path}: {exc}") from None
    return databases


def command_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` from its command on: the top-level options (``--fleet``, ``--jobs``) left out."""
    i = 0
    while i < len(argv):
        token = argv[i]
        if token in _TOP:
            i += 2
        elif token.startswith(tuple(f"{option}=" for option in _TOP)):
            i += 1
        else:
            break
    return list(argv[i:])


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


def _run_one(name: str, database: str, argv: list[str], secrets: list[str]) -> Outcome:
    """The command on one database, in a process of its own; its output with every secret
    of the fleet file replaced (its own errors show none already)."""
    env = {**os.environ, "HAREL_DATABASE_URL": database}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "harel_store", *argv],
            env=env,
            capture_output=True,
            text=True,
            errors="replace",
            stdin=subprocess.DEVNULL,
        )
    except OSError as exc:
        return Outcome(name, 1, [], [f"{PROG}: error: cannot start: {exc}"])
    status = done.returncode if done.returncode >= 0 else 128 - done.returncode

    def lines(text: str) -> list[str]:
        for secret in secrets:
            text = text.replace(secret, "***")
        return text.splitlines()

    return Outcome(name, status, lines(done.stdout), lines(done.stderr))


def run(args: argparse.Namespace, argv: Sequence[str]) -> int:
    """``harel-store --fleet FILE COMMAND ...``: COMMAND on every database of FILE."""
    _check(args)
    databases = read_fleet(args.fleet)
    jobs = min(args.jobs or JOBS, len(databases))
    rest = command_argv(argv)
    secrets = sorted(
        {parse_database(db).auth_token for db in databases.values()} - {""}, key=len, reverse=True
    )
    progress = colour_on(sys.stderr)
    as_json = bool(getattr(args, "json", False))
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    with ThreadPoolExecutor(jobs, thread_name_prefix="harel-fleet") as pool:
        futures = [
            pool.submit(_run_one, name, databases[name], rest, secrets)
            for name in sorted(databases)
        ]
        for future in as_completed(futures):
            outcome = future.result()
            with lock:
                outcomes.append(outcome)
                if progress:
                    print("\r\x1b[2K", end="", file=sys.stderr)
                _show(outcome, as_json)
                if progress:
                    done = f"{len(outcomes)}/{len(databases)} databases done"
                    print(f"\r\x1b[2K{done}", end="", file=sys.stderr, flush=True)
    if progress:
        print("\r\x1b[2K", end="", file=sys.stderr, flush=True)
    return _summary(outcomes, args.command, as_json)


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


def _summary(outcomes: list[Outcome], command: str, as_json: bool) -> int:
    """The summary line (on stdout; with --json, on stderr) and the worst exit status."""
    failed = sorted((o for o in outcomes if o.status), key=lambda o: o.name)
    total = len(outcomes)
    line = f"{PROG} {command}: {total} database{'' if total == 1 else 's'}, "
    line += f"{total - len(failed)} ok, {len(failed)} failed"
    if failed:
        line += ": " + ", ".join(f"{o.name} (exit status {o.status})" for o in failed)
    print(line, file=sys.stderr if as_json else sys.stdout)
    return max((o.status for o in outcomes), default=0)
