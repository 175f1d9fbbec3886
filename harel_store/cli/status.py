"""``status``: the schema revision, executions by status, pending relays and timers."""

from __future__ import annotations

import argparse
import sys
import time

from harel_store.cli.common import Command, add_json, database, open_store
from harel_store.cli.output import COLOURS, PROG, age, colour_on, paint, plain, to_json
from harel_store.connection import show
from harel_store.models import STATUSES
from harel_store.sql import HEAD


def _held(claimed: int) -> str:
    """How many of a relay's rows a worker holds under a live lease (none: nothing said)."""
    return f" ({claimed} claimed by a worker)" if claimed else ""


def status(args: argparse.Namespace) -> int:
    where = database(args)
    with open_store(args) as store:
        now = time.time()
        stats = store.stats(now)
    counts = {status: stats.executions.get(status, 0) for status in STATUSES}
    counts.update(stats.executions)
    oldest_age = None if stats.oldest_outbox_at is None else now - stats.oldest_outbox_at
    if args.json:
        doc = {
            "database": show(where),
            "schema_revision": stats.schema_revision,
            "head": HEAD,
            "executions": counts,
            "pending_outbox": stats.pending_outbox,
            "oldest_outbox_age": oldest_age,
            "pending_spawns": stats.pending_spawns,
            "timers_due": stats.timers_due,
            "timers_future": stats.timers_future,
            "claimed_outbox": stats.claimed_outbox,
            "claimed_spawns": stats.claimed_spawns,
            "claimed_timers": stats.claimed_timers,
        }
        print(to_json(doc))
        return 0
    on = colour_on(sys.stdout)
    state = "up to date" if stats.schema_revision == HEAD else "differs"
    oldest = ""
    if stats.pending_outbox:
        oldest = f", oldest {'unknown' if oldest_age is None else age(oldest_age) + ' old'}"
    by_status = ", ".join(
        f"{paint(plain(status), COLOURS.get(status), on)} {n}" for status, n in counts.items()
    )
    rows = [
        ("database", plain(show(where))),
        ("schema", f"{plain(str(stats.schema_revision))} (head {HEAD}, {state})"),
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


COMMANDS = [
    Command(
        "status",
        "schema revision, executions by status, pending relays and timers",
        f"""examples:
  {PROG} status
  {PROG} status --json | jq .executions""",
        status,
        add_json,
    )
]
