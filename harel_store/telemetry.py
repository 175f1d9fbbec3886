"""OpenTelemetry, through its API only (the ``otel`` extra: opentelemetry-api).

The store records into the global providers an application sets: the commit histogram and
span (`observed`), and the relays' item counter, lag histogram and handler span. Without
the API, or with no provider set (the API's defaults are proxies that record nothing),
nothing is recorded and a commit costs one check more (`active`).

Names and attributes (the contract):

- ``harel_store.commit.duration`` (histogram, s): ``harel_store.database`` (the store's
  display name, never a secret) and ``outcome`` (``ok``, ``conflict``, ``unknown``,
  ``error``); a span ``harel_store.commit`` around each commit, with the same attributes.
- ``harel_store.relay.items`` (counter): ``kind`` (``outbox``, ``spawn``, ``timer``) and
  ``outcome`` (``done``, ``failed``: its handler raised, ``dead``: a claim made it a dead
  letter, whoever held its last attempt, ``released``).
- ``harel_store.relay.lag`` (histogram, s): ``kind``; an item's age when its handler
  starts: from when it was written (the database's clock), a timer from its ``fire_at``.
- a span ``harel_store.relay.handle`` around each handler call, current while it runs (the
  handler's own spans nest in it), with ``kind``, ``harel_store.item``,
  ``harel_store.execution`` (the execution the item steps: an event's target, a spawn's
  child, a timer's execution) and ``harel_store.event`` (an event's name), linked to the
  span the commit that wrote the item ran in (its W3C ``traceparent``, stored with the item
  since 0010), in whatever process that was.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from harel_store.batch import Plan
from harel_store.errors import OutcomeUnknown, StoreConflict

# The API is looked up where the application has imported it, never imported here: an
# application that does not use OpenTelemetry has set no provider, and importing the API
# would make every garbage collection of the process walk its objects (~3 % more
# instructions a commit, measured). Once imported, its globals say whether a provider is set
# (None before one is), a look that costs far less than get_tracer_provider() and
# get_meter_provider(), which read the environment; a provider named in it to be loaded
# (OpenTelemetry's auto-instrumentation) counts as set.
_NAMED = any(
    name in os.environ for name in ("OTEL_PYTHON_TRACER_PROVIDER", "OTEL_PYTHON_METER_PROVIDER")
)


def _api() -> tuple[Any, Any] | None:
    """The API's trace and metrics modules if the application imported them and set a
    provider; None otherwise (a lookup of each in sys.modules, and of its global)."""
    trace = sys.modules.get("opentelemetry.trace")
    state = sys.modules.get("opentelemetry.metrics._internal")
    if trace is None and state is None:
        return None
    tracing = getattr(trace, "_TRACER_PROVIDER", None)
    if not _NAMED and tracing is None and getattr(state, "_METER_PROVIDER", None) is None:
        return None
    from opentelemetry import metrics, trace

    return trace, metrics


T = TypeVar("T")
F = TypeVar("F", bound=Callable[..., Any])
NAME = "harel_store"


class _Instruments:
    """The instruments of one pair of providers, made on first use."""

    def __init__(self, tracer_provider: Any, meter_provider: Any) -> None:
        from opentelemetry.metrics._internal import _ProxyMeterProvider
        from opentelemetry.trace import ProxyTracerProvider

        from harel_store import __version__

        self.providers = (tracer_provider, meter_provider)
        self.tracer = None
        if not isinstance(tracer_provider, ProxyTracerProvider):
            self.tracer = tracer_provider.get_tracer(NAME, __version__)
        self.commits = self.items = self.lag = None
        if not isinstance(meter_provider, _ProxyMeterProvider):
            meter = meter_provider.get_meter(NAME, __version__)
            self.commits = meter.create_histogram(
                "harel_store.commit.duration", unit="s", description="How long a commit took"
            )
            self.items = meter.create_counter(
                "harel_store.relay.items", description="Relay items, by what became of them"
            )
            self.lag = meter.create_histogram(
                "harel_store.relay.lag", unit="s", description="How late a handler started"
            )


_current: _Instruments | None = None


def instruments() -> _Instruments | None:
    """The instruments of the providers set now; None when the API is absent or neither a
    tracer nor a meter provider is set."""
    global _current
    api = _api()
    if api is None:
        return None
    trace, metrics = api
    tracers, meters = trace.get_tracer_provider(), metrics.get_meter_provider()
    if _current is None or _current.providers != (tracers, meters):
        _current = _Instruments(tracers, meters)
    return _current if _current.tracer or _current.commits else None


def observed(plan: F) -> F:
    """A commit's plan, timed and traced (`_watched`) while a provider is set."""

    @functools.wraps(plan)
    def watched(store: Any, /, *args: Any, **kwargs: Any) -> Plan[Any]:
        inner = plan(store, *args, **kwargs)
        found = instruments()
        return inner if found is None else _watched(inner, found, store._conn.where)

    return watched  # type: ignore[return-value]


def _watched(inner: Plan[T], found: _Instruments, where: str) -> Plan[T]:
    attributes = {"harel_store.database": where}
    span = (
        None
        if found.tracer is None
        else found.tracer.start_span("harel_store.commit", attributes=attributes)
    )
    started, outcome = time.perf_counter(), "error"
    try:
        result = yield from inner
        outcome = "ok"
        return result
    except StoreConflict:
        outcome = "conflict"
        raise
    except OutcomeUnknown:
        outcome = "unknown"
        raise
    finally:
        if found.commits is not None:
            found.commits.record(time.perf_counter() - started, {**attributes, "outcome": outcome})
        if span is not None:
            span.set_attribute("outcome", outcome)
            if outcome != "ok":
                from opentelemetry.trace import Status, StatusCode

                span.set_status(Status(StatusCode.ERROR, outcome))
            span.end()


def traceparent() -> str | None:
    """The W3C traceparent of the current span, for the relay items a commit writes: None
    unless the application imported the API and a valid span (its own, or one it took from
    a caller's headers) is current."""
    trace = sys.modules.get("opentelemetry.trace")
    if trace is None:
        return None
    span = trace.get_current_span().get_span_context()
    if not span.is_valid:
        return None
    return f"00-{span.trace_id:032x}-{span.span_id:016x}-{span.trace_flags:02x}"


def _links(item: Any) -> list[Any]:
    """The link from a handler's span to the span of the commit that wrote ``item``, when
    that commit carried one (read with the API's W3C propagator: a malformed value is none)."""
    if item._traceparent is None:
        return []
    from opentelemetry import trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    carried = TraceContextTextMapPropagator().extract({"traceparent": item._traceparent})
    span = trace.get_current_span(carried).get_span_context()
    return [trace.Link(span)] if span.is_valid else []


KINDS = {"OutboxEntry": "outbox", "SpawnEntry": "spawn", "DueTimer": "timer"}


def kind_of(item: Any) -> str:
    """A relay item's kind, as the attributes name it."""
    return KINDS[type(item).__name__]


def count(items: Iterable[Any], outcome: str) -> None:
    """Relay ``items`` came to ``outcome``: counted by kind."""
    found = instruments()
    if found is not None and found.items is not None:
        for kind, n in collections.Counter(map(kind_of, items)).items():
            found.items.add(n, {"kind": kind, "outcome": outcome})


def count_kind(kind: str, n: int, outcome: str) -> None:
    """``n`` relay items of ``kind`` came to ``outcome`` (a claim's dead letters: it reads
    their keys, not the items)."""
    if n:
        found = instruments()
        if found is not None and found.items is not None:
            found.items.add(n, {"kind": kind, "outcome": outcome})


def _subject(kind: str, item: Any) -> dict[str, str]:
    """What a handler's span says its item is about: ``harel_store.execution``, the
    execution it steps (an event's target: none for one to the outside world; a spawn's
    child; a timer's execution), and ``harel_store.event``, an outbox entry's event name."""
    if kind == "outbox":
        subject = {"harel_store.event": item.event.name}
        if item.target_id is not None:
            subject["harel_store.execution"] = item.target_id
        return subject
    return {"harel_store.execution": item.child_id if kind == "spawn" else item.execution_id}


@contextlib.contextmanager
def handling(kind: str, item: Any, describe: Callable[[Any], str]) -> Iterator[None]:
    """Around a handler call: the lag of a timer, and the current span
    ``harel_store.relay.handle`` (the item named by ``describe``, only then)."""
    found = instruments()
    if found is None:
        yield
        return
    if found.lag is not None:
        since = item.fire_at if kind == "timer" else item._written_at
        if since is not None:
            found.lag.record(max(time.time() - since, 0.0), {"kind": kind})
    if found.tracer is None:
        yield
        return
    attributes = {"kind": kind, "harel_store.item": describe(item), **_subject(kind, item)}
    with found.tracer.start_as_current_span(
        "harel_store.relay.handle", attributes=attributes, links=_links(item)
    ):
        yield
