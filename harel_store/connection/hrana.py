"""A remote libSQL primary (sqld, Turso) over Hrana 3 over HTTP (`http`, our own client).

Every request is one ``POST /v3/pipeline`` on a new stream that it also closes, so no
server-side state outlives it: a read is one statement; a write is one Hrana batch
(``BEGIN IMMEDIATE``, the steps, each run only if the one before succeeded, a guard after
each guarded step, a gate after a gated step with the steps on either side of it,
``COMMIT``, ``ROLLBACK`` if the ``COMMIT`` did not run, and the conflict read if a guard
failed). The sync and the async client share the wire format; only the sending differs.
"""

from __future__ import annotations

import base64
import collections
import contextlib
import itertools
import json
import random
import ssl
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from decimal import ROUND_DOWN, Context, Decimal
from typing import Any
from urllib.parse import urlsplit

from harel_store.batch import Batch, Conflicted, Fresh, Request, Statement, shape, statement
from harel_store.connection import http
from harel_store.connection.url import server_key
from harel_store.connection.watch import ListenWatch
from harel_store.errors import OutcomeUnknown, StoreBusy, StoreError, scrub, translate
from harel_store.lazy import asyncio

_GUARD = statement("guard_changed")


_DIGITS = Context(prec=18, rounding=ROUND_DOWN)


def _decimal(number: float) -> str:
    """A float as the decimal text sqld's SQLite turns back into exactly that double.

    Not a JSON number: sqld's JSON parser rounds about one double in six to a neighbour.
    Nor its shortest repr: that can lie near the midpoint between two doubles, and the
    server's SQLite (3.45) rounds about one in 8,000 of those to the neighbour. Its first
    18 significant digits, cut toward zero, lie within 1e-17 of the double, far inside its
    half ulp, and never past the largest double (rounded up, that one overflowed to
    infinity): 172k doubles of every kind tried, subnormals and powers of two too. Every
    float the store binds meets a REAL column, whose affinity makes it a REAL again.
    """
    return format(_DIGITS.plus(Decimal(number)), "e")


def _value(param: Any) -> dict[str, Any]:
    if param is None:
        return {"type": "null"}
    if isinstance(param, str):
        return {"type": "text", "value": param}
    if isinstance(param, int):  # bool too: SQLite has no other
        return {"type": "integer", "value": str(int(param))}  # a decimal string: exact
    if isinstance(param, float):
        return {"type": "text", "value": _decimal(param)}
    if isinstance(param, bytes):
        return {"type": "blob", "base64": base64.b64encode(param).decode("ascii")}
    raise TypeError(f"cannot send a {type(param).__name__} to the server")


def _stmt(statement: Statement) -> dict[str, Any]:
    query, params = statement
    return {
        "sql": query.sql,
        "args": [_value(p) for p in params],
        "want_rows": query.kind != "!",
    }


def _column(value: dict[str, Any]) -> Any:
    """A Hrana value as Python, checked against the type it declares."""
    kind = value["type"]
    if kind == "integer":
        text = value["value"]
        if not isinstance(text, str):
            raise TypeError("an integer that is not a decimal string")
        return int(text)
    if kind == "float":
        number = value["value"]  # a JSON number: exact
        if not isinstance(number, (int, float)) or isinstance(number, bool):
            raise TypeError("a float that is not a number")
        return float(number)
    if kind == "text":
        if not isinstance(text := value["value"], str):
            raise TypeError("a text value that is not a string")
        return text
    if kind == "blob":
        coded = value["base64"]  # sqld sends it without its padding
        return base64.b64decode(coded + "=" * (-len(coded) % 4))
    if kind == "null":
        return None
    raise ValueError(f"a value of an unknown type {str(kind)[:20]!r}")


def _result(statement: Statement, result: dict[str, Any]) -> Any:
    rows = [tuple(_column(v) for v in row) for row in result["rows"]]
    return shape(statement[0], rows, result["affected_row_count"])


# A batch step's condition, as the JSON text it is sent as (made for every step of every
# write: formatted, not json.dumps'ed).
def _ok(step: int) -> bytes:
    return b'{"type":"ok","step":%d}' % step


def _failed(step: int) -> bytes:
    return b'{"type":"not","cond":{"type":"ok","step":%d}}' % step


def _any(*conds: bytes) -> bytes:
    return b'{"type":"or","conds":[' + b",".join(conds) + b"]}"


def _all(*conds: bytes) -> bytes:
    return b'{"type":"and","conds":[' + b",".join(conds) + b"]}"


def _step(condition: bytes | None, stmt: bytes) -> bytes:
    if condition is None:
        return b'{"stmt":' + stmt + b"}"
    return b'{"condition":' + condition + b',"stmt":' + stmt + b"}"


class _Wire:
    """One request as an entry of a pipeline's ``requests``, and how to read its result.

    A write's steps are laid out by `place` at a position of a Hrana batch: alone (BEGIN,
    its steps, COMMIT, ROLLBACK if the COMMIT did not run, the conflict read), or as a member
    of a group that is one transaction (`_group_part`): between a SAVEPOINT and its RELEASE,
    with a ROLLBACK TO the savepoint and the conflict read if one of its steps failed.
    """

    __slots__ = (
        "commit",
        "conflict",
        "gate",
        "gates",
        "guards",
        "last",
        "members",
        "part",
        "positions",
        "quiet",
        "request",
        "saved",
        "sided",
        "start",
        "stmts",
        "stream",
        "write",
    )

    def __init__(self, request: Request) -> None:
        if isinstance(request, Fresh):  # every read here sees the primary
            request = request.statement
        self.request = request
        self.write = isinstance(request, Batch)
        self.saved = False  # in a group: laid out between a savepoint and its release
        self.stream: tuple[str | None, bool] | None = None  # a read's (baton, kept): _Streams
        if not isinstance(request, Batch):
            self.part = _json({"type": "execute", "stmt": _stmt(request)})
            return
        # Each step's statement, and its guard's after it (None: not guarded), encoded once.
        self.stmts: list[tuple[bytes, bytes | None]] = []
        for index, step in enumerate(request.steps):
            guard = None
            if index in request.guards:
                rows = request.guards[index]
                guard = _json(_stmt(_GUARD if rows is None else statement("guard_rows", rows)))
            self.stmts.append((_json(_stmt(step)), guard))
        self.gate = None if request.gated is None else _json(_stmt(request.gated[1]))
        self.part = self.alone()

    def alone(self) -> bytes:
        """The write as a batch of its own (laid out anew after it was a group's member)."""
        steps = [_step(None, _BEGIN_JSON)]
        self.place(steps)
        self.members: frozenset[int] = frozenset()  # in a group: every member's own steps
        self.quiet = frozenset(self.gates)  # the request's gates, whose failure is no error
        self.commit = len(steps)
        steps.append(_step(_ok(self.commit - 1), _COMMIT_JSON))
        steps.append(_step(_failed(self.commit), _ROLLBACK_JSON))
        self._conflict_read(steps)
        return b'{"type":"batch","batch":{"steps":[' + b",".join(steps) + b"]}}"

    def place(self, steps: list[bytes]) -> None:
        """Append the batch's steps to ``steps``, each run if the step before succeeded: the
        one before on its side of the batch's gate, if it has one (`Batch.gate`); the gate
        right after its step, and after the steps of either side one step (``branch_end``)
        that runs once the side taken has ended."""
        request = self.request
        assert isinstance(request, Batch)
        self.start = len(steps)  # the first of them
        self.positions: list[int] = []
        self.guards: dict[int, int] = {}  # wire index of a guard -> the batch step it guards
        self.gates: list[int] = []  # wire index of the gate
        self.sided: set[int] = set()  # wire indexes of the steps run on one side only
        gated = None if request.gated is None else request.gated[0]
        # What a step on each side of the gate runs on (one condition before the gate).
        sides = [_ok(len(steps) - 1)] * 2
        branches: list[bytes] | None = None  # the gate passed, the gate failed
        for index, (stmt, guard) in enumerate(self.stmts):
            side = request.side(index) if branches is not None else None
            on = sides[0] if sides[0] == sides[1] else _any(*sides)
            steps.append(_step(on if side is None else sides[side], stmt))
            self.positions.append(len(steps) - 1)
            if guard is not None:
                steps.append(_step(_ok(len(steps) - 1), guard))
                self.guards[len(steps) - 1] = index
            done = _ok(len(steps) - 1)
            if side is not None:
                sides[side] = done
                self.sided.add(self.positions[-1])
            elif branches is None:
                sides = [done] * 2
            else:
                sides = [_all(done, branches[0]), _all(done, branches[1])]
            if index == gated and self.gate is not None:
                steps.append(_step(done, self.gate))
                self.gates.append(len(steps) - 1)
                # Failed once it ran, not "error": sqld takes a step never run for one that
                # failed, and the side after a gate skipped (an earlier step failed) would run.
                branches = [_ok(len(steps) - 1), _all(done, _failed(len(steps) - 1))]
                sides = list(branches)
        if branches is not None:
            steps.append(_step(_any(*sides), _BRANCH_END_JSON))
        self.last = len(steps) - 1

    def _conflict_read(self, steps: list[bytes]) -> None:
        """Append the batch's conflict read, run if a guard failed."""
        assert isinstance(self.request, Batch)
        self.conflict: int | None = None
        if self.request.conflict is not None and self.guards:
            self.conflict = len(steps)
            # A guard that ran (its step succeeded) and failed: sqld's "error" condition holds
            # for a guard never run too (an earlier step failed, or on a gate's other side).
            failed = _any(*(_all(_ok(g - 1), _failed(g)) for g in self.guards))
            steps.append(_step(failed, _json(_stmt(self.request.conflict))))

    def decode(self, first: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        """The request's result, or the server's error (nothing of the request applied);
        a reply of another shape raises ValueError, KeyError, TypeError or IndexError."""
        if first["type"] != "ok":
            return None, _error(first["error"])
        result = first["response"]["result"]
        if not isinstance(self.request, Batch):
            return _result(self.request, result), None
        request, results, errors = self.request, result["step_results"], result["step_errors"]
        if results[self.commit] is not None and results[self.last] is not None:
            steps = zip(request.steps, self.positions, strict=True)
            # A step of the side not taken has no result: None, as a file gives one it skips.
            return [
                None if p in self.sided and results[p] is None else _result(step, results[p])
                for step, p in steps
            ], None
        own = next(
            (
                j
                for j in range(self.start, self.last + 1)
                if errors[j] is not None and j not in self.quiet
            ),
            None,
        )
        if own is None:  # its steps did not fail: the transaction did, for all its members
            error = errors[self.commit]
            if error is None:  # BEGIN, or a member's rollback to its savepoint
                error = next(
                    e
                    for j, e in enumerate(errors)
                    if e and j not in self.members and j not in self.quiet
                )
            return None, _error(error)
        if own in self.guards:
            found = None
            if self.conflict is not None and request.conflict is not None:
                found = _result(request.conflict, results[self.conflict])
            raise Conflicted(self.guards[own], found)
        return None, _error(errors[own])


def _group_part(group: list[_Pending]) -> bytes:
    """Several writes as one transaction, written optimistically: every member's steps one
    after the other, each run only if the one before succeeded, COMMIT once the last did,
    ROLLBACK if it did not run. If a member's step fails, the whole transaction rolls back
    and `HranaConnection._settle` sends the group again laid out by `_saved_part`, where
    that member fails alone: two statements a member saved while none fails."""
    if any(pending.wire.saved for pending in group):
        return _saved_part(group)
    steps = [_step(None, _BEGIN_JSON)]
    for pending in group:
        pending.wire.place(steps)
        pending.wire.conflict = None
    return _finish(group, steps)


def _saved_part(group: list[_Pending]) -> bytes:
    """Several writes as one transaction: each member between a SAVEPOINT and its RELEASE,
    run only once the member before it was released; a member whose step failed is rolled
    back to its savepoint (and its conflict read) before its release, so that it fails
    alone. COMMIT runs once every member is released; ROLLBACK if it did not run."""
    steps = [_step(None, _BEGIN_JSON)]
    for pending in group:
        wire = pending.wire
        savepoint = len(steps)
        steps.append(_step(_ok(savepoint - 1), _SAVEPOINT_JSON))
        wire.place(steps)
        undo = len(steps)
        failed = _all(_ok(savepoint), _failed(wire.last))
        steps.append(_step(failed, _ROLLBACK_TO_JSON))
        wire._conflict_read(steps)
        done = _any(_ok(wire.last), _ok(undo))
        steps.append(_step(done, _RELEASE_JSON))
    return _finish(group, steps)


def _finish(group: list[_Pending], steps: list[bytes]) -> bytes:
    """The group's COMMIT (run if the step before it succeeded) and ROLLBACK (if it did not
    run) after ``steps``; each member told where they are and where every member's own
    steps are."""
    commit = len(steps)
    steps.append(_step(_ok(commit - 1), _COMMIT_JSON))
    steps.append(_step(_failed(commit), _ROLLBACK_JSON))
    quiet = frozenset(g for pending in group for g in pending.wire.gates)
    members = (
        frozenset(j for pending in group for j in range(pending.wire.start, pending.wire.last + 1))
        - quiet
    )
    for pending in group:
        pending.wire.commit, pending.wire.members, pending.wire.quiet = commit, members, quiet
    return b'{"type":"batch","batch":{"steps":[' + b",".join(steps) + b"]}}"


def _member_failed(wire: _Wire, first: dict[str, Any]) -> bool:
    """Whether a step of a member of the group that ``wire`` was laid out in failed (in the
    group's one result ``first``); a reply of another shape raises KeyError, TypeError or
    IndexError."""
    if first["type"] != "ok":
        return False
    result = first["response"]["result"]
    results, errors = result["step_results"], result["step_errors"]
    if not isinstance(results, list) or not isinstance(errors, list):
        raise TypeError("step results or errors that are not lists")
    if results[wire.commit] is not None:  # it committed: every member's steps ran
        return False
    failed = [errors[j] for j in wire.members if errors[j] is not None]
    if any(not isinstance(error, dict) for error in failed):
        raise TypeError("a step error that is not an error object")
    return bool(failed)


def _error(error: Any) -> dict[str, Any]:
    """A Hrana error object, checked: ``{"message": str, "code": str | None}``."""
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        raise TypeError(f"an error that is not a Hrana error object: {type(error).__name__}")
    if not isinstance(error.get("code"), (str, type(None))):
        raise TypeError("an error code that is not text")
    return error


def _json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode("ascii")


(
    _BEGIN_JSON,
    _COMMIT_JSON,
    _ROLLBACK_JSON,
    _SAVEPOINT_JSON,
    _RELEASE_JSON,
    _ROLLBACK_TO_JSON,
    _BRANCH_END_JSON,
) = (
    _json(_stmt(statement(name)))
    for name in (
        "begin",
        "commit",
        "rollback",
        "savepoint",
        "release_savepoint",
        "rollback_to_savepoint",
        "branch_end",
    )
)


def _one_transaction(group: list[_Pending]) -> bool:
    """Whether ``group`` goes as one transaction (`_group_part`), with one result for all."""
    return len(group) > 1 and group[0].wire.write


class _Streams:
    """The server's streams kept open between reads (a read costs sqld ~0.5 ms of CPU less
    on a stream it already has than on a new one, which opens a database connection): at
    most `STREAMS` of them, each its Hrana baton while idle. One idle longer than
    `STREAM_IDLE` is let go (sqld expires a stream after 10 s). Writes go on new streams.
    A server that names a ``base_url`` (sticky sessions) gets no stream kept from then on."""

    def __init__(self) -> None:
        self._idle: list[tuple[str, float]] = []  # (baton, when it came back), newest last
        self._open = 0  # idle and in use
        self._keeping = True  # False once off (closed, or a server naming a base_url)
        self._lock = threading.Lock()

    def take(self) -> tuple[str | None, bool]:
        """A read's stream: (its baton, None for a new one; whether it is kept after)."""
        with self._lock:
            if self._idle and time.monotonic() - self._idle[-1][1] < STREAM_IDLE:
                return self._idle.pop()[0], True
            self._open -= len(self._idle)  # the newest is last: all of them are too old
            self._idle.clear()
            if self._keeping and self._open < STREAMS:
                self._open += 1
                return None, True
            return None, False

    def give(self, baton: str) -> None:
        with self._lock:
            self._idle.append((baton, time.monotonic()))

    def drop(self, *, all_idle: bool = False, off: bool = False) -> None:
        """A kept stream let go: its request failed (its baton is not known to be good),
        or its answer named no baton, or another server's (``off``: keep none from now
        on). ``all_idle``: let the idle ones go too (a server that refused one likely
        knows none of them: it restarted)."""
        with self._lock:
            self._open -= 1
            if off:
                self._keeping = False
            if all_idle or off:
                self._let_go()

    def close(self) -> list[str]:
        """Keep none from now on; the batons of the idle ones not yet expired, to close."""
        with self._lock:
            self._keeping = False
            return self._let_go()

    def _let_go(self) -> list[str]:
        now = time.monotonic()
        batons = [baton for baton, since in self._idle if now - since < STREAM_IDLE]
        self._open -= len(self._idle)
        self._idle.clear()
        return batons


STREAMS = 4  # (each holds a database connection of sqld while it lasts)
STREAM_IDLE = 5.0


def _body(group: list[_Pending], streams: _Streams | None = None) -> bytes:
    """One pipeline: the requests in order, or a group of writes as one transaction
    (`_group_part`), on a new stream, then ``close``; a read alone goes on a stream of
    ``streams`` (kept open after, unless there are already `STREAMS`)."""
    wire = group[0].wire
    if streams is not None and len(group) == 1 and not wire.write:
        baton, kept = wire.stream = streams.take()
        after = b"" if kept else b',{"type":"close"}'
        return b'{"baton":%s,"requests":[%s%s]}' % (
            b"null" if baton is None else json.dumps(baton).encode(),
            wire.part,
            after,
        )
    if _one_transaction(group):
        parts = _group_part(group)
    else:
        if wire.write and wire.members:  # a group's member before, alone now
            wire.part = wire.alone()
        parts = b",".join(pending.wire.part for pending in group)
    return b'{"baton":null,"requests":[' + parts + b',{"type":"close"}]}'


class BadReply(Exception):
    """Why a reply could not be read (the parser's complaint, scrubbed): the ``__cause__``
    of the StoreError raised."""


class ServerError(Exception):
    """An error as the server reported it: the ``__cause__`` of the StoreError raised."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.message = message
        self.code = code


# A group (the writes that waited while the one before was in flight) is sent as one
# request of at most this many batches and (past its first) bytes; the rest wait for the
# next. sqld runs each batch of a pipeline as its own transaction, one after the other.
GROUP_MAX = 128
GROUP_BYTES = 1 << 20

# The callers of a group just answered are likely to write again at once (an engine's
# workers, a relay's handlers): the next group waits for them, that is until as many writes
# wait as were waiting or answered when the answer came, for at most GROUP_WAIT seconds
# (threads) or _GROUP_TURNS turns of the event loop (tasks). A lone writer's next write
# finds itself expected, and nothing waits. PostgreSQL's commit_delay with commit_siblings
# is the same idea.
GROUP_WAIT = 0.002
_GROUP_TURNS = 16
# The async writes of a loop go in up to FLIGHTS requests at once, pipelined on one
# connection (HTTP/1.1): sqld reads and runs them one after the other in the order sent, so
# the store never has more than one write at the server (its wedge: see HranaConnection),
# while the next requests cross the link as the one before them runs there. The writes
# waiting are shared among the free flights, at least SPLIT_LEAST a request: 32 writers
# fly in four requests of 8, and each answer's callers fill the next request as it lands.
FLIGHTS = 4
SPLIT_LEAST = 8
_WAKE_TURN = 2  # async callers woken a turn of the loop (see HranaConnection._asender)

# What an https client reads when the server answered in plain HTTP (OpenSSL's words).
_PLAIN_HTTP = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST")


class _Pending:
    """A request waiting for its answer, and once that is in, its outcome (a result, or the
    exception its caller raises); an async caller awaits ``future``."""

    __slots__ = ("done", "error", "future", "result", "wire")

    def __init__(self, wire: _Wire, future: asyncio.Future[Any] | None = None) -> None:
        self.wire = wire
        self.future = future
        self.done = False
        self.result: Any = None
        self.error: BaseException | None = None

    def settle(self, result: Any, error: BaseException | None) -> None:
        self.result, self.error, self.done = result, error, True

    def wake(self) -> None:
        """Hand an async caller its outcome."""
        future = self.future
        if future is not None and not future.done():  # done: its caller was cancelled
            error = self.error
            future.set_result(self.result) if error is None else future.set_exception(error)

    def left(self) -> bool:
        """Whether its async caller was cancelled: nobody waits for its outcome (a write
        that cannot have landed yet is then dropped)."""
        return self.future is not None and self.future.cancelled()

    def outcome(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.result


class _LoopWrites:
    """The async writes of one event loop: those waiting, its sender task (while any
    waits), and how many writes its next group waits for (as `HranaConnection._expect`)."""

    __slots__ = ("awaiting", "changed", "expect", "loop", "pipeline", "sender")

    def __init__(self, loop: asyncio.AbstractEventLoop, pipeline: http.Pipeline) -> None:
        self.loop = loop
        self.awaiting: collections.deque[_Pending] = collections.deque()
        self.sender: asyncio.Task[None] | None = None
        self.changed = asyncio.Event()  # set when a write arrives or a flight lands
        self.pipeline = pipeline  # the connection its write requests go on
        self.expect = 0


def _take(waiting: collections.deque[_Pending], most: int = GROUP_MAX) -> list[_Pending]:
    """The next group: the oldest waiting writes, within ``most`` and (past the first)
    `GROUP_BYTES`; a write whose async caller left before it was sent is dropped."""
    group: list[_Pending] = []
    size = 0
    while waiting and len(group) < most:
        pending = waiting[0]
        if pending.left():
            waiting.popleft()
            continue
        size += len(pending.wire.part)
        if group and size > GROUP_BYTES:
            break
        group.append(waiting.popleft())
    return group


class HranaConnection:
    """A remote primary at ``url`` (``http(s)://``, as `url.parse_database` makes it): every
    request one HTTP round trip, from any thread or task at once.

    Reads go out at once, as many at a time as there are callers. Writes are grouped
    (group commit): one request carries every write batch that waited for it, each its own
    transaction with its own outcome, and a write alone costs one request and no wait. The
    threads of a process send **one write request at a time**; the tasks of an event loop
    up to `FLIGHTS` at once, pipelined on one connection, which sqld answers one after the
    other in the order sent. Either way the store has one write at the server at a time,
    because sqld 0.24.32 can wedge for good when writers queue at its write lock; several
    processes (or loops) writing to one server still queue there, one write each.

    ``timeout`` bounds each request (connecting, sending, waiting for the answer); a write
    can also wait for the requests in flight before its own. A write that was sent and got
    no complete answer raises `OutcomeUnknown`, as does every write of its group. A batch
    the server refused as busy (SQLITE_BUSY: its write lock was not to be had, so the batch
    rolled back) is sent again after a short pause, for up to ``busy_timeout`` seconds, as
    SQLite's busy wait does on a local file; then `StoreBusy`.
    """

    def __init__(
        self, url: str, where: str, *, auth_token: str, timeout: float, busy_timeout: float
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {where}")
        host = parts.netloc.rpartition("@")[2]
        self.url = server_key(url)  # one text for every spelling of the URL: no secret
        self.where = where
        self.key = self.url  # what tells this database apart in the process
        self._endpoint = parts.path.rstrip("/") + "/v3/pipeline"
        self._secrets = (auth_token,) if auth_token else ()
        self._plain_hint = ""
        if parts.scheme == "https":
            self._plain_hint = (
                "; the server answered without TLS: for a plain-HTTP server use "
                f"http://{host} or libsql://{host}?tls=0"
            )
        headers = {"Content-Type": "application/json"}
        if auth_token:
            headers["Authorization"] = f"Bearer {auth_token}"
        self._timeout = timeout
        self._busy_timeout = busy_timeout
        self._options: dict[str, Any] = {
            "headers": headers,
            "timeout": timeout,
            "ssl_context": _system_trust() if parts.scheme == "https" else None,
        }
        origin = f"{parts.scheme}://{host}"
        try:
            self._client = http.Client(origin, **self._options)
        except ValueError as exc:  # it names the header, never its value
            raise ValueError(f"cannot send to {where}: {exc}") from None
        self._origin = origin
        # Made now (it does no I/O): its connections belong to no event loop, so it serves
        # every loop the store is used on, one after the other or at once.
        self._aclient = http.AsyncClient(origin, **self._options)
        # Group commit: the writes waiting, and whether a write request is in flight (sync
        # callers: threads under `_turn`; async callers: the sender task of their loop).
        self._waiting: collections.deque[_Pending] = collections.deque()
        lock = threading.Lock()
        self._turn = threading.Condition(lock)  # notified when a group's answer is in
        self._arrived = threading.Condition(lock)  # notified when a write arrives
        self._flying = self._gathering = False
        self._expect = 0  # writes waiting, and answered, when the last group's answer came
        self._loops: dict[asyncio.AbstractEventLoop, _LoopWrites] = {}  # under `_turn`
        self._streams = _Streams()  # the reads' streams
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store on {self.where} is closed")

    # --- sync: threads ---

    def execute(self, request: Request) -> Any:
        self._check_open()
        mine = _Pending(_Wire(request))
        if not mine.wire.write:
            self._send([mine])
            return mine.outcome()
        with self._turn:
            self._waiting.append(mine)
            if self._gathering:
                self._arrived.notify()
        while True:
            with self._turn:
                leading = False
                try:
                    while self._flying and not mine.done:
                        self._turn.wait()
                    if not mine.done:
                        self._flying = leading = True  # this thread sends the next group
                        if len(self._waiting) < self._expect:  # see GROUP_WAIT
                            self._gathering = True
                            self._arrived.wait_for(
                                lambda: len(self._waiting) >= self._expect, GROUP_WAIT
                            )
                            self._gathering = False
                        group = _take(self._waiting)
                except BaseException:  # KeyboardInterrupt while waiting: nothing sent
                    if mine in self._waiting:
                        self._waiting.remove(mine)
                    if leading:
                        self._flying = self._gathering = False
                        self._turn.notify_all()
                    raise
                if not leading:
                    return mine.outcome()
            try:
                self._send(group)
            finally:
                self._abandon(group)
                with self._turn:
                    self._expect = min(len(self._waiting) + len(group), GROUP_MAX)
                    self._flying = False
                    self._turn.notify_all()

    def _send(self, group: list[_Pending]) -> None:
        """Send ``group`` in one request (again, for those refused as busy) and settle each."""
        started = time.monotonic()
        for tries in itertools.count():
            if self._closed:  # closed meanwhile (a read's second try, a write that waited)
                self._refuse_closed(group)
                return
            try:
                answer: http.Response | http.HTTPFailure = self._client.post(
                    self._endpoint, _body(group, self._streams)
                )
            except http.HTTPFailure as exc:
                answer = exc
            except BaseException as exc:
                self._not_sent(group, exc)
                return
            settle = self._settle(group, answer, started, tries)
            while True:
                try:
                    next(settle)
                except StopIteration as stop:
                    group, pause = stop.value
                    break
            if not group:
                return
            time.sleep(pause)

    # --- async: tasks of any event loop ---

    async def aexecute(self, request: Request) -> Any:
        """Async version of `execute`, on the `http.AsyncClient`; a sender task of the
        caller's loop sends the writes waiting there."""
        self._check_open()
        wire = _Wire(request)
        if not wire.write:
            mine = _Pending(wire)
            await self._asend([mine], None)
            return mine.outcome()
        writes = self._writes()
        mine = _Pending(wire, writes.loop.create_future())
        writes.awaiting.append(mine)
        if writes.sender is None:
            writes.sender = asyncio.create_task(self._asender(writes))
        else:
            writes.changed.set()
        return await mine.future  # type: ignore[misc]

    def _writes(self) -> _LoopWrites:
        """The group-commit state of the running loop, made on its first write. The store
        may be used on one loop after another (``asyncio.run`` twice) or on several at once
        (in threads): each loop's tasks wait for their own loop's request in flight, as the
        writers of two processes would. A closed loop's state is dropped: it has no task
        left to answer."""
        loop = asyncio.get_running_loop()
        writes = self._loops.get(loop)
        if writes is None:
            with self._turn:
                for old in [old for old in self._loops if old.is_closed()]:
                    self._loops.pop(old).pipeline.close()
                writes = self._loops.get(loop)
                if writes is None:
                    writes = _LoopWrites(loop, http.Pipeline(self._aclient))
                    self._loops[loop] = writes
        return writes

    async def _asender(self, writes: _LoopWrites) -> None:
        """Send the waiting writes of this loop, a group per request and up to `FLIGHTS`
        requests in flight on its pipeline, until none waits and none flies."""
        awaiting, changed = writes.awaiting, writes.changed
        flights: set[asyncio.Task[None]] = set()
        failed: list[BaseException] = []  # a flight's own failure (its callers are settled)

        def landed(flight: asyncio.Task[None]) -> None:
            flights.discard(flight)
            if not flight.cancelled() and (error := flight.exception()) is not None:
                failed.append(error)
            changed.set()

        try:
            while awaiting or flights:
                if failed:
                    raise failed[0]
                if self._closed and awaiting:  # closed: nothing more is sent
                    self._refuse_waiting(awaiting)
                    continue
                if not awaiting or len(flights) >= FLIGHTS:
                    changed.clear()
                    await changed.wait()
                    continue
                # Let the writes of the last group, just answered, queue again first (see
                # GROUP_WAIT): a few turns of the loop, no timed wait.
                for _ in range(_GROUP_TURNS):
                    if len(awaiting) >= writes.expect:
                        break
                    await asyncio.sleep(0)
                free = FLIGHTS - len(flights)  # the waiting writes, shared among them
                share = min(GROUP_MAX, max(SPLIT_LEAST, -(-len(awaiting) // free)))
                group = _take(awaiting, share)
                if group:
                    flight = asyncio.create_task(self._afly(writes, group))
                    flights.add(flight)
                    flight.add_done_callback(landed)
        finally:
            if flights:  # the sender was cancelled (the store closes): their writes too
                for flight in flights:
                    flight.cancel()
                await asyncio.wait(list(flights))
            writes.sender = None
            self._refuse_waiting(awaiting)  # the sender itself was cancelled: never sent

    def _refuse_waiting(self, awaiting: collections.deque[_Pending]) -> None:
        while awaiting:
            pending = awaiting.popleft()
            pending.settle(
                None, StoreError(f"the write to {self.where} was not sent: the store closed")
            )
            pending.wake()

    async def _afly(self, writes: _LoopWrites, group: list[_Pending]) -> None:
        """Send one group of the loop's writes on its pipeline and wake its callers."""
        try:
            waiting = await self._asend(group, writes.awaiting, writes.pipeline.post)
            writes.expect = min(waiting + len(group), GROUP_MAX)
        finally:
            self._abandon(group)
            for pending in group:
                pending.wake()

    async def _asend(
        self,
        group: list[_Pending],
        awaiting: collections.deque[_Pending] | None,
        post: Callable[[str, bytes], Awaitable[http.Response]] | None = None,
    ) -> int:
        """Async version of `_send`; it wakes each caller as its outcome is known, a few
        in a turn of the loop (the next steps of 32 callers run in one turn would stall the
        loop for milliseconds). Returns how many writes (of ``awaiting``, the sender's
        queue) waited when the last answer came."""
        started = time.monotonic()
        for tries in itertools.count():
            if self._closed:
                self._refuse_closed(group)
                for pending in group:
                    pending.wake()
                return len(awaiting or ())
            try:
                answer: http.Response | http.HTTPFailure = await (post or self._aclient.post)(
                    self._endpoint, _body(group, self._streams)
                )
            except http.HTTPFailure as exc:
                answer = exc
            except BaseException as exc:
                self._not_sent(group, exc)
                for pending in group:
                    pending.wake()
                return len(awaiting or ())
            waiting = len(awaiting or ())
            settle = self._settle(group, answer, started, tries)
            for n in itertools.count(1):
                try:
                    next(settle).wake()
                except StopIteration as stop:
                    group, pause = stop.value
                    break
                if n % _WAKE_TURN == 0:
                    await asyncio.sleep(0)
            if not group:
                return waiting
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    # --- what an answer means, for every request of it ---

    def _close_streams(self) -> None:
        """Close the streams kept for reads on the server (each a database connection of
        it), best effort: within a second each, and none more once one fails."""
        batons = self._streams.close()
        if not batons:
            return
        try:
            client = http.Client(self._origin, **{**self._options, "timeout": 1.0})
        except ValueError:
            return
        try:
            for baton in batons:
                body = json.dumps({"baton": baton, "requests": [{"type": "close"}]})
                with contextlib.suppress(http.HTTPFailure, RuntimeError):
                    if client.post(self._endpoint, body.encode()).status == 200:
                        continue
                break
        finally:
            client.close()

    def _not_sent(self, group: list[_Pending], exc: BaseException) -> None:
        """The request of ``group`` ended with ``exc`` and no answer to read: a read's
        stream, if kept, is let go; the client closed (the store, by another thread)
        refuses the group as closed (it was never sent); anything else is raised."""
        wire = group[0].wire
        if wire.stream is not None and wire.stream[1]:
            self._streams.drop()
        wire.stream = None
        if not (isinstance(exc, RuntimeError) and self._closed):
            raise exc
        self._refuse_closed(group)

    def _refuse_closed(self, group: list[_Pending]) -> None:
        for pending in group:
            pending.settle(None, StoreError(f"the store on {self.where} is closed"))

    def _abandon(self, group: list[_Pending]) -> None:
        """A group whose sending was interrupted (KeyboardInterrupt, a cancelled sender):
        its writes may have been sent."""
        for pending in group:
            if not pending.done:
                pending.settle(
                    None,
                    OutcomeUnknown(
                        f"the request to {self.where} was interrupted; the write may or "
                        "may not have landed: reload to learn which"
                    ),
                )

    def _settle(
        self,
        todo: list[_Pending],
        answer: http.Response | http.HTTPFailure,
        started: float,
        tries: int,
    ) -> Generator[_Pending, None, tuple[list[_Pending], float]]:
        """Record what one attempt came to for each of ``todo``, yielding each as its
        outcome is settled; return those to send again (refused as busy within
        busy_timeout, or a read whose connection broke) and the pause before."""
        stream = todo[0].wire.stream
        todo[0].wire.stream = None
        kept = stream is not None and stream[1]
        if kept and not (isinstance(answer, http.Response) and answer.status == 200):
            # Its baton is not known to be good any more; if it was an idle one, the others
            # are likely gone too (the server restarted): the read runs again anew.
            self._streams.drop(all_idle=stream is not None and stream[0] is not None)
        if isinstance(answer, http.HTTPFailure):
            # A read whose connection broke runs once more: it changed nothing. A timeout
            # is not retried: that would double the wait.
            if tries == 0 and not todo[0].wire.write and isinstance(answer, http.Broken):
                return todo, 0.0
            for pending in todo:
                error = self._lost(answer, pending.wire)
                error.__cause__ = answer
                pending.settle(None, error)
                yield pending
            return [], 0.0
        if answer.status != 200:
            if stream is not None and stream[0] is not None and tries == 0:
                return todo, 0.0  # a stream the server let go (expired): once more, anew
            for pending in todo:
                pending.settle(None, self._refused(pending.wire, answer))
                yield pending
            return [], 0.0
        try:
            reply = json.loads(answer.body)
            results = reply["results"]
            one = _one_transaction(todo)
            expected = 1 if kept else 2 if one else len(todo) + 1
            if not isinstance(results, list) or len(results) != expected:
                raise ValueError(f"{expected} results expected")
            if kept:  # the stream goes on with the baton of this answer
                baton, kept = reply["baton"], False
                if isinstance(baton, str) and reply.get("base_url") is None:
                    self._streams.give(baton)
                else:  # none, or for a server named (sticky sessions): no more kept
                    self._streams.drop(off=True)
            replay = one and not todo[0].wire.saved and _member_failed(todo[0].wire, results[0])
            if one:  # every member reads its part of the one result
                results = [results[0]] * len(todo)
        except (ValueError, KeyError, TypeError, IndexError, RecursionError) as exc:
            if kept:
                self._streams.drop()
            for pending in todo:
                pending.settle(None, self._garbled(pending.wire, exc))
                yield pending
            return [], 0.0
        if replay:  # written optimistically, a member failed: again, each in a savepoint
            again = []
            for pending in todo:
                if pending.left():  # nothing of the group landed: dropped, as by `_take`
                    pending.settle(None, StoreError(f"the write to {self.where} was withdrawn"))
                    yield pending
                    continue
                pending.wire.saved = True
                again.append(pending)
            return again, 0.0
        pause = min(0.002 * 2**tries, 0.05) * random.uniform(0.5, 1.5)
        in_time = time.monotonic() + pause - started < self._busy_timeout
        again = []
        for pending, first in zip(todo, results, strict=False):
            try:
                pending.settle(self._answer(pending.wire, first), None)
            except StoreBusy as exc:
                if in_time:
                    again.append(pending)
                    continue
                pending.settle(None, exc)
            except (StoreError, Conflicted) as exc:
                pending.settle(None, exc)
            yield pending
        return again, pause

    def _garbled(self, wire: _Wire, exc: Exception) -> StoreError:
        what = scrub(repr(exc), self._secrets)[:300]  # a cell's text may echo anything
        message = f"{self.where} sent a reply that is not a Hrana pipeline result ({what})"
        error = (
            OutcomeUnknown(f"{message}; the write may or may not have landed")
            if wire.write
            else StoreError(message)
        )
        # The parser's own exception would show the reply's text unscrubbed in a traceback.
        error.__cause__ = BadReply(what)
        return error

    def _lost(self, exc: http.HTTPFailure, wire: _Wire) -> StoreError:
        what = scrub(str(exc) or type(exc).__name__, self._secrets)
        if not exc.sent:  # nothing of the request left: it cannot have landed
            plain = any(marker in what for marker in _PLAIN_HTTP)
            return StoreError(
                f"cannot reach {self.where}: {what}{self._plain_hint if plain else ''}"
            )
        if isinstance(exc, http.TimedOut):
            message = f"no answer from {self.where} within {self._timeout:g} s"
        elif isinstance(exc, http.BadResponse):
            message = f"{self.where} sent an answer that is not HTTP: {what}"
        else:
            message = f"the connection to {self.where} broke before the answer came: {what}"
        if wire.write:
            return OutcomeUnknown(
                f"{message}; the write may or may not have landed: reload to learn which"
            )
        return StoreError(message)

    def _answer(self, wire: _Wire, first: Any) -> Any:
        """One request's result in the reply, or its error raised."""
        try:
            result, error = wire.decode(first)
        except Conflicted:
            raise
        except (ValueError, KeyError, TypeError, IndexError, StopIteration, AttributeError) as exc:
            garbled = self._garbled(wire, exc)
            raise garbled from garbled.__cause__
        if error is not None:
            cause = ServerError(scrub(error["message"], self._secrets), error.get("code"))
            raise translate(cause) from cause
        return result

    def _refused(self, wire: _Wire, response: http.Response) -> StoreError:
        status = response.status
        text = scrub(" ".join(response.text.split()), self._secrets)[:300]
        message = f"HTTP {status} from {self.where}: {text}"
        if status in (401, 403):
            return StoreError(
                f"authentication failed: the server refused the auth token ({message})"
            )
        if wire.write and status >= 500:  # a proxy's 502, a server dying mid-batch
            return OutcomeUnknown(
                f"{message}; the write may or may not have landed: reload to learn which"
            )
        return StoreError(message)

    def sync(self) -> None:
        """Nothing to pull: every read goes to the primary."""

    def watch(self) -> ListenWatch:
        """The server's change notifications, over connections of their own."""
        client = http.Client(self._origin, **self._options)
        return ListenWatch(
            client, self._endpoint.removesuffix("/v3/pipeline"), self.where, self._timeout
        )

    def close(self) -> None:
        self._closed = True
        self._close_streams()
        self._aclient.close()  # its idle connections too: that needs no event loop
        self._client.close()
        with self._turn:
            loops = list(self._loops.values())
        running = None
        if loops:  # a loop wrote here (if none did, asyncio need not even be imported)
            with contextlib.suppress(RuntimeError):
                running = asyncio.get_running_loop()
        for writes in loops:
            if writes.loop is running:
                _close_pipeline(writes)
                continue
            try:  # a pipeline is its loop's: closed there, between two of its steps
                writes.loop.call_soon_threadsafe(_close_pipeline, writes)
            except RuntimeError:  # that loop is closed: nothing runs there any more
                writes.pipeline.close()

    async def aclose(self) -> None:
        """Close, from any loop: each loop's sender sends nothing more (its writes not yet
        sent fail: the store is closed), and its requests in flight have their answers
        (this loop's are awaited, within the timeout)."""
        self.close()
        with self._turn:
            writes = self._loops.get(asyncio.get_running_loop())
        sender = writes.sender if writes is not None else None
        if sender is not None and sender is not asyncio.current_task():
            await asyncio.wait([sender])  # (a failure of its own is the task's to report)


def _close_pipeline(writes: _LoopWrites) -> None:
    """On the loop of ``writes``: its sender sends nothing more, its pipeline closes."""
    writes.changed.set()
    writes.pipeline.close()


def _system_trust() -> ssl.SSLContext:
    """TLS verified against the operating system's trust store (SSL_CERT_FILE is honoured)."""
    import truststore

    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
