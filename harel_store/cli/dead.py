"""``dead``, ``revive`` and ``discard``: the dead letters a claim set aside after too many
attempts, and what an operator does with them (give them another round, or drop them)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator, Sequence
from typing import Any

from harel_store.cli.common import Command, add_json, limit, open_store
from harel_store.cli.output import PROG, Failure, colour_on, plain, table, to_json, when
from harel_store.models import DEAD_KINDS, DeadLetter, OutboxEntry, SpawnEntry
from harel_store.store import MAX_PAGE, Store

COLUMNS = ("KIND", "ITEM", "ATTEMPTS", "LAST ERROR")
SHOWN_ERROR = 80  # characters of a last error in a table (--json has it whole)


def shown_error(error: str | None) -> str:
    if error is None:
        return ""
    text = plain(" ".join(error.split()))
    return text if len(text) <= SHOWN_ERROR else text[: SHOWN_ERROR - 3] + "..."


def item_text(letter: DeadLetter) -> str:
    """How an operator names a dead letter (as `revive` and `discard` take it)."""
    item = letter.item
    if isinstance(item, OutboxEntry):
        target = plain(item.target_id or "(publish)")
        return f"outbox {item.seq}: {plain(item.event.name)} for {target}"
    if isinstance(item, SpawnEntry):
        return f"spawn {item.seq}: {plain(item.child_id)} of {plain(item.parent_id)}"
    return f"timer {plain(item.execution_id)} {plain(item.path)} at {when(item.fire_at)}"


def rows(letters: Sequence[DeadLetter]) -> list[list[str]]:
    return [[d.kind, item_text(d), str(d.attempts), shown_error(d.last_error)] for d in letters]


def doc(letter: DeadLetter) -> dict[str, Any]:
    item: dict[str, Any] = letter.item._asdict()
    if isinstance(letter.item, OutboxEntry):
        item["event"] = letter.item.event.model_dump(mode="json")
    return {
        "kind": letter.kind,
        "item": item,
        "attempts": letter.attempts,
        "error": letter.last_error,
    }


def print_letters(letters: Sequence[DeadLetter], args: argparse.Namespace, what: str) -> None:
    if args.json:
        for letter in letters:
            print(to_json(doc(letter), separators=(",", ":")))
    elif letters:
        table(COLUMNS, rows(letters), colour_on(sys.stdout))
    if not letters:
        print(f"{PROG}: no {what}", file=sys.stderr)
    elif len(letters) == getattr(args, "limit", None):
        print(f"{PROG}: showing the first {len(letters)} (use --limit N for more)", file=sys.stderr)


def listing(args: argparse.Namespace, kind: str | None = None) -> int:
    """``dead``, and ``outbox|spawns|timers --dead`` (``kind``)."""
    kind = kind or getattr(args, "kind", None)
    with open_store(args) as store:
        letters = store.dead_letters(kind=kind, limit=args.limit)
    print_letters(letters, args, "dead letters" if kind is None else f"dead letters of kind {kind}")
    return 0


def _selected(store: Store, args: argparse.Namespace) -> tuple[list[DeadLetter], list[str]]:
    """The dead letters the arguments name by key, and the keys that name none."""
    keys: list[tuple[str, Any]] = [("outbox", seq) for seq in args.outbox or ()]
    keys += [("spawn", seq) for seq in args.spawn or ()]
    keys += [("timer", tuple(key)) for key in args.timer or ()]
    found, missing = [], []
    for kind, key in keys:
        letter = store.dead_letter(kind, key)
        if letter is None:
            name = " ".join(map(str, key)) if kind == "timer" else str(key)
            missing.append(f"{kind} {plain(name)}")
        else:
            found.append(letter)
    return found, missing


def _everything(store: Store, kinds: Sequence[str]) -> Iterator[list[DeadLetter]]:
    """Every dead letter of ``kinds``, a page at a time; each page must be dealt with (made
    live or removed) before the next is read."""
    for kind in kinds:
        while page := store.dead_letters(kind=kind, limit=MAX_PAGE):
            yield page


def _dead_count(store: Store, kinds: Sequence[str]) -> int:
    stats = store.stats(0.0)
    counts = {"outbox": stats.dead_outbox, "spawn": stats.dead_spawns, "timer": stats.dead_timers}
    return sum(counts[kind] for kind in kinds)


def act(args: argparse.Namespace, revive: bool) -> int:
    verb, done = ("revive", "revived") if revive else ("discard", "discarded")
    keyed = bool(args.outbox or args.spawn or args.timer)
    if keyed == bool(args.all):
        raise Failure(
            f"name what to {verb}: --outbox SEQ, --spawn SEQ and --timer ID PATH, or --all KIND"
        )
    kinds = list(DEAD_KINDS) if args.all == "all" else [args.all] if args.all else []
    with open_store(args) as store:
        deal = store.revive if revive else store.ack
        letters, missing = _selected(store, args) if keyed else ([], [])
        if args.dry_run:
            count = len(letters) if keyed else _dead_count(store, kinds)
            if not keyed:
                letters = [d for kind in kinds for d in store.dead_letters(kind=kind, limit=50)]
        elif keyed:
            count = deal([d.item for d in letters])
        else:
            count = 0
            for page in _everything(store, kinds):
                dealt = deal([d.item for d in page])
                count += dealt
                if not dealt:  # another process dealt with them meanwhile: stop, not spin
                    break
    for name in missing:
        print(f"{PROG}: not a dead letter: {name}", file=sys.stderr)
    if args.dry_run:
        print_letters(letters, args, f"dead letters to {verb}")
        print(f"{PROG}: dry run: would {verb} {count}, nothing changed", file=sys.stderr)
    elif args.json:
        print(to_json({done: count, "missing": missing}))
    else:
        print(f"{done} {count}")
    return 1 if missing else 0


def configure_listing(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kind", choices=DEAD_KINDS, help="only dead letters of this kind")
    parser.add_argument(
        "--limit", type=limit, default=50, metavar="N", help=f"at most N rows (50, <= {MAX_PAGE})"
    )
    add_json(parser)


def configure_act(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--outbox", type=limit, action="append", metavar="SEQ", help="an outbox entry"
    )
    parser.add_argument("--spawn", type=limit, action="append", metavar="SEQ", help="a spawn")
    parser.add_argument(
        "--timer", nargs=2, action="append", metavar=("ID", "PATH"), help="a timer of an execution"
    )
    parser.add_argument(
        "--all",
        choices=[*DEAD_KINDS, "all"],
        metavar="KIND",
        help="every dead letter of KIND (outbox, spawn, timer or all)",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="say what would change; change nothing"
    )
    add_json(parser)


COMMANDS = [
    Command(
        "dead",
        "dead letters: relay items set aside after too many attempts, in the order they died",
        f"""A claim with max_attempts makes a row whose attempts reached it a dead letter: it is
never claimed again until revived. ITEM names it as revive and discard take it.

examples:
  {PROG} dead
  {PROG} dead --kind timer --json | jq .error""",
        listing,
        configure_listing,
    ),
    Command(
        "revive",
        "give dead letters another round: attempts back to 0, claimable at once",
        f"""Exits 1 when a key names no dead letter (the others are revived).

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
        f"""Exits 1 when a key names no dead letter (the others are discarded).

examples:
  {PROG} discard --spawn 7
  {PROG} discard --all outbox --dry-run""",
        lambda args: act(args, revive=False),
        configure_act,
    ),
]
