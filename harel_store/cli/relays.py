"""``outbox``, ``timers`` and ``spawns``: what the relays and the timer sweep still have to
do, oldest (or soonest) first, and who holds it under a lease."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence

from harel_store.cli import dead
from harel_store.cli.common import Command, add_json, limit, open_store
from harel_store.cli.output import PROG, age, plain, when
from harel_store.models import ArmedTimer, PendingOutbox, PendingSpawn
from harel_store.store import MAX_PAGE

OUTBOX_COLUMNS = ("SEQ", "AGE", "SOURCE", "TARGET", "EVENT", "CLAIMED BY", *dead.TRIES)
SPAWN_COLUMNS = ("SEQ", "AGE", "PARENT", "CHILD", "ROOT PATH", "CLAIMED BY", *dead.TRIES)
TIMER_COLUMNS = ("EXECUTION", "PATH", "FIRE AT", "DUE", "CLAIMED BY", *dead.TRIES)


def _age_of(at: float | None, now: float) -> str:
    return "" if at is None else age(now - at)


def _holder(claimed_by: str | None, claimed_until: float | None, now: float) -> str:
    """The worker holding a row under a live lease (an expired lease holds nothing), or when
    a row a worker failed may be claimed again."""
    if claimed_until is None or claimed_until <= now:
        return ""
    if claimed_by is None:
        return f"(retry in {age(claimed_until - now)})"
    return f"{plain(claimed_by)} ({age(claimed_until - now)} left)"


def _tries(attempts: int, last_error: str | None) -> list[str]:
    return [str(attempts) if attempts else "", dead.shown_error(last_error)]


def outbox_rows(entries: Sequence[PendingOutbox], now: float) -> list[list[str]]:
    return [
        [
            str(e.seq),
            _age_of(e.created_at, now),
            plain(e.source_id or ""),
            plain(e.target_id or "(publish)"),
            plain(e.event.name),
            _holder(e.claimed_by, e.claimed_until, now),
            *_tries(e.attempts, e.last_error),
        ]
        for e in entries
    ]


def spawn_rows(entries: Sequence[PendingSpawn], now: float) -> list[list[str]]:
    return [
        [
            str(e.seq),
            _age_of(e.created_at, now),
            plain(e.parent_id),
            plain(e.child_id),
            plain(e.root_path),
            _holder(e.claimed_by, e.claimed_until, now),
            *_tries(e.attempts, e.last_error),
        ]
        for e in entries
    ]


def due(fire_at: float, now: float) -> str:
    try:
        return f"{age(now - fire_at)} ago" if fire_at <= now else f"in {age(fire_at - now)}"
    except OverflowError:  # an int past the largest float
        return ""


def timer_rows(timers: Sequence[ArmedTimer], now: float) -> list[list[str]]:
    return [
        [
            plain(t.execution_id),
            plain(t.path),
            when(t.fire_at),
            due(t.fire_at, now),
            _holder(t.claimed_by, t.claimed_until, now),
            *_tries(t.attempts, t.last_error),
        ]
        for t in timers
    ]


# show (executions.py) writes a pending entry's and a spawn's JSON as these views do.
outbox_doc = spawn_doc = dead.doc


def _dead(args: argparse.Namespace, kind: str, *filters: str) -> int:
    """``--dead``: the dead letters of ``kind`` instead of the live rows, all of them (a
    filter of the live rows is a usage error: ValueError, exit 2)."""
    given = [f for f in filters if getattr(args, f.removeprefix("--"))]
    if given:
        raise ValueError(f"--dead lists every dead letter of the kind: drop {', '.join(given)}")
    return dead.listing(args, kind)


def outbox(args: argparse.Namespace) -> int:
    if args.dead:
        return _dead(args, "outbox", "--target", "--source")
    with open_store(args, read_only=True) as store:
        entries = store.outbox_view(target=args.target, source=args.source, limit=args.limit)
    rows = outbox_rows(entries, time.time())
    dead.listed(args, entries, OUTBOX_COLUMNS, rows, "pending outbox entries", args.limit)
    return 0


def spawns(args: argparse.Namespace) -> int:
    if args.dead:
        return _dead(args, "spawn", "--parent")
    with open_store(args, read_only=True) as store:
        entries = store.spawns_view(parent=args.parent, limit=args.limit)
    rows = spawn_rows(entries, time.time())
    dead.listed(args, entries, SPAWN_COLUMNS, rows, "pending spawns", args.limit)
    return 0


def timers(args: argparse.Namespace) -> int:
    if args.dead:
        return _dead(args, "timer", "--due")
    now = time.time()
    with open_store(args, read_only=True) as store:
        armed = store.timers_view(due_before=now if args.due else None, limit=args.limit)
    what = "due timers" if args.due else "armed timers"
    dead.listed(args, armed, TIMER_COLUMNS, timer_rows(armed, now), what, args.limit)
    return 0


def _view_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dead", action="store_true", help="the dead letters instead (see `dead`, `revive`)"
    )
    parser.add_argument(
        "--limit",
        type=limit,
        default=dead.SHOWN,
        metavar="N",
        help=f"at most N rows ({dead.SHOWN}, <= {MAX_PAGE})",
    )
    add_json(parser)


def configure_outbox(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", metavar="ID", help="only entries for this execution")
    parser.add_argument("--source", metavar="ID", help="only entries this execution emitted")
    _view_options(parser)


def configure_spawns(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parent", metavar="ID", help="only spawns of this parent")
    _view_options(parser)


def configure_timers(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--due", action="store_true", help="only timers due now")
    _view_options(parser)


COMMANDS = [
    Command(
        "outbox",
        "pending outbox entries, oldest first, and the worker holding each",
        f"""TARGET (publish) is an entry with no target execution. AGE is measured on this
machine's clock from the time the database's clock wrote. TRIES counts the claims of an
entry, LAST ERROR is what the last worker that failed it said; a failed entry waits for its
retry (CLAIMED BY says when). --dead lists the dead letters instead.

examples:
  {PROG} outbox
  {PROG} outbox --target order-1a2b3c4d
  {PROG} outbox --source order-1a2b3c4d --json | jq .event.name
  {PROG} outbox --dead""",
        outbox,
        configure_outbox,
    ),
    Command(
        "timers",
        "armed timers, soonest first",
        f"""examples:
  {PROG} timers
  {PROG} timers --due --limit 500
  {PROG} timers --dead""",
        timers,
        configure_timers,
    ),
    Command(
        "spawns",
        "pending child spawns, oldest first",
        f"""examples:
  {PROG} spawns
  {PROG} spawns --parent order-1a2b3c4d --json
  {PROG} spawns --dead""",
        spawns,
        configure_spawns,
    ),
]
