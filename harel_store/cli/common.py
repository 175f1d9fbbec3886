"""What every command shares: the `Command` record, opening the database, and argument
types."""

from __future__ import annotations

import argparse
import datetime
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from harel_store.batch import drive
from harel_store.cli.output import PROG, Failure
from harel_store.connection import Connection, open_libsql, parse_database, show
from harel_store.connection.local import open_reader
from harel_store.connection.revision import revision
from harel_store.connection.url import token_from_env
from harel_store.migrate import database_from_env
from harel_store.models import Execution
from harel_store.store import Store, checked

MAX_SPAN = 100 * 365 * 86400.0  # seconds: any longer duration is a typo


class Command(NamedTuple):
    """One subcommand: its name, one-line summary, ``--help`` epilog (with examples), what
    it runs, what adds its own arguments to its parser, and the global options it refuses
    (left out of its ``--help``)."""

    name: str
    summary: str
    epilog: str
    run: Callable[[argparse.Namespace], int]
    configure: Callable[[argparse.ArgumentParser], None]
    refuses: tuple[str, ...] = ()


def database(args: argparse.Namespace) -> str:
    """--url, else $HAREL_DATABASE_URL, else $TURSO_DATABASE_URL, else harel.db."""
    return database_from_env(args.url)


def exists(database: str) -> bool:
    """Whether ``database`` is a server, ``:memory:`` or a file that is already there."""
    db = parse_database(database)
    return db.local is None or db.local == ":memory:" or Path(db.local).exists()


def require_local(database: str, sync_url: str | None) -> None:
    """A missing local file is a mistake, not a database to create by looking at it."""
    if sync_url is None and not exists(database):
        raise Failure(f"{show(database)} does not exist: create it with `{PROG} migrate --url ...`")


def open_store(args: argparse.Namespace, *, read_only: bool = False, check: bool = True) -> Store:
    """The store, checked (never migrated): a schema behind head is a one-line failure.
    ``read_only`` (the commands that only read): a local file is opened for reading only,
    so read-only media do (see `open_reader`). ``check=False``: its schema is not read here
    (``metrics --listen`` reads it at every scrape)."""
    where = database(args)
    require_local(where, args.sync_url)
    local = parse_database(where).local
    if read_only and args.sync_url is None and local not in (None, ":memory:"):
        conn: Connection = open_reader(local)
    else:
        conn = open_libsql(where, auth_token=token_from_env(), sync_url=args.sync_url)
    return Store(checked(conn, migrate=False) if check else conn)


@contextmanager
def connection(database: str, *, read_only: bool = False) -> Iterator[Connection]:
    """The database through the store's connection layer, whatever its schema (a replica's
    primary is reached by its own URL: migrate and schema act there); ``read_only``: a local
    file for reading only (`open_reader`)."""
    local = parse_database(database).local
    if read_only and local not in (None, ":memory:"):
        conn: Connection = open_reader(local)
    else:
        conn = open_libsql(database, auth_token=token_from_env())
    try:
        yield conn
    finally:
        conn.close()


def current_revision(database: str) -> str | None:
    with connection(database) as conn:
        return drive(conn.execute, revision())


def load(store: Store, args: argparse.Namespace) -> Execution:
    """The execution ``args.id``, or a one-line failure naming the database."""
    exe = store.load(args.id)
    if exe is None:
        raise Failure(f"no execution {args.id!r} in {show(database(args))}")
    return exe


def _whole(text: str, least: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"must be at least {least}, not {value}")
    return value


def limit(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    return _whole(text, 1)


def count(text: str) -> int:
    """An argparse type: a whole number of at least 0."""
    return _whole(text, 0)


UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")


def duration(text: str) -> float:
    """An argparse type: seconds, written ``90``, ``90s``, ``5m``, ``1.5h`` or ``2d``."""
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a duration (30s, 5m, 1h, 2d): {text!r}")
    seconds = float(match[1]) * UNITS[match[2] or "s"]
    if seconds > MAX_SPAN:
        raise argparse.ArgumentTypeError(f"longer than 100 years: {text!r}")
    return seconds


def timeout(text: str) -> float:
    """An argparse type: a timeout, a duration of more than 0 (at 0 nothing could run)."""
    seconds = duration(text)
    if seconds <= 0:
        raise argparse.ArgumentTypeError(f"a timeout must be more than 0: {text!r}")
    return seconds


def age(text: str) -> float:
    """An argparse type: a duration written with its unit (``90s``, ``5m``, ``1.5h``,
    ``2d``), for an age that decides what is deleted: a bare number's unit is a guess."""
    if _DURATION.fullmatch(text.strip()) and text.strip()[-1].isdigit():
        raise argparse.ArgumentTypeError(
            f"an age needs a unit (30s, 5m, 1h, 2d): {text!r} (seconds? days?)"
        )
    return duration(text)


def moment(text: str) -> float:
    """An argparse type: an epoch time, written as a duration back from now (``1h``: an hour
    ago) or as ISO 8601 (``2026-12-01``, ``2026-12-01T10:00Z``; no offset means UTC)."""
    if _DURATION.fullmatch(text.strip()):
        return time.time() - duration(text)
    try:
        at = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (a duration back from now such as 1h, or ISO 8601 such as"
            " 2026-12-01T10:00Z)"
        ) from None
    if at.tzinfo is None:
        at = at.replace(tzinfo=datetime.timezone.utc)
    return at.timestamp()


def add_json(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="JSON output")


def add_id(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("id", metavar="ID", help="execution id")
