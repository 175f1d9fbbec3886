"""OpenTelemetry (harel_store.telemetry): what a commit and a relay record into the global
providers an application sets, read back with the SDK's in-memory reader and exporter;
nothing with no provider set."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
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
from tests.test_claims import elapse


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
    # "boom" failed on its last attempt: a dead letter at the next claim, counted then.
    assert items(recorded) == {("outbox", "done"): 1, ("outbox", "failed"): 1, ("timer", "done"): 1}
    lags = {a["kind"]: p for a, p in recorded.points("harel_store.relay.lag")}
    assert lags.keys() == {"outbox", "timer"}
    assert lags["timer"].count == 1 and 5 <= lags["timer"].sum < 60  # from its fire_at
    assert lags["outbox"].count == 2 and 0 <= lags["outbox"].sum < 60  # from when written
    spans = recorded.spans.get_finished_spans()
    handles = [s for s in spans if s.name == "harel_store.relay.handle"]
    assert sorted(s.attributes["kind"] for s in handles) == ["outbox", "outbox", "timer"]
    assert all(not h.links for h in handles)  # committed in no span: nothing to link to
    own = [s for s in spans if s.name == "handler's own"]
    assert len(own) == 2
    assert {s.parent.span_id for s in own} <= {h.context.span_id for h in handles}  # nested
    failed = [h for h in handles if h.status.status_code == trace.StatusCode.ERROR]
    assert len(failed) == 1 and failed[0].events[0].name == "exception"
    store.close()


def items(recorded: Recorded) -> dict[tuple[str, str], int]:
    """The relay's item counter by kind and outcome."""
    points = recorded.points("harel_store.relay.items")
    return {(a["kind"], a["outcome"]): p.value for a, p in points}


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_every_dead_letter_is_counted_once_when_a_claim_sets_it_aside(
    recorded: Recorded, tmp_path: Path, kind: str
) -> None:
    """One entry's worker died holding its last attempt (its lease ran out), another's
    handler raised on its last attempt: each is counted dead once, by the claim that makes
    it a dead letter, whoever held it."""
    store = LibsqlStore(tmp_path / "t.db")
    exe = Execution(id="exe-1", definition_id="d")
    store.commit(exe, [(None, Event(name="lost")), (None, Event(name="boom"))])
    (lost,) = store.claim_outbox("gone", limit=1, max_attempts=1)
    assert lost.event.name == "lost"
    elapse(store, 60)  # the worker died: its lease ran out

    def boom(entry: Any) -> None:
        raise RuntimeError("boom")

    async def aboom(entry: Any) -> None:
        boom(entry)

    def round_() -> int:
        if kind == "sync":
            return int(Relay(store, "w", on_outbox=boom, max_attempts=1).run_once())

        async def main() -> int:
            relay = AsyncRelay(AsyncLibsqlStore(store), "w", on_outbox=aboom, max_attempts=1)
            return await relay.run_once()

        return asyncio.run(main())

    # The claim sets "lost" aside (a dead letter) and hands out "boom", whose handler raises.
    assert round_() == 1
    assert items(recorded) == {("outbox", "dead"): 1, ("outbox", "failed"): 1}
    assert round_() == 0  # this claim sets "boom" aside
    assert items(recorded) == {("outbox", "dead"): 2, ("outbox", "failed"): 1}
    dead = store.dead_letters()
    assert [(d.item.event.name, d.attempts) for d in dead] == [("lost", 1), ("boom", 1)]
    store.close()


def test_with_no_provider_set_nothing_is_recorded(tmp_path: Path) -> None:
    _reset()
    assert telemetry.instruments() is None
    with LibsqlStore(tmp_path / "t.db") as store:
        exe = Execution(id="exe-1", definition_id="d")
        store.commit(exe, [])
        assert telemetry.instruments() is None


def handles(recorded: Recorded) -> dict[str, list[Any]]:
    """The handler spans by kind, each a list of the span contexts it links to."""
    found: dict[str, list[Any]] = {}
    for span in recorded.spans.get_finished_spans():
        if span.name == "harel_store.relay.handle":
            for link in span.links:
                assert link.context.is_remote  # read back from the store, as any process would
            found.setdefault(span.attributes["kind"], []).append(
                [(link.context.trace_id, link.context.span_id) for link in span.links]
            )
    return found


def ids(span: Any) -> tuple[int, int]:
    return span.get_span_context().trace_id, span.get_span_context().span_id


def drain(store: Any) -> int:
    relay = Relay(
        store, "w", on_outbox=lambda e: None, on_spawn=lambda s: None, on_timer=lambda t: None
    )
    return relay.run_once()


@pytest.mark.parametrize("where", ["file", pytest.param("sqld", marks=pytest.mark.sqld)])
def test_a_handler_span_links_to_the_span_its_item_was_committed_in(
    recorded: Recorded, tmp_path: Path, where: str, request: pytest.FixtureRequest
) -> None:
    if where == "file":
        store = LibsqlStore(tmp_path / "t.db")
    else:
        server = request.getfixturevalue("server")
        store = LibsqlStore(server.url, auth_token=server.token)
    tracer = trace.get_tracer("engine")
    exe = Execution(id="exe-1", definition_id="d")
    with tracer.start_as_current_span("step") as step:
        store.commit(
            exe,
            [("exe-2", Event(name="go"))],
            spawns=[("exe-1.child", "s", {})],
            timers=[TimerOp.schedule("t", time.time() - 1)],
        )
    with tracer.start_as_current_span("re-arm") as rearm:
        store.commit(exe, [], timers=[TimerOp.schedule("t", time.time() - 2)])
    store.commit(exe, [], timers=[TimerOp.schedule("u", time.time() - 1)])  # in no span
    time.sleep(0.2)
    assert drain(store) == 4
    linked = handles(recorded)
    assert linked["outbox"] == linked["spawn"] == [[ids(step)]]
    # A re-armed timer carries the context of the commit that re-armed it; one armed in no
    # span, none.
    assert sorted(linked["timer"], key=len) == [[], [ids(rearm)]]
    lags = {a["kind"]: p for a, p in recorded.points("harel_store.relay.lag")}
    assert lags["outbox"].count == lags["spawn"].count == 1
    assert 0.15 <= lags["outbox"].sum < 60 and 0.15 <= lags["spawn"].sum < 60
    store.close()


def test_a_handler_span_names_the_execution_and_the_event(
    recorded: Recorded, tmp_path: Path
) -> None:
    """The execution an item steps (an event's target, a spawn's child, a timer's
    execution) and an event's name are attributes of its handler's span."""
    store = LibsqlStore(tmp_path / "t.db")
    exe = Execution(id="exe-1", definition_id="d")
    store.commit(
        exe,
        [("exe-2", Event(name="go")), (None, Event(name="shipped"))],
        spawns=[("exe-1.child", "s", {})],
        timers=[TimerOp.schedule("t", time.time() - 1)],
    )
    assert drain(store) == 4
    spans = [s for s in recorded.spans.get_finished_spans() if s.name == "harel_store.relay.handle"]
    named = sorted(
        (
            s.attributes["kind"],
            s.attributes.get("harel_store.execution", "-"),
            s.attributes.get("harel_store.event", "-"),
        )
        for s in spans
    )
    assert named == [
        ("outbox", "-", "shipped"),  # to the outside world: no execution
        ("outbox", "exe-2", "go"),
        ("spawn", "exe-1.child", "-"),
        ("timer", "exe-1", "-"),
    ]
    store.close()


CHILD = textwrap.dedent(
    """
    import sys, time
    from opentelemetry import trace
    from opentelemetry.sdk.trace import TracerProvider
    from harel_store import Event, Execution, LibsqlStore, TimerOp

    trace.set_tracer_provider(TracerProvider())
    with LibsqlStore(sys.argv[1]) as store:
        exe = Execution(id="exe-1", definition_id="d")
        with trace.get_tracer("engine").start_as_current_span("step") as step:
            store.commit(exe, [(None, Event(name="out"))], spawns=[("exe-1.c", "s", {})],
                         timers=[TimerOp.schedule("t", time.time() - 1)])
    context = step.get_span_context()
    print(f"{context.trace_id:032x} {context.span_id:016x}")
    """
)


def test_the_link_crosses_processes(recorded: Recorded, tmp_path: Path) -> None:
    """The commit is made in another process, inside its own span; this process's relay
    handles the items, each handler span linked to that span."""
    database = tmp_path / "t.db"
    LibsqlStore(database).close()  # migrated before the child opens it
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    child = subprocess.run(
        [sys.executable, "-c", CHILD, str(database)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=True,
    )
    trace_id, span_id = (int(part, 16) for part in child.stdout.split())
    with LibsqlStore(database) as store:
        assert drain(store) == 3
    linked = handles(recorded)
    assert linked.keys() == {"outbox", "spawn", "timer"}
    assert list(linked.values()) == [[[(trace_id, span_id)]]] * 3
