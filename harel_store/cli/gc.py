"""``gc``: what a store that runs for years forgets, in short batches, oldest first: final
execution trees, dedupe markers, dead letters."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable

from harel_store.cli.common import Command, add_json, age, limit, open_store
from harel_store.cli.output import PROG, colour_on, to_json
from harel_store.store import MAX_PURGE

# How long a dedupe marker is kept when --markers-older-than is given no age: far longer than
# any lease, retry or backoff a relay runs (theirs are seconds to minutes).
MARKERS_KEPT = 30 * 86400.0
# Executions per write transaction (markers: ten times as many, they are small rows).
BATCH = 500
KINDS = ("executions", "markers", "dead_letters")


class Progress:
    """A line on stderr, rewritten in place, while stderr is a terminal; nothing otherwise."""

    def __init__(self) -> None:
        self.on = colour_on(sys.stderr)  # a terminal that takes control sequences
        self.start = time.monotonic()

    def show(self, kind: str, removed: int) -> None:
        if self.on:
            rate = removed / max(time.monotonic() - self.start, 1e-6)
            label = kind.replace("_", " ")
            print(f"\r\x1b[2K{label}: {removed:,} removed ({rate:,.0f}/s)", end="", file=sys.stderr)

    def done(self) -> None:
        if self.on:
            print("\r\x1b[2K", end="", file=sys.stderr, flush=True)


def _drain(call: Callable[[], int], kind: str, progress: Progress) -> int:
    """Call a retention method until it removes nothing; the total."""
    total = 0
    while removed := call():
        total += removed
        progress.show(kind, total)
    return total


def _count(n: int, things: str) -> str:
    return f"{n:,} {things if n != 1 else things.removesuffix('s')}"


def gc(args: argparse.Namespace) -> int:
    ages = (args.finished_older_than, args.markers_older_than, args.dead_older_than)
    if all(age is None for age in ages):
        raise ValueError(
            "nothing to collect: give --finished-older-than, --markers-older-than or"
            " --dead-older-than"
        )
    if args.batch > MAX_PURGE:
        raise ValueError(f"--batch must be at most {MAX_PURGE}, not {args.batch}")
    with open_store(args) as store:
        now = store.clock()  # every stored time is on the database's clock
        finished, markers, dead = (None if age is None else now - age for age in ages)
        started = time.monotonic()
        if args.dry_run:
            counts = store.retention_counts(
                finished_before=finished, markers_before=markers, dead_before=dead
            )
        else:
            progress = Progress()
            try:
                counts = (
                    0
                    if finished is None
                    else _drain(
                        lambda: store.purge_finished(finished, limit=args.batch),
                        "executions",
                        progress,
                    ),
                    0
                    if markers is None
                    else _drain(
                        lambda: store.forget_processed(markers, limit=args.batch * 10),
                        "markers",
                        progress,
                    ),
                    0
                    if dead is None
                    else _drain(
                        lambda: store.purge_dead(dead, limit=args.batch), "dead_letters", progress
                    ),
                )
            finally:
                progress.done()
        seconds = time.monotonic() - started
    totals = dict(zip(KINDS, counts, strict=True))
    if args.json:
        print(to_json({**totals, "dry_run": args.dry_run, "seconds": round(seconds, 3)}))
        return 0
    asked = [kind for kind, age in zip(KINDS, ages, strict=True) if age is not None]
    verb = "would remove" if args.dry_run else "removed"
    parts = [_count(totals[kind], kind.replace("_", " ")) for kind in asked]
    print(f"{verb} {', '.join(parts)}" + ("" if args.dry_run else f" in {seconds:.1f}s"))
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    add_json(parser)
    parser.add_argument(
        "--finished-older-than",
        type=age,
        metavar="DUR",
        help="finished, failed and cancelled execution trees last updated longer ago than DUR",
    )
    parser.add_argument(
        "--markers-older-than",
        type=age,
        nargs="?",
        const=MARKERS_KEPT,
        metavar="DUR",
        help="dedupe markers recorded longer ago than DUR (no DUR: 30d); keep them longer"
        " than any redelivery can come",
    )
    parser.add_argument(
        "--dead-older-than",
        type=age,
        metavar="DUR",
        help="dead letters (outbox entries, spawns, timers) dead longer ago than DUR",
    )
    parser.add_argument(
        "--batch",
        type=limit,
        default=BATCH,
        metavar="N",
        help=f"executions or dead letters per write transaction, markers ten times N"
        f" (default {BATCH}, at most {MAX_PURGE})",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="count what would go; remove nothing"
    )


COMMANDS = [
    Command(
        "gc",
        "forget what is old: final execution trees, dedupe markers, dead letters",
        f"""Each kind is removed oldest first in short write transactions (--batch), so the
commits of running engines wait milliseconds, not seconds; run it from cron as often as you
like. Ages are on the database's clock and take a unit (s, m, h, d). A tree goes only
whole and only once every execution in it is final and older than the age (an execution
whose parent is gone is the root of its own tree); an execution goes with everything it
owns (trace, markers, timers, outbox entries sent to it, its spawns). A forgotten marker
no longer stops its event from being handled again: keep markers longer than any
redelivery (leases, retries, backoffs) can come; 30 days when --markers-older-than is
given without DUR.

examples:
  {PROG} gc --finished-older-than 90d --markers-older-than --dead-older-than 30d
  {PROG} gc --finished-older-than 7d --dry-run
  {PROG} gc --markers-older-than 14d --batch 200 --json""",
        gc,
        configure,
    )
]
