"""The relays' queues: what a claim, an ack, a fail, an extend and a revive write, and how
their rows decode (the queue section of ``sql/queries.sql`` holds the SQL and says why).

An item is what a relay was handed: an `OutboxEntry` or a `SpawnEntry` (by its ``seq``), or
a `DueTimer` (by its key and ``fire_at``: only as it was claimed, so a re-armed timer is
spared). Outbox entries and spawns go as one statement per kind whatever their number (a
JSON array of seqs); timers one statement each, their ``fire_at`` bound as a number.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from harel_store.batch import Batch
from harel_store.checks import check_finite, check_id, check_int, loads_dict, stored
from harel_store.errors import StoreError
from harel_store.models import (
    DeadLetter,
    DueTimer,
    Event,
    OutboxEntry,
    RelayItem,
    SpawnEntry,
)

# Failures and dead letters are the relays' news: a logger of their own.
relay_log = logging.getLogger("harel_store.relay")
log = logging.getLogger("harel_store")
E = TypeVar("E")

# Each kind's part of its statements' names (ack_outbox, fail_spawns, fail_timer, ...).
OUTBOX, SPAWNS, TIMERS = "outbox", "spawns", "timer"


class Items(NamedTuple):
    """Items checked and sorted by kind: all of them in the order given (``given``), the
    seqs and the timer keys to send (a timer given twice sent once)."""

    given: list[RelayItem]
    outbox: list[int]
    spawns: list[int]
    timers: list[tuple[str, str, float]]


def _add_seq(seqs: list[int], value: object, what: str) -> None:
    # No row has a seq below 1 (a dead letter's is stored negated: the statements negate
    # what they are given), so such an item is one already gone: nothing to send.
    if check_int(value, f"{what} seq") >= 1:
        seqs.append(value)  # type: ignore[arg-type]


def items_of(items: Iterable[object], call: str) -> Items:
    """The items of ``call``, checked before anything is sent: TypeError for anything but
    an OutboxEntry, a SpawnEntry or a DueTimer (a lone item, not in a list, included)."""
    if isinstance(items, (OutboxEntry, SpawnEntry, DueTimer, str, bytes)):
        raise TypeError(f"{call} takes a list of items, not one {type(items).__name__}")
    checked = Items([], [], [], [])
    for item in items:
        if isinstance(item, OutboxEntry):
            _add_seq(checked.outbox, item.seq, "outbox entry")
        elif isinstance(item, SpawnEntry):
            _add_seq(checked.spawns, item.seq, "spawn")
        elif isinstance(item, DueTimer):
            checked.timers.append(
                (
                    check_id(item.execution_id, "timer execution_id"),
                    check_id(item.path, "timer path"),
                    check_finite(item.fire_at, "timer fire_at"),
                )
            )
        else:
            raise TypeError(
                f"{call} takes OutboxEntry, SpawnEntry and DueTimer items, "
                f"not {type(item).__name__}: {item!r:.80}"
            )
        checked.given.append(item)
    # A seq given twice is one row to the statements (`IN`); a timer given twice would be
    # two statements on one row, and two counts.
    checked.timers[:] = dict.fromkeys(checked.timers)
    return checked


def add_each(
    batch: Batch, items: Items, verb: str, *args: Any, worker: str | None = None
) -> list[int]:
    """Add ``verb`` (ack, ack_held, fail, extend, revive) of every item to ``batch``: one
    step per kind of seqs, one per timer; return the steps' indexes. ``worker`` comes first
    where the statement checks the holder; ``args`` after the items."""
    held = () if worker is None else (worker,)
    steps = []
    for kind, seqs in ((OUTBOX, items.outbox), (SPAWNS, items.spawns)):
        if seqs:
            steps.append(batch.add(f"{verb}_{kind}", *held, json.dumps(seqs), *args))
    name = "delete_timer" if verb == "ack" else f"{verb}_timer"
    for key in items.timers:
        steps.append(batch.add(name, *held, *key, *args))
    return steps


def held_items(items: Items, steps: list[int], results: Sequence[Any]) -> list[RelayItem]:
    """Of the given items, those an extend renewed (its steps' results), in order."""
    renewed: set[Any] = set()
    outcomes = iter(results[i] for i in steps)
    for kind, seqs in ((OUTBOX, items.outbox), (SPAWNS, items.spawns)):
        if seqs:
            renewed |= {(kind, seq) for (seq,) in next(outcomes)}
    for key in items.timers:
        if next(outcomes):
            renewed.add((TIMERS, key))
    return [item for item in items.given if _key(item) in renewed]


def attempts(items: Items, rows: Iterable[Sequence[Any]]) -> list[int]:
    """Each given item's attempts from the attempts_of query's rows (0: not found, or a
    timer at another fire_at now)."""
    found = {(kind, (a, b, float(at)) if kind == TIMERS else a): n for kind, a, b, at, n in rows}
    return [found.get(_key(item), 0) for item in items.given]


class Holding:
    """The items a relay round holds, and those a commit of this process consumed since
    (``commit(..., acks=...)`` that landed): the round's own ack need not send those."""

    def __init__(self, database: str, items: Iterable[RelayItem]) -> None:
        self.database = database
        self.keys = {_key(item) for item in items}
        self.consumed: set[tuple[str, Any]] = set()

    def __enter__(self) -> Holding:
        with _holdings_lock:
            _holdings.setdefault(self.database, set()).add(self)
        return self

    def __exit__(self, *exc: object) -> None:
        with _holdings_lock:
            held = _holdings.get(self.database)
            if held is not None:
                held.discard(self)
                if not held:
                    del _holdings[self.database]

    def unconsumed(self, items: Iterable[RelayItem]) -> list[RelayItem]:
        with _holdings_lock:
            return [item for item in items if _key(item) not in self.consumed]


_holdings: dict[str, set[Holding]] = {}
_holdings_lock = threading.Lock()


def consumed(database: str, items: Items) -> None:
    """A commit to ``database`` that consumed ``items`` landed: the rounds holding any of
    them need not ack those."""
    if database not in _holdings:  # the common case: no relay of this process holds any
        return
    keys = {_key(item) for item in items.given}
    with _holdings_lock:
        for holding in _holdings.get(database, ()):
            holding.consumed |= keys & holding.keys


def execution_of(item: RelayItem) -> str | None:
    """The execution whose step an item is: an event's target (None: to the outside world),
    a spawn's child, a timer's execution."""
    if isinstance(item, OutboxEntry):
        return item.target_id
    if isinstance(item, SpawnEntry):
        return item.child_id
    return item.execution_id


def _key(item: RelayItem) -> tuple[str, Any]:
    if isinstance(item, OutboxEntry):
        return OUTBOX, item.seq
    if isinstance(item, SpawnEntry):
        return SPAWNS, item.seq
    return TIMERS, (item.execution_id, item.path, float(item.fire_at))


def outbox_entry(row: Sequence[Any]) -> OutboxEntry:
    seq, target, event = row
    return OutboxEntry(seq, target, stored(f"outbox entry {seq}", Event.model_validate_json, event))


def spawn_entry(row: Sequence[Any]) -> SpawnEntry:
    seq, parent, child, root, context = row
    return SpawnEntry(seq, parent, child, root, stored(f"spawn {seq}", loads_dict, context))


def due_timer(row: Sequence[Any]) -> DueTimer:
    execution_id, path, fire_at = row
    return DueTimer(execution_id, path, float(fire_at))  # sqlite3 may return a whole REAL as int


def dead_letter(row: Sequence[Any]) -> DeadLetter:
    """A row of the dead_letters query (its columns by kind are listed there)."""
    kind, _dead_at, attempts, last_error, seq, *rest = row
    item: RelayItem
    if kind == "outbox":
        item = outbox_entry((seq, *rest[:2]))
    elif kind == "spawn":
        item = spawn_entry((seq, *rest))
    else:
        item = due_timer(rest[:3])
    return DeadLetter(kind, item, attempts, last_error)


CLAIMED = "left claimed and skipped: ack it once dealt with"


def decoded(
    rows: Iterable[Sequence[Any]], decode: Callable[[Sequence[Any]], E], then: str = CLAIMED
) -> list[E]:
    """Rows each decoded on its own: a corrupt one is logged (with what ``then`` happens to
    it) and skipped, so it does not stop a relay for every worker, or an operator's view. A
    claimed one is left to its lease (an operator acks or purges it)."""
    good = []
    for row in rows:
        try:
            good.append(decode(row))
        except StoreError as exc:
            log.warning("%s; %s", exc, then)
    return good


def _name(kind: str, key: Sequence[Any]) -> str:
    if kind == OUTBOX:
        return f"outbox entry {key[0]}"
    if kind == SPAWNS:
        return f"spawn {key[0]}"
    return f"timer {key[1]!r} of {key[0]!r} at {key[2]!r}"


def describe(item: RelayItem) -> str:
    """How the relay's log names an item."""
    kind, key = _key(item)
    return _name(kind, key if kind == TIMERS else (key,))


def log_dead(kind: str, rows: Iterable[Sequence[Any]]) -> None:
    """Say which rows a claim made dead letters (mark_dead_* RETURNING)."""
    for *key, attempts, last_error in rows:
        relay_log.warning(
            "%s is a dead letter after %d attempts (last error: %s); revive or ack it",
            _name(kind, key),
            attempts,
            "none recorded" if last_error is None else repr(last_error[:300]),
        )
