"""The values the engine hands the store and gets back (pydantic v2 models, named tuples)."""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

# Ids are keys: non-empty, bounded, and really strings (no silent coercion from int); no NUL,
# which SQLite TEXT does not keep apart (libsql 0.1.8 reads "a\x00b" back as "a").
Id = Annotated[
    str, StringConstraints(strict=True, min_length=1, max_length=512, pattern="^[^\x00]*$")
]
Status = Literal["running", "finished", "failed", "cancelled"]
STATUSES: tuple[str, ...] = ("running", "finished", "failed", "cancelled")


class Execution(BaseModel):
    """One statechart execution, as the engine keeps it between events.

    ``version`` is the optimistic-concurrency counter: a write (`save`, `commit`) succeeds
    only if the stored version is still the one the execution was read at, and then adds
    one. An execution at version 0 has never been stored: its first write inserts it (and
    fails with `StoreConflict` if the id is taken). Fields other than these are kept too
    (``extra="allow"``), inside the stored JSON."""

    # NaN/Infinity serialize as bare tokens (not a silent null) so the store can refuse them.
    model_config = ConfigDict(validate_assignment=True, extra="allow", ser_json_inf_nan="constants")

    id: Id
    """The execution's key: any non-empty string up to 512 characters, without NUL."""
    definition_id: Id
    """The statechart it runs (see `publish_definition`)."""
    version: int = Field(default=0, ge=0, strict=True)
    """Writes so far: 0 until the first one; the store raises it by one on each."""
    status: Status = "running"
    """``running``, ``finished``, ``failed`` or ``cancelled`` (the last three are final)."""
    outcome: str | None = None
    """What a final execution ended with, as the engine names it."""
    active_path: str | None = None
    """The engine's active state configuration (a path such as ``main.placed``)."""
    parent_id: Id | None = None
    """The execution that spawned this one (None: a root)."""
    finished_at: float | None = Field(default=None, allow_inf_nan=False)
    """Epoch seconds when it reached a final status, as the engine records it."""
    context: dict[str, Any] = Field(default_factory=dict)
    """The execution's data (JSON: strings, finite numbers, booleans, None, lists, dicts)."""


def _new_id() -> str:
    return uuid.uuid4().hex


class Event(BaseModel):
    """An event handled or emitted by an execution; ``id`` is its dedupe key."""

    model_config = ConfigDict(extra="allow", ser_json_inf_nan="constants")

    name: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=512)]
    """The event's name, as the statechart's transitions name it."""
    id: Id = Field(default_factory=_new_id)
    """Its dedupe key, generated (32 hex digits) unless given: the receiver commits it as its
    ``processed_event_id``, so a redelivered event is seen as handled."""
    payload: dict[str, Any] = Field(default_factory=dict)
    """The event's data (JSON)."""


class TimerOp(BaseModel):
    """A timer change carried by a commit: ``TimerOp.schedule(path, at)`` or ``.cancel(path)``."""

    model_config = ConfigDict(frozen=True)

    action: Literal["schedule", "cancel"]
    path: Id
    fire_at: float | None = Field(default=None, allow_inf_nan=False)

    @model_validator(mode="after")
    def _fire_at_if_scheduled(self) -> TimerOp:
        if self.action == "schedule" and self.fire_at is None:
            raise ValueError("a scheduled timer needs a finite fire_at")
        return self

    @classmethod
    def schedule(cls, path: str, fire_at: float) -> TimerOp:
        """Arm (or re-arm) the timer at ``path`` to fire at epoch second ``fire_at``."""
        return cls(action="schedule", path=path, fire_at=fire_at)

    @classmethod
    def cancel(cls, path: str) -> TimerOp:
        """Disarm the timer at ``path`` (a no-op if none is armed)."""
        return cls(action="cancel", path=path)


class _Carried:
    """What a store read of a relay item besides its fields: the database it came from (a
    store of another database refuses it: its seq names another row there), and, from a
    claim, when it was written (epoch seconds, the database's clock) and the W3C traceparent
    of the commit that wrote it (0010), for its relay. Attributes of the object, not fields
    of the tuple: equality, unpacking, the repr and a copy made by hand are the fields'
    alone, and an item built by hand carries None (taken by every store)."""

    _origin: str | None = None
    _written_at: float | None = None
    _traceparent: str | None = None
    # Its turn in the claim that took it (0011): its key's priority negated, and its rank. A
    # relay handles a round's items in that order (ClaimedWork.items).
    _turn: tuple[int, int] = (0, 0)


class _OutboxFields(NamedTuple):
    seq: int
    """Its place in the outbox: entries are delivered oldest (lowest) first."""
    target_id: str | None
    """The execution to deliver it to; None: not addressed to an execution (an event for
    the outside world: the engine's relay decides where it goes)."""
    event: Event
    """The event, with the ``id`` the receiver dedupes it by."""


class OutboxEntry(_OutboxFields, _Carried):
    """An emitted event waiting for delivery (a commit's ``emits`` item ``(target_id,
    event)``), as the relays read it; consume it with `ack`, or `commit(..., acks=)`."""


class _SpawnFields(NamedTuple):
    seq: int
    """Its place in the spawn queue, oldest first."""
    parent_id: str
    """The execution whose commit asked for the child."""
    child_id: str
    """The new execution's id."""
    root_path: str
    """The state the child starts in."""
    context: dict[str, Any]
    """The child's initial context (JSON)."""


class SpawnEntry(_SpawnFields, _Carried):
    """A child execution to create (a commit's ``spawns`` item ``(child_id, root_path,
    context)``), as the relays read it; consume it with `ack`, or `commit(..., acks=)`."""


class _TimerFields(NamedTuple):
    execution_id: str
    path: str
    fire_at: float


class DueTimer(_TimerFields, _Carried):
    """A timer due to fire, as `due_timers` and `claim_due_timers` hand it out (a tuple)."""

    @property
    def event_id(self) -> str:
        """A stable id for this firing, to pass as the commit's ``processed_event_id``: the
        same for the same ``(execution_id, path, fire_at)`` in any process, different for
        any other (a digest of the three, each exactly: a float by its repr, -0.0 as 0.0),
        and a valid `Event.id`. A timer fired again after a lost lease is then seen as
        processed."""
        key = json.dumps([self.execution_id, self.path, repr(float(self.fire_at) + 0.0)])
        return "timer-" + hashlib.sha256(key.encode("ascii")).hexdigest()


DeadKind = Literal["outbox", "spawn", "timer"]
DEAD_KINDS: tuple[DeadKind, ...] = ("outbox", "spawn", "timer")
# What a relay claims and acks (`Store.ack`, `commit(..., acks=)`, `fail`, `extend`, `revive`).
RelayItem = OutboxEntry | SpawnEntry | DueTimer


class WorkAhead(NamedTuple):
    """What a relay could claim, as `peek_work` (or a `claim_work`, after its claims) read
    it: whether an outbox entry, a spawn, and a timer due at the ``now`` given are
    claimable (live, and held by no live lease nor waiting out a `fail`'s retry), and the
    soonest armed timer not due at ``now`` (epoch seconds; None: there is none)."""

    outbox: bool
    """An outbox entry is claimable now."""
    spawns: bool
    """A spawn is claimable now."""
    timers: bool
    """A timer due at ``now`` is claimable."""
    next_timer_at: float | None
    """The soonest armed timer's fire_at after ``now`` (epoch seconds), or None."""

    def ready(self, kind: DeadKind) -> bool:
        """Whether work of ``kind`` (``"outbox"``, ``"spawn"``, ``"timer"``) is claimable."""
        return self.outbox if kind == "outbox" else self.spawns if kind == "spawn" else self.timers


def _in_turn(item: OutboxEntry | SpawnEntry) -> tuple[int, int, int]:
    return (*item._turn, item.seq)


class ClaimedWork(NamedTuple):
    """What `claim_work` claimed of each kind (as `claim_outbox`, `claim_spawns` and
    `claim_due_timers` return it; empty for a kind not asked for), and what is left to
    claim after it (``ahead``)."""

    outbox: list[OutboxEntry]
    """The outbox entries claimed, oldest first."""
    spawns: list[SpawnEntry]
    """The spawns claimed, oldest first."""
    timers: list[DueTimer]
    """The timers claimed, soonest first."""
    ahead: WorkAhead
    """What is left to claim after these."""

    def items(self) -> list[tuple[DeadKind, RelayItem]]:
        """Every item claimed, with its kind: the outbox's, then the spawns', then the
        timers'; the outbox entries and the spawns in their turns (their keys' priority,
        then their rank: the order the claim took them in), the timers soonest first."""
        return [
            *(("outbox", entry) for entry in sorted(self.outbox, key=_in_turn)),
            *(("spawn", spawn) for spawn in sorted(self.spawns, key=_in_turn)),
            *(("timer", timer) for timer in self.timers),
        ]


class Flow(NamedTuple):
    """A flow key's settings (`set_flow`), and what its items are doing now: the claims of
    every worker honour them (see the relays guide). A key with no settings is not listed."""

    key: str
    """The flow key: by default the root key of the execution an item concerns."""
    priority: int
    """Higher first: a claim takes the items of higher priorities before any other."""
    concurrency: int | None
    """At most this many of the key's items held at once, all kinds (None: no limit)."""
    paused: bool
    """No item of the key is claimed while it is paused (its due timers wait)."""
    rate: tuple[int, float] | None
    """``(count, seconds)``: at most ``count`` of its items claimed in any ``seconds``, on
    the database's clock (None: no rate)."""
    pending: int
    """Its items waiting to be claimed: outbox entries and spawns neither held nor dead,
    and due timers not held."""
    held: int
    """Its items claimed under a live lease, all kinds."""


class WorkerHold(NamedTuple):
    """What one worker holds now (`workers`): claimed under a live lease."""

    worker: str
    held: dict[str, int]
    """Items held by kind: ``"outbox"``, ``"spawn"``, ``"timer"`` (a kind it holds none of
    is absent)."""
    lease_until: float
    """The latest of its leases' ends (epoch seconds, the database's clock)."""


class DeadLetter(NamedTuple):
    """A row a claim set aside after ``attempts`` claims (its ``max_attempts``): ``kind`` is
    ``"outbox"``, ``"spawn"`` or ``"timer"``, ``item`` the `OutboxEntry`, `SpawnEntry` or
    `DueTimer`, ``last_error`` what the last `fail` said (None: no worker failed it, its
    handler died). Never claimed again until `revive`d; `ack` discards it."""

    kind: DeadKind
    item: RelayItem
    attempts: int
    last_error: str | None


class DeadView(NamedTuple):
    """A dead letter as an operator sees it (`dead_view`): its ``kind`` and ``key`` (as
    `dead_letter` and `discard_dead_letter` take it: a seq, a timer's (execution_id, path)),
    the `DeadLetter` (None when what it holds cannot be read: ``problem`` says why; it can
    still be discarded), when it died (the database's clock; None if unknown), its attempts
    and last error."""

    kind: DeadKind
    key: int | tuple[str, str]
    letter: DeadLetter | None
    died_at: float | None
    attempts: int
    last_error: str | None
    problem: str | None


class PendingOutbox(NamedTuple):
    """An undelivered outbox entry as an operator sees it: who emitted it (``source_id``,
    None before 0005), when (``created_at``, the database's clock; None before 0002), which
    relay holds it until when (None: not claimed), how often it was claimed and what the last
    worker that failed to deliver it said (0006)."""

    seq: int
    target_id: str | None
    source_id: str | None
    created_at: float | None
    claimed_by: str | None
    claimed_until: float | None
    attempts: int
    last_error: str | None
    event: Event


class PendingSpawn(NamedTuple):
    """A child still to be created, as an operator sees it (``created_at``: None before 0005)."""

    seq: int
    parent_id: str
    child_id: str
    root_path: str
    created_at: float | None
    claimed_by: str | None
    claimed_until: float | None
    attempts: int
    last_error: str | None
    context: dict[str, Any]


class ArmedTimer(NamedTuple):
    """An armed timer as an operator sees it, with the relay that holds it (if any), its
    claims and the last worker's error."""

    execution_id: str
    path: str
    fire_at: float
    claimed_by: str | None
    claimed_until: float | None
    attempts: int
    last_error: str | None


@dataclass(frozen=True)
class TraceStep:
    """A trace step as an operator sees it: its index in the ring, when it was recorded
    (epoch seconds on the database's clock; None for a step recorded before migration
    0008) and the entry the engine wrote. (A dataclass: a named tuple's ``index`` is a
    method.)"""

    index: int
    recorded_at: float | None
    entry: dict[str, Any]


class ExecutionSummary(BaseModel):
    """The scalar fields of an execution, as the monitor lists them. ``created_at`` (the
    first save) and ``updated_at`` (the latest CAS write) are epoch seconds on the database's
    clock; None for an execution last written before migration 0005."""

    model_config = ConfigDict(frozen=True)

    id: str
    definition_id: str
    version: int
    status: str
    outcome: str | None = None
    active_path: str | None = None
    parent_id: str | None = None
    finished_at: float | None = None
    created_at: float | None = None
    updated_at: float | None = None


class ExecutionPage(BaseModel):
    """One page of a listing; pass ``next_cursor`` back for the next (None: no more)."""

    model_config = ConfigDict(frozen=True)

    items: list[ExecutionSummary]
    """This page's executions (iterate ``page.items``: iterating the page itself yields
    pydantic's field pairs)."""
    next_cursor: str | None = None
    """Pass it as ``cursor=`` for the next page; None on the last."""


class DefinitionRecord(BaseModel):
    """One published version of a machine definition; ``source`` holds its files."""

    model_config = ConfigDict(frozen=True)

    definition_id: Id
    version: int = Field(ge=0, strict=True)
    digest: Annotated[str, StringConstraints(strict=True, min_length=1, max_length=512)]
    source: dict[str, Any]
    published_at: float | None = Field(default=None, allow_inf_nan=False)
