"""``flow``, ``workers`` and ``release``: flow control (a flow key's priority, concurrency,
rate and pause, which every claim honours) and failover (who holds what, and handing back
what a worker that is gone holds), as `harel_store.flows` has them."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from typing import Any

from harel_store.checks import INT64, MAX_SECONDS, check_id
from harel_store.cli.common import UNITS, Command, add_json, count, duration, limit, open_store
from harel_store.cli.output import PROG, age, colour_on, plain, table, to_json, when
from harel_store.flows import check_flow_key
from harel_store.models import Flow, WorkerHold

FLOW_COLUMNS = ("KEY", "PRIORITY", "CONCURRENCY", "PAUSED", "RATE", "PENDING", "HELD")
WORKER_COLUMNS = ("WORKER", "OUTBOX", "SPAWNS", "TIMERS", "LEASE UNTIL", "LEFT")
RATE_FORM = "COUNT/DURATION, such as 10/1s, 600/1h or 5/30"


# --- argument types: a bad value is a usage error (exit 2) before any database is opened,
# so a fleet run starts none of them.


def _usage(exc: ValueError | TypeError) -> argparse.ArgumentTypeError:
    return argparse.ArgumentTypeError(str(exc))


def flow_key(text: str) -> str:
    """An argparse type: a flow key (``""`` too: the key of entries with no target)."""
    try:
        return check_flow_key(text)
    except (ValueError, TypeError) as exc:
        raise _usage(exc) from None


def worker(text: str) -> str:
    """An argparse type: a worker id."""
    try:
        check_id(text, "worker")
    except (ValueError, TypeError) as exc:
        raise _usage(exc) from None
    return text


def _int64(value: int, name: str) -> int:
    if value not in INT64:
        raise argparse.ArgumentTypeError(f"{name} must fit in a signed 64-bit integer")
    return value


def priority(text: str) -> int:
    """An argparse type: any whole number (higher first; 0 is every other key's)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r:.80}") from None
    return _int64(value, "priority")


def concurrency(text: str) -> int:
    """An argparse type: a whole number of at least 0 (0 holds nothing, as paused)."""
    return _int64(count(text), "concurrency")


def rate(text: str) -> tuple[int, float]:
    """An argparse type: ``COUNT/DURATION`` (``10/1s``, ``600/1h``, ``5/30``: seconds when
    bare), at most COUNT (>= 1) items claimed in any DURATION (more than 0, at most 365d)."""
    number, slash, span = text.partition("/")
    if not slash:
        raise argparse.ArgumentTypeError(f"not a rate ({RATE_FORM}): {text!r:.80}")
    try:
        most = limit(number.strip())
        seconds = duration(span)
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"not a rate ({RATE_FORM}): {text!r:.80}: {exc}") from None
    if not 0 < seconds <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"a rate's duration must be more than 0 and at most {MAX_SECONDS // 86400}d:"
            f" {text!r:.80}"
        )
    return _int64(most, "a rate's count"), seconds


# --- what is printed


def shown_key(key: str) -> str:
    """A flow key in a table or a message: ``""`` for the empty key (entries with no
    target: how a shell names it), escaped otherwise."""
    return '""' if key == "" else plain(key)


def span(seconds: float) -> str:
    """A rate's duration as ``rate`` takes it: in the largest unit it is a whole number of."""
    for unit in ("d", "h", "m"):
        whole, part = divmod(seconds, UNITS[unit])
        if whole and not part:
            return f"{int(whole)}{unit}"
    return f"{int(seconds)}s" if float(seconds).is_integer() else f"{seconds!r}s"


def flow_rows(flows: Sequence[Flow]) -> list[list[str]]:
    return [
        [
            shown_key(f.key),
            str(f.priority),
            "-" if f.concurrency is None else str(f.concurrency),
            "yes" if f.paused else "no",
            "-" if f.rate is None else f"{f.rate[0]}/{span(f.rate[1])}",
            str(f.pending),
            str(f.held),
        ]
        for f in flows
    ]


def flow_doc(flow: Flow) -> dict[str, Any]:
    """A flow's JSON: its fields, the rate as ``{"count", "seconds"}`` (or null)."""
    doc = flow._asdict()
    if flow.rate is not None:
        doc["rate"] = {"count": flow.rate[0], "seconds": flow.rate[1]}
    return doc


def _print_flows(args: argparse.Namespace, flows: Sequence[Flow]) -> None:
    if args.json:
        for flow in flows:
            print(to_json(flow_doc(flow), separators=(",", ":")))
    elif flows:
        table(FLOW_COLUMNS, flow_rows(flows), colour_on(sys.stdout))


def worker_rows(holds: Sequence[WorkerHold], now: float) -> list[list[str]]:
    return [
        [
            plain(h.worker),
            str(h.held.get("outbox", 0)),
            str(h.held.get("spawn", 0)),
            str(h.held.get("timer", 0)),
            when(h.lease_until),
            age(h.lease_until - now) if h.lease_until > now else "",
        ]
        for h in holds
    ]


# --- the commands


def flow_ls(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        flows = store.flows()
    _print_flows(args, flows)
    if not flows:
        print(f"{PROG}: no flow key has settings", file=sys.stderr)
    return 0


def flow_set(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        flow = store.set_flow(
            args.key,
            priority=args.priority,
            concurrency=args.concurrency,
            paused=args.paused,
            rate=args.rate,
        )
    _print_flows(args, [flow])
    return 0


def flow_pause(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        flow = store.pause_flow(args.key)
    _print_flows(args, [flow])
    return 0


def flow_resume(args: argparse.Namespace) -> int:
    """A key with no settings is not paused: said so, exit 0 (the state asked for holds)."""
    with open_store(args) as store:
        flow = store.resume_flow(args.key)
    if flow is not None:
        _print_flows(args, [flow])
    elif args.json:
        print(to_json(None))
    else:
        print(f"{shown_key(args.key)} has no settings: not paused")
    return 0


def flow_clear(args: argparse.Namespace) -> int:
    """A key with no settings already has none: said so, exit 0."""
    with open_store(args) as store:
        cleared = store.clear_flow(args.key)
    if args.json:
        print(to_json({"key": args.key, "cleared": cleared}))
    elif cleared:
        print(f"cleared {shown_key(args.key)}")
    else:
        print(f"{shown_key(args.key)} had no settings: nothing cleared")
    return 0


ACTIONS = {
    "ls": flow_ls,
    "set": flow_set,
    "pause": flow_pause,
    "resume": flow_resume,
    "clear": flow_clear,
}


def flow(args: argparse.Namespace) -> int:
    return ACTIONS[args.action](args)


def workers(args: argparse.Namespace) -> int:
    with open_store(args, read_only=True) as store:
        holds = store.workers()
    if args.json:
        for hold in holds:
            print(to_json(hold._asdict(), separators=(",", ":")))
    elif holds:
        table(WORKER_COLUMNS, worker_rows(holds, time.time()), colour_on(sys.stdout))
    if not holds:
        print(f"{PROG}: no worker holds an item under a live lease", file=sys.stderr)
    return 0


def release(args: argparse.Namespace) -> int:
    with open_store(args) as store:
        released = store.release_worker(args.worker)
    if args.json:
        print(to_json({"worker": args.worker, "released": released}))
    else:
        print(f"released {released}")
    return 0


# --- their arguments


def _key(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "key",
        type=flow_key,
        metavar="KEY",
        help='the flow key (by default an execution tree\'s root id; "" for entries with no'
        " target)",
    )


def configure_flow(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    raw = argparse.RawDescriptionHelpFormatter

    def action(name: str, summary: str) -> argparse.ArgumentParser:
        return actions.add_parser(name, help=summary, description=summary, formatter_class=raw)

    ls = action("ls", "the flow keys with settings, by key, and their items now")
    add_json(ls)
    put = action("set", "replace every setting of KEY (one left out is its default)")
    _key(put)
    put.add_argument(
        "--priority",
        type=priority,
        default=0,
        metavar="N",
        help="higher first; 0 is every other key's (default 0)",
    )
    put.add_argument(
        "--concurrency",
        type=concurrency,
        metavar="N",
        help="at most N of its items held at once, all kinds, by every worker (default: no"
        " limit; 0 holds nothing)",
    )
    put.add_argument(
        "--rate",
        type=rate,
        metavar="N/DUR",
        help="at most N of its items claimed in any DUR (10/1s, 600/1h; default: no rate)",
    )
    put.add_argument("--paused", action="store_true", help="none of its items claimed")
    add_json(put)
    for name, summary in (
        ("pause", "pause KEY: none of its items claimed; its other settings kept"),
        ("resume", "resume KEY, its other settings kept"),
        ("clear", "drop every setting of KEY: the defaults again, no longer listed"),
    ):
        each = action(name, summary)
        _key(each)
        add_json(each)


def configure_workers(parser: argparse.ArgumentParser) -> None:
    add_json(parser)


def configure_release(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--worker",
        type=worker,
        required=True,
        metavar="W",
        help="the worker id whose items to hand back",
    )
    add_json(parser)


COMMANDS = [
    Command(
        "flow",
        "flow control: a flow key's priority, concurrency, rate and pause (ls, set, pause,"
        " resume, clear)",
        f"""Every outbox entry, spawn and timer has a flow key: by default the root id of the
execution it concerns (the text before the first "."; "" for an outbox entry with no
target), or what the store's flow_key function says. A key's settings bind every worker's
claims at once: higher PRIORITY first, at most CONCURRENCY of its items held at once, at
most RATE claimed in any period (on the database's clock), none while PAUSED; keys are
served in turn within a priority. `flow set` replaces every setting (one left out is its
default: priority 0, no limit, no rate, not paused); pause and resume keep the others.
`flow ls` lists the keys with settings, with their items PENDING (waiting to be claimed)
and HELD (claimed under a live lease). resume and clear of a key with no settings say so
and exit 0. --json: a JSON document per flow.

examples:
  {PROG} flow set order-1a2b3c4d --priority 10 --concurrency 4 --rate 100/1m
  {PROG} flow set "" --concurrency 2            # outbox entries with no target
  {PROG} flow pause order-1a2b3c4d && {PROG} flow ls
  {PROG} flow pause order-1a2b3c4d --json | jq .pending
  {PROG} flow resume order-1a2b3c4d
  {PROG} flow clear order-1a2b3c4d""",
        flow,
        configure_flow,
    ),
    Command(
        "workers",
        "the workers holding relay items under a live lease, and how many of each kind",
        f"""One row a worker: its items held by kind, when its latest lease ends (the database's
clock) and the time left (this machine's clock); a lease run out holds nothing. A worker
that is gone keeps what it holds until then: `{PROG} release --worker W` hands it back
at once. --json: a JSON document per worker.

examples:
  {PROG} workers
  {PROG} workers --json | jq .held""",
        workers,
        configure_workers,
    ),
    Command(
        "release",
        "hand back every item a worker holds, all kinds: claimable at once",
        f"""For a worker known to be gone (a relay does this itself as it starts with its id):
each claim's attempt is given back, and any worker may claim the items at once instead of
waiting out the leases. Prints how many (0 when it held nothing); exit 0 either way.

examples:
  {PROG} release --worker relay-1
  {PROG} release --worker relay-1 --json | jq .released""",
        release,
        configure_release,
    ),
]
