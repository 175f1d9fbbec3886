"""``ls``, ``show``, ``trace`` and ``purge``: executions, one at a time or paged."""

from __future__ import annotations

import argparse
import sys
import time

from pydantic import ValidationError

from harel_store.cli import relays
from harel_store.cli.common import Command, add_id, add_json, limit, load, moment, open_store
from harel_store.cli.output import (
    COLOURS,
    PROG,
    Failure,
    colour_on,
    paint,
    plain,
    since,
    table,
    to_json,
    when,
)
from harel_store.errors import StoreError
from harel_store.models import STATUSES, Execution, ExecutionSummary, TraceStep
from harel_store.store import MAX_PAGE, Store

COLUMNS = (
    "ID",
    "DEFINITION",
    "VERSION",
    "STATUS",
    "OUTCOME",
    "ACTIVE PATH",
    "PARENT",
    "UPDATED",
    "FINISHED",
)


def _cells(s: ExecutionSummary) -> list[str]:
    text = [s.id, s.definition_id, str(s.version), s.status, s.outcome, s.active_path, s.parent_id]
    return [plain(cell or "") for cell in text] + [when(s.updated_at), when(s.finished_at)]


def ls(args: argparse.Namespace) -> int:
    on = colour_on(sys.stdout)
    remaining = None if args.all else args.limit
    widths: list[int] | None = None
    shown = 0
    cursor = None
    with open_store(args, read_only=True) as store:
        while True:
            page = store.list_executions(
                definition_id=args.definition,
                status=args.status,
                roots_only=args.roots,
                limit=MAX_PAGE if remaining is None else min(MAX_PAGE, remaining),
                cursor=cursor,
                updated_after=args.since,
                updated_before=args.until,
                newest_first=args.newest,
                id_prefix=args.id_prefix,
            )
            for item in page.items:
                if args.json:
                    print(to_json(item.model_dump(mode="json"), separators=(",", ":")))
                    continue
                cells = _cells(item)
                if widths is None:  # sized on the first page, so the table streams
                    rows = [list(COLUMNS)] + [_cells(i) for i in page.items]
                    widths = [max(len(r[c]) for r in rows) for c in range(len(COLUMNS))]
                    header = "  ".join(h.ljust(w) for h, w in zip(COLUMNS, widths, strict=True))
                    print(paint(header.rstrip(), "1", on))
                padded = [cell.ljust(w) for cell, w in zip(cells, widths, strict=True)]
                padded[3] = paint(padded[3], COLOURS.get(item.status), on)
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


def show_execution(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        exe = load(store, args)
        # The smallest id with this prefix is the id itself: its summary carries the times.
        summary = store.list_executions(id_prefix=args.id, limit=1).items[0]
        timers = store.timers_of(args.id)
        inbox = store.outbox_for(args.id)
        emitted = store.outbox_view(source=args.id, limit=MAX_PAGE)
        spawns = store.spawns_view(parent=args.id, limit=MAX_PAGE)
        children = store.children_of(args.id)
    if args.json:
        doc = {
            "execution": exe.model_dump(mode="json"),
            "created_at": summary.created_at,
            "updated_at": summary.updated_at,
            "timers": [
                {"path": path, "fire_at": at, "fire_at_utc": when(at)} for path, at in timers
            ],
            "outbox": [{"seq": e.seq, "event": e.event.model_dump(mode="json")} for e in inbox],
            "emitted": [relays.outbox_doc(e) for e in emitted],
            "spawns": [relays.spawn_doc(e) for e in spawns],
            "children": [c.model_dump(mode="json") for c in children],
        }
        print(to_json(doc, indent=2))
        return 0
    on = colour_on(sys.stdout)
    now = time.time()
    fields = [
        ("definition", exe.definition_id),
        ("version", str(exe.version)),
        ("status", paint(plain(exe.status), COLOURS.get(exe.status), on)),
        ("outcome", exe.outcome or ""),
        ("active path", exe.active_path or ""),
        ("parent", exe.parent_id or ""),
        ("created", when(summary.created_at)),
        ("updated", when(summary.updated_at)),
        ("finished", when(exe.finished_at)),
        ("context", to_json(exe.context, separators=(",", ":"))),
    ]
    print(paint(f"execution {plain(exe.id)}", "1", on))
    for label, value in fields:
        if value:
            print(f"  {label:<12} {value if label == 'status' else plain(value)}")
    sections = [
        (
            "timers",
            ("PATH", "FIRE AT", "DUE"),
            [[plain(path), when(at), relays.due(at, now)] for path, at in timers],
        ),
        (
            "pending outbox entries it emitted",
            relays.OUTBOX_COLUMNS,
            relays.outbox_rows(emitted, now),
        ),
        (
            "pending outbox entries for it",
            ("SEQ", "EVENT"),
            [[str(e.seq), plain(e.event.name)] for e in inbox],
        ),
        ("pending spawns", relays.SPAWN_COLUMNS, relays.spawn_rows(spawns, now)),
        (
            "children",
            ("ID", "STATUS", "VERSION", "UPDATED"),
            [[plain(c.id), plain(c.status), str(c.version), when(c.updated_at)] for c in children],
        ),
    ]
    for title, columns, rows in sections:
        print()
        print(paint(f"{title} ({len(rows)})", "1", on))
        if rows:
            table(["  " + columns[0], *columns[1:]], [["  " + r[0], *r[1:]] for r in rows], on)
    return 0


def _moment(step: TraceStep) -> float | None:
    """When a step happened: the engine's own ``at`` if it wrote one, else when the store
    recorded it."""
    at = step.entry.get("at")
    return at if isinstance(at, (int, float)) and not isinstance(at, bool) else step.recorded_at


def trace(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        steps = store.trace_view(args.id)
        if not steps:
            load(store, args)
    if args.json:
        for step in steps:
            print(to_json({**step.entry, "index": step.index, "recorded_at": step.recorded_at}))
        return 0
    if not steps:
        print(f"{PROG}: {plain(args.id)} has no trace steps", file=sys.stderr)
        return 0
    on = colour_on(sys.stdout)
    start = next((at for at in map(_moment, steps) if at is not None), None)
    rows = []
    for step in steps:
        rest = dict(step.entry)
        rest.pop("at", None)
        at = _moment(step)
        moment = delta = ""
        if at is not None and start is not None:
            moment, delta = when(at), since(at, start)
        cells = (
            str(step.index),
            moment,
            delta,
            str(rest.pop("event", "")),
            str(rest.pop("transition", "")),
            to_json(rest, separators=(",", ":")) if rest else "",
        )
        rows.append(tuple(plain(cell) for cell in cells))
    widths = [max(len(row[c]) for row in rows) for c in range(5)]
    for index, moment, delta, event, transition, extra in rows:
        line = "  ".join(
            [
                index.rjust(widths[0]),
                moment.ljust(widths[1]),
                delta.rjust(widths[2]),
                paint(event.ljust(widths[3]), "1", on),
                transition.ljust(widths[4]),
                extra,
            ]
        )
        print(line.rstrip())
    return 0


def _decoded(store: Store, args: argparse.Namespace) -> Execution | None:
    """``_load``, or None when the stored record cannot be decoded."""
    try:
        return load(store, args)
    except StoreError as exc:
        if isinstance(exc.__cause__, ValidationError):
            return None
        raise


def _some(children: list[ExecutionSummary]) -> str:
    """The first children's ids, for a one-line message."""
    names = ", ".join(plain(c.id) for c in children[:3])
    return names + (f" and {len(children) - 3} more" if len(children) > 3 else "")


def purge(args: argparse.Namespace) -> int:
    # With --version nothing is read but summary columns, so a corrupt record can be purged.
    with open_store(args) as store:
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
        if not args.tree and not args.orphan:
            children = store.children_of(args.id)
            if children:
                raise Failure(
                    f"{args.id} has {len(children)} child execution"
                    f"{'s' if len(children) > 1 else ''} ({_some(children)}): pass --tree to"
                    " purge them with it, or --orphan to leave them without their parent"
                )
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
        executions = "execution" if len(purged) == 1 else "executions"
        print(f"purged {len(purged)} {executions}: {', '.join(map(plain, purged))}")
    else:
        print(f"purged {plain(args.id)} (version {version})")
    return 0


def configure_ls(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    parser.add_argument(
        "--status", action="append", choices=STATUSES, help="any of these (repeatable)"
    )
    parser.add_argument("--definition", metavar="D", help="only this definition id")
    parser.add_argument("--roots", action="store_true", help="only executions without a parent")
    parser.add_argument("--id-prefix", metavar="P", help="only ids that start with P")
    parser.add_argument(
        "--since",
        type=moment,
        metavar="WHEN",
        help="updated at or after WHEN (1h, 2026-12-01T10:00Z)",
    )
    parser.add_argument("--until", type=moment, metavar="WHEN", help="updated before WHEN")
    parser.add_argument(
        "--newest", action="store_true", help="most recently updated first (default: by id)"
    )
    parser.add_argument("--limit", type=limit, default=50, metavar="N", help="at most N rows (50)")
    parser.add_argument("--all", action="store_true", help="every matching row, page by page")


def configure_show(parser: argparse.ArgumentParser) -> None:
    add_id(parser)
    add_json(parser)


def configure_trace(parser: argparse.ArgumentParser) -> None:
    add_id(parser)
    add_json(parser)


def configure_purge(parser: argparse.ArgumentParser) -> None:
    add_id(parser)
    parser.add_argument(
        "--version", type=int, metavar="V", help="purge only at this version (default: current)"
    )
    how = parser.add_mutually_exclusive_group()
    how.add_argument("--tree", action="store_true", help="also purge every descendant")
    how.add_argument(
        "--orphan", action="store_true", help="purge it alone, its children left without a parent"
    )


COMMANDS = [
    Command(
        "ls",
        "list executions, by id or most recently updated first",
        f"""WHEN is a duration back from now (90s, 5m, 1h, 2d) or an ISO 8601 time (UTC unless it
has an offset). Rows are listed by id; with --since or --until by update time, oldest
first; with --newest, most recently updated first. Times are shown in ISO 8601 UTC;
UPDATED is the last write's time on the database's clock (empty for rows last written
before migration 0005: listed last by --newest, left out by --since and --until).

examples:
  {PROG} ls
  {PROG} ls --status failed --since 1h --newest      # what failed in the last hour
  {PROG} ls --status running --status failed --definition order --roots
  {PROG} ls --since 2026-12-01T10:00Z --until 2026-12-01T11:00Z
  {PROG} ls --id-prefix order-1a2b
  {PROG} ls --all --json | jq -r .id""",
        ls,
        configure_ls,
    ),
    Command(
        "show",
        "one execution: its fields, timers, pending outbox entries and spawns, children",
        f"""--json prints one document: the stored execution, its times, timers, the pending
entries for it (outbox) and from it (emitted), its pending spawns and children.

examples:
  {PROG} show order-1a2b3c4d
  {PROG} show order-1a2b3c4d --json | jq .execution.context""",
        show_execution,
        configure_show,
    ),
    Command(
        "trace",
        "an execution's trace ring as a timeline",
        f"""A step's time is its entry's own `at` (epoch seconds) if the engine wrote one, else
when the database recorded it (none for steps recorded before migration 0008); --json
prints each entry with its index and recorded_at.

examples:
  {PROG} trace order-1a2b3c4d
  {PROG} trace order-1a2b3c4d --json""",
        trace,
        configure_trace,
    ),
    Command(
        "purge",
        "delete an execution, or a finished execution and all its descendants",
        f"""A running execution is purged only with an explicit --version; --tree refuses
while any execution of the tree is still running. An execution with children is purged
with --tree (all of them too) or --orphan (it alone). With --version the stored record
is not read, so a corrupt one can be purged.

examples:
  {PROG} purge invoice-9f8e7d6c
  {PROG} purge order-1a2b3c4d --tree
  {PROG} purge order-1a2b3c4d --orphan
  {PROG} purge stuck-42 --version 7""",
        purge,
        configure_purge,
    ),
]
