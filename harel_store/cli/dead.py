"""``dead``, ``revive`` and ``discard``: the dead letters a claim set aside after too many
attempts, and what an operator does with them (give them another round, or drop them).
Also what every relay listing shares: a row's JSON, its last error in a table, and how a
listing is printed (`relays` lists the live rows with them)."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Callable, Sequence
from typing import Any

from harel_store.cli.common import Command, add_json, limit, open_store
from harel_store.cli.output import PROG, colour_on, plain, table, to_json, when
from harel_store.errors import CorruptRecord
from harel_store.models import (
    DEAD_KINDS,
    DeadLetter,
    DueTimer,
    Event,
    OutboxEntry,
    RelayItem,
    SpawnEntry,
)
from harel_store.store import MAX_PAGE, Store, StoreStats

TRIES = ("TRIES", "LAST ERROR")  # a row's attempts (claims) so far, the last worker's error
COLUMNS = ("KIND", "ITEM", *TRIES)
SHOWN_ERROR = 80  # characters of a last error in a table (--json has it whole)
SHOWN = 50  # rows a listing shows unless --limit says otherwise, and a dry run lists

Key = tuple[str, Any]  # a dead letter's kind and key: a seq, or a timer's (execution_id, path)


def dead_counts(stats: StoreStats) -> dict[str, int]:
    """The dead letters waiting, by kind."""
    return {"outbox": stats.dead_outbox, "spawn": stats.dead_spawns, "timer": stats.dead_timers}


def shown_error(error: str | None) -> str:
    """A worker's last error in a table cell: one line, escaped, cut to SHOWN_ERROR."""
    if error is None:
        return ""
    text = plain(" ".join(error.split()))
    return text if len(text) <= SHOWN_ERROR else text[: SHOWN_ERROR - 3] + "..."


def doc(row: Any) -> dict[str, Any]:
    """A listed row's JSON: its own fields (a named tuple's), an event or an item as its
    document."""

    def value(field: Any) -> Any:
        if isinstance(field, Event):
            return field.model_dump(mode="json")
        return doc(field) if isinstance(field, (OutboxEntry, SpawnEntry, DueTimer)) else field

    return {name: value(field) for name, field in row._asdict().items()}


def listed(
    args: argparse.Namespace,
    items: Sequence[Any],
    columns: Sequence[str],
    rows: list[list[str]],
    what: str,
    asked: int | None,
) -> None:
    """Print ``items`` as JSON lines (--json) or a table of ``rows``; on stderr, that there
    are no ``what``, or that there may be more than the ``asked`` (--limit) listed."""
    if args.json:
        for item in items:
            print(to_json(doc(item), separators=(",", ":")))
    elif items:
        table(columns, rows, colour_on(sys.stdout))
    if not items:
        print(f"{PROG}: no {what}", file=sys.stderr)
    elif len(items) == asked:
        print(f"{PROG}: showing the first {len(items)} (use --limit N for more)", file=sys.stderr)


def _timer_key(execution_id: str, path: str) -> str:
    """A timer's key as --timer takes it (quoted as a shell would need it)."""
    return plain(shlex.join((execution_id, path)))


def item_text(letter: DeadLetter) -> str:
    """What a dead letter is, starting with how `revive` and `discard` name it."""
    item = letter.item
    if isinstance(item, OutboxEntry):
        target = plain(item.target_id or "(publish)")
        return f"outbox {item.seq}: {plain(item.event.name)} for {target}"
    if isinstance(item, SpawnEntry):
        return f"spawn {item.seq}: {plain(item.child_id)} of {plain(item.parent_id)}"
    return f"timer {_timer_key(item.execution_id, item.path)} at {when(item.fire_at)}"


def rows(letters: Sequence[DeadLetter]) -> list[list[str]]:
    return [[d.kind, item_text(d), str(d.attempts), shown_error(d.last_error)] for d in letters]


def listing(args: argparse.Namespace, kind: str | None) -> int:
    """``dead``, and ``outbox|spawns|timers --dead``: the dead letters of ``kind`` (None:
    every kind)."""
    with open_store(args, read_only=True) as store:
        letters = store.dead_letters(kind=kind, limit=args.limit)
    what = "dead letters" if kind is None else f"dead letters of kind {kind}"
    listed(args, letters, COLUMNS, rows(letters), what, args.limit)
    return 0


def _keys(args: argparse.Namespace) -> list[Key]:
    """The keys given, each once, in the order given."""
    keys: list[Key] = [("outbox", seq) for seq in args.outbox]
    keys += [("spawn", seq) for seq in args.spawn]
    keys += [("timer", (execution_id, path)) for execution_id, path in args.timer]
    return list(dict.fromkeys(keys))


def _key_text(key: Key) -> str:
    kind, value = key
    return f"{kind} {_timer_key(*value) if kind == 'timer' else value}"


def _all(store: Store, deal: Callable[[list[RelayItem]], int], kind: str | None) -> int:
    """Deal with every dead letter of ``kind`` (None: any) that decodes, a page at a time:
    a page dealt with is no longer dead, so the next read starts past it."""
    count = 0
    while page := store.dead_letters(kind=kind, limit=MAX_PAGE):
        dealt = deal([d.item for d in page])
        if not dealt:  # another process dealt with them meanwhile: stop, not spin
            break
        count += dealt
    return count


def _discard_all(store: Store, kind: str | None) -> int:
    """Remove every dead letter of ``kind`` (None: any), corrupt ones included, a page at a
    time (each removed one is gone, so the next page starts past it)."""
    count = 0
    while removed := store.discard_dead_letters(kind=kind, limit=MAX_PAGE):
        count += removed
    return count


def _dead_count(store: Store, kind: str | None) -> int:
    counts = dead_counts(store.stats(0.0))
    return sum(counts.values()) if kind is None else counts[kind]


def _one_line(text: str) -> str:
    return plain(" ".join(text.split()))[:300]


def act(args: argparse.Namespace, revive: bool) -> int:
    """``revive`` and ``discard``: by key (exit 1 when a key names no dead letter; the
    others are dealt with) or ``--all KIND``. A dead letter whose stored event or context
    no longer decodes is discarded like any other, and never revived (a relay could not
    deliver it): it is named, and the exit code is 1."""
    verb, done = ("revive", "revived") if revive else ("discard", "discarded")
    keys = _keys(args)
    if not keys and args.all is None:  # ValueError: a usage error, exit 2
        raise ValueError(
            f"name what to {verb}: --outbox SEQ, --spawn SEQ, --timer ID PATH (each "
            "repeatable) or --all KIND"
        )
    if keys and args.all is not None:
        raise ValueError(f"--all {args.all} takes no --outbox, --spawn or --timer")
    kind = None if args.all == "all" else args.all
    letters: list[DeadLetter] = []
    missing: list[Key] = []
    corrupt: dict[Key, str] = {}  # a dead letter by key that does not decode: why
    left = 0  # revive --all: the dead letters it could not decode, left dead
    with open_store(args) as store:
        if keys and (revive or args.dry_run):
            found: dict[Key, DeadLetter | None] = {}
            for key in keys:
                try:
                    found[key] = store.dead_letter(*key)
                except CorruptRecord as exc:
                    corrupt[key] = _one_line(str(exc))
            letters = [d for d in found.values() if d is not None]
            missing = [key for key, d in found.items() if d is None]
            if args.dry_run:
                count = len(letters) + (0 if revive else len(corrupt))
            else:
                count = store.revive([d.item for d in letters])
        elif keys:
            removed = {key: store.discard_dead_letter(*key) for key in keys}
            missing = [key for key, gone in removed.items() if not gone]
            count = len(keys) - len(missing)
        elif args.dry_run:
            letters = store.dead_letters(kind=kind, limit=SHOWN)
            count = _dead_count(store, kind)
        elif revive:
            count = _all(store, store.revive, kind)
            left = _dead_count(store, kind)
        else:
            count = _discard_all(store, kind)
    for key in missing:
        print(f"{PROG}: not a dead letter: {_key_text(key)}", file=sys.stderr)
    for key, why in corrupt.items():
        if revive:
            hint = f"discard it: {PROG} discard --{_key_text(key)}"
            print(f"{PROG}: not revived: {_key_text(key)} ({why}); {hint}", file=sys.stderr)
        else:
            print(f"{PROG}: {_key_text(key)}: {why}", file=sys.stderr)
    if left:
        print(
            f"{PROG}: not revived: {left} dead letter{'s' if left > 1 else ''} with a corrupt "
            f"stored record (discard them: {PROG} discard --all {args.all})",
            file=sys.stderr,
        )
    if args.dry_run:
        listed(args, letters, COLUMNS, rows(letters), f"dead letters to {verb}", None)
        first = f" (the first {len(letters)} listed)" if len(letters) < count else ""
        print(f"{PROG}: dry run: would {verb} {count}{first}; nothing changed", file=sys.stderr)
    elif args.json:
        gone = [{"kind": what, "key": key} for what, key in missing]
        answer: dict[str, Any] = {done: count, "missing": gone}
        if revive:
            answer["corrupt"] = [{"kind": what, "key": key} for what, key in corrupt]
        print(to_json(answer))
    else:
        print(f"{done} {count}")
    return 1 if missing or (revive and (corrupt or left)) else 0


def configure_listing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=DEAD_KINDS, help="only dead letters of this kind")
    parser.add_argument(
        "--limit",
        type=limit,
        default=SHOWN,
        metavar="N",
        help=f"at most N rows ({SHOWN}, <= {MAX_PAGE})",
    )
    add_json(parser)


def configure_act(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--outbox", type=limit, action="append", default=[], metavar="SEQ", help="an outbox entry"
    )
    parser.add_argument(
        "--spawn", type=limit, action="append", default=[], metavar="SEQ", help="a spawn"
    )
    parser.add_argument(
        "--timer",
        nargs=2,
        action="append",
        default=[],
        metavar=("ID", "PATH"),
        help="the timer at PATH of execution ID",
    )
    parser.add_argument(
        "--all",
        choices=[*DEAD_KINDS, "all"],
        metavar="KIND",
        help="every dead letter of KIND (outbox, spawn, timer or all); no keys with it",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help=f"list (the first {SHOWN} of) what would change and count it; change nothing",
    )
    add_json(parser)


COMMANDS = [
    Command(
        "dead",
        "dead letters: relay items set aside after too many attempts, in the order they died",
        f"""A claim with max_attempts makes a row whose attempts reached it a dead letter: it is
never claimed again until revived. ITEM starts with how revive and discard name it; TRIES
counts its claims, LAST ERROR is what the last worker that failed it said (--json: whole).

examples:
  {PROG} dead
  {PROG} dead --kind timer --json | jq .last_error""",
        lambda args: listing(args, args.kind),
        configure_listing,
    ),
    Command(
        "revive",
        "give dead letters another round: attempts back to 0, claimable at once",
        f"""Keys can be mixed and repeated. Exits 1 when a key names no dead letter (the others
are revived); --json prints {{"revived": N, "missing": [...]}}.

examples:
  {PROG} revive --outbox 42 --timer order-1a2b main.remind
  {PROG} revive --all spawn --dry-run
  {PROG} revive --all all --json""",
        lambda args: act(args, revive=True),
        configure_act,
    ),
    Command(
        "discard",
        "drop dead letters for good (as an ack does)",
        f"""Keys can be mixed and repeated. Exits 1 when a key names no dead letter (the others
are discarded); --json prints {{"discarded": N, "missing": [...]}}.

examples:
  {PROG} discard --spawn 7
  {PROG} discard --all outbox --dry-run""",
        lambda args: act(args, revive=False),
        configure_act,
    ),
]
