"""The executions: the engine's atomic commit, its reads, a monitor's listing, definitions,
trace rings and the purge of one execution or one tree.

Each operation is a plan (`harel_store.batch`) written once with its docstring and checks
(`harel_store.operation`); its SQL is the named query of ``sql/queries.sql`` it yields.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from harel_store import flows, queues, telemetry, wakeup
from harel_store.awaiting import Call, wait_message
from harel_store.batch import Batch, Conflicted, Plan, fresh, statement
from harel_store.checks import (
    check_definition,
    check_delay,
    check_event,
    check_execution,
    check_finite,
    check_id,
    check_int,
    check_text,
    decode_cursor,
    dump_model,
    dumps,
    encode_cursor,
    loads_dict,
    prefix_upper,
    stored,
)
from harel_store.core import (
    _PURGE_TRIES,
    ABOVE_ALL,
    BELOW_ALL_TIMES,
    StoreCore,
    _page,
)
from harel_store.errors import StoreConflict, StoreError
from harel_store.models import (
    STATUSES,
    DefinitionRecord,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    OutboxEntry,
    RelayItem,
    TimerOp,
    TraceStep,
)
from harel_store.operation import operation
from harel_store.retention import _purge_batch, _purge_companions


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


class Listing(NamedTuple):
    """`list_executions`' arguments as `check_listing` read them."""

    statuses: list[str] | None  # None: any
    low: float | None  # updated_after
    high: float | None  # updated_before
    order: str  # harel_store.checks.ORDERS: "id", "newest" or "oldest"
    cursor: tuple[str, float | None]  # its (id, time); ("", None): none


def check_listing(
    definition_id: str | None,
    status: str | Iterable[str] | None,
    roots_only: bool,
    limit: int,
    cursor: str | None,
    updated_after: float | None,
    updated_before: float | None,
    newest_first: bool,
    id_prefix: str | None,
) -> Listing:
    """`list_executions`' arguments checked (ValueError, TypeError: see there), and what
    they say; a fleet checks a listing with it before it reads any database."""
    check_id(definition_id, "definition_id", optional=True)
    if id_prefix is not None and not isinstance(id_prefix, str):
        raise TypeError(f"id_prefix must be a string, not {type(id_prefix).__name__}")
    if id_prefix is not None:
        check_text(id_prefix, "id_prefix")
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
    keyset = ("", None) if cursor is None else decode_cursor(cursor, order)
    return Listing(statuses, low, high, order, keyset)


def _set_version(exe: Execution, version: int) -> None:
    """``exe.version = version``; on an `Execution` itself without the assignment's
    validation (~4 us, a tenth of a commit's own work), which has nothing to refuse in the
    store's own int past `check_execution`. A subclass's validators run, as they always did."""
    if type(exe) is Execution:
        exe.__dict__["version"] = version
        exe.__pydantic_fields_set__.add("version")
    else:
        exe.version = version


class Executions(StoreCore):
    """The operations on executions (`harel_store.store.Store` has them all)."""

    @operation
    def save(self, exe: Execution) -> Plan[None]:
        """Persist ``exe`` alone under the version CAS and bump ``exe.version``.

        Raises StoreConflict if another writer moved it (``exe.version`` is left as it was).
        """
        yield from Executions.commit.plan(self, exe, [])

    @operation
    @telemetry.observed
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
    ) -> Plan[list[int]]:
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
        if not isinstance(exe, Execution):
            raise TypeError(f"exe must be an Execution, not {type(exe).__name__}")
        check_execution(exe)
        outbox = []
        for item in emits:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Event)):
                raise TypeError(f"each emit must be a (target_id | None, Event) pair, not {item!r}")
            target, event = item
            check_event(event)
            target = check_id(target, "emit target_id", optional=True)
            outbox.append((target, dump_model(event, "emitted event")))
        check_id(processed_event_id, "processed_event_id", optional=True)
        timer_ops = list(timers)  # a copy: what is checked is what is written
        armed = False
        for op in timer_ops:  # checked again: TimerOp.model_construct skips its validation
            if not isinstance(op, TimerOp):
                raise TypeError(f"each timer must be a TimerOp, not {type(op).__name__}")
            check_id(op.path, "timer path")
            if op.action == "schedule":
                check_finite(op.fire_at, "timer fire_at")
                armed = True
            elif op.action != "cancel":
                raise ValueError(f"unknown timer action {op.action!r}: schedule or cancel")
        spawn_rows: list[tuple[str, str, str]] = []
        for spawn in spawns:
            if not (isinstance(spawn, tuple) and len(spawn) == 3):
                raise TypeError(f"each spawn must be (child_id, root_path, context), not {spawn!r}")
            child_id, root_path, context = spawn
            child_id = check_id(child_id, "spawn child_id")
            root_path = check_id(root_path, "spawn root_path")
            spawn_rows.append((child_id, root_path, dumps(context, "spawn context")))
        # Each item's flow key, once every argument passed its check and before anything is
        # written (a flow_key function may raise).
        keys = self._flow_key
        outbox_keys = [flows.flow_of(keys, target) for target, _ in outbox]
        spawn_keys = [flows.flow_of(keys, child) for child, _, _ in spawn_rows]
        timer_key = flows.flow_of(keys, exe.id) if armed else ""
        trace_json = None if trace is None else dumps(trace, "trace")
        consumed = queues.items_of(acks, "acks", self._conn.key) if acks else None
        traced = telemetry.traceparent() if outbox or spawn_rows or timer_ops else None
        old = exe.version
        try:
            _set_version(exe, old + 1)
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
                queues.add_freed(batch, consumed)
                queues.add_each(batch, consumed, "ack")
            emitted = [
                batch.add("insert_outbox", target, exe.id, event, traced, key)
                for (target, event), key in zip(outbox, outbox_keys, strict=True)
            ]
            if processed_event_id is not None:
                batch.add("mark_processed", exe.id, processed_event_id)  # and markers_since
            for row, key in zip(spawn_rows, spawn_keys, strict=True):
                batch.add("insert_spawn", exe.id, *row, traced, key)
            for op in timer_ops:
                if op.action == "schedule":
                    batch.add("schedule_timer", exe.id, op.path, op.fire_at, traced, timer_key)
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
            _set_version(exe, old)
            raise StoreConflict(exe.id, expected=old, found=conflict.found) from None
        except BaseException:
            _set_version(exe, old)
            raise
        self._remember(exe)
        if consumed is not None:
            queues.consumed(self._conn.key, consumed)
        signals = [wakeup.EXECUTION]
        if outbox:
            signals.append(wakeup.OUTBOX)
        if spawn_rows:
            signals.append(wakeup.SPAWN)
        if armed:
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

    def _add_trace(self, batch: Batch, execution_id: str, entry: str) -> None:
        index = batch.add("append_trace", execution_id, entry)
        keep = self._trace_max
        if keep:  # a ring not yet full has nothing to trim
            batch.add("trim_trace", execution_id, keep, only_if=(index, keep))

    @operation
    def append_trace(self, execution_id: str, entry: dict[str, Any]) -> Plan[None]:
        """Append one step to an execution's trace ring on its own (trimmed to trace_max)."""
        check_id(execution_id, "execution_id")
        batch = Batch()
        self._add_trace(batch, execution_id, dumps(entry, "trace entry"))
        yield batch

    @operation
    def purge(self, execution_id: str, expected_version: int) -> Plan[bool]:
        """Delete an execution at ``expected_version`` and everything that belongs to it.

        Returns True if it was deleted; False if it has moved on (nothing is deleted) or does
        not exist (leftovers of an earlier interrupted purge are cleared).
        """
        check_id(execution_id, "execution_id")
        check_int(expected_version, "expected_version")
        batch = Batch()
        batch.add("purge_executions", json.dumps([[execution_id, expected_version]]))
        _purge_companions(batch, [execution_id])
        deleted, *_ = yield batch
        self._forget([execution_id])
        return bool(deleted)

    @operation
    def publish_definition(self, record: DefinitionRecord) -> Plan[DefinitionRecord]:
        """Store a definition version unless one is stored already; return what is stored."""
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

    @operation
    def load_definition(self, definition_id: str, version: int) -> Plan[DefinitionRecord | None]:
        """The published definition version, or None."""
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

    @operation
    def load(self, execution_id: str) -> Plan[Execution | None]:
        """The execution stored under ``execution_id``, or None."""
        check_id(execution_id, "execution_id")
        row = yield statement("load_execution", execution_id)
        return None if row is None else self._execution(execution_id, *row)

    @operation
    def load_for_event(
        self, execution_id: str, event_id: str
    ) -> Plan[tuple[Execution | None, bool]]:
        """The execution and whether ``event_id`` was already processed, in one round trip."""
        check_id(execution_id, "execution_id")
        check_id(event_id, "event_id")
        data, version, processed = yield statement("load_for_event", execution_id, event_id)
        if data is None:
            return None, False
        return self._execution(execution_id, data, version), bool(processed)

    @operation
    def is_processed(self, execution_id: str, event_id: str) -> Plan[bool]:
        """Whether the execution already handled the event ``event_id``."""
        check_id(execution_id, "execution_id")
        check_id(event_id, "event_id")
        return (yield statement("is_processed", execution_id, event_id)) is not None

    @operation
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
    ) -> Plan[ExecutionPage]:
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
        statuses, low, high, order, (after, at) = check_listing(
            definition_id,
            status,
            roots_only,
            limit,
            cursor,
            updated_after,
            updated_before,
            newest_first,
            id_prefix,
        )
        window = low is not None or high is not None
        first, beyond = ("", ABOVE_ALL) if not id_prefix else (id_prefix, prefix_upper(id_prefix))
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

    @operation
    def ids_with_prefix(self, prefix: str) -> Plan[list[str]]:
        """Every execution id that starts with ``prefix``, sorted; no character is special."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        check_text(prefix, "prefix")
        rows = yield statement("ids_in_range", prefix, prefix_upper(prefix))
        return [row[0] for row in rows]

    @operation
    def children_of(
        self, execution_id: str, *, limit: int | None = None, after: str | None = None
    ) -> Plan[list[ExecutionSummary]]:
        """Summaries of the executions whose parent is ``execution_id``, ordered by id: the
        first ``limit`` (1..1000; None: all), of those whose id sorts after ``after`` if
        given (the last id of the page before: the next page)."""
        check_id(execution_id, "execution_id")
        if after is not None:
            check_id(after, "after")
        rows = -1 if limit is None else _page(limit)
        since = "" if after is None else after
        return self._summaries((yield statement("children_of", execution_id, since, rows)))

    @operation
    def timers_of(
        self, execution_id: str, *, limit: int | None = None
    ) -> Plan[list[tuple[str, float]]]:
        """The execution's armed timers as (path, fire_at), soonest first: the first
        ``limit`` (1..1000; None: all)."""
        check_id(execution_id, "execution_id")
        rows = yield statement("timers_of", execution_id, -1 if limit is None else _page(limit))
        return [(path, at) for path, at in rows]

    @operation
    def outbox_for(self, execution_id: str) -> Plan[list[OutboxEntry]]:
        """Undelivered outbox entries addressed to the execution, oldest first."""
        check_id(execution_id, "execution_id")
        rows = yield statement("outbox_for", execution_id)
        return queues.stamped([queues.outbox_entry(row) for row in rows], self._conn.key)

    @operation
    def read_trace(self, execution_id: str) -> Plan[list[dict[str, Any]]]:
        """The execution's trace ring in order, each step stamped with its ``index``."""
        check_id(execution_id, "execution_id")
        rows = yield statement("read_trace", execution_id)
        return [
            {**stored(f"trace step {idx} of {execution_id!r}", loads_dict, entry), "index": idx}
            for idx, entry in rows
        ]

    @operation
    def trace_view(self, execution_id: str, *, limit: int | None = None) -> Plan[list[TraceStep]]:
        """The execution's trace ring in order, as an operator sees it: each step with its
        index and the time it was recorded; only the latest ``limit`` (1..1000; None: all)."""
        check_id(execution_id, "execution_id")
        rows = yield statement("trace_view", execution_id, -1 if limit is None else _page(limit))
        return [
            TraceStep(idx, at, stored(f"trace step {idx} of {execution_id!r}", loads_dict, entry))
            for idx, at, entry in rows
        ]

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
        notifications), never in a busy loop, and looking in case a notification was
        missed (every second, less often while notifications flow). The calls of a store
        waiting at once share one read a change. Raises TimeoutError (the
        builtin) when the time is up, ValueError/TypeError for an unknown status or a
        timeout that is not 0 to a year of seconds, StoreError if the database fails."""
        execution_id, statuses, seconds = _wait_args(execution_id, status, timeout)
        deadline = time.monotonic() + seconds
        found = self._awaited({execution_id: statuses})
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

    @operation
    def _awaited(self, wanted: dict[str, frozenset[str]]) -> Plan[dict[str, Execution]]:
        """Of the executions ``wanted`` (id -> statuses), those at one of their statuses, in
        one read (of the primary on a replica)."""
        arg = json.dumps({execution_id: sorted(s) for execution_id, s in wanted.items()})
        rows = yield fresh("awaited", arg)
        return {
            execution_id: self._execution(execution_id, data, version)
            for execution_id, data, version in rows
        }

    @operation
    def _awaited_changes(
        self, statuses: frozenset[str], since: float
    ) -> Plan[tuple[float, list[tuple[str, str]]]]:
        """The database's clock now, and the (id, status) of the executions at one of
        ``statuses`` last written at or after ``since`` (that clock): what may have changed
        for wait_for's calls, read at a cost in proportion to the change (of the primary on
        a replica)."""
        rows = yield fresh("awaited_changes", json.dumps(sorted(statuses)), since)
        now = float(rows[0][0])
        return now, [(execution_id, status) for _, execution_id, status in rows if execution_id]

    @operation
    def purge_tree(self, execution_id: str, expected_version: int) -> Plan[list[str]]:
        """Purge an execution and all its descendants in one transaction; return their ids.

        The execution must be at ``expected_version`` (else nothing is deleted and ``[]`` is
        returned, as for a missing one) and no execution of the tree may still be running:
        then StoreError names them and nothing is deleted.
        """
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
                    f"executions {'is' if len(running) == 1 else 'are'} still running "
                    f"({', '.join(running[:5])}{', ...' if len(running) > 5 else ''})"
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
