"""``status``: the schema revision, executions by status, pending relays and timers; with
``--check``, a health check for cron, probes and CI."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any

from harel_store.cli.common import (
    Command,
    add_json,
    count,
    database,
    duration,
    open_store,
    require_local,
)
from harel_store.cli.dead import dead_counts
from harel_store.cli.output import COLOURS, PROG, age, colour_on, paint, plain, to_json
from harel_store.cli.schema import drift
from harel_store.connection import show
from harel_store.connection.revision import KNOWN
from harel_store.models import STATUSES
from harel_store.sql import HEAD
from harel_store.store import StoreStats


def _held(claimed: int) -> str:
    """How many of a relay's rows a worker holds under a live lease (none: nothing said)."""
    return f" ({claimed} claimed by a worker)" if claimed else ""


def _ages(stats: StoreStats, now: float) -> dict[str, float | None]:
    """How old the oldest pending outbox entry and spawn are, on the database's clock that
    wrote their times, and how late the most overdue timer is, on this machine's clock (the
    engine's, that set it); None: nothing pending or overdue, or written before rows had a
    time."""

    def since(at: float | None, clock: float) -> float | None:
        return None if at is None else max(clock - at, 0.0)

    outbox = since(stats.oldest_outbox_at, stats.now) if stats.pending_outbox else None
    return {
        "oldest_outbox_age": outbox,
        "oldest_spawn_age": since(stats.oldest_spawn_at, stats.now)
        if stats.pending_spawns
        else None,
        "timer_lag": since(stats.soonest_timer_at, now) if stats.timers_due else None,
    }


# --check's thresholds: the option, the age it bounds, what that age is, and its --help.
THRESHOLDS = (
    (
        "max_outbox_age",
        "oldest_outbox_age",
        "the oldest pending outbox entry is {} old",
        "fail when the oldest pending outbox entry is older than DUR (60s, 5m)",
    ),
    (
        "max_timer_lag",
        "timer_lag",
        "the most overdue timer is {} late",
        "fail when a due timer has waited longer than DUR past its time",
    ),
    (
        "max_spawn_age",
        "oldest_spawn_age",
        "the oldest pending spawn is {} old",
        "fail when the oldest pending spawn is older than DUR",
    ),
)


def _dead_text(dead: dict[str, int]) -> str:
    """How many dead letters wait, and of which kinds."""
    total = sum(dead.values())
    kinds = ", ".join(f"{kind} {n}" for kind, n in dead.items() if n)
    return f"{total} dead letter{'' if total == 1 else 's'}" + (f" ({kinds})" if kinds else "")


def _crossed(
    args: argparse.Namespace, ages: dict[str, float | None], stats: StoreStats
) -> list[str]:
    failures = []
    dead = dead_counts(stats)
    if args.max_dead is not None and sum(dead.values()) > args.max_dead:
        failures.append(f"--max-dead {args.max_dead}: {_dead_text(dead)}")
    for option, key, what, _help in THRESHOLDS:
        limit: float | None = getattr(args, option)
        seen = ages[key]
        if limit is not None and seen is not None and seen > limit:
            flag = "--" + option.replace("_", "-")
            failures.append(f"{flag} {age(limit)}: {what.format(age(seen))}")
    return failures


def _schema_problems(where: str, sync_url: str | None) -> list[str]:
    """Why the schema is not the head schema (nothing: it is)."""
    require_local(where, sync_url)
    current, lines = drift(sync_url or where)
    if current != HEAD:
        state = "behind" if current is None or current in KNOWN else "ahead of"
        return [f"schema: at revision {current}, {state} head {HEAD}"]
    return [f"schema drifted from head: {line}" for line in lines]


def status(args: argparse.Namespace) -> int:
    where = database(args)
    args.check = (
        args.check
        or args.max_dead is not None
        or any(getattr(args, t[0]) is not None for t in THRESHOLDS)
    )
    failures = _schema_problems(where, args.sync_url) if args.check else []
    if failures:  # the counts below need the head schema
        for line in failures:
            print(f"{PROG}: check failed: {plain(line)}", file=sys.stderr)
        return 1
    with open_store(args, read_only=True) as store:
        now = time.time()
        stats = store.stats(now)
    counts = {status: stats.executions.get(status, 0) for status in STATUSES}
    counts.update(stats.executions)
    ages = _ages(stats, now)
    failures = _crossed(args, ages, stats) if args.check else []
    if args.json:
        doc: dict[str, Any] = {
            "database": show(where),
            "schema_revision": stats.schema_revision,
            "head": HEAD,
            "executions": counts,
            "pending_outbox": stats.pending_outbox,
            "oldest_outbox_age": ages["oldest_outbox_age"],
            "pending_spawns": stats.pending_spawns,
            "oldest_spawn_age": ages["oldest_spawn_age"],
            "timers_due": stats.timers_due,
            "timers_future": stats.timers_future,
            "timer_lag": ages["timer_lag"],
            "claimed_outbox": stats.claimed_outbox,
            "claimed_spawns": stats.claimed_spawns,
            "claimed_timers": stats.claimed_timers,
            "dead_letters": dead_counts(stats),
        }
        if args.check:
            doc["check"] = {"ok": not failures, "failures": failures}
        print(to_json(doc))
    else:
        _print_status(where, stats, counts, ages)
    for line in failures:
        print(f"{PROG}: check failed: {line}", file=sys.stderr)
    return 1 if failures else 0


def _oldest(pending: int, seen: float | None, word: str) -> str:
    if not pending:
        return ""
    return f", {word} {'unknown' if seen is None else age(seen)}"


def _print_status(
    where: str, stats: StoreStats, counts: dict[str, int], ages: dict[str, float | None]
) -> None:
    on = colour_on(sys.stdout)
    state = "up to date" if stats.schema_revision == HEAD else "differs"
    by_status = ", ".join(
        f"{paint(plain(status), COLOURS.get(status), on)} {n}" for status, n in counts.items()
    )
    outbox_age = _oldest(stats.pending_outbox, ages["oldest_outbox_age"], "oldest")
    spawn_age = _oldest(stats.pending_spawns, ages["oldest_spawn_age"], "oldest")
    lag = _oldest(stats.timers_due, ages["timer_lag"], "most overdue by")
    rows = [
        ("database", plain(show(where))),
        ("schema", f"{plain(str(stats.schema_revision))} (head {HEAD}, {state})"),
        ("executions", f"{sum(counts.values())} total: {by_status}"),
        ("outbox", f"{stats.pending_outbox} pending{outbox_age}{_held(stats.claimed_outbox)}"),
        ("spawns", f"{stats.pending_spawns} pending{spawn_age}{_held(stats.claimed_spawns)}"),
        (
            "timers",
            f"{stats.timers_due} due{lag}, {stats.timers_future} future"
            f"{_held(stats.claimed_timers)}",
        ),
        ("dead", _dead_text(dead_counts(stats))),
    ]
    for label, value in rows:
        print(f"{label:<11} {value}")


def configure(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    check = parser.add_argument_group("health check")
    check.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when the schema is not the head schema or a threshold below is crossed",
    )
    for option, _key, _what, help_text in THRESHOLDS:
        flag = "--" + option.replace("_", "-")
        check.add_argument(
            flag, type=duration, metavar="DUR", help=help_text + " (implies --check)"
        )
    check.add_argument(
        "--max-dead",
        type=count,
        metavar="N",
        help="fail when more than N dead letters (of any kind) wait (0: any; implies --check)",
    )


COMMANDS = [
    Command(
        "status",
        "schema revision, executions by status, pending relays and timers; --check for probes",
        f"""--check exits 1, naming each problem on stderr, when the schema is behind, ahead
of or drifted from head, or when a given threshold is crossed (an age, or more than
--max-dead N dead letters waiting); otherwise 0. Ages of outbox entries and spawns are on
the database's clock, which wrote their times; a timer's lag on this machine's, like the
engine that armed it.

examples:
  {PROG} status
  {PROG} status --json | jq .executions
  {PROG} status --check --max-outbox-age 60s --max-timer-lag 30s --max-spawn-age 60s
  {PROG} status --max-dead 0""",
        status,
        configure,
    )
]
