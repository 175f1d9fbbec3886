"""harel-store: the durable execution store of a Harel statechart engine, over libSQL."""

from __future__ import annotations

from harel_store.aio import AsyncLibsqlStore
from harel_store.errors import (
    OutcomeUnknown,
    SchemaError,
    StoreBusy,
    StoreConflict,
    StoreError,
)
from harel_store.fleet import AsyncFleet, Fleet
from harel_store.models import (
    ArmedTimer,
    ClaimedWork,
    DeadLetter,
    DefinitionRecord,
    DueTimer,
    Event,
    Execution,
    ExecutionPage,
    ExecutionSummary,
    Flow,
    OutboxEntry,
    PendingOutbox,
    PendingSpawn,
    SpawnEntry,
    TimerOp,
    TraceStep,
    WorkAhead,
    WorkerHold,
)
from harel_store.relay import AsyncRelay, Relay
from harel_store.sql import HEAD
from harel_store.store import DEFAULT_TRACE_MAX, LibsqlStore, SqliteStore

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_TRACE_MAX",
    "HEAD",
    "ArmedTimer",
    "AsyncFleet",
    "AsyncLibsqlStore",
    "AsyncRelay",
    "ClaimedWork",
    "DeadLetter",
    "DefinitionRecord",
    "DueTimer",
    "Event",
    "Execution",
    "ExecutionPage",
    "ExecutionSummary",
    "Fleet",
    "Flow",
    "LibsqlStore",
    "OutboxEntry",
    "OutcomeUnknown",
    "PendingOutbox",
    "PendingSpawn",
    "Relay",
    "SchemaError",
    "SpawnEntry",
    "SqliteStore",
    "StoreBusy",
    "StoreConflict",
    "StoreError",
    "TimerOp",
    "TraceStep",
    "WorkAhead",
    "WorkerHold",
]
