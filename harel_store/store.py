"""The store: one core over a DB-API connection, two drivers (libsql, sqlite3).

Every statement comes from ``sql/queries.sql``; every write is one ``BEGIN IMMEDIATE`` ...
``COMMIT`` that lands whole or not at all; every driver error leaves as a ``StoreError``.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import sqlite3
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, TypeVar

from pydantic import ValidationError

from harel_store.errors import SchemaError, StoreConflict, StoreError, connection_lost, translate
from harel_store.models import (
    STATUSES,
    DefinitionRecord,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    OutboxEntry,
    SpawnEntry,
    TimerOp,
    check_finite,
)
from harel_store.sql import HEAD, MIGRATIONS, QUERIES, Migration

DEFAULT_TRACE_MAX = 200
MAX_ID_LENGTH = 512
MAX_PAGE = 1000
REMOTE_SCHEMES = ("libsql://", "http://", "https://", "ws://", "wss://")
Synchronous = Literal["FULL", "NORMAL", "EXTRA", "OFF"]


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


class Connection(Protocol):
    """The part of DB-API that both drivers give and the store uses."""

    def execute(self, sql: str, parameters: Any = ..., /) -> Cursor: ...
    def commit(self) -> None: ...
    def rollback(self) -> None: ...
    def close(self) -> None: ...


def is_remote(database: str | Path) -> bool:
    return str(database).startswith(REMOTE_SCHEMES)


def _show(database: str | Path) -> str:
    """A database name fit for messages: a URL without its query (which may carry a token)."""
    return str(database).split("?", 1)[0]


# --- argument checks: everything is validated and serialized before the first statement ---


def _check_id(value: object, name: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if not 0 < len(value) <= MAX_ID_LENGTH:
        raise ValueError(f"{name} must be 1 to {MAX_ID_LENGTH} characters, not {len(value)}")
    if "\x00" in value:  # SQLite TEXT ends at NUL for some drivers: a different key
        raise ValueError(f"{name} must not contain a NUL character")
    return value


def _check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not -(2**63) <= value < 2**63:  # SQLite's INTEGER
        raise ValueError(f"{name} must fit in a signed 64-bit integer, not {value}")
    return value


# json.dumps with options builds a new encoder per call; one shared encoder is ~1 us cheaper.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def _json(value: object, name: str) -> str:
    """Compact JSON of a dict, or a clear error: no NaN, nothing unserializable, no abyss."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, not {type(value).__name__}")
    try:
        return _ENCODER.encode(value)
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


_T = TypeVar("_T")


def _reject_constant(token: str) -> None:
    raise ValueError(f"{token} is not a JSON number")


def _dump(model: Execution | Event, name: str) -> str:
    try:
        data = model.model_dump_json()
        # The models write NaN/Infinity as bare tokens (not null); refuse them, as _json does.
        if "NaN" in data or "Infinity" in data:
            json.loads(data, parse_constant=_reject_constant)
        return data
    except (ValueError, RecursionError) as exc:  # PydanticSerializationError is a ValueError
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


def _loads_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, found {type(value).__name__}")
    return value


def _stored(what: str, parse: Callable[[str], _T], text: str) -> _T:
    """Parse a stored JSON column; a corrupt one is a StoreError that names its row."""
    try:
        return parse(text)
    except (ValueError, TypeError) as exc:  # ValidationError, JSONDecodeError are ValueErrors
        raise StoreError(f"{what} has a corrupt stored record: {exc}") from exc


def _encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": last_id}).encode()).decode()


def _decode_cursor(cursor: str) -> str:
    if not isinstance(cursor, str):
        raise TypeError(f"cursor must be a string, not {type(cursor).__name__}")
    try:
        after = json.loads(base64.urlsafe_b64decode(cursor.encode("ascii")))["after"]
    except (UnicodeError, binascii.Error, ValueError, TypeError, KeyError):
        raise ValueError(f"not a cursor from list_executions: {cursor!r}") from None
    if not isinstance(after, str):
        raise ValueError(f"not a cursor from list_executions: {cursor!r}")
    return after


def _prefix_upper(prefix: str) -> str | bytes:
    """The least string above every string that starts with ``prefix`` (bytes: none exists).

    SQLite orders TEXT by its UTF-8 bytes, which is code point order; an empty BLOB sorts
    after every TEXT value.
    """
    chars = list(prefix)
    while chars:
        code = ord(chars.pop()) + 1
        if 0xD800 <= code <= 0xDFFF:  # surrogates are not characters: skip past them
            code = 0xE000
        if code <= 0x10FFFF:
            return "".join(chars) + chr(code)
    return b""


class StoreStats(NamedTuple):
    """What `Store.stats` counts (``oldest_outbox_at``: epoch seconds, None if unknown)."""

    schema_revision: str | None
    executions: dict[str, int]
    pending_outbox: int
    pending_spawns: int
    timers_due: int
    timers_future: int
    oldest_outbox_at: float | None


class Store:
    """The store core, shared by both drivers. Safe to share between threads.

    ``connect`` opens a ready connection (pragmas set, a replica synced). A connection the
    server has given up on (an expired stream, a lost transaction) is closed and replaced
    by a new one from ``connect`` on the next operation.
    """

    def __init__(
        self,
        connect: Callable[[], Connection],
        *,
        database: str | Path,
        migrate: bool,
        trace_max: int | None,
        secrets: tuple[str, ...] = (),
        sync: Callable[[Any], None] | None = None,
    ) -> None:
        self._connect = connect
        self._database = _show(database)
        self._secrets = secrets
        self._sync = sync
        self._lock = threading.RLock()
        self._dead = False  # the connection must be replaced before its next use
        self._closed = False
        self._writing = False  # a statement of the current write transaction may have run
        self.trace_max = trace_max
        self._conn = self._open()
        try:
            self._ensure_schema(migrate)
        except BaseException:
            self.close()
            raise

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self._database!r})"

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- plumbing ---

    def _q(self, name: str, *params: Any) -> Any:
        """Run one named query; what comes back depends on its suffix in queries.sql."""
        query = QUERIES[name]
        args = query.bind(params)
        try:
            cur = self._conn.execute(query.sql, args)
        except Exception as exc:
            # A dead connection: a read, or a BEGIN, has had no effect yet, so it runs again
            # on a new one; a write transaction past its BEGIN fails (see _txn).
            if self._writing or not connection_lost(exc):
                raise
            self._discard()
            self._conn = self._open()
            self._dead = False
            cur = self._conn.execute(query.sql, args)
        if query.kind == "!":
            return cur.rowcount
        if query.kind == "^":
            return cur.fetchone()
        if query.kind == "$":
            row = cur.fetchone()
            return None if row is None else row[0]
        return cur.fetchall()

    def _open(self) -> Connection:
        try:
            return self._connect()
        except Exception as exc:
            raise translate(exc, self._secrets) from exc

    def _discard(self) -> None:
        """Close a connection that is no longer usable; the next operation opens another."""
        self._dead = True
        # A dead libsql connection may fail any call, even close (pyo3's PanicException is
        # a BaseException).
        with suppress(BaseException):
            self._conn.close()

    def _ready(self) -> None:
        if self._dead:
            if self._closed:
                raise StoreError(f"{self!r} is closed")
            self._conn = self._open()
            self._dead = False

    @contextmanager
    def _op(self) -> Iterator[None]:
        """One operation at a time on the connection; driver errors become StoreError."""
        with self._lock:
            try:
                self._ready()
                yield
            except StoreError:
                raise
            except Exception as exc:
                raise translate(exc, self._secrets) from exc

    @contextmanager
    def _txn(self) -> Iterator[None]:
        """One write transaction: lands whole on success, rolled back on any failure."""
        with self._op():
            self._q("begin")
            self._writing = True
            try:
                yield
                self._conn.commit()
            except BaseException as exc:
                # The connection may be gone; the server then drops the transaction.
                try:
                    self._conn.rollback()
                except Exception as lost:
                    if connection_lost(lost):
                        self._discard()
                if connection_lost(exc):
                    self._discard()
                raise
            finally:
                self._writing = False

    def _after_conflict(self) -> None:
        """A replica that lost a CAS catches up, so the caller's reload sees the winner."""
        if self._sync is not None:
            try:
                with self._op():
                    self._sync(self._conn)
            except StoreError:
                pass

    # --- schema ---

    def _revision(self) -> str | None:
        if not self._q("version_table_exists"):
            return None
        rev: str | None = self._q("schema_revision")
        return rev

    def _ensure_schema(self, migrate: bool) -> None:
        known = [m.revision for m in MIGRATIONS]
        with self._op():
            current = self._revision()
        if current == HEAD:
            return
        if current is not None and current not in known:
            raise SchemaError(
                f"{self._database} is at schema revision {current!r}, which this version of "
                f"harel-store does not know (its head is {HEAD!r}): upgrade harel-store"
            )
        if not migrate:
            where = "has no harel-store schema" if current is None else f"is at {current!r}"
            raise SchemaError(
                f"{self._database} {where}, behind head {HEAD!r}: run "
                f"`harel-store migrate --url {self._database}` (or `alembic upgrade head`), "
                "or open the store with migrate=True"
            )
        for migration in MIGRATIONS[known.index(current) + 1 if current else 0 :]:
            self._apply(migration, known)

    def _apply(self, migration: Migration, known: list[str]) -> None:
        """Apply one migration in its own transaction, unless another process already did."""
        with self._txn():
            current = self._revision()  # re-read under the write lock
            if current is not None and known.index(current) >= known.index(migration.revision):
                return
            if current != migration.down_revision:
                raise SchemaError(f"cannot apply {migration.name} on revision {current!r}")
            try:
                for statement in migration.statements("up"):
                    self._conn.execute(statement, ())
            except Exception as exc:
                cause = translate(exc, self._secrets)
                raise SchemaError(
                    f"migration {migration.name} failed, nothing applied: {cause}"
                ) from exc
            if current is None:
                self._q("create_version_table")
                self._q("insert_revision", migration.revision)
            else:
                self._q("update_revision", migration.revision)

    @property
    def schema_revision(self) -> str | None:
        """The Alembic revision the database is at (``HEAD`` once the store is open)."""
        with self._op():
            return self._revision()

    # --- writes ---

    def _write(self, exe: Execution, data: str) -> None:
        """The version CAS, inside the caller's transaction; ``exe.version`` is already bumped."""
        old = exe.version - 1
        summary = (exe.status, exe.outcome, exe.active_path, exe.parent_id, exe.finished_at)
        if old == 0:
            changed = self._q(
                "insert_execution", exe.id, exe.definition_id, data, exe.version, *summary
            )
        else:
            changed = self._q("update_execution", exe.id, data, exe.version, old, *summary)
        if changed == 0:
            raise StoreConflict(exe.id, expected=old, found=self._q("execution_version", exe.id))

    def _write_trace(self, execution_id: str, entry: str) -> None:
        idx = self._q("append_trace", execution_id, entry)
        if self.trace_max and idx >= self.trace_max:  # a shorter ring has nothing to trim
            self._q("trim_trace", execution_id, idx, self.trace_max)

    def save(self, exe: Execution) -> None:
        """Persist ``exe`` alone under the version CAS and bump ``exe.version``.

        Raises StoreConflict if another writer moved it (``exe.version`` is left as it was).
        """
        self.commit(exe, [])

    def commit(
        self,
        exe: Execution,
        emits: Iterable[tuple[str | None, Event]],
        processed_event_id: str | None = None,
        timers: Iterable[TimerOp] = (),
        spawns: Iterable[tuple[str, str, dict[str, Any]]] = (),
        trace: dict[str, Any] | None = None,
    ) -> list[int]:
        """Persist one event's whole effect in one transaction; return the outbox seqs.

        The execution (version CAS), its emitted events, the dedupe marker of the handled
        event, timer changes, child spawns and a trace step land together or not at all.
        Raises StoreConflict when the CAS fails, ValueError/TypeError for bad arguments
        (nothing written), StoreError for anything the database refuses. On any failure
        ``exe.version`` is restored.
        """
        if not isinstance(exe, Execution):
            raise TypeError(f"exe must be an Execution, not {type(exe).__name__}")
        outbox = []
        for item in emits:
            if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[1], Event)):
                raise TypeError(f"each emit must be a (target_id | None, Event) pair, not {item!r}")
            outbox.append(
                (
                    _check_id(item[0], "emit target_id", optional=True),
                    _dump(item[1], "emitted event"),
                )
            )
        _check_id(processed_event_id, "processed_event_id", optional=True)
        timer_ops = list(timers)
        for op in timer_ops:  # checked again: TimerOp.model_construct skips its validation
            if not isinstance(op, TimerOp):
                raise TypeError(f"each timer must be a TimerOp, not {type(op).__name__}")
            _check_id(op.path, "timer path")
            if op.action == "schedule":
                check_finite(op.fire_at, "timer fire_at")
            elif op.action != "cancel":
                raise ValueError(f"unknown timer action {op.action!r}: schedule or cancel")
        spawn_rows: list[tuple[str, str, str, str]] = []
        for spawn in spawns:
            if not (isinstance(spawn, tuple) and len(spawn) == 3):
                raise TypeError(f"each spawn must be (child_id, root_path, context), not {spawn!r}")
            child_id, root_path, context = spawn
            spawn_rows.append(
                (
                    exe.id,
                    _check_id(child_id, "spawn child_id"),
                    _check_id(root_path, "spawn root_path"),
                    _json(context, "spawn context"),
                )
            )
        trace_json = None if trace is None else _json(trace, "trace")
        old = exe.version
        try:
            exe.version = old + 1
            data = _dump(exe, "execution")
            with self._txn():
                self._write(exe, data)
                seqs = [self._q("insert_outbox", target, event) for target, event in outbox]
                if processed_event_id is not None:
                    self._q("mark_processed", exe.id, processed_event_id)
                for row in spawn_rows:
                    self._q("insert_spawn", *row)
                for op in timer_ops:
                    if op.action == "schedule":
                        self._q("schedule_timer", exe.id, op.path, op.fire_at)
                    else:
                        self._q("cancel_timer", exe.id, op.path)
                if trace_json is not None:
                    self._write_trace(exe.id, trace_json)
            return seqs
        except BaseException as exc:
            exe.version = old
            if isinstance(exc, StoreConflict):
                self._after_conflict()
            raise

    def append_trace(self, execution_id: str, entry: dict[str, Any]) -> None:
        """Append one step to an execution's trace ring on its own (trimmed to trace_max)."""
        _check_id(execution_id, "execution_id")
        entry_json = _json(entry, "trace entry")
        with self._txn():
            self._write_trace(execution_id, entry_json)

    def ack_outbox(self, seq: int) -> None:
        """Remove a delivered outbox entry (a no-op if it is already gone)."""
        _check_int(seq, "seq")
        with self._txn():
            self._q("ack_outbox", seq)

    def ack_spawn(self, seq: int) -> None:
        """Remove a spawn intent once its child exists (a no-op if it is already gone)."""
        _check_int(seq, "seq")
        with self._txn():
            self._q("ack_spawn", seq)

    def delete_timer(self, execution_id: str, path: str, fire_at: float) -> None:
        """Delete a swept timer only if it still fires at ``fire_at`` (a re-arm survives)."""
        _check_id(execution_id, "execution_id")
        _check_id(path, "path")
        fire_at = check_finite(fire_at, "fire_at")
        with self._txn():
            self._q("delete_timer", execution_id, path, fire_at)

    def purge(self, execution_id: str, expected_version: int) -> bool:
        """Delete an execution at ``expected_version`` and everything that belongs to it.

        Returns True if it was deleted; False if it has moved on (nothing is deleted) or does
        not exist (leftovers of an earlier interrupted purge are cleared).
        """
        _check_id(execution_id, "execution_id")
        _check_int(expected_version, "expected_version")
        with self._txn():
            deleted = self._q("purge_execution", execution_id, expected_version)
            if not deleted and self._q("execution_version", execution_id) is not None:
                return False
            self._purge_companions(execution_id)
        return bool(deleted)

    def _purge_companions(self, execution_id: str) -> None:
        """Delete what an execution owns besides its row, inside the caller's transaction."""
        for name in ("processed", "trace", "timers", "outbox", "spawns"):
            self._q(f"purge_{name}", execution_id)

    def publish_definition(self, record: DefinitionRecord) -> DefinitionRecord:
        """Store a definition version unless one is stored already; return what is stored."""
        if not isinstance(record, DefinitionRecord):
            raise TypeError(f"record must be a DefinitionRecord, not {type(record).__name__}")
        source = _json(record.source, "definition source")
        with self._txn():
            self._q(
                "publish_definition",
                record.definition_id,
                record.version,
                record.digest,
                source,
                record.published_at,
            )
            row = self._q("load_definition", record.definition_id, record.version)
        return self._definition(row)

    # --- reads ---

    def _execution(self, execution_id: str, data: str) -> Execution:
        try:
            return Execution.model_validate_json(data)
        except ValidationError as exc:
            raise StoreError(
                f"execution {execution_id!r} has a corrupt stored record: {exc}"
            ) from exc

    def load(self, execution_id: str) -> Execution | None:
        """The execution stored under ``execution_id``, or None."""
        _check_id(execution_id, "execution_id")
        with self._op():
            data = self._q("load_execution", execution_id)
        return None if data is None else self._execution(execution_id, data)

    def load_for_event(self, execution_id: str, event_id: str) -> tuple[Execution | None, bool]:
        """The execution and whether ``event_id`` was already processed, in one round trip."""
        _check_id(execution_id, "execution_id")
        _check_id(event_id, "event_id")
        with self._op():
            data, processed = self._q("load_for_event", execution_id, event_id)
        if data is None:
            return None, False
        return self._execution(execution_id, data), bool(processed)

    def is_processed(self, execution_id: str, event_id: str) -> bool:
        """Whether the execution already handled the event ``event_id``."""
        _check_id(execution_id, "execution_id")
        _check_id(event_id, "event_id")
        with self._op():
            return self._q("is_processed", execution_id, event_id) is not None

    def list_executions(
        self,
        *,
        definition_id: str | None = None,
        status: str | Iterable[str] | None = None,
        roots_only: bool = False,
        limit: int = 50,
        cursor: str | None = None,
    ) -> ExecutionPage:
        """One page of execution summaries ordered by id; pass ``next_cursor`` for the next.

        ``status`` is one status or several (any of). Raises ValueError for an unknown
        status, a limit outside 1..1000 or a cursor this method did not make.
        """
        _check_id(definition_id, "definition_id", optional=True)
        if not isinstance(roots_only, bool):
            raise TypeError(f"roots_only must be a bool, not {type(roots_only).__name__}")
        statuses = [status] if isinstance(status, str) else None if status is None else list(status)
        for s in statuses or ():
            if s not in STATUSES:
                raise ValueError(f"unknown status {s!r}: expected one of {', '.join(STATUSES)}")
        if _check_int(limit, "limit") < 1 or limit > MAX_PAGE:
            raise ValueError(f"limit must be between 1 and {MAX_PAGE}, not {limit}")
        after = "" if cursor is None else _decode_cursor(cursor)
        # One named query per filter shape, each index-backed; statuses fill four slots
        # (None: unused), so several statuses still cost one LIMITed seek each.
        slots: list[str | None] = list(dict.fromkeys(STATUSES if statuses is None else statuses))
        slots += [None] * (len(STATUSES) - len(slots))
        if definition_id is not None:
            name = "list_roots_by_definition" if roots_only else "list_by_definition"
            params: tuple[Any, ...] = (after, definition_id, *slots, limit + 1)
        elif roots_only:
            name, params = "list_roots", (after, *slots, limit + 1)
        elif statuses is not None:
            name, params = "list_by_status", (after, *slots, limit + 1)
        else:
            name, params = "list_executions", (after, limit + 1)
        with self._op():
            rows = self._q(name, *params)
        items = [
            ExecutionSummary(
                id=r[0],
                definition_id=r[1],
                version=r[2],
                status=r[3],
                outcome=r[4],
                active_path=r[5],
                parent_id=r[6],
                finished_at=r[7],
            )
            for r in rows[:limit]
        ]
        more = len(rows) > limit
        return ExecutionPage(
            items=items, next_cursor=_encode_cursor(items[-1].id) if more else None
        )

    def ids_with_prefix(self, prefix: str) -> list[str]:
        """Every execution id that starts with ``prefix``, sorted; no character is special."""
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a string, not {type(prefix).__name__}")
        with self._op():
            return [row[0] for row in self._q("ids_in_range", prefix, _prefix_upper(prefix))]

    def pending_outbox(self) -> list[OutboxEntry]:
        """Undelivered emitted events, oldest first."""
        with self._op():
            rows = self._q("pending_outbox")
        return [
            OutboxEntry(
                seq, target, _stored(f"outbox entry {seq}", Event.model_validate_json, event)
            )
            for seq, target, event in rows
        ]

    def pending_spawns(self) -> list[SpawnEntry]:
        """Child executions still to be created, oldest first."""
        with self._op():
            rows = self._q("pending_spawns")
        return [
            SpawnEntry(seq, parent, child, root, _stored(f"spawn {seq}", _loads_dict, ctx))
            for seq, parent, child, root, ctx in rows
        ]

    def due_timers(self, now: float) -> list[tuple[str, str, float]]:
        """Timers with ``fire_at <= now`` as (execution_id, path, fire_at), soonest first."""
        now = check_finite(now, "now")
        with self._op():
            return [(eid, path, at) for eid, path, at in self._q("due_timers", now)]

    def read_trace(self, execution_id: str) -> list[dict[str, Any]]:
        """The execution's trace ring in order, each step stamped with its ``index``."""
        _check_id(execution_id, "execution_id")
        with self._op():
            rows = self._q("read_trace", execution_id)
        return [
            {**_stored(f"trace step {idx} of {execution_id!r}", _loads_dict, entry), "index": idx}
            for idx, entry in rows
        ]

    def load_definition(self, definition_id: str, version: int) -> DefinitionRecord | None:
        """The published definition version, or None."""
        _check_id(definition_id, "definition_id")
        _check_int(version, "version")
        with self._op():
            row = self._q("load_definition", definition_id, version)
        return None if row is None else self._definition(row)

    @staticmethod
    def _definition(row: Sequence[Any]) -> DefinitionRecord:
        definition_id, version, digest, source, published_at = row
        return DefinitionRecord(
            definition_id=definition_id,
            version=version,
            digest=digest,
            source=_stored(f"definition {definition_id!r} v{version}", _loads_dict, source),
            published_at=published_at,
        )

    def close(self) -> None:
        """Close the connection; the store is unusable afterwards (a second close is a no-op)."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._discard()

    # --- operator reads and the tree purge (the harel-store CLI) ---

    @staticmethod
    def _summaries(rows: Iterable[Sequence[Any]]) -> list[ExecutionSummary]:
        keys = ExecutionSummary.model_fields
        return [ExecutionSummary(**dict(zip(keys, row, strict=True))) for row in rows]

    def stats(self, now: float) -> StoreStats:
        """Counts for an operator: executions by status, pending outbox entries and spawns,
        timers due at ``now`` and later, and when the oldest pending outbox entry was
        written (None when unknown: no entry, or one written before outbox rows had a time).
        """
        now = check_finite(now, "now")
        with self._op():
            by_status = {status: count for status, count in self._q("count_by_status")}
            outbox, spawns, due, future, oldest = self._q("pending_counts", now)
            revision = self._revision()
        return StoreStats(revision, by_status, outbox, spawns, due, future, oldest)

    def timers_of(self, execution_id: str) -> list[tuple[str, float]]:
        """The execution's armed timers as (path, fire_at), soonest first."""
        _check_id(execution_id, "execution_id")
        with self._op():
            return [(path, at) for path, at in self._q("timers_of", execution_id)]

    def outbox_for(self, execution_id: str) -> list[OutboxEntry]:
        """Undelivered outbox entries addressed to the execution, oldest first."""
        _check_id(execution_id, "execution_id")
        with self._op():
            rows = self._q("outbox_for", execution_id)
        return [
            OutboxEntry(seq, t, _stored(f"outbox entry {seq}", Event.model_validate_json, event))
            for seq, t, event in rows
        ]

    def children_of(self, execution_id: str) -> list[ExecutionSummary]:
        """Summaries of the executions whose parent is ``execution_id``, ordered by id."""
        _check_id(execution_id, "execution_id")
        with self._op():
            return self._summaries(self._q("children_of", execution_id))

    def purge_tree(self, execution_id: str, expected_version: int) -> list[str]:
        """Purge an execution and all its descendants in one transaction; return their ids.

        The execution must be at ``expected_version`` (else nothing is deleted and ``[]`` is
        returned, as for a missing one) and no execution of the tree may still be running:
        then StoreError names them and nothing is deleted.
        """
        _check_id(execution_id, "execution_id")
        _check_int(expected_version, "expected_version")
        with self._txn():
            tree = self._summaries(self._q("execution_tree", execution_id))
            if not tree or tree[0].version != expected_version:
                return []
            running = [s.id for s in tree if s.status == "running"]
            if running:
                raise StoreError(
                    f"cannot purge the tree of {execution_id!r}: {len(running)} of its "
                    f"executions are still running ({', '.join(running[:5])}"
                    f"{', ...' if len(running) > 5 else ''})"
                )
            for s in tree:
                self._q("purge_execution", s.id, s.version)
                self._purge_companions(s.id)
        return [s.id for s in tree]


def _check_local_options(synchronous: str, busy_timeout: float) -> None:
    if synchronous not in ("OFF", "NORMAL", "FULL", "EXTRA"):
        raise ValueError(f"synchronous must be FULL, NORMAL, EXTRA or OFF, not {synchronous!r}")
    if check_finite(busy_timeout, "busy_timeout") < 0:
        raise ValueError(f"busy_timeout must be >= 0 seconds, not {busy_timeout!r}")


def _local_pragmas(
    conn: Connection, database: str | Path, synchronous: str, busy_timeout: float
) -> None:
    """WAL (readers never block the writer), a busy wait, and the chosen durability."""
    conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}", ())
    if str(database) != ":memory:":
        conn.execute("PRAGMA journal_mode = WAL", ()).fetchall()
    conn.execute(f"PRAGMA synchronous = {synchronous}", ())


def _import_libsql() -> Any:
    """Import libsql with its Rust log off unless RUST_LOG is set.

    libsql's client logs to stdout (a replica's handshakes at INFO, its retries at ERROR)
    and reads RUST_LOG once, when it is imported; failures reach the caller as exceptions
    anyway. The variable is set only around the import, so child processes do not inherit it.
    """
    if "libsql" in sys.modules or "RUST_LOG" in os.environ:
        import libsql
    else:
        os.environ["RUST_LOG"] = "off"
        try:
            import libsql
        finally:
            del os.environ["RUST_LOG"]
    return libsql


def _replica_sync(conn: Any) -> None:
    conn.sync()


def _why_sync_failed(libsql: Any, sync_url: str, auth_token: str) -> None:
    """A replica's sync reports a refused token only as a handshake timeout (the cause goes
    to the Rust log); ask the primary directly, and raise what it says if it refuses."""
    probe = libsql.connect(sync_url, auth_token=auth_token)
    try:
        probe.execute("SELECT 1", ()).fetchall()
    finally:
        with suppress(BaseException):
            probe.close()


class LibsqlStore(Store):
    """The store over libSQL: a local file, a remote primary, or an embedded replica.

    ``LibsqlStore("state.db")`` (or ``":memory:"``) is a local file;
    ``LibsqlStore("http://host:8080", auth_token=...)`` (also ``libsql://``, ``https://``)
    talks to a remote primary; ``LibsqlStore("local.db", sync_url=URL, auth_token=...)``
    is an embedded replica: local reads, writes delegated to the primary.

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
        migrate: bool | None = None,
    ) -> None:
        libsql = _import_libsql()

        _check_local_options(synchronous, busy_timeout)
        remote = is_remote(database) or sync_url is not None
        kwargs: dict[str, Any] = {"_check_same_thread": False}
        if remote:
            kwargs["auth_token"] = auth_token
        if sync_url is not None:
            kwargs["sync_url"] = sync_url
            if sync_interval is not None:
                kwargs["sync_interval"] = sync_interval
        secrets = (auth_token,) if auth_token else ()

        def connect() -> Connection:
            conn = libsql.connect(str(database), **kwargs)
            try:
                if sync_url is not None:
                    try:
                        conn.sync()  # opening a replica pulls nothing by itself
                    except Exception:
                        _why_sync_failed(libsql, sync_url, auth_token)
                        raise
                elif not remote:
                    _local_pragmas(conn, database, synchronous, busy_timeout)
            except BaseException:
                with suppress(BaseException):
                    conn.close()
                raise
            return conn  # type: ignore[no-any-return]

        super().__init__(
            connect,
            database=database if sync_url is None else f"{database} (replica of {_show(sync_url)})",
            migrate=not remote if migrate is None else migrate,
            trace_max=trace_max,
            secrets=secrets,
            sync=_replica_sync if sync_url is not None else None,
        )

    def sync(self) -> None:
        """Pull the primary's latest state into an embedded replica (no-op otherwise)."""
        if self._sync is not None:
            with self._op():
                self._sync(self._conn)


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
        _check_local_options(synchronous, busy_timeout)

        def connect() -> Connection:
            conn = sqlite3.connect(
                str(database), isolation_level=None, check_same_thread=False, timeout=busy_timeout
            )
            try:
                _local_pragmas(conn, database, synchronous, busy_timeout)
            except BaseException:
                conn.close()
                raise
            return conn

        super().__init__(connect, database=database, migrate=migrate, trace_max=trace_max)
