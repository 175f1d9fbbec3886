"""What the store asks of a connection, as data: one read, or one write batch.

A store method is a *plan*: a generator that yields a request (a `Statement` to read, or a
`Batch` to write) and is sent back its result, so the same method body runs over a local
file, a remote primary or a replica, and under a sync or an async driver (`drive`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from contextlib import suppress
from typing import Any, NamedTuple, TypeVar

from harel_store.lazy import asyncio
from harel_store.sql import QUERIES, Query, RowError

T = TypeVar("T")


# One query (a named block of ``sql/queries.sql``) with its parameters laid out for ``?``.
Statement = tuple[Query, Sequence[Any]]


def statement(name: str, *params: Any) -> Statement:
    query = QUERIES[name]
    return query, query.bind(params)


class Batch:
    """One write transaction: its steps run in order and land together or not at all.

    A *guard* step must change at least one row (a version CAS, a revision claim), or exactly
    ``rows`` rows when given (the CAS of several executions at once): if it does not,
    nothing after it runs, the transaction rolls back, and the connection
    raises `Conflicted` carrying what the batch's ``conflict`` statement read, in the same
    round trip. The result is one entry per step, shaped by its query's kind.

    A step added with ``only_if=(step, least)`` can change something only once the earlier
    step's result reached ``least`` (the trace ring's trim, once the ring is full), and one
    added with ``unless=(step, least)`` only while it has not (a claim's plain statement,
    while no flow has settings): a local connection skips it otherwise (its result is then
    None); a remote batch cannot branch on a value, so it always runs it, to no effect.
    A step added with ``remote=True`` serves only a server's change notifications (a file's
    watch hears every commit): a local connection skips it.

    A step given a *gate* (`gate`) lets a remote batch branch after all: the gate, sent right
    after the step, is a statement that fails exactly when the step's result reaches 1, and
    the steps ``only_if``/``unless`` that step at 1 then run on the server on their side of
    it (the others still run, to no effect, as above). One gate a batch.
    """

    __slots__ = ("conflict", "gated", "guards", "only_if", "remote", "steps")

    def __init__(self) -> None:
        self.steps: list[Statement] = []
        self.guards: dict[int, int | None] = {}  # step -> the rows it must change (None: any)
        # step -> (the earlier step, the least result it needs, whether that skips it instead)
        self.only_if: dict[int, tuple[int, int, bool]] = {}
        self.remote: set[int] = set()  # steps a local connection skips
        self.conflict: Statement | None = None
        self.gated: tuple[int, Statement] | None = None  # (step, its gate): see `gate`

    def add(
        self,
        name: str,
        *params: Any,
        only_if: tuple[int, int] | None = None,
        unless: tuple[int, int] | None = None,
        remote: bool = False,
    ) -> int:
        """Append a step; return its index in the batch's result."""
        query = QUERIES[name]
        self.steps.append((query, query.bind(params)))
        if remote:
            self.remote.add(len(self.steps) - 1)
        if only_if is not None:
            self.only_if[len(self.steps) - 1] = (*only_if, False)
        if unless is not None:
            self.only_if[len(self.steps) - 1] = (*unless, True)
        return len(self.steps) - 1

    def skips(self, index: int, results: Sequence[Any]) -> bool:
        """Whether a local connection skips step ``index``, given the results so far."""
        if index in self.remote:
            return True
        condition = self.only_if.get(index)
        if condition is None:
            return False
        step, least, negate = condition
        return bool(results[step] < least) != negate

    def gate(self, step: int, name: str) -> None:
        """Give step ``step`` its gate for a remote batch: query ``name``, which fails exactly
        when the step's result is 1 or more (see the class docstring)."""
        if self.gated is not None:
            raise ValueError("a batch has one gate")
        if not 0 <= step < len(self.steps):
            raise ValueError(f"no step {step} to gate: the batch has {len(self.steps)}")
        self.gated = (step, statement(name))

    def side(self, index: int) -> int | None:
        """The side of the gate step ``index`` runs on in a remote batch: 0 while the gate
        passes (``unless`` its step reached 1), 1 once it failed (``only_if`` it did), None
        on both (not branched on the gated step at 1)."""
        condition = self.only_if.get(index)
        if self.gated is None or condition is None:
            return None
        step, least, negate = condition
        if step != self.gated[0] or least != 1:
            return None
        return 0 if negate else 1

    def guard(self, name: str, *params: Any, rows: int | None = None) -> int:
        """Append a step that must change a row, or exactly ``rows`` rows (see the class
        docstring)."""
        if QUERIES[name].kind != "!":
            raise ValueError(f"a guard step counts the rows it changed: {name} is not a `!` query")
        index = self.add(name, *params)
        self.guards[index] = rows
        return index

    def guarded(self, index: int, changed: int) -> bool:
        """Whether step ``index`` passes its guard (any step that is none does), having
        changed ``changed`` rows."""
        if index not in self.guards:
            return True
        rows = self.guards[index]
        return changed > 0 if rows is None else changed == rows

    def on_conflict(self, name: str, *params: Any) -> None:
        """What to read, after the rollback, when a guard step changed no row."""
        self.conflict = statement(name, *params)

    def __repr__(self) -> str:
        return f"Batch({', '.join(query.name for query, _ in self.steps)})"


class Conflicted(Exception):
    """A guard step of a batch changed no row: nothing of the batch was written."""

    def __init__(self, step: int, found: Any) -> None:
        super().__init__(f"guard step {step} changed no row")
        self.step = step
        self.found = found


class Fresh(NamedTuple):
    """A read that must see every commit made so far, wherever it was made: an embedded
    replica sends it to its primary (its own copy lags); anywhere else it is a plain read."""

    statement: Statement


def fresh(name: str, *params: Any) -> Fresh:
    return Fresh(statement(name, *params))


Request = Statement | Batch | Fresh
Plan = Generator[Request, Any, T]


def shape(query: Query, rows: list[tuple[Any, ...]], changed: int) -> Any:
    """A statement's result as its query's kind says (see the header of queries.sql), its
    rows checked against the row the query declares: a row that does not fit, or no row
    where one is due (``=``), raises RowError naming the query (and the column and the
    row's key)."""
    kind = query.kind
    if kind == "!":
        return changed
    if query.row:
        rows = query.check(rows)
    if kind == "^":
        return rows[0] if rows else None
    if kind == "=":
        if not rows:
            raise RowError(f"the database returned no row of {query.name}, where one is due")
        return rows[0]
    if kind == "$":
        return rows[0][0] if rows else None
    return rows


def drive(execute: Callable[[Request], Any], plan: Plan[T]) -> T:
    """Run a plan to its end, each request through ``execute``; its errors go back into the
    plan (which restores what it changed, or turns them into the store's own)."""
    try:
        request = next(plan)
        while True:
            try:
                result = execute(request)
            except BaseException as exc:
                request = plan.throw(exc)
            else:
                request = plan.send(result)
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]


async def settle(
    awaitable: Awaitable[T],
) -> tuple[asyncio.Future[T], asyncio.CancelledError | None]:
    """Await ``awaitable`` to its end even if the caller is cancelled meanwhile; return it
    (done) and the cancellation that arrived, which the caller raises once it has used the
    outcome. A request once sent is never abandoned half-way by a cancellation."""
    task = asyncio.ensure_future(awaitable)
    cancelled = None
    while not task.done():
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError as exc:
            cancelled = exc
    return task, cancelled


async def adrive(execute: Callable[[Request], Awaitable[Any]], plan: Plan[T]) -> T:
    """Async version of `drive`. A cancelled call waits for the request in flight, hands its
    outcome to the plan (so ``exe`` tells what is stored), and then raises the cancellation."""
    try:
        request = next(plan)
        while True:
            task, cancelled = await settle(execute(request))
            error = asyncio.CancelledError() if task.cancelled() else task.exception()
            if cancelled is not None:
                with suppress(BaseException):  # the cancellation wins over the outcome
                    plan.throw(error) if error is not None else plan.send(task.result())
                plan.close()
                raise cancelled
            request = plan.throw(error) if error is not None else plan.send(task.result())
    except StopIteration as stop:
        return stop.value  # type: ignore[no-any-return]
