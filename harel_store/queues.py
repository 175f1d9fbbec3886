"""The relays' queues: their operations (`Queues`: claims, acks, fails, leases, dead letters
and the operator's views), what each writes, and how their rows decode (the queue section of
``sql/queries.sql`` holds the SQL and says why).

An item is what a relay was handed: an `OutboxEntry` or a `SpawnEntry` (by its ``seq``), or
a `DueTimer` (by its key and ``fire_at``: only as it was claimed, so a re-armed timer is
spared). Outbox entries and spawns go as one statement per kind whatever their number (a
JSON array of seqs); timers one statement each, their ``fire_at`` bound as a number.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, TypeVar

from harel_store import telemetry, wakeup
from harel_store.batch import Batch, Plan, fresh, statement
from harel_store.checks import (
    check_delay,
    check_finite,
    check_id,
    check_int,
    check_max_attempts,
    check_timeout,
    error_text,
    loads_dict,
    stored,
)
from harel_store.core import (
    ABOVE_ALL,
    MAX_PAGE,
    StoreCore,
    _limit,
    _page,
)
from harel_store.errors import StoreError
from harel_store.models import (
    DEAD_KINDS,
    ArmedTimer,
    ClaimedWork,
    DeadKind,
    DeadLetter,
    DeadView,
    DueTimer,
    Event,
    OutboxEntry,
    PendingOutbox,
    PendingSpawn,
    RelayItem,
    SpawnEntry,
    WorkAhead,
)
from harel_store.operation import operation

# Failures and dead letters are the relays' news: a logger of their own.
relay_log = logging.getLogger("harel_store.relay")
log = logging.getLogger("harel_store")
E = TypeVar("E")

# Each kind's part of its statements' names (ack_outbox, fail_spawns, fail_timer, ...).
OUTBOX, SPAWNS, TIMERS = "outbox", "spawns", "timer"
# The verbs whose items stop being held: room under their keys' limits (add_freed).
_FREEING = frozenset({"ack", "ack_held", "fail", "release"})


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


def stamped(items: list[E], database: str) -> list[E]:
    """``items``, read from ``database`` (a connection's key), marked as its own."""
    for item in items:
        item._origin = database  # type: ignore[attr-defined]
    return items


def items_of(items: Iterable[object], call: str, database: str) -> Items:
    """The items of ``call`` to ``database`` (a connection's key), checked before anything
    is sent: TypeError for anything but an OutboxEntry, a SpawnEntry or a DueTimer (a lone
    item, not in a list, included), ValueError for one read from another database."""
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
        if item._origin is not None and item._origin != database:
            raise ValueError(
                f"{call}: {describe(item)} was read from {item._origin}, not from this "
                f"store's database ({database}); pass it to a store of the database it came from"
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


def add_freed(batch: Batch, items: Items) -> None:
    """Add to ``batch``, before its steps that ack, fail or release ``items``, the mark of
    the room they make under their keys' limits (touch_flows): a server's change
    notifications of it wake the relays waiting for that room (a local file's watch hears
    the commit itself: a local connection skips it)."""
    if items.outbox or items.spawns or items.timers:
        timers = json.dumps([[execution_id, path] for execution_id, path, _ in items.timers])
        outbox, spawns = json.dumps(items.outbox), json.dumps(items.spawns)
        batch.add("touch_flows", outbox, spawns, timers, remote=True)


def _add_rerank(batch: Batch, items: Items, worker: str | None) -> None:
    """Add the new ranks of what comes back to the queue (rerank_items_*): the items
    ``worker`` holds and releases, or (None) the items revived."""
    for name, seqs in (
        ("rerank_items_outbox", items.outbox),
        ("rerank_items_spawns", items.spawns),
    ):
        if seqs:
            batch.add(name, json.dumps(seqs), worker)


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
    seq, target, event, *carried = row
    event = stored(f"outbox entry {seq}", Event.model_validate_json, event)
    entry = OutboxEntry(seq, target, event)
    if carried:  # a claim's row: when it was written, the commit's trace context, its turn
        entry._written_at, entry._traceparent, rank, priority = carried
        entry._turn = (-priority, rank)
    return entry


def spawn_entry(row: Sequence[Any]) -> SpawnEntry:
    seq, parent, child, root, context, *carried = row
    spawn = SpawnEntry(seq, parent, child, root, stored(f"spawn {seq}", loads_dict, context))
    if carried:
        spawn._written_at, spawn._traceparent, rank, priority = carried
        spawn._turn = (-priority, rank)
    return spawn


def due_timer(row: Sequence[Any]) -> DueTimer:
    execution_id, path, fire_at, *carried = row
    timer = DueTimer(execution_id, path, float(fire_at))  # sqlite3 may return a whole REAL as int
    if carried:  # a timer is late from its fire_at: only the trace context
        (timer._traceparent,) = carried
    return timer


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


def _dead_view(row: Sequence[Any]) -> DeadView:
    """A row of the dead_letters query as `DeadView`: decoded if it can be."""
    kind, died_at, attempts, last_error, seq, execution_id, path, *_ = row
    key: int | tuple[str, str] = seq if kind != "timer" else (execution_id, path)
    try:
        letter: DeadLetter | None = dead_letter(row)
        problem = None
    except StoreError as exc:
        letter, problem = None, str(exc)
    return DeadView(kind, key, letter, died_at, attempts, last_error, problem)


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


# A kind's statement that removes its dead letters, a page at a time.
_DISCARD_ALL = {
    "outbox": "discard_dead_outbox",
    "spawn": "discard_dead_spawns",
    "timer": "discard_dead_timers",
}


def _dead_key(
    kind: str, key: object, outbox: str, spawn: str, timer: str
) -> tuple[Any, ...] | None:
    """The statement of ``kind`` (one of the three names) and its parameters for a dead
    letter's ``key``: a seq (None when below 1: no row has one), or a timer's (execution_id,
    path). ValueError/TypeError for a kind or a key that is none."""
    if kind == "timer":
        if not (isinstance(key, tuple) and len(key) == 2):
            raise TypeError(f"a timer's key is (execution_id, path), not {key!r:.80}")
        return timer, check_id(key[0], "execution_id"), check_id(key[1], "path")
    if kind in ("outbox", "spawn"):
        if check_int(key, "seq") < 1:  # no row has such a seq: below 1 are dead ones negated
            return None
        return (outbox if kind == "outbox" else spawn), key
    raise ValueError(f"kind must be one of {', '.join(DEAD_KINDS)}, not {kind!r}")


# Each kind's claim: its statements (the dead letters' sweep, the claim while no flow key
# has settings, the claim that honours them), how its rows decode, and the order it hands
# them out in.
_CLAIMS: dict[DeadKind, tuple[tuple[str, str], Any, Any]] = {
    "outbox": (("mark_dead_outbox", "claim_outbox"), outbox_entry, None),
    "spawn": (("mark_dead_spawns", "claim_spawns"), spawn_entry, None),
    "timer": (
        ("mark_dead_timers", "claim_due_timers"),
        due_timer,
        lambda t: (t.fire_at, t.execution_id, t.path),
    ),
}

# A claim's steps: its dead letters' sweep (None: no max_attempts) and its claim, each as two
# statements (the plain one, and the _flows one that honours the flows), of which a local
# connection runs the one that fits (see queries.sql), and a server the one on its side of
# the batch's gate (`Batch.gate`): (plain, honouring) step pairs.
ClaimSteps = tuple[tuple[int, int] | None, tuple[int, int]]


def _add_either(
    batch: Batch, name: str, flows: int, *params: Any, honouring: tuple[Any, ...] = ()
) -> tuple[int, int]:
    """Add statement ``name`` and its ``name_flows`` twin (its parameters followed by
    ``honouring``): the first runs unless step ``flows`` says some key has settings, the
    second only then."""
    plain = batch.add(name, *params, unless=(flows, 1))
    return plain, batch.add(f"{name}_flows", *params, *honouring, only_if=(flows, 1))


# The log of what a flow-honouring claim of each kind took for keys with a rate.
_LOGS = {
    "outbox": "log_flow_claims_outbox",
    "spawn": "log_flow_claims_spawns",
    "timer": "log_flow_claims_timers",
}


def _claims_batch() -> tuple[Batch, int, int]:
    """A batch for claims: its first step reads whether some key has settings (which of each
    claim's twin statements fits), and the token its flow-honouring claims write."""
    batch = Batch()
    flows = batch.add("flows_in_use")
    batch.gate(flows, "flows_gate")  # a server runs one of each claim's twins, as a file does
    return batch, flows, secrets.randbits(62)


def _end_claims(batch: Batch, flows: int, worker: str, kinds: Iterable[str]) -> None:
    """End a claims batch of ``kinds``: where the claims stand moved on (outbox entries and
    spawns: timers are ranked when claimed), the rate log's rows past their window dropped
    (only while some key has settings)."""
    if "outbox" in kinds or "spawn" in kinds:
        _add_either(batch, "advance_clock", flows, worker)
    batch.add("prune_flow_claims", only_if=(flows, 1))


def _either(results: Sequence[Any], steps: tuple[int, int]) -> list[Any]:
    """The rows of the one of two twin statements that ran (or that changed something)."""
    plain, honouring = steps
    return (results[plain] or []) + (results[honouring] or [])


def _check_claim(worker: str, limit: int, lease: float, max_attempts: int | None) -> float:
    check_id(worker, "worker")
    _page(limit)
    check_max_attempts(max_attempts)
    return check_timeout(lease, "lease")


def _add_claim(
    batch: Batch,
    kind: DeadKind,
    worker: str,
    limit: int,
    lease: float,
    max_attempts: int | None,
    due: float,
    flows: int,
    token: int,
) -> ClaimSteps:
    """Add a claim of ``kind`` to ``batch`` (made by `_claims_batch`, its ``flows`` step and
    ``token``; checked by `_check_claim`): given a ``max_attempts``, first the statement
    that makes dead letters of the rows at it, then the UPDATE ... RETURNING of queries.sql
    that fits the flows, then its log for rated keys; return the first two's steps."""
    names = _CLAIMS[kind][0]
    timer = (due,) if kind == "timer" else ()
    mark = None
    if max_attempts is not None:
        mark = _add_either(batch, names[0], flows, max_attempts, limit, *timer)
    params = (worker, limit, lease, *timer, max_attempts)
    claim = _add_either(batch, names[1], flows, *params, honouring=(token,))
    batch.add(_LOGS[kind], worker, token, only_if=(flows, 1))  # before the next kind's claim
    return mark, claim


# What a claim carries beside each item (0010), and what it is read as when a foreign client
# wrote there something the store does not: (database, kind, column) already logged.
_UNKNOWN = {"created_at": "an unknown time", "traceparent": "no trace context"}
_foreign_seen: set[tuple[str, str, str]] = set()


def _foreign(database: str, item: RelayItem, column: str, value: object) -> None:
    """Log, once a database, kind and column in this process, a value of ``column`` that
    is not what the store writes there."""
    key = (database, _key(item)[0], column)
    if key in _foreign_seen:
        return
    _foreign_seen.add(key)
    log.warning(
        "%s: its %s is not what the store writes there (%s %.40r): read as %s; further such "
        "values of this kind are not logged",
        describe(item),
        column,
        type(value).__name__,
        value,
        _UNKNOWN[column],
    )


def _carried(database: str, items: list[Any]) -> list[Any]:
    """``items`` as claimed, their written time (epoch seconds) and trace context (a text)
    kept only when they are what the store writes: anything else is none (logged)."""
    for item in items:
        written = item._written_at
        item._written_at = _moment(written)
        if written is not None and item._written_at is None:
            _foreign(database, item, "created_at", written)
        context = item._traceparent
        if context is not None and type(context) is not str:
            _foreign(database, item, "traceparent", context)
            item._traceparent = None
    return items


def _claimed(database: str, kind: DeadKind, results: Sequence[Any], steps: ClaimSteps) -> list[Any]:
    """What a claim's steps came to: the dead letters it made logged, its rows decoded (a
    corrupt one logged and left claimed) in the order the claim hands them out, marked as
    ``database``'s."""
    (mark_name, _), decode, order = _CLAIMS[kind]
    mark, claim = steps
    if mark is not None:
        dead = _either(results, mark)
        log_dead(mark_name.removeprefix("mark_dead_"), dead)
        # Every dead letter is made here, so counted here, once: its last attempt may have
        # been a handler's failure or a worker that died holding it.
        telemetry.count_kind(kind, len(dead), "dead")
    items = _carried(database, decoded(_either(results, claim), decode))
    return stamped(sorted(items, key=order), database)


def _claim(
    database: str,
    kind: DeadKind,
    worker: str,
    limit: int,
    lease: float,
    max_attempts: int | None,
    due: float = 0.0,
) -> Plan[list[Any]]:
    """One kind's claim: one write."""
    seconds = _check_claim(worker, limit, lease, max_attempts)
    batch, flows, token = _claims_batch()
    steps = _add_claim(batch, kind, worker, limit, seconds, max_attempts, due, flows, token)
    _end_claims(batch, flows, worker, (kind,))
    return _claimed(database, kind, (yield batch), steps)


def _work_ahead(row: Sequence[Any]) -> WorkAhead:
    outbox, spawns, timers, next_timer_at, _flows = row
    return WorkAhead(bool(outbox), bool(spawns), bool(timers), next_timer_at)


def _kinds(items: Items) -> list[str]:
    """The signals of work of these items' kinds made claimable again."""
    kinds = ((wakeup.OUTBOX, items.outbox), (wakeup.SPAWN, items.spawns))
    return [signal for signal, seqs in kinds if seqs] + ([wakeup.TIMER] if items.timers else [])


def _moment(value: object) -> float | None:
    """A written time as the store writes it (epoch seconds), else None: a foreign client's
    text or BLOB there is an unknown time, not a row that fails the whole view."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    return None


def _pending_outbox(row: Sequence[Any]) -> PendingOutbox:
    seq, target, source, created, by, until, attempts, error, event = row
    decoded = stored(f"outbox entry {seq}", Event.model_validate_json, event)
    created = _moment(created)
    return PendingOutbox(seq, target, source, created, by, until, attempts, error, decoded)


def _pending_spawn(row: Sequence[Any]) -> PendingSpawn:
    seq, parent, child, root, created, by, until, attempts, error, context = row
    decoded = stored(f"spawn {seq}", loads_dict, context)
    created = _moment(created)
    return PendingSpawn(seq, parent, child, root, created, by, until, attempts, error, decoded)


class Queues(StoreCore):
    """The relays' operations on the queues (`harel_store.store.Store` has them all)."""

    @operation
    def pending_outbox(self, limit: int | None = None) -> Plan[list[OutboxEntry]]:
        """Undelivered emitted events, oldest first: the first ``limit`` (None: all),
        claimed or not; dead letters are not pending (see `dead_letters`)."""
        rows = yield statement("pending_outbox", _limit(limit))
        return stamped([outbox_entry(row) for row in rows], self._conn.key)

    @operation
    def claim_outbox(
        self, worker: str, *, limit: int = 100, lease: float = 30.0, max_attempts: int | None = None
    ) -> Plan[list[OutboxEntry]]:
        """Claim up to ``limit`` undelivered entries for ``worker``: round-robin across flow
        keys (one of each key's oldest before a second of any; first in, first out inside a
        key), honouring the keys' settings (`set_flow`: priority first, pauses, concurrency
        limits and rates, across every worker), in its one transaction.

        No other worker is handed them until the lease (seconds, on the database's clock)
        runs out; then they are claimable again, so a worker that dies loses nothing. Each
        claim of an entry counts one attempt of it. With ``max_attempts``, an entry whose
        attempts reached it is not handed out: this claim makes it a dead letter (logged on
        ``harel_store.relay``; see `dead_letters`). Consume what was delivered with `ack` or
        in the handling commit (``commit(..., acks=...)``); `fail` what was not. One atomic
        write (one round trip remote).
        """
        return (yield from _claim(self._conn.key, "outbox", worker, limit, lease, max_attempts))

    @operation
    def pending_spawns(self, limit: int | None = None) -> Plan[list[SpawnEntry]]:
        """Child executions still to be created, oldest first: the first ``limit`` (None:
        all), claimed or not; dead letters are not pending."""
        rows = yield statement("pending_spawns", _limit(limit))
        return stamped([spawn_entry(row) for row in rows], self._conn.key)

    @operation
    def claim_spawns(
        self, worker: str, *, limit: int = 100, lease: float = 30.0, max_attempts: int | None = None
    ) -> Plan[list[SpawnEntry]]:
        """Claim up to ``limit`` pending spawns for ``worker``, round-robin across flow keys
        and honouring their settings (as `claim_outbox`); consume each child created with
        `ack` or in the child's first commit (``commit(child, [], acks=(spawn,))``)."""
        return (yield from _claim(self._conn.key, "spawn", worker, limit, lease, max_attempts))

    @operation
    def due_timers(self, now: float, limit: int | None = None) -> Plan[list[DueTimer]]:
        """Live timers with ``fire_at <= now``, soonest first: the first ``limit`` (None:
        all), claimed or not."""
        rows = yield statement("due_timers", check_finite(now, "now"), _limit(limit))
        return stamped([due_timer(row) for row in rows], self._conn.key)

    @operation
    def claim_due_timers(
        self,
        worker: str,
        now: float,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> Plan[list[DueTimer]]:
        """Claim up to ``limit`` timers due at ``now`` for ``worker``: round-robin across
        flow keys (each key's soonest first) and honouring their settings (a paused key's
        timers wait, and fire once resumed); leases, attempts and dead letters as
        `claim_outbox`. Fire each one in a commit with
        ``processed_event_id=timer.event_id`` and ``acks=(timer,)``; re-arming a timer
        drops its claim."""
        due = check_finite(now, "now")
        return (yield from _claim(self._conn.key, "timer", worker, limit, lease, max_attempts, due))

    @operation
    def peek_work(self, now: float) -> Plan[WorkAhead]:
        """What a relay could claim at ``now`` (the caller's clock, as `claim_due_timers`
        takes it), claiming nothing: whether an outbox entry, a spawn and a timer due at
        ``now`` are claimable (an item of a paused key, or of one at its limit, is not),
        and the soonest timer not due yet. One read, writing nothing
        (at the primary on an embedded replica: its own copy may lag)."""
        due = check_finite(now, "now")
        row = yield fresh("work_ahead", due)
        if row[4] and any(row[:3]):  # some key has settings: what of it may be claimed now?
            row = yield fresh("work_ahead_flows", due)
        return _work_ahead(row)

    @operation
    def claim_work(
        self,
        worker: str,
        now: float,
        *,
        kinds: Iterable[str] = DEAD_KINDS,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> Plan[ClaimedWork]:
        """The claims of `claim_outbox`, `claim_spawns` and `claim_due_timers` (those of
        ``kinds``: ``"outbox"``, ``"spawn"``, ``"timer"``; each up to ``limit``, timers due
        at ``now``), and what is left to claim after them (`peek_work`), in one write
        transaction: one round trip to a server. A relay's round."""
        due = check_finite(now, "now")
        seconds = _check_claim(worker, limit, lease, max_attempts)
        if isinstance(kinds, str):
            raise TypeError(f"kinds is a collection of kinds, not one string: ({kinds!r},)")
        asked = set(kinds)
        wanted = [k for k in DEAD_KINDS if k in asked]
        if asked - set(DEAD_KINDS) or not wanted:
            raise ValueError(f"kinds must name some of {', '.join(DEAD_KINDS)}, not {asked}")
        batch, flows, token = _claims_batch()
        steps = {
            k: _add_claim(batch, k, worker, limit, seconds, max_attempts, due, flows, token)
            for k in wanted
        }
        _end_claims(batch, flows, worker, wanted)
        plain, honouring = _add_either(batch, "work_ahead", flows, due)
        results = yield batch
        key = self._conn.key
        claimed = {k: _claimed(key, k, results, step) for k, step in steps.items()}
        return ClaimedWork(
            claimed.get("outbox", []),
            claimed.get("spawn", []),
            claimed.get("timer", []),
            _work_ahead(results[honouring if results[flows] else plain]),
        )

    @operation
    def ack(self, items: Iterable[RelayItem]) -> Plan[int]:
        """Consume delivered items, any mix of `OutboxEntry`, `SpawnEntry` and `DueTimer`
        (live or dead letters, whoever holds them), in one transaction; return how many rows
        were removed (an item already gone counts 0). A timer goes only while it is still
        armed at its ``fire_at`` (a re-armed one is spared). TypeError for anything else,
        nothing written."""
        return (yield from self._each(items_of(items, "ack", self._conn.key), "ack"))

    @operation
    def _ack_held(self, worker: str, items: Iterable[RelayItem]) -> Plan[int]:
        """A relay's own ack: `ack` of the items ``worker`` still holds. One its handler
        consumed, re-armed or revived, or that another worker claimed since, is spared."""
        checked = items_of(items, "ack", self._conn.key)
        return (yield from self._each(checked, "ack_held", worker=worker))

    @operation
    def ack_outbox(self, seq: int) -> Plan[None]:
        """Remove a delivered outbox entry (a no-op if it is already gone): `ack` of one."""
        check_int(seq, "seq")
        yield from self._each(Items([], [seq] if seq >= 1 else [], [], []), "ack")

    @operation
    def ack_spawn(self, seq: int) -> Plan[None]:
        """Remove a spawn intent once its child exists (a no-op if it is already gone)."""
        check_int(seq, "seq")
        yield from self._each(Items([], [], [seq] if seq >= 1 else [], []), "ack")

    @operation
    def delete_timer(self, execution_id: str, path: str, fire_at: float) -> Plan[None]:
        """Delete a swept timer only if it still fires at ``fire_at`` (a re-arm survives)."""
        key = (check_id(execution_id, "execution_id"), check_id(path, "path"))
        timer = (*key, check_finite(fire_at, "fire_at"))
        yield from self._each(Items([], [], [], [timer]), "ack")

    @operation
    def fail(
        self, worker: str, items: Iterable[RelayItem], *, error: str, retry_in: float = 0.0
    ) -> Plan[int]:
        """``worker`` could not deliver ``items``: each one it still holds under its lease
        records ``error`` as its last error (bounded and escaped: see `checks.error_text`)
        and becomes claimable ``retry_in`` seconds from now (the database's clock; held by
        nobody meanwhile). Rows it does not hold are left alone. Returns how many rows it
        updated. The attempt was counted by the claim."""
        check_id(worker, "worker")
        checked = items_of(items, "fail", self._conn.key)
        text, delay = error_text(error), check_delay(retry_in, "retry_in")
        return (yield from self._each(checked, "fail", text, delay, worker=worker))

    @operation
    def extend(
        self, worker: str, items: Iterable[RelayItem], *, lease: float
    ) -> Plan[list[RelayItem]]:
        """Renew, to ``lease`` seconds from now (the database's clock), the leases of the
        items ``worker`` still holds; return those items, in the order given (the others
        it lost: their lease ran out, or they were acked, revived or re-armed)."""
        check_id(worker, "worker")
        checked = items_of(items, "extend", self._conn.key)
        seconds = check_timeout(lease, "lease")
        batch = Batch()
        steps = add_each(batch, checked, "extend", seconds, worker=worker)
        if not steps:
            return []
        results = yield batch
        return held_items(checked, steps, results)

    @operation
    def revive(self, items: Iterable[RelayItem]) -> Plan[int]:
        """Give items (dead letters or live rows) a fresh start: attempts 0, no claim,
        claimable at once. Returns how many rows it updated."""
        checked = items_of(items, "revive", self._conn.key)
        revived = yield from self._each(checked, "revive", rerank=True)
        self._notify(_kinds(checked))
        return revived

    @operation
    def release(self, worker: str, items: Iterable[RelayItem]) -> Plan[int]:
        """Hand back items ``worker`` claimed and did not handle (a relay stopping): each
        one it still holds is claimable at once, its claim's attempt given back. Returns how
        many rows it updated."""
        check_id(worker, "worker")
        checked = items_of(items, "release", self._conn.key)
        released = yield from self._each(checked, "release", worker=worker, rerank=True)
        self._notify(_kinds(checked))
        return released

    @staticmethod
    def _each(
        items: Items, verb: str, *args: Any, worker: str | None = None, rerank: bool = False
    ) -> Plan[int]:
        """``verb`` of every item in one write (``args`` after each item's key, as
        `add_each` lays them out); how many rows it changed. ``rerank``: the items come
        back to the queue (a release, a revive): those ranked below where the claims stand
        take their turns from there (rerank_items_*)."""
        batch = Batch()
        if verb in _FREEING:
            add_freed(batch, items)
        if rerank and worker is not None:  # before the release: what it holds, it hands back
            _add_rerank(batch, items, worker)
        steps = add_each(batch, items, verb, *args, worker=worker)
        if not steps:
            return 0
        if rerank and worker is None:  # after a revive: its rows live again
            _add_rerank(batch, items, None)
        results = yield batch
        return sum(results[i] for i in steps)

    @operation
    def attempts_of(self, items: Iterable[RelayItem]) -> Plan[list[int]]:
        """How many times each item was claimed (0: it is gone, or a timer re-armed since),
        in the order given; one read. A relay's backoff grows with it."""
        checked = items_of(items, "attempts_of", self._conn.key)
        if not checked.given:
            return []
        timers = json.dumps([[execution_id, path] for execution_id, path, _ in checked.timers])
        rows = yield statement(
            "attempts_of", json.dumps(checked.outbox), json.dumps(checked.spawns), timers
        )
        return attempts(checked, rows)

    @operation
    def dead_letters(self, *, kind: str | None = None, limit: int = 100) -> Plan[list[DeadLetter]]:
        """The first ``limit`` (1..1000) dead letters, in the order they died (oldest
        first), of one ``kind`` (``"outbox"``, ``"spawn"``, ``"timer"``) or all. A corrupt
        one is logged and skipped."""
        if kind is not None and kind not in DEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DEAD_KINDS)} or None, not {kind!r}")
        rows = yield statement("dead_letters", _page(limit), kind)
        letters = decoded(rows, dead_letter, "skipped")
        stamped([letter.item for letter in letters], self._conn.key)
        return letters

    @operation
    def dead_view(self, *, limit: int = 100) -> Plan[list[DeadView]]:
        """The first ``limit`` (1..1000) dead letters of every kind, oldest first, as an
        operator sees them (`DeadView`): a corrupt one too, with what is wrong with it."""
        rows = yield statement("dead_letters", _page(limit), None)
        views = [_dead_view(row) for row in rows]
        stamped([v.letter.item for v in views if v.letter is not None], self._conn.key)
        return views

    @operation
    def dead_letter(self, kind: str, key: int | tuple[str, str]) -> Plan[DeadLetter | None]:
        """The dead letter of ``kind`` with ``key`` (an outbox entry's or a spawn's seq, a
        timer's ``(execution_id, path)``), or None: there is none (gone, or live)."""
        keyed = _dead_key(kind, key, "dead_outbox_entry", "dead_spawn", "dead_timer")
        if keyed is None:
            return None
        found = yield statement(*keyed)
        if found is None:
            return None
        letter = dead_letter(found)
        stamped([letter.item], self._conn.key)
        return letter

    @operation
    def revive_dead_letter(self, kind: str, key: int | tuple[str, str]) -> Plan[bool]:
        """Revive the dead letter of ``kind`` with ``key`` (as `dead_letter` names it) as
        `revive` does, only while it is dead: True if it was. A row live again meanwhile (and
        maybe claimed since) is left alone, which `revive` of a letter read before would
        not do."""
        keyed = _dead_key(
            kind, key, "revive_dead_outbox_entry", "revive_dead_spawn", "revive_dead_timer"
        )
        if keyed is None:
            return False
        batch = Batch()
        step = batch.add(*keyed)
        seqs = [keyed[1]] if kind != "timer" else []
        items = Items([], seqs if kind == "outbox" else [], seqs if kind == "spawn" else [], [])
        _add_rerank(batch, items, None)  # its turn from where the claims stand, as revive's
        results = yield batch
        if results[step]:
            signal = {"outbox": wakeup.OUTBOX, "spawn": wakeup.SPAWN}.get(kind, wakeup.TIMER)
            self._notify([signal])
        return bool(results[step])

    @operation
    def discard_dead_letter(self, kind: str, key: int | tuple[str, str]) -> Plan[bool]:
        """Remove the dead letter of ``kind`` with ``key`` (as `dead_letter` names it),
        whatever it holds: one whose stored event or context is corrupt (which `dead_letter`
        and `dead_letters` cannot decode) included. True if there was one; a live row with
        that key is left alone."""
        keyed = _dead_key(
            kind, key, "discard_dead_outbox_entry", "discard_dead_spawn", "discard_dead_timer"
        )
        if keyed is None:
            return False
        batch = Batch()
        batch.add(*keyed)
        (removed,) = yield batch
        return bool(removed)

    @operation
    def discard_dead_letters(self, *, kind: str | None = None, limit: int = MAX_PAGE) -> Plan[int]:
        """Remove up to ``limit`` (1..1000) dead letters of each ``kind`` (``"outbox"``,
        ``"spawn"``, ``"timer"``; None: every kind), whatever they hold, corrupt ones
        included (every one `stats` counts); return how many. Call again until 0."""
        if kind is not None and kind not in DEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DEAD_KINDS)} or None, not {kind!r}")
        rows = _page(limit)
        batch = Batch()
        for each, name in _DISCARD_ALL.items():
            if kind in (None, each):
                batch.add(name, rows)
        return sum((yield batch))

    @operation
    def outbox_view(
        self, *, target: str | None = None, source: str | None = None, limit: int = 50
    ) -> Plan[list[PendingOutbox]]:
        """Up to ``limit`` (1..1000) undelivered outbox entries, oldest first, with their
        source, time and claim; only those addressed to ``target`` and/or emitted by
        ``source`` if given. A corrupt entry is logged and skipped."""
        check_id(target, "target", optional=True)
        check_id(source, "source", optional=True)
        _page(limit)
        if target is None:
            rows = yield statement("outbox_view", source, limit)
        else:
            rows = yield statement("outbox_view_target", target, source, limit)
        return decoded(rows, _pending_outbox, "skipped")

    @operation
    def spawns_view(
        self, *, parent: str | None = None, limit: int = 50
    ) -> Plan[list[PendingSpawn]]:
        """Up to ``limit`` (1..1000) pending spawns, oldest first, with their time and claim;
        only those of ``parent`` if given. A corrupt one is logged and skipped."""
        check_id(parent, "parent", optional=True)
        _page(limit)
        if parent is None:
            rows = yield statement("spawns_view", limit)
        else:
            rows = yield statement("spawns_view_parent", parent, limit)
        return decoded(rows, _pending_spawn, "skipped")

    @operation
    def timers_view(
        self, *, due_before: float | None = None, limit: int = 50
    ) -> Plan[list[ArmedTimer]]:
        """Up to ``limit`` (1..1000) armed timers, soonest first, with their claim; only
        those with ``fire_at < due_before`` if given."""
        end = ABOVE_ALL if due_before is None else check_finite(due_before, "due_before")
        rows = yield statement("timers_view", end, _page(limit))
        return [ArmedTimer(*row) for row in rows]
