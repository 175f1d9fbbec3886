"""The store: the contract methods, over any connection (a local file, a remote primary, a
replica).

Each method is a *plan* (see `harel_store.batch`): it checks its arguments, yields the reads
and write batches it needs and decodes their results. A write is one batch that lands whole
or not at all; the connection decides how it travels. The public methods run their plan on
the store's connection (``_run``); `AsyncLibsqlStore` runs the same plans natively on a
remote primary.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import ValidationError

from harel_store import queues, wakeup
from harel_store.awaiting import Awaits, Call, wait_message
from harel_store.batch import Batch, Conflicted, Plan, drive, fresh, statement
from harel_store.checks import (
    check_definition,
    check_delay,
    check_event,
    check_execution,
    check_finite,
    check_id,
    check_int,
    check_max_attempts,
    check_text,
    check_timeout,
    check_trace_max,
    decode_cursor,
    dump_model,
    dumps,
    encode_cursor,
    error_text,
    loads_dict,
    prefix_upper,
    stored,
)
from harel_store.connection import Connection, is_remote, open_libsql, open_sqlite
from harel_store.connection.local import LocalConnection, Synchronous
from harel_store.connection.revision import ensure_schema, revision
from harel_store.errors import CorruptRecord, StoreConflict, StoreError
from harel_store.models import (
    DEAD_KINDS,
    STATUSES,
    ArmedTimer,
    ClaimedWork,
    DeadKind,
    DeadLetter,
    DefinitionRecord,
    DueTimer,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    OutboxEntry,
    PendingOutbox,
    PendingSpawn,
    RelayItem,
    SpawnEntry,
    TimerOp,
    TraceStep,
    WorkAhead,
)
from harel_store.pace import Pacer

DEFAULT_TRACE_MAX = 200
MAX_PAGE = 1000
# The most a retention call may take at once (its one write transaction's size).
MAX_PURGE = 10_000
MAX_FORGET = 100_000
FINAL = frozenset(STATUSES) - {"running"}
# What an execution owns besides its row (purge_<name> in queries.sql).
COMPANIONS = ("processed", "trace", "timers", "outbox", "spawns")
# How many executions' stored summaries a store remembers to pick its CAS write's shape.
REMEMBERED = 10_000
# Bounds that leave a time range open: an empty BLOB sorts above every number (and every
# TEXT); no time on the database's clock is below the most negative float.
ABOVE_ALL = b""
BELOW_ALL_TIMES = -sys.float_info.max

# How often purge_tree reads a tree again after its delete met a member that had moved: a
# tree that busy, or a server that refuses every delete, fails instead of looping.
_PURGE_TRIES = 100

T = TypeVar("T")


def _limit(limit: object) -> int:
    """A read's row limit: None (all: SQLite's -1) or a positive int."""
    if limit is None:
        return -1
    if check_int(limit, "limit") < 1:
        raise ValueError(f"limit must be >= 1 (or None: all), not {limit}")
    return limit  # type: ignore[return-value]


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


def _page(limit: object) -> int:
    """A page's row limit (a listing's, a claim's): 1 to MAX_PAGE."""
    rows = check_int(limit, "limit")
    if not 1 <= rows <= MAX_PAGE:
        raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {rows}")
    return rows


# Each kind's claim: its statements (the dead letters' sweep, the claim), how its rows decode,
# and the order it hands them out in.
_CLAIMS: dict[DeadKind, tuple[tuple[str, str], Any, Any]] = {
    "outbox": (("mark_dead_outbox", "claim_outbox"), queues.outbox_entry, None),
    "spawn": (("mark_dead_spawns", "claim_spawns"), queues.spawn_entry, None),
    "timer": (
        ("mark_dead_timers", "claim_due_timers"),
        queues.due_timer,
        lambda t: (t.fire_at, t.execution_id, t.path),
    ),
}


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
) -> tuple[int | None, int]:
    """Add a claim of ``kind`` to ``batch`` (checked by `_check_claim`): given a
    ``max_attempts``, first the statement that makes dead letters of the rows at it, then
    the UPDATE ... RETURNING of queries.sql; return their steps."""
    names = _CLAIMS[kind][0]
    timer = (due,) if kind == "timer" else ()
    mark = None
    if max_attempts is not None:
        mark = batch.add(names[0], max_attempts, limit, *timer)
    return mark, batch.add(names[1], worker, limit, lease, *timer, max_attempts)


def _claimed(kind: DeadKind, results: Sequence[Any], steps: tuple[int | None, int]) -> list[Any]:
    """What a claim's steps came to: the dead letters it made logged, its rows decoded (a
    corrupt one logged and left claimed) in the order the claim hands them out."""
    (mark_name, _), decode, order = _CLAIMS[kind]
    mark, claim = steps
    if mark is not None:
        queues.log_dead(mark_name.removeprefix("mark_dead_"), results[mark])
    return sorted(queues.decoded(results[claim], decode), key=order)


def _claim(
    kind: DeadKind,
    worker: str,
    limit: int,
    lease: float,
    max_attempts: int | None,
    due: float = 0.0,
) -> Plan[list[Any]]:
    """One kind's claim: one write."""
    seconds = _check_claim(worker, limit, lease, max_attempts)
    batch = Batch()
    steps = _add_claim(batch, kind, worker, limit, seconds, max_attempts, due)
    return _claimed(kind, (yield batch), steps)


def _work_ahead(row: Sequence[Any]) -> WorkAhead:
    outbox, spawns, timers, next_timer_at = row
    return WorkAhead(bool(outbox), bool(spawns), bool(timers), next_timer_at)


def _wait_args(
    execution_id: str, status: str | Iterable[str], timeout: float
) -> tuple[str, frozenset[str], float]:
    """wait_for's arguments, checked: ValueError/TypeError for an unknown status or a timeout
    that is not 0 to a year of seconds."""
    check_id(execution_id, "execution_id")
    statuses = frozenset([status] if isinstance(status, str) else status)
    for s in statuses:
        if s not in STATUSES:
            raise ValueError(f"unknown status {s!r}: expected one of {', '.join(STATUSES)}")
    if not statuses:
        raise ValueError("status must name at least one status")
    return execution_id, statuses, check_delay(timeout, "timeout")


def _purge_companions(batch: Batch, ids: list[str]) -> None:
    """Add what the executions ``ids`` own (each deleted only once its row is gone)."""
    array = json.dumps(ids)
    for name in COMPANIONS:
        batch.add(f"purge_{name}", array)


def _purge_batch(members: list[tuple[str, int]]) -> Batch:
    """The executions (id, version), whole trees, deleted all together under their version
    CAS, or none (`Conflicted`), with everything they own; also none when one of them has
    gained a child since they were read (it would be left without its parent)."""
    ids = [execution_id for execution_id, _ in members]
    batch = Batch()
    batch.guard("purge_executions", json.dumps(members), rows=len(members))
    batch.guard("purge_children_left", json.dumps(ids), rows=0)
    _purge_companions(batch, ids)
    return batch


def _ripe_trees(walk: str, before: float, limit: int) -> Plan[list[tuple[str, int]]]:
    """The members (id, version) of the first trees that ``walk`` (finished_trees or
    orphan_trees) reads whose every member is final and last updated before ``before``, up
    to ``limit`` of them (a larger tree alone); none when no such tree is left."""
    window = limit
    while True:
        trees: dict[str, list[tuple[str, int, int]]] = {}
        for root, execution_id, version, ripe in (yield statement(walk, before, window)):
            trees.setdefault(root, []).append((execution_id, version, ripe))
        chosen: list[tuple[str, int]] = []
        for tree in trees.values():
            if not all(ripe for _, _, ripe in tree):
                continue  # a member running or updated since the horizon: the tree stays
            if chosen and len(chosen) + len(tree) > limit:
                break
            chosen.extend((execution_id, version) for execution_id, version, _ in tree)
        if chosen or len(trees) < window:
            return chosen
        window *= 2  # every tree read must stay: read past them


def _kinds(items: queues.Items) -> list[str]:
    """The signals of work of these items' kinds made claimable again."""
    kinds = ((wakeup.OUTBOX, items.outbox), (wakeup.SPAWN, items.spawns))
    return [signal for signal, seqs in kinds if seqs] + ([wakeup.TIMER] if items.timers else [])


def _batch_limit(limit: object, most: int) -> int:
    """A retention call's limit: 1 to ``most``."""
    rows = check_int(limit, "limit")
    if not 1 <= rows <= most:
        raise ValueError(f"limit must be between 1 and {most}, not {rows}")
    return rows


def _pending_outbox(row: Sequence[Any]) -> PendingOutbox:
    seq, target, source, created, by, until, attempts, error, event = row
    decoded = stored(f"outbox entry {seq}", Event.model_validate_json, event)
    return PendingOutbox(seq, target, source, created, by, until, attempts, error, decoded)


def _pending_spawn(row: Sequence[Any]) -> PendingSpawn:
    seq, parent, child, root, created, by, until, attempts, error, context = row
    decoded = stored(f"spawn {seq}", loads_dict, context)
    return PendingSpawn(seq, parent, child, root, created, by, until, attempts, error, decoded)


class StoreStats(NamedTuple):
    """What `Store.stats` counts (``*_at`` and ``now``: epoch seconds, the times of rows on
    the database's clock, None if unknown; ``claimed_*``: rows a relay holds under a lease
    that has not run out)."""

    schema_revision: str | None
    executions: dict[str, int]
    pending_outbox: int
    pending_spawns: int
    timers_due: int
    timers_future: int
    oldest_outbox_at: float | None
    claimed_outbox: int  # of pending_outbox, those under a live lease (claim_outbox)
    claimed_spawns: int
    claimed_timers: int
    oldest_spawn_at: float | None  # when the oldest pending spawn was written
    soonest_timer_at: float | None  # the earliest fire_at of any armed timer
    now: float  # the database's clock as it read these: the ages of the *_at times
    dead_outbox: int  # dead letters (0006), not counted in pending_outbox
    dead_spawns: int
    dead_timers: int  # not counted in timers_due or timers_future


def checked(connection: Connection, migrate: bool) -> Connection:
    """The connection, its schema at head (migrated there if ``migrate``); closed on failure."""
    try:
        drive(connection.execute, ensure_schema(connection.where, migrate))
    except BaseException:
        connection.close()
        raise
    return connection


class Store:
    """The store core, shared by every driver. Safe to share between threads."""

    def __init__(
        self, connection: Connection, *, trace_max: int | None = DEFAULT_TRACE_MAX
    ) -> None:
        self._conn = connection
        self._trace_max = check_trace_max(trace_max)
        # Execution id -> (version, status, parent_id) as last loaded or written here, the
        # oldest forgotten first. Only a hint: the CAS write checks what it leaves unwritten.
        self._stored: dict[str, tuple[int, str, str | None]] = {}
        self._stored_lock = threading.Lock()
        self._awaits = Awaits(self, connection.where)
        # How many items a retention write takes (harel_store.pace), and the file's
        # data_version at the previous one.
        self._pacer = Pacer()
        self._seen_version: int | None = None

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._conn.where!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, plan: Plan[T]) -> T:
        return drive(self._conn.execute, plan)

    @property
    def trace_max(self) -> int | None:
        """How many trace steps each execution keeps, the oldest dropped first (None or 0:
        every step); ValueError/TypeError for anything but a non-negative int or None."""
        return self._trace_max

    @trace_max.setter
    def trace_max(self, value: int | None) -> None:
        self._trace_max = check_trace_max(value)

    @property
    def database_key(self) -> str:
        """What tells this store's database apart in this process (its file, or its
        server's URL): the relays of one database wait on its signal (`harel_store.wakeup`)."""
        return self._conn.key

    def _notify(self, signals: Iterable[str]) -> None:
        """Tell the waiters of this database in this process what changed (`wakeup`)."""
        wakeup.notify(self._conn.key, signals)

    def _waiter(self) -> wakeup.Waiter:
        """A subscription to this database's signals: this process's writes, and every other
        process's through the database's watch (started with the first subscriber)."""
        return wakeup.Waiter(self._conn.key, self._conn.watch)

    @property
    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (``HEAD`` once the store is open)."""
        return self._run(revision())

    # --- writes ---

    def save(self, exe: Execution) -> None:
        """Persist ``exe`` alone under the version CAS and bump ``exe.version``.

        Raises StoreConflict if another writer moved it (``exe.version`` is left as it was).
        """
        self._run(self._save(exe))

    def _save(self, exe: Execution) -> Plan[None]:
        yield from self._commit(exe, [])

    def commit(
        self,
        exe: Execution,
        emits: Iterable[tuple[str | None, Event]],
        processed_event_id: str | None = None,
        timers: Iterable[TimerOp] = (),
        spawns: Iterable[tuple[str, str, dict[str, Any]]] = (),
        trace: dict[str, Any] | None = None,
        *,
        acks: Iterable[RelayItem] = (),
    ) -> list[int]:
        """Persist one event's whole effect in one transaction; return the outbox seqs.

        The execution (version CAS), its emitted events, the dedupe marker of the handled
        event, timer changes, child spawns and a trace step land together or not at all,
        and with them the relay items in ``acks`` this commit consumes (`OutboxEntry`,
        `SpawnEntry`, `DueTimer`, removed as `ack` removes them; one already gone is no
        error): delivery and ack in one transaction.
        Raises StoreConflict when the CAS fails (nothing written, nothing acked),
        ValueError/TypeError for bad arguments (nothing written), OutcomeUnknown when a
        remote write got no answer, StoreError for anything the database refuses. On any
        failure ``exe.version`` is restored.
        """
        return self._run(
            self._commit(exe, emits, processed_event_id, timers, spawns, trace, acks=acks)
        )

    def _commit(
        self,
        exe: Execution,
        emits: Iterable[tuple[str | None, Event]],
        processed_event_id: str | None = None,
        timers: Iterable[TimerOp] = (),
        spawns: Iterable[tuple[str, str, dict[str, Any]]] = (),
        trace: dict[str, Any] | None = None,
        *,
        acks: Iterable[RelayItem] = (),
    ) -> Plan[list[int]]:
        if not isinstance(exe, Execution):
            raise TypeError(f"exe must be an Execution, not {type(exe).__name__}")
        check_execution(exe)
        outbox = []
        for item in emits:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Event)):
                raise TypeError(f"each emit must be a (target_id | None, Event) pair, not {item!r}")
            check_event(item[1])
            outbox.append(
                (
                    check_id(item[0], "emit target_id", optional=True),
                    dump_model(item[1], "emitted event"),
                )
            )
        check_id(processed_event_id, "processed_event_id", optional=True)
        timer_ops = list(timers)
        for op in timer_ops:  # checked again: TimerOp.model_construct skips its validation
            if not isinstance(op, TimerOp):
                raise TypeError(f"each timer must be a TimerOp, not {type(op).__name__}")
            check_id(op.path, "timer path")
            if op.action == "schedule":
                check_finite(op.fire_at, "timer fire_at")
            elif op.action != "cancel":
                raise ValueError(f"unknown timer action {op.action!r}: schedule or cancel")
        spawn_rows: list[tuple[str, str, str]] = []
        for spawn in spawns:
            if not (isinstance(spawn, tuple) and len(spawn) == 3):
                raise TypeError(f"each spawn must be (child_id, root_path, context), not {spawn!r}")
            child_id, root_path, context = spawn
            spawn_rows.append(
                (
                    check_id(child_id, "spawn child_id"),
                    check_id(root_path, "spawn root_path"),
                    dumps(context, "spawn context"),
                )
            )
        trace_json = None if trace is None else dumps(trace, "trace")
        consumed = queues.items_of(acks, "acks") if acks else None
        old = exe.version
        try:
            exe.version = old + 1
            data = dump_model(exe, "execution")
            summary = (exe.status, exe.outcome, exe.active_path, exe.parent_id, exe.finished_at)
            batch = Batch()
            if old == 0:  # new: no row may exist yet
                cas = "insert_execution"
                batch.guard(cas, exe.id, exe.definition_id, data, exe.version, *summary)
            else:
                cas = self._cas_shape(exe, old)
                update = (exe.id, data, exe.version, old, *summary)
                batch.guard(cas, *update)
            batch.on_conflict("execution_version", exe.id)
            # The acks consume the items as they were before this commit, so what it writes
            # itself stays: a timer it re-arms, even at the time it fired at.
            if consumed is not None:
                queues.add_each(batch, consumed, "ack")
            emitted = [
                batch.add("insert_outbox", target, exe.id, event) for target, event in outbox
            ]
            if processed_event_id is not None:
                batch.add("mark_processed", exe.id, processed_event_id)
                batch.add("note_marker", exe.id, processed_event_id)
            for row in spawn_rows:
                batch.add("insert_spawn", exe.id, *row)
            for op in timer_ops:
                if op.action == "schedule":
                    batch.add("schedule_timer", exe.id, op.path, op.fire_at)
                else:
                    batch.add("cancel_timer", exe.id, op.path)
            if trace_json is not None:
                self._add_trace(batch, exe.id, trace_json)
            try:
                results = yield batch
            except Conflicted as conflict:
                if conflict.found != old or cas in ("insert_execution", "update_execution"):
                    raise
                # The row is at the expected version but its summary is not the one this
                # store remembered (purged and made anew elsewhere, say): write all of it.
                batch.steps[0] = statement("update_execution", *update)
                results = yield batch
        except Conflicted as conflict:
            exe.version = old
            raise StoreConflict(exe.id, expected=old, found=conflict.found) from None
        except BaseException:
            exe.version = old
            raise
        self._remember(exe)
        if consumed is not None:
            queues.consumed(self._conn.key, consumed)
        signals = [wakeup.EXECUTION]
        if outbox:
            signals.append(wakeup.OUTBOX)
        if spawn_rows:
            signals.append(wakeup.SPAWN)
        if any(op.action == "schedule" for op in timer_ops):
            signals.append(wakeup.TIMER)
        self._notify(signals)
        return [results[i] for i in emitted]

    def _cas_shape(self, exe: Execution, old: int) -> str:
        """The CAS write (a query of queries.sql) that names only the indexed summary
        columns ``exe`` changes from the stored version ``old``, as far as this store knows."""
        with self._stored_lock:
            known = self._stored.get(exe.id)
        if known is None or known[0] != old or known[2] != exe.parent_id:
            return "update_execution"
        return "update_execution_data" if known[1] == exe.status else "update_execution_status"

    def _remember(self, exe: Execution) -> None:
        with self._stored_lock:
            self._stored.pop(exe.id, None)  # re-inserted last: the most recently used
            self._stored[exe.id] = (exe.version, exe.status, exe.parent_id)
            if len(self._stored) > REMEMBERED:
                del self._stored[next(iter(self._stored))]

    def _forget(self, execution_ids: Iterable[str]) -> None:
        with self._stored_lock:
            for execution_id in execution_ids:
                self._stored.pop(execution_id, None)

    def _add_trace(self, batch: Batch, execution_id: str, entry: str) -> None:
        index = batch.add("append_trace", execution_id, entry)
        keep = self._trace_max
        if keep:  # a ring not yet full has nothing to trim
            batch.add("trim_trace", execution_id, keep, only_if=(index, keep))

    def append_trace(self, execution_id: str, entry: dict[str, Any]) -> None:
        """Append one step to an execution's trace ring on its own (trimmed to trace_max)."""
        self._run(self._append_trace(execution_id, entry))

    def _append_trace(self, execution_id: str, entry: dict[str, Any]) -> Plan[None]:
        check_id(execution_id, "execution_id")
        batch = Batch()
        self._add_trace(batch, execution_id, dumps(entry, "trace entry"))
        yield batch

    def purge(self, execution_id: str, expected_version: int) -> bool:
        """Delete an execution at ``expected_version`` and everything that belongs to it.

        Returns True if it was deleted; False if it has moved on (nothing is deleted) or does
        not exist (leftovers of an earlier interrupted purge are cleared).
        """
        return self._run(self._purge(execution_id, expected_version))

    def _purge(self, execution_id: str, expected_version: int) -> Plan[bool]:
        check_id(execution_id, "execution_id")
        check_int(expected_version, "expected_version")
        batch = Batch()
        batch.add("purge_executions", json.dumps([[execution_id, expected_version]]))
        _purge_companions(batch, [execution_id])
        deleted, *_ = yield batch
        self._forget([execution_id])
        return bool(deleted)

    def publish_definition(self, record: DefinitionRecord) -> DefinitionRecord:
        """Store a definition version unless one is stored already; return what is stored."""
        return self._run(self._publish_definition(record))

    def _publish_definition(self, record: DefinitionRecord) -> Plan[DefinitionRecord]:
        if not isinstance(record, DefinitionRecord):
            raise TypeError(f"record must be a DefinitionRecord, not {type(record).__name__}")
        check_definition(record)
        batch = Batch()
        batch.add(
            "publish_definition",
            record.definition_id,
            record.version,
            record.digest,
            dumps(record.source, "definition source"),
            record.published_at,
        )
        batch.add("stored_definition", record.definition_id, record.version)
        _, row = yield batch
        return self._definition(row)

    # --- retention ---

    def clock(self) -> float:
        """The database's clock now, epoch seconds: the clock of every time the store writes
        (``updated_at``, a marker's time, a lease), so the one to take a horizon from."""
        return self._run(self._clock())

    @staticmethod
    def _clock() -> Plan[float]:
        return float((yield statement("clock")))

    def purge_finished(self, before: float, *, limit: int = 1000) -> int:
        """Remove up to ``limit`` (1..10000) finished, failed or cancelled executions last
        updated before ``before`` (epoch seconds, the database's clock), each with everything
        it owns; return how many. A child goes only with its root, and a tree only whole,
        when every member is final and last updated before ``before`` (a tree larger than
        ``limit`` goes whole, alone in its call). An execution whose parent row is gone is
        the root of its own tree. One short write transaction; call again until 0. On a
        local file the store sizes each call's transaction by time, not only by ``limit``
        (about 10 ms of write lock, 2 ms while another connection writes the file), so a
        call may remove fewer than ``limit`` while more are due.
        """
        return self._run(self._purge_finished(before, limit=limit))

    def _purge_finished(self, before: float, *, limit: int = 1000) -> Plan[int]:
        before = check_finite(before, "before")
        limit = _batch_limit(limit, MAX_PURGE)
        limit = yield from self._retention_size("executions", limit)
        for _ in range(_PURGE_TRIES):
            chosen = yield from _ripe_trees("finished_trees", before, limit)
            if not chosen:  # the roots' trees are done (or must wait): the orphans' then
                chosen = yield from _ripe_trees("orphan_trees", before, limit)
            if not chosen:
                return 0
            started = time.perf_counter()
            try:
                yield _purge_batch(chosen)
            except Conflicted:  # a member moved since it was read: read them again
                continue
            yield from self._retention_wrote("executions", len(chosen), started)
            self._forget(execution_id for execution_id, _ in chosen)
            return len(chosen)
        raise StoreError(
            f"purge_finished: the executions it read changed under each of {_PURGE_TRIES} tries"
        )

    def forget_processed(self, before: float, *, limit: int = 10000) -> int:
        """Remove up to ``limit`` (1..100000) dedupe markers recorded before ``before``
        (epoch seconds, the database's clock); return how many. One short write
        transaction; call again until 0. A marker forgotten no longer stops its event from
        being handled again: keep markers longer than any redelivery can come."""
        return self._run(self._forget_processed(before, limit=limit))

    def _forget_processed(self, before: float, *, limit: int = 10000) -> Plan[int]:
        before = check_finite(before, "before")
        limit = _batch_limit(limit, MAX_FORGET)
        limit = yield from self._retention_size("markers", limit)
        batch = Batch()
        forgot = batch.add("forget_markers", before, limit)
        batch.add("renew_markers_since", before, limit)
        started = time.perf_counter()
        results = yield batch
        removed: int = results[forgot]
        yield from self._retention_wrote("markers", removed, started)
        return removed

    def purge_dead(self, before: float, *, limit: int = 1000) -> int:
        """Remove up to ``limit`` (1..100000) dead letters (outbox entries, spawns, timers)
        that died before ``before`` (epoch seconds, the database's clock), oldest first;
        return how many. Call again until 0."""
        return self._run(self._purge_dead(before, limit=limit))

    def _purge_dead(self, before: float, *, limit: int = 1000) -> Plan[int]:
        before = check_finite(before, "before")
        left = _batch_limit(limit, MAX_FORGET)
        total = 0
        for kind in ("outbox", "spawns", "timers"):  # one short transaction each
            size = yield from self._retention_size("dead", left)
            batch = Batch()
            batch.add(f"purge_dead_{kind}", before, size)
            started = time.perf_counter()
            (removed,) = yield batch
            yield from self._retention_wrote("dead", removed, started)
            total += removed
            left -= removed
            if removed == size:  # as many as it could take: more may be left (call again)
                break
        return total

    def _retention_size(self, kind: str, limit: int) -> Plan[int]:
        """How many items of ``kind`` the next retention write takes, up to ``limit``: on a
        local file, what its time budget holds (`harel_store.pace`)."""
        local = isinstance(self._conn, LocalConnection)
        others_wrote = False
        if local:
            version = yield statement("data_version")
            others_wrote, self._seen_version = version != self._seen_version, version
        return self._pacer.size(kind, limit, local=local, others_wrote=others_wrote)

    def _retention_wrote(self, kind: str, items: int, started: float) -> Plan[None]:
        """After a retention write begun at ``started`` (perf_counter) removed ``items``: on
        a local file, time it, and write the pages it left in the WAL back to the file."""
        if items and isinstance(self._conn, LocalConnection):
            self._pacer.took(kind, items, time.perf_counter() - started)
            yield statement("checkpoint")

    def retention_counts(
        self,
        *,
        finished_before: float | None = None,
        markers_before: float | None = None,
        dead_before: float | None = None,
    ) -> tuple[int, int, int]:
        """What `purge_finished`, `forget_processed` and `purge_dead` would remove, called
        until 0 with these times (None: that kind is not counted): the executions, the
        markers and the dead letters. One read, to the end of each walk."""
        return self._run(
            self._retention_counts(
                finished_before=finished_before,
                markers_before=markers_before,
                dead_before=dead_before,
            )
        )

    @staticmethod
    def _retention_counts(
        *,
        finished_before: float | None = None,
        markers_before: float | None = None,
        dead_before: float | None = None,
    ) -> Plan[tuple[int, int, int]]:
        times = [
            None if at is None else check_finite(at, name)
            for at, name in (
                (finished_before, "finished_before"),
                (markers_before, "markers_before"),
                (dead_before, "dead_before"),
            )
        ]
        executions, markers, dead = yield statement("retention_counts", *times)
        return executions, markers, dead

    # --- reads ---

    def _execution(self, execution_id: str, data: str, version: int) -> Execution:
        """The stored record at its ``version`` column: the CAS compares the column, which a
        foreign client may have moved without the JSON's copy (a load that took the JSON's
        would conflict on every commit, and reload the same stale version, for ever)."""
        try:
            exe = Execution.model_validate_json(data)
            if exe.version != version:
                exe.version = version
        except ValidationError as exc:
            raise CorruptRecord(
                f"execution {execution_id!r} has a corrupt stored record: {exc}"
            ) from exc
        self._remember(exe)
        return exe

    def load(self, execution_id: str) -> Execution | None:
        """The execution stored under ``execution_id``, or None."""
        return self._run(self._load(execution_id))

    def _load(self, execution_id: str) -> Plan[Execution | None]:
        check_id(execution_id, "execution_id")
        row = yield statement("load_execution", execution_id)
        return None if row is None else self._execution(execution_id, *row)

    def load_for_event(self, execution_id: str, event_id: str) -> tuple[Execution | None, bool]:
        """The execution and whether ``event_id`` was already processed, in one round trip."""
        return self._run(self._load_for_event(execution_id, event_id))

    def _load_for_event(
        self, execution_id: str, event_id: str
    ) -> Plan[tuple[Execution | None, bool]]:
        check_id(execution_id, "execution_id")
        check_id(event_id, "event_id")
        data, version, processed = yield statement("load_for_event", execution_id, event_id)
        if data is None:
            return None, False
        return self._execution(execution_id, data, version), bool(processed)

    def is_processed(self, execution_id: str, event_id: str) -> bool:
        """Whether the execution already handled the event ``event_id``."""
        return self._run(self._is_processed(execution_id, event_id))

    def _is_processed(self, execution_id: str, event_id: str) -> Plan[bool]:
        check_id(execution_id, "execution_id")
        check_id(event_id, "event_id")
        return (yield statement("is_processed", execution_id, event_id)) is not None

    def list_executions(
        self,
        *,
        definition_id: str | None = None,
        status: str | Iterable[str] | None = None,
        roots_only: bool = False,
        limit: int = 50,
        cursor: str | None = None,
        updated_after: float | None = None,
        updated_before: float | None = None,
        newest_first: bool = False,
        id_prefix: str | None = None,
    ) -> ExecutionPage:
        """One page of execution summaries; pass ``next_cursor`` for the next.

        Ordered by id, or with ``newest_first`` by ``(updated_at, id)`` descending, the
        executions last written before migration 0005 (``updated_at`` None) last. A time
        window keeps the rows with ``updated_after <= updated_at < updated_before`` (either
        bound optional; a row without a time is in none) and is read in update order: oldest
        first, or newest first with ``newest_first``. ``status`` is one status or several
        (any of). ``id_prefix`` keeps the ids that start with it (no character is special):
        a range of the index in id order, checked on each row read in update order. A cursor
        is valid only for the same order. Raises ValueError for an unknown status, a limit
        outside 1..1000, a bound that is not finite, or a cursor this method did not make for
        this order; TypeError for an argument of the wrong type.
        """
        return self._run(
            self._list_executions(
                definition_id=definition_id,
                status=status,
                roots_only=roots_only,
                limit=limit,
                cursor=cursor,
                updated_after=updated_after,
                updated_before=updated_before,
                newest_first=newest_first,
                id_prefix=id_prefix,
            )
        )

    def _list_executions(
        self,
        *,
        definition_id: str | None = None,
        status: str | Iterable[str] | None = None,
        roots_only: bool = False,
        limit: int = 50,
        cursor: str | None = None,
        updated_after: float | None = None,
        updated_before: float | None = None,
        newest_first: bool = False,
        id_prefix: str | None = None,
    ) -> Plan[ExecutionPage]:
        check_id(definition_id, "definition_id", optional=True)
        if id_prefix is not None and not isinstance(id_prefix, str):
            raise TypeError(f"id_prefix must be a string, not {type(id_prefix).__name__}")
        if id_prefix is not None:
            check_text(id_prefix, "id_prefix")
        first, beyond = ("", ABOVE_ALL) if not id_prefix else (id_prefix, prefix_upper(id_prefix))
        for flag, value in (("roots_only", roots_only), ("newest_first", newest_first)):
            if not isinstance(value, bool):
                raise TypeError(f"{flag} must be a bool, not {type(value).__name__}")
        low = None if updated_after is None else check_finite(updated_after, "updated_after")
        high = None if updated_before is None else check_finite(updated_before, "updated_before")
        window = low is not None or high is not None
        order = "newest" if newest_first else "oldest" if window else "id"
        statuses = [status] if isinstance(status, str) else None if status is None else list(status)
        for s in statuses or ():
            if s not in STATUSES:
                raise ValueError(f"unknown status {s!r}: expected one of {', '.join(STATUSES)}")
        _page(limit)
        after, at = ("", None) if cursor is None else decode_cursor(cursor, order)
        # One named query per filter shape, each index-backed; statuses fill four slots
        # (None: unused), so several statuses still cost one LIMITed seek each.
        slots: list[str | None] = list(dict.fromkeys(STATUSES if statuses is None else statuses))
        slots += [None] * (len(STATUSES) - len(slots))
        params: tuple[Any, ...]
        by_time = (definition_id, int(roots_only), limit + 1, first, beyond)
        # Ids from `first` on: past the cursor's id, the least string above it is that id
        # followed by a NUL (SQLite orders TEXT by its bytes).
        lowest = first if cursor is None else max(first, after + "\0")
        if order == "newest":
            # The keyset (start, after) begins at the window's exclusive end, never above it
            # (a cursor from a wider window); a cursor without a time is past every timed row,
            # and then only the untimed rows below its id are left.
            start: float | bytes | None = at
            if cursor is None or (high is not None and at is not None and at > high):
                start, after = (ABOVE_ALL if high is None else high), ""
            untimed = "" if window else ABOVE_ALL if start is not None else after
            low = BELOW_ALL_TIMES if low is None else low
            name, params = "list_newest", (low, start, after, untimed, *slots, *by_time)
        elif order == "oldest":
            if cursor is None or (low is not None and at is not None and at < low):
                at, after = (BELOW_ALL_TIMES if low is None else low), ""
            end = ABOVE_ALL if high is None else high
            name, params = "list_oldest", (end, at, after, *slots, *by_time)
        elif definition_id is not None:
            name = "list_roots_by_definition" if roots_only else "list_by_definition"
            params = (lowest, definition_id, *slots, limit + 1, beyond)
        elif roots_only:
            name, params = "list_roots", (lowest, *slots, limit + 1, beyond)
        elif statuses is not None:
            name, params = "list_by_status", (lowest, *slots, limit + 1, beyond)
        else:
            name, params = "list_executions", (lowest, limit + 1, beyond)
        rows = yield statement(name, *params)
        items = self._summaries(rows[:limit])
        if len(rows) <= limit:
            return ExecutionPage(items=items)
        last = items[-1]
        return ExecutionPage(
            items=items, next_cursor=encode_cursor(last.id, order, last.updated_at)
        )

    def ids_with_prefix(self, prefix: str) -> list[str]:
        """Every execution id that starts with ``prefix``, sorted; no character is special."""
        return self._run(self._ids_with_prefix(prefix))

    def _ids_with_prefix(self, prefix: str) -> Plan[list[str]]:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        check_text(prefix, "prefix")
        rows = yield statement("ids_in_range", prefix, prefix_upper(prefix))
        return [row[0] for row in rows]

    # --- the relays' queues (what harel_store.queues writes and decodes) ---

    def pending_outbox(self, limit: int | None = None) -> list[OutboxEntry]:
        """Undelivered emitted events, oldest first: the first ``limit`` (None: all),
        claimed or not; dead letters are not pending (see `dead_letters`)."""
        return self._run(self._pending_outbox(limit))

    @staticmethod
    def _pending_outbox(limit: int | None = None) -> Plan[list[OutboxEntry]]:
        rows = yield statement("pending_outbox", _limit(limit))
        return [queues.outbox_entry(row) for row in rows]

    def claim_outbox(
        self,
        worker: str,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[OutboxEntry]:
        """Claim up to ``limit`` undelivered entries for ``worker``, oldest first.

        No other worker is handed them until the lease (seconds, on the database's clock)
        runs out; then they are claimable again, so a worker that dies loses nothing. Each
        claim of an entry counts one attempt of it. With ``max_attempts``, an entry whose
        attempts reached it is not handed out: this claim makes it a dead letter (logged on
        ``harel_store.relay``; see `dead_letters`). Consume what was delivered with `ack` or
        in the handling commit (``commit(..., acks=...)``); `fail` what was not. One atomic
        write (one round trip remote).
        """
        return self._run(
            self._claim_outbox(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        )

    @staticmethod
    def _claim_outbox(
        worker: str, *, limit: int = 100, lease: float = 30.0, max_attempts: int | None = None
    ) -> Plan[list[OutboxEntry]]:
        return (yield from _claim("outbox", worker, limit, lease, max_attempts))

    def outbox_for(self, execution_id: str) -> list[OutboxEntry]:
        """Undelivered outbox entries addressed to the execution, oldest first."""
        return self._run(self._outbox_for(execution_id))

    @staticmethod
    def _outbox_for(execution_id: str) -> Plan[list[OutboxEntry]]:
        check_id(execution_id, "execution_id")
        rows = yield statement("outbox_for", execution_id)
        return [queues.outbox_entry(row) for row in rows]

    def pending_spawns(self, limit: int | None = None) -> list[SpawnEntry]:
        """Child executions still to be created, oldest first: the first ``limit`` (None:
        all), claimed or not; dead letters are not pending."""
        return self._run(self._pending_spawns(limit))

    @staticmethod
    def _pending_spawns(limit: int | None = None) -> Plan[list[SpawnEntry]]:
        rows = yield statement("pending_spawns", _limit(limit))
        return [queues.spawn_entry(row) for row in rows]

    def claim_spawns(
        self,
        worker: str,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[SpawnEntry]:
        """Claim up to ``limit`` pending spawns for ``worker``, oldest first (as
        `claim_outbox`); consume each child created with `ack` or in the child's first
        commit (``commit(child, [], acks=(spawn,))``)."""
        return self._run(
            self._claim_spawns(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        )

    @staticmethod
    def _claim_spawns(
        worker: str, *, limit: int = 100, lease: float = 30.0, max_attempts: int | None = None
    ) -> Plan[list[SpawnEntry]]:
        return (yield from _claim("spawn", worker, limit, lease, max_attempts))

    def due_timers(self, now: float, limit: int | None = None) -> list[DueTimer]:
        """Live timers with ``fire_at <= now``, soonest first: the first ``limit`` (None:
        all), claimed or not."""
        return self._run(self._due_timers(now, limit))

    @staticmethod
    def _due_timers(now: float, limit: int | None = None) -> Plan[list[DueTimer]]:
        rows = yield statement("due_timers", check_finite(now, "now"), _limit(limit))
        return [queues.due_timer(row) for row in rows]

    def claim_due_timers(
        self,
        worker: str,
        now: float,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> list[DueTimer]:
        """Claim up to ``limit`` timers due at ``now`` for ``worker``, soonest first (leases,
        attempts and dead letters as `claim_outbox`). Fire each one in a commit with
        ``processed_event_id=timer.event_id`` and ``acks=(timer,)``; re-arming a timer
        drops its claim."""
        return self._run(
            self._claim_due_timers(worker, now, limit=limit, lease=lease, max_attempts=max_attempts)
        )

    @staticmethod
    def _claim_due_timers(
        worker: str,
        now: float,
        *,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> Plan[list[DueTimer]]:
        due = check_finite(now, "now")
        return (yield from _claim("timer", worker, limit, lease, max_attempts, due))

    def peek_work(self, now: float) -> WorkAhead:
        """What a relay could claim at ``now`` (the caller's clock, as `claim_due_timers`
        takes it), claiming nothing: whether an outbox entry, a spawn and a timer due at
        ``now`` are claimable, and the soonest timer not due yet. One read, writing nothing
        (at the primary on an embedded replica: its own copy may lag)."""
        return self._run(self._peek_work(now))

    @staticmethod
    def _peek_work(now: float) -> Plan[WorkAhead]:
        return _work_ahead((yield fresh("work_ahead", check_finite(now, "now"))))

    def claim_work(
        self,
        worker: str,
        now: float,
        *,
        kinds: Iterable[str] = DEAD_KINDS,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> ClaimedWork:
        """The claims of `claim_outbox`, `claim_spawns` and `claim_due_timers` (those of
        ``kinds``: ``"outbox"``, ``"spawn"``, ``"timer"``; each up to ``limit``, timers due
        at ``now``), and what is left to claim after them (`peek_work`), in one write
        transaction: one round trip to a server. A relay's round."""
        return self._run(
            self._claim_work(
                worker, now, kinds=kinds, limit=limit, lease=lease, max_attempts=max_attempts
            )
        )

    @staticmethod
    def _claim_work(
        worker: str,
        now: float,
        *,
        kinds: Iterable[str] = DEAD_KINDS,
        limit: int = 100,
        lease: float = 30.0,
        max_attempts: int | None = None,
    ) -> Plan[ClaimedWork]:
        due = check_finite(now, "now")
        seconds = _check_claim(worker, limit, lease, max_attempts)
        if isinstance(kinds, str):
            raise TypeError(f"kinds is a collection of kinds, not one string: ({kinds!r},)")
        asked = set(kinds)
        wanted = [k for k in DEAD_KINDS if k in asked]
        if asked - set(DEAD_KINDS) or not wanted:
            raise ValueError(f"kinds must name some of {', '.join(DEAD_KINDS)}, not {asked}")
        batch = Batch()
        steps = {k: _add_claim(batch, k, worker, limit, seconds, max_attempts, due) for k in wanted}
        ahead = batch.add("work_ahead", due)
        results = yield batch
        claimed = {k: _claimed(k, results, step) for k, step in steps.items()}
        return ClaimedWork(
            claimed.get("outbox", []),
            claimed.get("spawn", []),
            claimed.get("timer", []),
            _work_ahead(results[ahead]),
        )

    def wait_for(
        self,
        execution_id: str,
        *,
        status: str | Iterable[str] = ("finished", "failed", "cancelled"),
        timeout: float,
    ) -> Execution:
        """The execution as soon as it exists with a status in ``status`` (one status or
        several), waiting up to ``timeout`` seconds: woken by every commit to the database,
        this process's or another's (a local file's writes, a server's change
        notifications), and looking at least every second, never in a busy loop. The
        calls of a store waiting at once share one read a change. Raises TimeoutError (the
        builtin) when the time is up, ValueError/TypeError for an unknown status or a
        timeout that is not 0 to a year of seconds, StoreError if the database fails."""
        execution_id, statuses, seconds = _wait_args(execution_id, status, timeout)
        deadline = time.monotonic() + seconds
        found = self._run(self._awaited({execution_id: statuses}))
        if execution_id in found:
            return found[execution_id]
        call = Call(execution_id, statuses)
        self._awaits.add(call)
        try:
            if not call.done.wait(max(deadline - time.monotonic(), 0.0)):
                raise TimeoutError(wait_message(execution_id, statuses, seconds))
            return call.outcome()
        finally:
            self._awaits.remove(call)

    def _wanted_now(self, wanted: dict[str, frozenset[str]]) -> dict[str, Execution]:
        """`_awaited`, run: what wait_for's reader reads (from its own thread)."""
        return self._run(self._awaited(wanted))

    def _awaited(self, wanted: dict[str, frozenset[str]]) -> Plan[dict[str, Execution]]:
        """Of the executions ``wanted`` (id -> statuses), those at one of their statuses, in
        one read (of the primary on a replica)."""
        arg = json.dumps({execution_id: sorted(s) for execution_id, s in wanted.items()})
        rows = yield fresh("awaited", arg)
        return {
            execution_id: self._execution(execution_id, data, version)
            for execution_id, data, version in rows
        }

    def ack(self, items: Iterable[RelayItem]) -> int:
        """Consume delivered items, any mix of `OutboxEntry`, `SpawnEntry` and `DueTimer`
        (live or dead letters, whoever holds them), in one transaction; return how many rows
        were removed (an item already gone counts 0). A timer goes only while it is still
        armed at its ``fire_at`` (a re-armed one is spared). TypeError for anything else,
        nothing written."""
        return self._run(self._ack(queues.items_of(items, "ack")))

    @classmethod
    def _ack(cls, items: queues.Items) -> Plan[int]:
        return (yield from cls._each(items, "ack"))

    @classmethod
    def _ack_held(cls, worker: str, items: Iterable[RelayItem]) -> Plan[int]:
        """A relay's own ack: `ack` of the items ``worker`` still holds. One its handler
        consumed, re-armed or revived, or that another worker claimed since, is spared."""
        return (yield from cls._each(queues.items_of(items, "ack"), "ack_held", worker=worker))

    def ack_outbox(self, seq: int) -> None:
        """Remove a delivered outbox entry (a no-op if it is already gone): `ack` of one."""
        self._run(self._ack_outbox(seq))

    @classmethod
    def _ack_outbox(cls, seq: int) -> Plan[None]:
        check_int(seq, "seq")
        yield from cls._ack(queues.Items([], [seq] if seq >= 1 else [], [], []))

    def ack_spawn(self, seq: int) -> None:
        """Remove a spawn intent once its child exists (a no-op if it is already gone)."""
        self._run(self._ack_spawn(seq))

    @classmethod
    def _ack_spawn(cls, seq: int) -> Plan[None]:
        check_int(seq, "seq")
        yield from cls._ack(queues.Items([], [], [seq] if seq >= 1 else [], []))

    def delete_timer(self, execution_id: str, path: str, fire_at: float) -> None:
        """Delete a swept timer only if it still fires at ``fire_at`` (a re-arm survives)."""
        self._run(self._delete_timer(execution_id, path, fire_at))

    @classmethod
    def _delete_timer(cls, execution_id: str, path: str, fire_at: float) -> Plan[None]:
        key = (check_id(execution_id, "execution_id"), check_id(path, "path"))
        timer = (*key, check_finite(fire_at, "fire_at"))
        yield from cls._ack(queues.Items([], [], [], [timer]))

    def fail(
        self, worker: str, items: Iterable[RelayItem], *, error: str, retry_in: float = 0.0
    ) -> int:
        """``worker`` could not deliver ``items``: each one it still holds under its lease
        records ``error`` as its last error (bounded and escaped: see `checks.error_text`)
        and becomes claimable ``retry_in`` seconds from now (the database's clock; held by
        nobody meanwhile). Rows it does not hold are left alone. Returns how many rows it
        updated. The attempt was counted by the claim."""
        return self._run(self._fail(worker, items, error=error, retry_in=retry_in))

    @classmethod
    def _fail(
        cls, worker: str, items: Iterable[RelayItem], *, error: str, retry_in: float = 0.0
    ) -> Plan[int]:
        check_id(worker, "worker")
        checked = queues.items_of(items, "fail")
        text, delay = error_text(error), check_delay(retry_in, "retry_in")
        return (yield from cls._each(checked, "fail", text, delay, worker=worker))

    def extend(self, worker: str, items: Iterable[RelayItem], *, lease: float) -> list[RelayItem]:
        """Renew, to ``lease`` seconds from now (the database's clock), the leases of the
        items ``worker`` still holds; return those items, in the order given (the others
        it lost: their lease ran out, or they were acked, revived or re-armed)."""
        return self._run(self._extend(worker, items, lease=lease))

    @staticmethod
    def _extend(worker: str, items: Iterable[RelayItem], *, lease: float) -> Plan[list[RelayItem]]:
        check_id(worker, "worker")
        checked = queues.items_of(items, "extend")
        seconds = check_timeout(lease, "lease")
        batch = Batch()
        steps = queues.add_each(batch, checked, "extend", seconds, worker=worker)
        if not steps:
            return []
        results = yield batch
        return queues.held_items(checked, steps, results)

    def revive(self, items: Iterable[RelayItem]) -> int:
        """Give items (dead letters or live rows) a fresh start: attempts 0, no claim,
        claimable at once. Returns how many rows it updated."""
        return self._run(self._revive(items))

    def _revive(self, items: Iterable[RelayItem]) -> Plan[int]:
        checked = queues.items_of(items, "revive")
        revived = yield from self._each(checked, "revive")
        self._notify(_kinds(checked))
        return revived

    def release(self, worker: str, items: Iterable[RelayItem]) -> int:
        """Hand back items ``worker`` claimed and did not handle (a relay stopping): each
        one it still holds is claimable at once, its claim's attempt given back. Returns how
        many rows it updated."""
        return self._run(self._release(worker, items))

    def _release(self, worker: str, items: Iterable[RelayItem]) -> Plan[int]:
        check_id(worker, "worker")
        checked = queues.items_of(items, "release")
        released = yield from self._each(checked, "release", worker=worker)
        self._notify(_kinds(checked))
        return released

    @staticmethod
    def _each(items: queues.Items, verb: str, *args: Any, worker: str | None = None) -> Plan[int]:
        """``verb`` of every item in one write (``args`` after each item's key, as
        `queues.add_each` lays them out); how many rows it changed."""
        batch = Batch()
        steps = queues.add_each(batch, items, verb, *args, worker=worker)
        if not steps:
            return 0
        results = yield batch
        return sum(results[i] for i in steps)

    def attempts_of(self, items: Iterable[RelayItem]) -> list[int]:
        """How many times each item was claimed (0: it is gone, or a timer re-armed since),
        in the order given; one read. A relay's backoff grows with it."""
        return self._run(self._attempts_of(items))

    @staticmethod
    def _attempts_of(items: Iterable[RelayItem]) -> Plan[list[int]]:
        checked = queues.items_of(items, "attempts_of")
        if not checked.given:
            return []
        timers = json.dumps([[execution_id, path] for execution_id, path, _ in checked.timers])
        rows = yield statement(
            "attempts_of", json.dumps(checked.outbox), json.dumps(checked.spawns), timers
        )
        return queues.attempts(checked, rows)

    def dead_letters(self, *, kind: str | None = None, limit: int = 100) -> list[DeadLetter]:
        """The first ``limit`` (1..1000) dead letters, in the order they died (oldest
        first), of one ``kind`` (``"outbox"``, ``"spawn"``, ``"timer"``) or all. A corrupt
        one is logged and skipped."""
        return self._run(self._dead_letters(kind=kind, limit=limit))

    @staticmethod
    def _dead_letters(*, kind: str | None = None, limit: int = 100) -> Plan[list[DeadLetter]]:
        if kind is not None and kind not in DEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DEAD_KINDS)} or None, not {kind!r}")
        rows = yield statement("dead_letters", _page(limit), kind)
        return queues.decoded(rows, queues.dead_letter, "skipped")

    def read_trace(self, execution_id: str) -> list[dict[str, Any]]:
        """The execution's trace ring in order, each step stamped with its ``index``."""
        return self._run(self._read_trace(execution_id))

    @staticmethod
    def _read_trace(execution_id: str) -> Plan[list[dict[str, Any]]]:
        check_id(execution_id, "execution_id")
        rows = yield statement("read_trace", execution_id)
        return [
            {**stored(f"trace step {idx} of {execution_id!r}", loads_dict, entry), "index": idx}
            for idx, entry in rows
        ]

    def trace_view(self, execution_id: str) -> list[TraceStep]:
        """The execution's trace ring in order, as an operator sees it: each step with its
        index and the time it was recorded."""
        return self._run(self._trace_view(execution_id))

    @staticmethod
    def _trace_view(execution_id: str) -> Plan[list[TraceStep]]:
        check_id(execution_id, "execution_id")
        rows = yield statement("trace_view", execution_id)
        return [
            TraceStep(idx, at, stored(f"trace step {idx} of {execution_id!r}", loads_dict, entry))
            for idx, at, entry in rows
        ]

    def load_definition(self, definition_id: str, version: int) -> DefinitionRecord | None:
        """The published definition version, or None."""
        return self._run(self._load_definition(definition_id, version))

    def _load_definition(self, definition_id: str, version: int) -> Plan[DefinitionRecord | None]:
        check_id(definition_id, "definition_id")
        check_int(version, "version")
        row = yield statement("load_definition", definition_id, version)
        return None if row is None else self._definition(row)

    @staticmethod
    def _definition(row: Sequence[Any]) -> DefinitionRecord:
        definition_id, version, digest, source, published_at = row
        return DefinitionRecord(
            definition_id=definition_id,
            version=version,
            digest=digest,
            source=stored(f"definition {definition_id!r} v{version}", loads_dict, source),
            published_at=published_at,
        )

    def sync(self) -> None:
        """Pull the primary's latest state into an embedded replica (no-op otherwise)."""
        self._conn.sync()

    def close(self) -> None:
        """Close the connection; the store is unusable afterwards (a second close is a no-op).
        A `wait_for` waiting meanwhile raises StoreError."""
        self._awaits.close()
        self._conn.close()

    # --- operator reads and the tree purge (the harel-store CLI) ---

    @staticmethod
    def _summaries(rows: Iterable[Sequence[Any]]) -> list[ExecutionSummary]:
        """A listing's rows as summaries: each was checked against the row its query declares
        (queries.sql), so the model is built without a second validation."""
        keys = tuple(ExecutionSummary.model_fields)
        build = ExecutionSummary.model_construct
        return [build(**dict(zip(keys, row, strict=True))) for row in rows]

    def stats(self, now: float) -> StoreStats:
        """Counts for an operator: executions by status, pending outbox entries and spawns,
        timers due at ``now`` and later, when the oldest pending outbox entry and spawn were
        written (None when unknown: none pending, or written before rows had a time), the
        soonest timer's fire_at, and the database's clock (``now``) to take their ages by.
        """
        return self._run(self._stats(now))

    @staticmethod
    def _stats(now: float) -> Plan[StoreStats]:
        now = check_finite(now, "now")
        by_status = {status: count for status, count in (yield statement("count_by_status"))}
        counts = yield statement("pending_counts", now)
        current = yield from revision()
        return StoreStats(current, by_status, *counts)

    def dead_letter(self, kind: str, key: int | tuple[str, str]) -> DeadLetter | None:
        """The dead letter of ``kind`` with ``key`` (an outbox entry's or a spawn's seq, a
        timer's ``(execution_id, path)``), or None: there is none (gone, or live)."""
        return self._run(self._dead_letter(kind, key))

    @staticmethod
    def _dead_letter(kind: str, key: int | tuple[str, str]) -> Plan[DeadLetter | None]:
        keyed = _dead_key(kind, key, "dead_outbox_entry", "dead_spawn", "dead_timer")
        if keyed is None:
            return None
        found = yield statement(*keyed)
        return None if found is None else queues.dead_letter(found)

    def discard_dead_letter(self, kind: str, key: int | tuple[str, str]) -> bool:
        """Remove the dead letter of ``kind`` with ``key`` (as `dead_letter` names it),
        whatever it holds: one whose stored event or context is corrupt (which `dead_letter`
        and `dead_letters` cannot decode) included. True if there was one; a live row with
        that key is left alone."""
        return self._run(self._discard_dead_letter(kind, key))

    @staticmethod
    def _discard_dead_letter(kind: str, key: int | tuple[str, str]) -> Plan[bool]:
        keyed = _dead_key(
            kind, key, "discard_dead_outbox_entry", "discard_dead_spawn", "discard_dead_timer"
        )
        if keyed is None:
            return False
        batch = Batch()
        batch.add(*keyed)
        (removed,) = yield batch
        return bool(removed)

    def discard_dead_letters(self, *, kind: str | None = None, limit: int = MAX_PAGE) -> int:
        """Remove up to ``limit`` (1..1000) dead letters of each ``kind`` (``"outbox"``,
        ``"spawn"``, ``"timer"``; None: every kind), whatever they hold, corrupt ones
        included (every one `stats` counts); return how many. Call again until 0."""
        return self._run(self._discard_dead_letters(kind=kind, limit=limit))

    @staticmethod
    def _discard_dead_letters(*, kind: str | None = None, limit: int = MAX_PAGE) -> Plan[int]:
        if kind is not None and kind not in DEAD_KINDS:
            raise ValueError(f"kind must be one of {', '.join(DEAD_KINDS)} or None, not {kind!r}")
        rows = _page(limit)
        batch = Batch()
        for each, name in _DISCARD_ALL.items():
            if kind in (None, each):
                batch.add(name, rows)
        return sum((yield batch))

    def timers_of(self, execution_id: str) -> list[tuple[str, float]]:
        """The execution's armed timers as (path, fire_at), soonest first."""
        return self._run(self._timers_of(execution_id))

    @staticmethod
    def _timers_of(execution_id: str) -> Plan[list[tuple[str, float]]]:
        check_id(execution_id, "execution_id")
        rows = yield statement("timers_of", execution_id)
        return [(path, at) for path, at in rows]

    def children_of(self, execution_id: str) -> list[ExecutionSummary]:
        """Summaries of the executions whose parent is ``execution_id``, ordered by id."""
        return self._run(self._children_of(execution_id))

    def _children_of(self, execution_id: str) -> Plan[list[ExecutionSummary]]:
        check_id(execution_id, "execution_id")
        return self._summaries((yield statement("children_of", execution_id)))

    def outbox_view(
        self, *, target: str | None = None, source: str | None = None, limit: int = 50
    ) -> list[PendingOutbox]:
        """Up to ``limit`` (1..1000) undelivered outbox entries, oldest first, with their
        source, time and claim; only those addressed to ``target`` and/or emitted by
        ``source`` if given. A corrupt entry is logged and skipped."""
        return self._run(self._outbox_view(target=target, source=source, limit=limit))

    @staticmethod
    def _outbox_view(
        *, target: str | None = None, source: str | None = None, limit: int = 50
    ) -> Plan[list[PendingOutbox]]:
        check_id(target, "target", optional=True)
        check_id(source, "source", optional=True)
        _page(limit)
        if target is None:
            rows = yield statement("outbox_view", source, limit)
        else:
            rows = yield statement("outbox_view_target", target, source, limit)
        return queues.decoded(rows, _pending_outbox, "skipped")

    def spawns_view(self, *, parent: str | None = None, limit: int = 50) -> list[PendingSpawn]:
        """Up to ``limit`` (1..1000) pending spawns, oldest first, with their time and claim;
        only those of ``parent`` if given. A corrupt one is logged and skipped."""
        return self._run(self._spawns_view(parent=parent, limit=limit))

    @staticmethod
    def _spawns_view(*, parent: str | None = None, limit: int = 50) -> Plan[list[PendingSpawn]]:
        check_id(parent, "parent", optional=True)
        _page(limit)
        if parent is None:
            rows = yield statement("spawns_view", limit)
        else:
            rows = yield statement("spawns_view_parent", parent, limit)
        return queues.decoded(rows, _pending_spawn, "skipped")

    def timers_view(self, *, due_before: float | None = None, limit: int = 50) -> list[ArmedTimer]:
        """Up to ``limit`` (1..1000) armed timers, soonest first, with their claim; only
        those with ``fire_at < due_before`` if given."""
        return self._run(self._timers_view(due_before=due_before, limit=limit))

    @staticmethod
    def _timers_view(*, due_before: float | None = None, limit: int = 50) -> Plan[list[ArmedTimer]]:
        end = ABOVE_ALL if due_before is None else check_finite(due_before, "due_before")
        rows = yield statement("timers_view", end, _page(limit))
        return [ArmedTimer(*row) for row in rows]

    def purge_tree(self, execution_id: str, expected_version: int) -> list[str]:
        """Purge an execution and all its descendants in one transaction; return their ids.

        The execution must be at ``expected_version`` (else nothing is deleted and ``[]`` is
        returned, as for a missing one) and no execution of the tree may still be running:
        then StoreError names them and nothing is deleted.
        """
        return self._run(self._purge_tree(execution_id, expected_version))

    def _purge_tree(self, execution_id: str, expected_version: int) -> Plan[list[str]]:
        check_id(execution_id, "execution_id")
        check_int(expected_version, "expected_version")
        for _ in range(_PURGE_TRIES):
            tree = self._summaries((yield statement("execution_tree", execution_id)))
            if not tree or tree[0].version != expected_version:
                return []
            running = [s.id for s in tree if s.status == "running"]
            if running:
                raise StoreError(
                    f"cannot purge the tree of {execution_id!r}: {len(running)} of its "
                    f"executions are still running ({', '.join(running[:5])}"
                    f"{', ...' if len(running) > 5 else ''})"
                )
            # Every member is deleted under its version CAS, so a tree that moved since it
            # was read conflicts, writes nothing, and is read again.
            ids = [s.id for s in tree]
            try:
                yield _purge_batch([(s.id, s.version) for s in tree])
            except Conflicted:
                continue
            self._forget(ids)
            return ids
        raise StoreError(
            f"cannot purge the tree of {execution_id!r}: it changed under each of "
            f"{_PURGE_TRIES} tries (the tree read again each time)"
        )


class LibsqlStore(Store):
    """The store over libSQL: a local file, a remote primary, or an embedded replica.

    ``LibsqlStore("state.db")`` (or ``":memory:"``) is a local file;
    ``LibsqlStore("http://host:8080", auth_token=...)`` (also ``libsql://``, ``https://``)
    talks to a remote primary, one HTTP request per read or write;
    ``LibsqlStore("local.db", sync_url=URL, auth_token=...)`` is an embedded replica:
    local reads, writes sent to the primary. ``timeout`` (seconds) bounds each request to
    a server; past it, StoreError (OutcomeUnknown for a write that was sent).

    Local databases are migrated to head when opened; remote ones are only checked unless
    ``migrate=True``. Raises SchemaError on a schema it does not know or may not migrate.
    """

    def __init__(
        self,
        database: str | Path = ":memory:",
        *,
        auth_token: str = "",
        sync_url: str | None = None,
        sync_interval: float | None = None,
        trace_max: int | None = DEFAULT_TRACE_MAX,
        synchronous: Synchronous = "FULL",
        busy_timeout: float = 5.0,
        timeout: float = 30.0,
        migrate: bool | None = None,
    ) -> None:
        check_trace_max(trace_max)  # before anything is opened
        connection = open_libsql(
            database,
            auth_token=auth_token,
            sync_url=sync_url,
            sync_interval=sync_interval,
            timeout=timeout,
            synchronous=synchronous,
            busy_timeout=busy_timeout,
        )
        if migrate is None:
            migrate = sync_url is None and not is_remote(database)
        super().__init__(checked(connection, migrate), trace_max=trace_max)


class SqliteStore(Store):
    """The same store over the standard library's ``sqlite3`` (local files and ``:memory:``)."""

    def __init__(
        self,
        database: str | Path = ":memory:",
        *,
        trace_max: int | None = DEFAULT_TRACE_MAX,
        synchronous: Synchronous = "FULL",
        busy_timeout: float = 5.0,
        migrate: bool = True,
    ) -> None:
        check_trace_max(trace_max)
        connection = open_sqlite(database, synchronous=synchronous, busy_timeout=busy_timeout)
        super().__init__(checked(connection, migrate), trace_max=trace_max)
