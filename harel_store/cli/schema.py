"""``migrate`` and ``schema``: change the schema with the packaged Alembic migrations, print
the head schema, or check a live database against it."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from harel_store.batch import drive
from harel_store.cli.common import (
    Command,
    connection,
    current_revision,
    database,
    exists,
    require_local,
)
from harel_store.cli.output import PROG, Failure
from harel_store.connection import show
from harel_store.connection.local import why_not
from harel_store.connection.revision import revision
from harel_store.migrate import alembic_config
from harel_store.schema import describe, diff, head_schema
from harel_store.sql import HEAD, MIGRATIONS, SQL_DIR, Query


def migrate(args: argparse.Namespace) -> int:
    from alembic import command

    # A replica delegates its writes: the schema is changed on its primary.
    where = args.sync_url or database(args)
    config = alembic_config(where)
    target = args.to
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"{PROG}: %(message)s"))
    handler.addFilter(lambda record: record.getMessage().startswith("Running"))
    logger = logging.getLogger("alembic")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        step: Callable[..., None] = command.upgrade
        if not args.sql:
            known = [m.revision for m in MIGRATIONS]
            current = None
            if exists(where):
                current = current_revision(where)
            if target == "base" or (
                target in known and current in known and known.index(target) < known.index(current)
            ):
                step = command.downgrade
        try:
            step(config, target, sql=args.sql)
        except (ValueError, TypeError) as exc:  # the driver's, under Alembic: not a usage error
            text = str(exc)
            why = why_not(text)  # a file that cannot be opened, in the store's words
            raise Failure(text if why == text else f"cannot open {show(where)}: {why}") from exc
        if args.sql:
            return 0
        after = current_revision(where)
    finally:
        logger.removeHandler(handler)
    print(f"{show(where)}: schema at revision {after or 'none'} (head {HEAD})")
    return 0


def configure_migrate(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sql", action="store_true", help="print the SQL only")
    revisions = ["base", *(m.revision for m in MIGRATIONS), "head"]
    parser.add_argument(
        "--to",
        default="head",
        choices=revisions,
        metavar="REV",
        help=f"target revision: {', '.join(revisions)} (default: head)",
    )


def drift(where: str) -> tuple[str | None, list[str]]:
    """The live database's revision and its differences from the head schema (none: it
    matches)."""
    with connection(where) as conn:
        current = drive(conn.execute, revision())
        live = describe(lambda sql, params: conn.execute((Query("describe", "", sql), params)))
    return current, diff(head_schema(), live)


def schema(args: argparse.Namespace) -> int:
    if not args.check:
        sys.stdout.write((SQL_DIR / "schema.sql").read_text(encoding="utf-8"))
        return 0
    where = args.sync_url or database(args)
    require_local(where, None)
    current, lines = drift(where)
    if not lines:
        print(f"{show(where)}: schema matches head (revision {current})")
        return 0
    for line in lines:
        print(line)
    behind = "" if current == HEAD else f"; it is at revision {current}, head is {HEAD}"
    raise Failure(
        f"{show(where)} has drifted from the head schema ({len(lines)} differences{behind})"
    )


def configure_schema(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--check", action="store_true", help="compare the live database with the head schema"
    )


COMMANDS = [
    Command(
        "migrate",
        "upgrade (or downgrade) the schema with the packaged Alembic migrations",
        f"""examples:
  {PROG} migrate                       # to head
  {PROG} migrate --to 0001             # to a revision (down if it is older)
  {PROG} migrate --sql > upgrade.sql   # print the SQL script, change nothing""",
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
