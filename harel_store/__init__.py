"""harel-store: the durable execution store of a Harel statechart engine, over libSQL."""

from __future__ import annotations

import functools
from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
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

# Each public name is imported from its module when first asked for (PEP 562), and so is a
# submodule asked for as an attribute: a process that needs part of the package (the CLI,
# Alembic's env, a child program) imports that part.
_MODULE_OF = {
    "ArmedTimer": "harel_store.models",
    "AsyncFleet": "harel_store.fleet",
    "AsyncLibsqlStore": "harel_store.aio",
    "AsyncRelay": "harel_store.relay",
    "ClaimedWork": "harel_store.models",
    "DEFAULT_TRACE_MAX": "harel_store.store",
    "DeadLetter": "harel_store.models",
    "DefinitionRecord": "harel_store.models",
    "DueTimer": "harel_store.models",
    "Event": "harel_store.models",
    "Execution": "harel_store.models",
    "ExecutionPage": "harel_store.models",
    "ExecutionSummary": "harel_store.models",
    "Fleet": "harel_store.fleet",
    "Flow": "harel_store.models",
    "HEAD": "harel_store.sql",
    "LibsqlStore": "harel_store.store",
    "OutboxEntry": "harel_store.models",
    "OutcomeUnknown": "harel_store.errors",
    "PendingOutbox": "harel_store.models",
    "PendingSpawn": "harel_store.models",
    "Relay": "harel_store.relay",
    "SchemaError": "harel_store.errors",
    "SpawnEntry": "harel_store.models",
    "SqliteStore": "harel_store.store",
    "StoreBusy": "harel_store.errors",
    "StoreConflict": "harel_store.errors",
    "StoreError": "harel_store.errors",
    "TimerOp": "harel_store.models",
    "TraceStep": "harel_store.models",
    "WorkAhead": "harel_store.models",
    "WorkerHold": "harel_store.models",
}


def __getattr__(name: str) -> Any:
    if name in _MODULE_OF:
        value = getattr(import_module(_MODULE_OF[name]), name)
    elif name in _submodules():  # as `harel_store.store.StoreStats` (importing all made one)
        value = import_module(f"{__name__}.{name}")
    else:  # a tool's probe (__wrapped__, _repr_html_), a dotted or odd name: nothing imported
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


@functools.cache
def _submodules() -> frozenset[str]:
    """The package's own modules and packages (a folder without ``__init__``, as the wheel's
    migrations, is none); ``__main__`` (it runs the CLI) is not one."""
    import pkgutil

    return frozenset(m.name for m in pkgutil.iter_modules(__path__)) - {"__main__"}


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})


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
