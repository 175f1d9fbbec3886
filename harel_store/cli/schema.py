"""``migrate`` and ``schema``: change the schema with the packaged Alembic migrations, print
the head schema, or check a live database against it."""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

from harel_store.batch import drive
from harel_store.cli.common import (
    Command,
    connection,
    current_revision,
    database,
    exists,
    require_local,
    timeout,
)
from harel_store.cli.output import PROG, Failure
from harel_store.connection import parse_database, show
from harel_store.connection.local import open_reader, why_not
from harel_store.connection.revision import KNOWN, revision, unknown_revision
from harel_store.errors import StoreError
from harel_store.migrate import (
    alembic_config,
    bounded_elsewhere,
    killed,
    migration_timeout,
    python_child,
    run_bounded,
    timed_out,
)
from harel_store.schema import describe, diff, head_schema, schema_at
from harel_store.sql import HEAD, SQL_DIR, Query

REVISIONS = ["base", *KNOWN, "head"]
BUSY_TIMEOUT_MS = 5000  # reading the revision waits this long for a writer's lock


def target(text: str) -> str:
    """An argparse type: a revision (``base``, ``0001`` ..., ``head``), or with ``--sql`` a
    range of two, ``FROM:TO``."""
    ends = text.split(":")
    if len(ends) > 2 or not all(end in REVISIONS for end in ends):
        raise argparse.ArgumentTypeError(
            f"not a revision: {text!r} (one of {', '.join(REVISIONS)}; or, with --sql, a"
            " range FROM:TO of two of them)"
        )
    return text


def _revision(name: str) -> str | None:
    """A revision as written on the command line, as the database holds it (base: None)."""
    return None if name == "base" else HEAD if name == "head" else name


def _rank(rev: str | None) -> int:
    return 0 if rev is None else KNOWN.index(rev) + 1


def _label(rev: str | None) -> str:
    return "base" if rev is None else f"{rev} (head)" if rev == HEAD else rev


def read_revision(where: str) -> str | None:
    """The revision ``where`` is at (None: base), read without writing anything.

    A local file is read over a read-only connection (SQLite refuses any write on it), with
    the SQLite library this process already has it open with, if any; a missing file (or
    ``:memory:``) is at base and is not created. A server is read through the store's
    connection (a replica's primary is given by its own URL)."""
    db = parse_database(where)
    if db.local is None:
        return current_revision(where)
    if db.local == ":memory:" or not Path(db.local).exists():
        return None
    try:
        conn = open_reader(db.local, busy_timeout=BUSY_TIMEOUT_MS / 1000)
    except StoreError as exc:
        raise Failure(str(exc).replace(db.local, show(where), 1)) from exc
    try:
        return drive(conn.execute, revision())  # its driver errors come back as StoreError
    except StoreError as exc:
        raise Failure(f"cannot open {show(where)}: {why_not(str(exc), db.local)}") from exc
    finally:
        conn.close()


def script_plan(where: str, to: str) -> tuple[str, str] | None:
    """What ``migrate --sql --to TO`` prints, as Alembic's command and its ``FROM:TO`` (or
    ``TO`` from base); None, said on stderr, when there is nothing to print. ``TO`` alone
    starts from the revision ``where`` is at (read, never written); ``FROM:TO`` reads no
    database."""
    parse_database(where)  # a usage error (exit 2) before anything is read
    if ":" in to:
        first, _, last = to.partition(":")
        start, end = _revision(first), _revision(last)
        if start == end:
            print(f"{PROG}: the range {to} is empty: nothing to do", file=sys.stderr)
            return None
    else:
        start, end = read_revision(where), _revision(to)
        if start is not None and start not in KNOWN:
            raise Failure(unknown_revision(show(where), start))
        if start == end:
            print(f"{PROG}: {show(where)} is at {_label(start)}: nothing to do", file=sys.stderr)
            return None
    if _rank(end) > _rank(start):
        return "upgrade", str(end) if start is None else f"{start}:{end}"
    return "downgrade", f"{start}:{end or 'base'}"


def migrate(args: argparse.Namespace) -> int:
    # A replica delegates its writes: the schema is changed on its primary.
    where = args.sync_url or database(args)
    target = args.to
    plan: tuple[str, str] | None = None
    if args.sql:
        plan = script_plan(where, target)
        if plan is None:
            return 0
    elif ":" in target:
        raise ValueError(f"--to {target}: a range FROM:TO is for --sql (the script of it)")
    elif _server(where) and not _bounded_elsewhere():
        return _bounded(where, args)  # this command again, in a child process
    current = None
    if plan is None and exists(where):
        current = current_revision(where)
        if current is not None and current == _revision(target):  # nothing to do
            print(f"{show(where)}: schema at revision {current} (head {HEAD})")
            return 0
    # Imported past the runs that need no Alembic (a server's parent, a database already at
    # its target): importing it takes ~0.7 s of CPU.
    from alembic import command

    config = alembic_config(where)
    config.attributes["timeout"] = args.timeout
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.addFilter(lambda record: record.getMessage().startswith("Running"))
    logger = logging.getLogger("alembic")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        step: Callable[..., None] = command.upgrade
        if plan is not None:
            name, target = plan
            step = command.upgrade if name == "upgrade" else command.downgrade
        else:
            if target == "base" or (
                target in KNOWN and current in KNOWN and KNOWN.index(target) < KNOWN.index(current)
            ):
                step = command.downgrade
        step(config, target, sql=args.sql)  # env.py says a driver's failure in one line
        if args.sql:
            return 0
        after = current_revision(where)
    finally:
        logger.removeHandler(handler)
    print(f"{show(where)}: schema at revision {after or 'none'} (head {HEAD})")
    return 0


def _server(where: str) -> bool:
    try:
        return parse_database(where).local is None
    except ValueError:  # Alembic's env says what is wrong with it, as for any run
        return False


# `migrate` run again in the child (`_bounded`): the database comes on its stdin.
_MIGRATE = """
from harel_store.cli import main
where = sys.stdin.buffer.read().decode("utf-8", "surrogateescape")
sys.exit(main(["migrate", f"--url={where}", *sys.argv[1:]]))
"""
# The variables a database may be given by: none of them reaches the child.
_DATABASE_VARIABLES = ("HAREL_DATABASE_URL", "TURSO_DATABASE_URL")


def _bounded_elsewhere() -> bool:
    try:
        return bounded_elsewhere()
    except ValueError as exc:  # not a usage error: one line, exit 1
        raise Failure(str(exc)) from None


def _bounded(where: str, args: argparse.Namespace) -> int:
    """``migrate`` against a server, run by a child process (this command again) that this
    one stops at the deadline (`harel_store.migrate.run_bounded`): then one line, exit 1;
    one line and exit 1 too when a signal killed it (an OOM kill). The database goes to the
    child on its stdin: a token in its URL is neither on the child's command line nor in its
    environment (which anything it started would inherit)."""
    try:
        seconds = migration_timeout(args.timeout)
    except ValueError as exc:  # $HAREL_TIMEOUT
        raise Failure(str(exc)) from None
    argv = python_child(_MIGRATE, "--to", args.to)
    env = {k: v for k, v in os.environ.items() if k not in _DATABASE_VARIABLES}
    stdin = where.encode("utf-8", "surrogateescape")
    done = run_bounded(argv, seconds, env=env, stdin=stdin)
    if done is None:
        raise Failure(timed_out(parse_database(where).where, seconds))
    if done[0] < 0:
        raise Failure(killed(parse_database(where).where, done[0]))
    return done[0]


def configure_migrate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--sql",
        action="store_true",
        help="print the SQL script from the database's revision to --to, change nothing",
    )
    parser.add_argument(
        "--to",
        default="head",
        type=target,
        metavar="REV",
        help=f"target revision: {', '.join(REVISIONS)} (default: head); with --sql, also"
        " FROM:TO (that range, reading no database)",
    )
    parser.add_argument(
        "--timeout",
        type=timeout,
        metavar="SECONDS",
        help="against a server, how long the migration may take before it is stopped"
        " (default: $HAREL_TIMEOUT, else 30s)",
    )
    parser.add_argument(
        "--create",
        action="store_true",
        help="with --fleet: create the fleet's local database files that do not exist yet"
        " (without it, a missing file is an error naming it: a typo makes no new database);"
        " alone, migrate creates its database anyway",
    )


def drift(where: str) -> tuple[str | None, list[str]]:
    """The live database's revision and its differences from the schema of that revision
    (none: it matches, or it is at none or at one this version does not know, which has no
    schema to compare with)."""
    with connection(where, read_only=True) as conn:
        current = drive(conn.execute, revision())
        live = describe(lambda sql, params: conn.execute((Query("describe", "", sql), params)))
    if current == HEAD:
        return current, diff(head_schema(), live)
    if current in KNOWN:
        return current, diff(schema_at(current), live, expected_name=f"revision {current}")
    return current, []


def _migrate_hint(where: str) -> str:
    return f"run `{PROG} migrate --url {shlex.quote(where)}`"


def schema(args: argparse.Namespace) -> int:
    if not args.check:
        sys.stdout.write((SQL_DIR / "schema.sql").read_text(encoding="utf-8"))
        return 0
    where = args.sync_url or database(args)
    require_local(where, None)
    current, lines = drift(where)
    if current is None:
        raise Failure(f"{show(where)} has no harel-store schema: {_migrate_hint(where)}")
    if current not in KNOWN:
        raise Failure(unknown_revision(show(where), current))
    if not lines and current == HEAD:
        print(f"{show(where)}: schema matches head (revision {current})")
        return 0
    if not lines:
        raise Failure(
            f"{show(where)} is behind: its schema matches revision {current}, head is {HEAD}:"
            f" {_migrate_hint(where)}"
        )
    for line in lines:
        print(line)
    at = "head" if current == HEAD else f"revision {current} (behind head {HEAD})"
    raise Failure(f"{show(where)} has drifted from the schema of {at} ({len(lines)} differences)")


def configure_schema(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check", action="store_true", help="compare the live database with the head schema"
    )


COMMANDS = [
    Command(
        "migrate",
        "upgrade (or downgrade) the schema with the packaged Alembic migrations",
        f"""--sql reads the database's revision (never writing it; a missing file is at base)
and prints the script from there to --to: an upgrade, or a downgrade to an older one.
Against a server the run may take --timeout ($HAREL_TIMEOUT, else 30s): at the deadline
its process is stopped, nothing of it committed, and this one says so in one line on
stderr (exit status 1).

examples:
  {PROG} migrate                             # to head
  {PROG} migrate --to 0001                   # to a revision (down if it is older)
  {PROG} migrate --sql > upgrade.sql         # what migrate would run; changes nothing
  {PROG} migrate --sql --to base > down.sql  # the downgrade from its revision to base
  {PROG} migrate --sql --to 0004:head        # a range, reading no database""",
        migrate,
        configure_migrate,
    ),
    Command(
        "schema",
        "print the head schema, or check a live database against it",
        f"""--check compares tables, columns, indexes and foreign keys (not the CREATE text)
and exits 1 with one line per difference.

examples:
  {PROG} schema
  {PROG} schema --check --url state.db""",
        schema,
        configure_schema,
    ),
]
