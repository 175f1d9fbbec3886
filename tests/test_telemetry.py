"""OpenTelemetry (harel_store.telemetry): what a commit and a relay record into the global
providers an application sets, read back with the SDK's in-memory reader and exporter;
nothing with no provider set."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import metrics, trace
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.util._once import Once

from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    Relay,
    StoreConflict,
    StoreError,
    TimerOp,
    telemetry,
)
from tests.proxy import Proxy


class Recorded:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        self.reader = InMemoryMetricReader()

    def points(self, name: str) -> list[tuple[dict[str, Any], Any]]:
        """Each data point of the instrument ``name``: its attributes and the point."""
        data = self.reader.get_metrics_data()
        found = []
        for resource in data.resource_metrics if data else []:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    if metric.name == name:
                        found += [(dict(p.attributes), p) for p in metric.data.data_points]
        return found


def _reset() -> None:
    """The API's global providers back to their proxies (what an application that sets
    none has); the API allows setting them once, so its own tests reset them so."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    metrics._internal._METER_PROVIDER_SET_ONCE = Once()
    metrics._internal._METER_PROVIDER = None


@pytest.fixture
def recorded() -> Iterator[Recorded]:
    got = Recorded()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(got.spans))
    meter_provider = MeterProvider(metric_readers=[got.reader])
    trace.set_tracer_provider(tracer_provider)
    metrics.set_meter_provider(meter_provider)
    try:
        yield got
    finally:
        _reset()
        meter_provider.shutdown()
        tracer_provider.shutdown()


def commits(got: Recorded) -> dict[str, int]:
    """The commit histogram's counts by outcome (one database)."""
    points = got.points("harel_store.commit.duration")
    assert len({a["harel_store.database"] for a, _ in points}) <= 1, points
    return {a["outcome"]: p.count for a, p in points}


def test_a_commit_records_its_duration_and_span_by_outcome(
    recorded: Recorded, tmp_path: Path
) -> None:
    db = str(tmp_path / "t.db")
    store = LibsqlStore(db)
    exe = Execution(id="exe-1", definition_id="d")
    store.commit(exe, [(None, Event(name="go"))])
    store.commit(exe, [])
    stale = exe.model_copy(update={"version": 1})
    with pytest.raises(StoreConflict):
        store.commit(stale, [])
    store.close()
    with pytest.raises(StoreError):
        store.commit(exe, [])  # refused: the store is closed
    assert commits(recorded) == {"ok": 2, "conflict": 1, "error": 1}
    (attributes, point), *_ = recorded.points("harel_store.commit.duration")
    assert attributes["harel_store.database"] == db and 0 < point.sum < 10
    spans = recorded.spans.get_finished_spans()
    assert [s.name for s in spans] == ["harel_store.commit"] * 4
    assert [s.attributes["outcome"] for s in spans] == ["ok", "ok", "conflict", "error"]
    assert [s.status.status_code for s in spans][2:] == [trace.StatusCode.ERROR] * 2


def test_the_async_store_records_its_commits_too(recorded: Recorded, tmp_path: Path) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(tmp_path / "t.db")
        await asyncio.gather(
            *(store.commit(Execution(id=f"e{i}", definition_id="d"), []) for i in range(8))
        )
        await store.close()

    asyncio.run(main())
    assert commits(recorded) == {"ok": 8}


@pytest.mark.sqld
def test_a_remote_write_with_no_answer_is_unknown_and_no_attribute_holds_the_token(
    recorded: Recorded, proxy: Proxy, server: Any
) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token, timeout=2) as store:
        exe = Execution(id="exe-r", definition_id="d")
        store.commit(exe, [])
        proxy.mode = "drop"  # type: ignore[assignment]
        with pytest.raises(OutcomeUnknown):
            store.commit(exe, [])
        proxy.mode = "forward"  # type: ignore[assignment]
    assert commits(recorded) == {"ok": 1, "unknown": 1}
    shown = [str(a) for a, _ in recorded.points("harel_store.commit.duration")]
    shown += [str(dict(s.attributes or {})) for s in recorded.spans.get_finished_spans()]
    assert all(server.token not in text for text in shown)
    assert all(proxy.url() in text for text in shown)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_relay_counts_its_items_times_a_timer_and_spans_each_handler(
    recorded: Recorded, tmp_path: Path, kind: str
) -> None:
    store = LibsqlStore(tmp_path / "t.db")
    exe = Execution(id="exe-1", definition_id="d")
    late = time.time() - 5
    store.commit(
        exe,
        [(None, Event(name="fine")), (None, Event(name="boom"))],
        timers=[TimerOp.schedule("t", late)],
    )
    tracer = trace.get_tracer("test")

    def outbox(entry: Any) -> None:
        with tracer.start_as_current_span("handler's own"):
            if entry.event.name == "boom":
                raise RuntimeError("boom")

    def timer(item: Any) -> None:
        pass

    async def aoutbox(entry: Any) -> None:
        outbox(entry)

    async def atimer(item: Any) -> None:
        pass

    if kind == "sync":
        relay: Any = Relay(store, "w", on_outbox=outbox, on_timer=timer, max_attempts=1)
        assert relay.run_once() == 3
    else:

        async def main() -> int:
            async_store = AsyncLibsqlStore(store)
            relay = AsyncRelay(async_store, "w", on_outbox=aoutbox, on_timer=atimer, max_attempts=1)
            return await relay.run_once()

        assert asyncio.run(main()) == 3
    items = {
        (a["kind"], a["outcome"]): p.value for a, p in recorded.points("harel_store.relay.items")
    }
    assert items == {("outbox", "done"): 1, ("outbox", "dead"): 1, ("timer", "done"): 1}
    ((attributes, lag),) = recorded.points("harel_store.relay.lag")
    assert attributes == {"kind": "timer"} and lag.count == 1 and 5 <= lag.sum < 60
    spans = recorded.spans.get_finished_spans()
    handles = [s for s in spans if s.name == "harel_store.relay.handle"]
    assert sorted(s.attributes["kind"] for s in handles) == ["outbox", "outbox", "timer"]
    own = [s for s in spans if s.name == "handler's own"]
    assert len(own) == 2
    assert {s.parent.span_id for s in own} <= {h.context.span_id for h in handles}  # nested
    failed = [h for h in handles if h.status.status_code == trace.StatusCode.ERROR]
    assert len(failed) == 1 and failed[0].events[0].name == "exception"
    store.close()


def test_with_no_provider_set_nothing_is_recorded(tmp_path: Path) -> None:
    _reset()
    assert telemetry.instruments() is None
    with LibsqlStore(tmp_path / "t.db") as store:
        exe = Execution(id="exe-1", definition_id="d")
        store.commit(exe, [])
        assert telemetry.instruments() is None
