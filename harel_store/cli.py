"""The ``harel-store`` command: migrate, inspect, trace and purge a harel-store database.

Exit codes: 0 ok, 1 failure, 2 usage. Errors are one line on stderr; the auth token is
read from $HAREL_AUTH_TOKEN only and never printed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, TextIO

from pydantic import ValidationError

from harel_store import demo
from harel_store.batch import drive
from harel_store.connection import Connection, is_remote, open_libsql, show
from harel_store.connection.revision import revision
from harel_store.errors import StoreError
from harel_store.migrate import alembic_config, database_from_env
from harel_store.models import STATUSES, Execution, ExecutionSummary
from harel_store.schema import describe, diff, head_schema
from harel_store.sql import HEAD, MIGRATIONS, SQL_DIR, Query
from harel_store.store import MAX_PAGE, LibsqlStore, Store

PROG = "harel-store"
DEMO_DATABASE = "harel-demo.db"
TOKEN_ENV = "HAREL_AUTH_TOKEN"
COLOURS = {"running": "33", "finished": "32", "failed": "31", "cancelled": "90"}


class Failure(Exception):
    """Print the message as one line and exit 1."""


# --- output ---


def _colour_on(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return (
        bool(isatty and isatty())
        and not os.environ.get("NO_COLOR")  # set and empty counts as unset (no-color.org)
        and (os.environ.get("TERM") != "dumb")
    )


def _paint(text: str, code: str | None, on: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if on and code else text


# What a terminal may act on (C0, DEL, C1) and what no output encoding holds (lone surrogates).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\ud800-\udfff]")  # JSON escapes C0 itself


def _plain(text: str) -> str:
    """Stored text fit for a terminal: each control character as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


def _json(value: Any, **options: Any) -> str:
    """JSON of ``value`` that is safe on a terminal and in any UTF-8 stream."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def _when(epoch: float | None) -> str:
    """An epoch time as UTC ISO 8601, or as its number when no datetime can hold it."""
    if epoch is None:
        return ""
    try:
        moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc)
    except (ValueError, OverflowError, OSError):  # epoch milliseconds, 1e308, inf
        return str(epoch)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _since(at: float, start: float) -> str:
    """The offset of a trace step from the first one."""
    try:
        return f"+{at - start:.3f}s"
    except OverflowError:  # an int past the largest float
        return ""


def _age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    return f"{hours}h {minutes}m" if hours else f"{minutes}m {secs}s"


def _token() -> str:
    return os.environ.get(TOKEN_ENV, "")


# A URL's user info, query and fragment: where a token may ride along.
_URL_SECRETS = re.compile(
    r"(?i)\b([a-z][a-z0-9+.-]*://)(?:[^\s/?#@]*@)?([^\s?#]*)(?:[?#][^\s'\"`]*)?"
)


def _scrub(text: str) -> str:
    """One line, with no auth token in it (neither ours nor one carried in a URL) and no
    control character."""
    token = _token()
    if token:
        text = text.replace(token, "***")
    text = _URL_SECRETS.sub(r"\1\2", text)  # show() for any URL, ours or a library's
    text = re.sub(r"(?i)(auth_?token=)[^&\s'\"]*", r"\1***", text)
    return _plain(" ".join(text.split()))


# --- opening the database ---


def _database(args: argparse.Namespace) -> str:
    return database_from_env(args.url)


def _require_local(database: str, sync_url: str | None) -> None:
    """A missing local file is a mistake, not a database to create by looking at it."""
    local = sync_url is None and not is_remote(database) and database != ":memory:"
    if local and not Path(database).exists():
        raise Failure(f"{show(database)} does not exist: create it with `{PROG} migrate --url ...`")


def _open(args: argparse.Namespace) -> LibsqlStore:
    """The store, checked (never migrated): a schema behind head is a one-line failure."""
    database = _database(args)
    _require_local(database, args.sync_url)
    return LibsqlStore(database, auth_token=_token(), sync_url=args.sync_url, migrate=False)


@contextmanager
def _connection(database: str) -> Iterator[Connection]:
    """The database through the store's connection layer, whatever its schema (a replica's
    primary is reached by its own URL: migrate and schema act there)."""
    conn = open_libsql(database, auth_token=_token())
    try:
        yield conn
    finally:
        conn.close()


def _revision(database: str) -> str | None:
    with _connection(database) as conn:
        return drive(conn.execute, revision())


# --- commands ---


def cmd_demo(args: argparse.Namespace) -> int:
    database = args.url or DEMO_DATABASE
    with LibsqlStore(database, auth_token=_token(), sync_url=args.sync_url) as store:
        demo.run(store, sys.stdout)
    return 0


def cmd_migrate(args: argparse.Namespace) -> int:
    from alembic import command

    # A replica delegates its writes: the schema is changed on its primary.
    database = args.sync_url or _database(args)
    if not is_remote(database) and not database.startswith("sqlite") and "?" in database:
        # Alembic's URL would read what follows as options; the store, as part of the name.
        raise ValueError("migrate takes no file path with '?' in it: rename the file")
    config = alembic_config(database)
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
            if is_remote(database) or Path(database).exists():
                current = _revision(database)
            if target == "base" or (
                target in known and current in known and known.index(target) < known.index(current)
            ):
                step = command.downgrade
        try:
            step(config, target, sql=args.sql)
        except (ValueError, TypeError) as exc:  # the driver's, under Alembic: not a usage error
            raise Failure(str(exc)) from exc
        if args.sql:
            return 0
        after = _revision(database)
    finally:
        logger.removeHandler(handler)
    print(f"{show(database)}: schema at revision {after or 'none'} (head {HEAD})")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    database = _database(args)
    with _open(args) as store:
        now = time.time()
        stats = store.stats(now)
    counts = {status: stats.executions.get(status, 0) for status in STATUSES}
    counts.update(stats.executions)
    age = None if stats.oldest_outbox_at is None else now - stats.oldest_outbox_at
    if args.json:
        doc = {
            "database": show(database),
            "schema_revision": stats.schema_revision,
            "head": HEAD,
            "executions": counts,
            "pending_outbox": stats.pending_outbox,
            "oldest_outbox_age": age,
            "pending_spawns": stats.pending_spawns,
            "timers_due": stats.timers_due,
            "timers_future": stats.timers_future,
            "claimed_outbox": stats.claimed_outbox,
            "claimed_spawns": stats.claimed_spawns,
            "claimed_timers": stats.claimed_timers,
        }
        print(_json(doc))
        return 0
    on = _colour_on(sys.stdout)
    state = "up to date" if stats.schema_revision == HEAD else "differs"
    oldest = ""
    if stats.pending_outbox:
        oldest = f", oldest {'unknown' if age is None else _age(age) + ' old'}"
    by_status = ", ".join(
        f"{_paint(_plain(status), COLOURS.get(status), on)} {n}" for status, n in counts.items()
    )
    rows = [
        ("database", _plain(show(database))),
        ("schema", f"{_plain(str(stats.schema_revision))} (head {HEAD}, {state})"),
        ("executions", f"{sum(counts.values())} total: {by_status}"),
        ("outbox", f"{stats.pending_outbox} pending{oldest}{_held(stats.claimed_outbox)}"),
        ("spawns", f"{stats.pending_spawns} pending{_held(stats.claimed_spawns)}"),
        (
            "timers",
            f"{stats.timers_due} due, {stats.timers_future} future{_held(stats.claimed_timers)}",
        ),
    ]
    for label, value in rows:
        print(f"{label:<11} {value}")
    return 0


def _held(claimed: int) -> str:
    """How many of a relay's rows a worker holds under a live lease (none: nothing said)."""
    return f" ({claimed} claimed by a worker)" if claimed else ""


COLUMNS = ("ID", "DEFINITION", "VERSION", "STATUS", "OUTCOME", "ACTIVE PATH", "PARENT", "FINISHED")


def _cells(s: ExecutionSummary) -> list[str]:
    text = [s.id, s.definition_id, str(s.version), s.status, s.outcome, s.active_path, s.parent_id]
    return [_plain(cell or "") for cell in text] + [_when(s.finished_at)]


def cmd_ls(args: argparse.Namespace) -> int:
    on = _colour_on(sys.stdout)
    remaining = None if args.all else args.limit
    widths: list[int] | None = None
    shown = 0
    cursor = None
    with _open(args) as store:
        while True:
            page = store.list_executions(
                definition_id=args.definition,
                status=args.status,
                roots_only=args.roots,
                limit=MAX_PAGE if remaining is None else min(MAX_PAGE, remaining),
                cursor=cursor,
            )
            for item in page.items:
                if args.json:
                    print(_json(item.model_dump(mode="json"), separators=(",", ":")))
                    continue
                cells = _cells(item)
                if widths is None:  # sized on the first page, so the table streams
                    rows = [list(COLUMNS)] + [_cells(i) for i in page.items]
                    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
                    header = "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths, strict=True))
                    print(_paint(header.rstrip(), "1", on))
                padded = [cell.ljust(w) for cell, w in zip(cells, widths, strict=True)]
                padded[3] = _paint(padded[3], COLOURS.get(item.status), on)
                print("  ".join(padded).rstrip())
            shown += len(page.items)
            cursor = page.next_cursor
            if remaining is not None:
                remaining -= len(page.items)
            if cursor is None:
                break
            if remaining == 0:
                print(
                    f"{PROG}: showing the first {shown}; more match (use --all or --limit N)",
                    file=sys.stderr,
                )
                break
    if shown == 0:
        print(f"{PROG}: no executions match", file=sys.stderr)
    return 0


def _load(store: Store, args: argparse.Namespace) -> Execution:
    """The execution ``args.id``, or a one-line failure naming the database."""
    exe = store.load(args.id)
    if exe is None:
        raise Failure(f"no execution {args.id!r} in {show(_database(args))}")
    return exe


def cmd_show(args: argparse.Namespace) -> int:
    with _open(args) as store:
        exe = _load(store, args)
        doc = {
            "execution": exe.model_dump(mode="json"),
            "timers": [
                {"path": path, "fire_at": at, "fire_at_utc": _when(at)}
                for path, at in store.timers_of(args.id)
            ],
            "outbox": [
                {"seq": e.seq, "event": e.event.model_dump(mode="json")}
                for e in store.outbox_for(args.id)
            ],
            "children": [c.model_dump(mode="json") for c in store.children_of(args.id)],
        }
    print(_json(doc, indent=2))
    return 0


def cmd_trace(args: argparse.Namespace) -> int:
    with _open(args) as store:
        steps = store.read_trace(args.id)
        if not steps:
            _load(store, args)
    if args.json:
        for step in steps:
            print(_json(step))
        return 0
    if not steps:
        print(f"{PROG}: {_plain(args.id)} has no trace steps", file=sys.stderr)
        return 0
    on = _colour_on(sys.stdout)
    start = next((s["at"] for s in steps if isinstance(s.get("at"), (int, float))), None)
    rows = []
    for step in steps:
        rest = dict(step)
        index, at = rest.pop("index"), rest.pop("at", None)
        when = delta = ""
        if isinstance(at, (int, float)) and start is not None:
            when, delta = _when(at), _since(at, start)
        cells = (
            str(index),
            when,
            delta,
            str(rest.pop("event", "")),
            str(rest.pop("transition", "")),
            _json(rest, separators=(",", ":")) if rest else "",
        )
        rows.append(tuple(_plain(cell) for cell in cells))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    for index, when, delta, event, transition, extra in rows:
        line = "  ".join(
            [
                index.rjust(widths[0]),
                when.ljust(widths[1]),
                delta.rjust(widths[2]),
                _paint(event.ljust(widths[3]), "1", on),
                transition.ljust(widths[4]),
                extra,
            ]
        )
        print(line.rstrip())
    return 0


def _decoded(store: Store, args: argparse.Namespace) -> Execution | None:
    """``_load``, or None when the stored record cannot be decoded."""
    try:
        return _load(store, args)
    except StoreError as exc:
        if isinstance(exc.__cause__, ValidationError):
            return None
        raise


def cmd_purge(args: argparse.Namespace) -> int:
    # With --version nothing is read but summary columns, so a corrupt record can be purged.
    with _open(args) as store:
        version = args.version
        if version is None:
            exe = _decoded(store, args)
            if exe is None:
                raise Failure(
                    f"execution {args.id!r} has a corrupt stored record: purge it unread with"
                    f" --version V (V is its VERSION in `{PROG} ls`)"
                )
            if exe.status == "running" and not args.tree:
                raise Failure(
                    f"{args.id} is still running: pass --version {exe.version} to purge it anyway"
                )
            version = exe.version
        if args.tree:
            purged = store.purge_tree(args.id, version)
        else:
            purged = [args.id] if store.purge(args.id, version) else []
        if not purged:
            now = _decoded(store, args)
            if now is None:
                raise Failure(f"{args.id} is not at version {version}: nothing purged")
            raise Failure(f"{args.id} is at version {now.version}, not {version}: nothing purged")
    if args.tree:
        print(f"purged {len(purged)} executions: {', '.join(map(_plain, purged))}")
    else:
        print(f"purged {_plain(args.id)} (version {version})")
    return 0


def cmd_schema(args: argparse.Namespace) -> int:
    if not args.check:
        sys.stdout.write((SQL_DIR / "schema.sql").read_text(encoding="utf-8"))
        return 0
    database = args.sync_url or _database(args)
    _require_local(database, None)
    with _connection(database) as conn:
        current = drive(conn.execute, revision())
        live = describe(lambda sql, params: conn.execute((Query("describe", "", sql), params)))
    lines = diff(head_schema(), live)
    if not lines:
        print(f"{show(database)}: schema matches head (revision {current})")
        return 0
    for line in lines:
        print(line)
    behind = "" if current == HEAD else f"; it is at revision {current}, head is {HEAD}"
    raise Failure(
        f"{show(database)} has drifted from the head schema ({len(lines)} differences{behind})"
    )


# --- the parser ---

TOP_HELP = f"""\
Operate a harel-store database: a local file, a remote libSQL URL or an embedded replica.

The database is --url, else $HAREL_DATABASE_URL, else harel.db (demo: harel-demo.db).
The auth token for a remote database comes from ${TOKEN_ENV} only.

examples:
  {PROG} demo
  {PROG} migrate --url state.db
  HAREL_DATABASE_URL=http://127.0.0.1:8080 {PROG} status
  {PROG} ls --status failed --roots
  {PROG} show order-1a2b3c4d
  {PROG} schema --check

exit codes: 0 ok, 1 failure, 2 usage error
"""

COMMANDS: list[tuple[str, str, str, Callable[[argparse.Namespace], int]]] = [
    (
        "migrate",
        "upgrade (or downgrade) the schema with the packaged Alembic migrations",
        f"""examples:
  {PROG} migrate                       # to head
  {PROG} migrate --to 0001             # to a revision (down if it is older)
  {PROG} migrate --sql > upgrade.sql   # print the SQL script, change nothing""",
        cmd_migrate,
    ),
    (
        "status",
        "schema revision, executions by status, pending relays and timers",
        f"""examples:
  {PROG} status
  {PROG} status --json | jq .executions""",
        cmd_status,
    ),
    (
        "ls",
        "list executions (paged by id)",
        f"""examples:
  {PROG} ls
  {PROG} ls --status running --status failed --definition order --roots
  {PROG} ls --all --json | jq -r .id""",
        cmd_ls,
    ),
    (
        "show",
        "one execution with its timers, pending outbox entries and children, as JSON",
        f"""examples:
  {PROG} show order-1a2b3c4d
  {PROG} show order-1a2b3c4d | jq .execution.context""",
        cmd_show,
    ),
    (
        "trace",
        "an execution's trace ring as a timeline",
        f"""examples:
  {PROG} trace order-1a2b3c4d
  {PROG} trace order-1a2b3c4d --json""",
        cmd_trace,
    ),
    (
        "purge",
        "delete an execution, or a finished execution and all its descendants",
        f"""A running execution is purged only with an explicit --version; --tree refuses
while any execution of the tree is still running. With --version the stored record is
not read, so a corrupt one can be purged.

examples:
  {PROG} purge order-1a2b3c4d
  {PROG} purge order-1a2b3c4d --tree
  {PROG} purge stuck-42 --version 7""",
        cmd_purge,
    ),
    (
        "schema",
        "print the head schema, or check a live database against it",
        f"""--check compares tables, columns, indexes and foreign keys (not the CREATE text)
and exits 1 with one line per difference.

examples:
  {PROG} schema
  {PROG} schema --check --url state.db""",
        cmd_schema,
    ),
    (
        "demo",
        "drive a small order workflow through the store (quick start)",
        f"""examples:
  {PROG} demo                  # into {DEMO_DATABASE}
  {PROG} demo --url other.db""",
        cmd_demo,
    ),
]


def _limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error is one line too (the usage itself is one ``--help`` away)."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog=PROG, description=TOP_HELP, formatter_class=raw)
    common = _Parser(add_help=False)
    where = common.add_argument_group("database")
    where.add_argument("--url", help="a file path or http(s)/libsql URL")
    where.add_argument(
        "--sync-url", metavar="URL", help="open --url as an embedded replica of this primary"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parsers = {}
    for name, summary, epilog, run in COMMANDS:
        p = sub.add_parser(
            name,
            help=summary,
            description=summary,
            epilog=epilog,
            parents=[common],
            formatter_class=raw,
        )
        p.set_defaults(run=run)
        parsers[name] = p
    parsers["migrate"].add_argument("--sql", action="store_true", help="print the SQL only")
    revisions = ["base", *(m.revision for m in MIGRATIONS), "head"]
    parsers["migrate"].add_argument(
        "--to",
        default="head",
        choices=revisions,
        metavar="REV",
        help=f"target revision: {', '.join(revisions)} (default: head)",
    )
    for name in ("status", "ls", "trace"):
        parsers[name].add_argument("--json", action="store_true", help="JSON output")
    ls = parsers["ls"]
    ls.add_argument("--status", action="append", choices=STATUSES, help="any of these (repeatable)")
    ls.add_argument("--definition", metavar="D", help="only this definition id")
    ls.add_argument("--roots", action="store_true", help="only executions without a parent")
    ls.add_argument("--limit", type=_limit, default=50, metavar="N", help="at most N rows (50)")
    ls.add_argument("--all", action="store_true", help="every matching row, page by page")
    for name in ("show", "trace", "purge"):
        parsers[name].add_argument("id", metavar="ID", help="execution id")
    parsers["purge"].add_argument(
        "--version", type=int, metavar="V", help="purge only at this version (default: current)"
    )
    parsers["purge"].add_argument("--tree", action="store_true", help="also purge every descendant")
    parsers["schema"].add_argument(
        "--check", action="store_true", help="compare the live database with the head schema"
    )
    return parser


def _fail(message: str, code: int) -> int:
    label = _paint("error", "31", _colour_on(sys.stderr))
    print(f"{PROG}: {label}: {_scrub(message)}", file=sys.stderr)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # usage errors exit 2 here
    # libsql's replica client logs INFO lines (in colour) to stdout unless RUST_LOG is set,
    # which would corrupt piped output; failures reach us as exceptions anyway.
    os.environ.setdefault("RUST_LOG", "off")
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        return run(args)
    except (Failure, StoreError) as exc:  # SchemaError says to run `harel-store migrate`
        return _fail(str(exc), 1)
    except (ValueError, TypeError) as exc:
        return _fail(str(exc), 2)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, with no flush error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # alembic, SQLAlchemy, the OS: still one line, no traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        return _fail(f"{type(exc).__name__}: {first}" if first else type(exc).__name__, 1)


if __name__ == "__main__":
    sys.exit(main())
