"""Claimable relays: how fast worker processes drain the outbox (an ack per entry, or one a
batch), what an engine-like delivery costs in each shape, what a claim costs as the backlog
and its dead letters grow, and what the relay runtime (`Relay`, `AsyncRelay`) delivers, how
soon it wakes and what it costs idle. Not a test: the figures depend on the machine; the
ratios, each against a baseline measured in the same run, carry across.

    python -m benchmarks.relays              # full: ~4-6 minutes on 2 cores (section 4: ~2)
    python -m benchmarks.relays --quick      # fewer entries and repetitions (~2-3 minutes)
    python -m benchmarks.relays --only 4b    # one section (a number: all its parts)
    python -m benchmarks.relays --smoke      # every section once, tiny: that it works

1. Drains: the outbox seeded with bulk SQL, then 1, 2 and 4 worker processes each looping
   ``claim_outbox(worker, limit=100)`` until it comes back empty, with ``ack_outbox(seq)``
   per entry or one ``store.ack(entries)``: entries/s, the scaling from 1 worker, batch over
   per-entry acks, every entry delivered once; (a) a file at FULL and NORMAL, (b) sqld
   behind the 20 ms link, and with no delay.
2. Engine-like delivery to 100 targets from a ``claim_outbox`` loop, per entry today's
   handler (``load``, ``commit(processed_event_id=)``, ``ack_outbox``) or the one-trip one
   (``load_for_event``, ``commit(acks=(entry,))``): events/s, one over the other, (a) on a
   file at FULL, (b) on the link, with the requests an event.
3. Claim cost: the median ``claim_outbox`` and ``claim_due_timers`` (limit 100, without and
   with ``max_attempts=10``, which sweeps dead letters first) with 1M pending and 100k dead
   letters of each kind, over 1k pending; claimed rows given back with ``store.revive``.
4. The relay runtime with section 2's one-trip handler against the hand-written loop: (a) on
   a file at FULL, ``Relay.run_once()`` and ``AsyncRelay(concurrency=32)``, the shapes taking
   turns (each keeps its fastest run), and the Relay over its handler in a bare claim loop;
   (b) the AsyncRelay on the link, and the client CPU a request; (c) wake-up: from before a
   commit of one emit to its handler's start, idle relay (``poll=30``); (d) the CPU of an
   idle ``Relay`` (``poll=1``, three handlers) less the same process idle, in % of a core.

No file is open in two SQLite libraries at once in one process (closing the second one
unlinks the first one's WAL): drain and claim-cost files are seeded with stdlib ``sqlite3``,
closed, then opened with libsql. Prints a table and writes JSON to
``benchmarks/results/relays-<timestamp>.json`` (not in a smoke run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import inspect
import itertools
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    TIMEOUT,
    Child,
    Proxy,
    Report,
    Served,
    client,
    meets,
    mode,
    module,
    parser,
    quantile,
    served,
)
from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    Event,
    Execution,
    LibsqlStore,
    OutboxEntry,
    Relay,
    SqliteStore,
)
from harel_store.store import Store

LIMIT = 100  # entries a claim asks for
NOW = 1e9  # the timer sweep's "now": every seeded timer is due
MAX_ATTEMPTS = 10  # the relay runtime's default
TARGETS = 100  # executions the engine-like delivery addresses
TARGET_DEF = "relay-bench-target"
EMITS = 250  # emits a seeding commit
CONCURRENCY = 32  # AsyncRelay's handlers in flight
ASYNC_RELAY = f"AsyncRelay (concurrency {CONCURRENCY})"
WAKE_POLL = 30.0  # an idle relay's poll in the wake-up timings: only the signal wakes it
WAKE_PAUSE = 0.02  # seconds between a handler's start and the next commit
IDLE_POLL = 1.0
RUNS = itertools.count(1)  # numbers a run's file, seqs on sqld and event ids

SEED_OUTBOX = """
WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < ?2)
INSERT INTO harel_outbox (seq, target_id, event, created_at)
SELECT ?1 + n, NULL, json_object('name', 'n', 'id', CAST(?1 + n AS TEXT), 'payload',
       json_object()), 0.0
FROM k
"""
SEED_TIMERS = """
WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < ?1)
INSERT INTO harel_timers (execution_id, path, fire_at)
SELECT printf('exe-%08d', n), 'main.wait', 1000.0 + n FROM k
"""
# Dead letters as a claim leaves them (sql/queries.sql, mark_dead_*): an outbox entry with
# its seq negated (seqs 1..?1, the oldest), a timer keeping its key; both with dead_at set
# and the attempts that reached the limit. The dead timers are due before every live one.
SEED_DEAD_OUTBOX = """
WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < ?1)
INSERT INTO harel_outbox (seq, target_id, event, created_at, attempts, last_error, dead_at)
SELECT -n, NULL, json_object('name', 'n', 'id', CAST(n AS TEXT), 'payload', json_object()),
       0.0, ?2, 'bench: gave up', 1.0 + n * 1e-3
FROM k
"""
SEED_DEAD_TIMERS = """
WITH RECURSIVE k(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM k WHERE n < ?1)
INSERT INTO harel_timers (execution_id, path, fire_at, attempts, last_error, dead_at)
SELECT printf('dead-%08d', n), 'main.wait', n * 1e-3, ?2, 'bench: gave up', 1.0 + n * 1e-3
FROM k
"""
OUTBOX_LEFT = "SELECT COUNT(*) FROM harel_outbox"
SECTIONS = ("1a", "1b", "2a", "2b", "3", "4a", "4b", "4c", "4d")


@dataclass
class Plan:
    workers: tuple[int, ...]  # worker processes of each drain, 1 first
    # entries seeded a drain: (acks per entry, one ack a batch); at least LIMIT a worker,
    # or the last workers find nothing to claim
    file_full: tuple[int, int]
    file_normal: tuple[int, int]
    link: tuple[int, int]
    no_delay: tuple[int, int]
    delivery: tuple[int, int]  # events a delivery run, each shape: file, link
    rounds: int  # of the claim-cost timings, the sizes taking turns
    calls: int  # timed claims per size and round
    relay_file: int  # events a relay-runtime run on the file, each shape
    relay_reps: int  # runs of each shape on the file, taking turns
    relay_link: tuple[int, int]  # events on the link: by hand, by AsyncRelay
    wakeups: int  # commits timed to their handler, each relay
    idle_seconds: float  # an idle relay's CPU is measured over, and the baseline too
    sizes: tuple[int, int] = (1_000, 1_000_000)  # pending rows for the claim cost
    dead: int = 100_000  # dead letters of each kind beside the larger backlog


PLANS = {
    "quick": Plan(
        (1, 2, 4), (1_000, 10_000), (10_000, 20_000), (400, 2_000), (400, 4_000), (400, 100),
        rounds=3, calls=30, relay_file=500, relay_reps=3, relay_link=(100, 1_000), wakeups=100,
        idle_seconds=5.0,
    ),
    "full": Plan(
        (1, 2, 4), (2_000, 40_000), (20_000, 100_000), (800, 10_000), (800, 10_000),
        (1_500, 200), rounds=5, calls=60, relay_file=1_500, relay_reps=3,
        relay_link=(200, 3_000), wakeups=200, idle_seconds=15.0,
    ),
    # Every section once on tiny sizes: that the module works, not what it measures.
    "smoke": Plan(
        (1, 2), (2 * LIMIT, 2 * LIMIT), (2 * LIMIT, 2 * LIMIT), (LIMIT, 2 * LIMIT),
        (2 * LIMIT, 2 * LIMIT), (50, 20), rounds=1, calls=1, relay_file=50, relay_reps=1,
        relay_link=(20, 50), wakeups=5, idle_seconds=0.5, sizes=(1_000, 2_000), dead=1_000,
    ),
}  # fmt: skip


# --- 1. drains: worker processes claim, note each seq, ack; until a claim comes back empty


def worker() -> None:
    """A pool process: for each job (a JSON line) open the store, say ready, wait for go,
    drain, close the store and print a JSON line. Exits when stdin closes."""
    while line := sys.stdin.readline():
        job = json.loads(line)
        if job["database"].startswith("http"):
            store = LibsqlStore(job["database"], auth_token=job["token"], timeout=TIMEOUT)
        else:
            store = LibsqlStore(job["database"], synchronous=job["synchronous"], migrate=False)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        seqs: list[int] = []
        claims = acks = mismatched = 0
        cpu = time.process_time()
        while entries := store.claim_outbox(job["name"], limit=LIMIT):
            claims += 1
            for entry in entries:  # "delivery": note it, check it is the entry seeded
                seqs.append(entry.seq)
                mismatched += entry.event.id != str(entry.seq)
            if job["batched"]:
                store.ack(entries)
                acks += 1
            else:
                for entry in entries:
                    store.ack_outbox(entry.seq)
                acks += len(entries)
        ended, cpu = time.monotonic(), time.process_time() - cpu
        store.close()
        out = {"seqs": seqs, "claims": claims + 1, "acks": acks, "mismatched": mismatched}
        print(json.dumps(out | {"ended": ended, "cpu": cpu}), flush=True)


@dataclass
class Drain:
    workers: int
    batched: bool  # one ack a batch (else an ack per entry)
    entries: int  # seeded
    seconds: float  # from go to the last worker's empty claim
    claims: int
    acks: int
    cpu: float  # seconds, all workers
    delivered: int
    duplicates: int  # deliveries past the first of an entry
    lost: int  # seeded, never delivered
    left: int  # rows in the outbox afterwards
    mismatched: int  # entries whose event id was not their seq
    link_requests: int | None = None  # counted by the proxy (remote): retries too

    @property
    def rate(self) -> float:
        return self.entries / self.seconds

    @property
    def requests_per_entry(self) -> float:
        sent = self.link_requests if self.link_requests is not None else self.claims + self.acks
        return sent / self.entries


def local_db(path: Path) -> sqlite3.Connection:
    """A file migrated to head by stdlib sqlite3 (SqliteStore), and a stdlib connection to it."""
    SqliteStore(path, synchronous="OFF").close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    return conn


def pipeline(url: str, token: str, sql: str, *args: int) -> int:
    """One statement on sqld directly: the first column of its first row, or else the number
    of rows it changed."""
    stmt = {"sql": sql, "args": [{"type": "integer", "value": str(a)} for a in args]}
    body = {"baton": None, "requests": [{"type": "execute", "stmt": stmt}, {"type": "close"}]}
    with contextlib.closing(client(url, token)) as http:
        reply = http.post("/v3/pipeline", json.dumps(body).encode())
    if reply.status != 200:
        raise RuntimeError(f"sqld answered HTTP {reply.status}: {reply.text[:200]}")
    first = json.loads(reply.body)["results"][0]
    if first["type"] != "ok":
        raise RuntimeError(f"{sql.split()[0]} on sqld failed: {first}")
    rows = first["response"]["result"]["rows"]
    return int(rows[0][0]["value"]) if rows else first["response"]["result"]["affected_row_count"]


def drained(
    procs: list[Child], job: dict[str, Any], n: int, at: Path | Served, proxy: Proxy | None
) -> Drain:
    """`n` entries seeded in the outbox of sqld, or of a fresh file in `at` (removed
    afterwards); the workers `procs` let go at once on them (`job`: where, how to ack), and
    what they delivered checked; `proxy` (remote) counts the requests."""
    run = next(RUNS)
    left: Callable[[], int]  # a count of the rows in the outbox
    with contextlib.ExitStack() as stack:
        if isinstance(at, Served):
            srv, base = at.srv, run * 10_000_000
            assert pipeline(srv.url, srv.token, SEED_OUTBOX, base, n) == n
            seeded, job = range(base + 1, base + n + 1), job | {"token": srv.token}
            left = functools.partial(pipeline, srv.url, srv.token, OUTBOX_LEFT)
        else:
            path = at / f"drain-{run}.db"
            stack.callback(path.unlink)
            conn = stack.enter_context(contextlib.closing(local_db(path)))
            conn.execute(SEED_OUTBOX, (0, n))
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            seeded, job = range(1, n + 1), job | {"database": str(path)}
            left = lambda: int(conn.execute(OUTBOX_LEFT).fetchone()[0])  # noqa: E731
        for i, proc in enumerate(procs):
            proc.send(json.dumps(job | {"name": f"w{i}"}))
        if [proc.line() for proc in procs] != ["ready"] * len(procs):
            raise RuntimeError("a worker did not open its store")
        before = proxy.requests() if proxy else 0
        started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on Linux
        for proc in procs:
            proc.send("go")
        outs = [json.loads(proc.line(600)) for proc in procs]
        counts = Counter(seq for out in outs for seq in out["seqs"])
        return Drain(
            workers=len(procs),
            batched=job["batched"],
            entries=len(seeded),
            seconds=max(out["ended"] for out in outs) - started,
            delivered=counts.total(),
            duplicates=counts.total() - len(counts),
            lost=sum(1 for seq in seeded if seq not in counts),
            left=left(),
            link_requests=proxy.requests() - before if proxy else None,
            **{k: sum(out[k] for out in outs) for k in ("claims", "acks", "cpu", "mismatched")},
        )


def workers_label(n: int) -> str:
    return f"{n} worker" + "s" * (n > 1)


def report_drains(
    report: Report, where: str, runs: dict[bool, list[Drain]], ratio_target: str, scale: str
) -> None:
    """Each drain's rate; per ack shape, the most workers over 1 (`scale`: the per-entry
    acks' target); per worker count, one ack a batch over an ack per entry; losses."""
    for batched, drains in runs.items():
        how = "one ack a batch" if batched else "ack per entry"
        for d in drains:
            report.add(
                f"drain {where}, {how}, {workers_label(d.workers)}: entries/s (a worker)",
                f"{d.rate:,.0f} ({d.rate / d.workers:,.0f}); {d.requests_per_entry:.3f} requests"
                f" an entry, worker CPU {d.cpu / d.seconds:.0%}",
                **asdict(d),
            )
        one, most = drains[0], drains[-1]
        if most.workers > 1:
            aim, ratio = "" if batched else scale, most.rate / one.rate
            label = f"{workers_label(most.workers)} / {workers_label(one.workers)}"
            report.add(f"drain {where}, {how}, {label}", f"{ratio:.2f}", aim, meets(ratio, aim))
    for per_entry, batch in zip(runs[False], runs[True], strict=True):
        ratio = batch.rate / per_entry.rate
        report.add(
            f"drain {where}, {workers_label(batch.workers)}: batch ack / ack per entry",
            f"{ratio:.1f}",
            ratio_target,
            meets(ratio, ratio_target),
        )
    drains = [d for ds in runs.values() for d in ds]
    lost = sum(d.lost + d.left for d in drains)
    dups, bad = sum(d.duplicates for d in drains), sum(d.mismatched for d in drains)
    report.add(
        f"drain {where}: lost / duplicated", f"{lost} / {dups}", "0 / 0", lost == dups == bad == 0
    )


def bench_drains(report: Report, plan: Plan, procs: list[Child], at: Path | Served) -> None:
    """1a on files in `at`, or 1b on sqld: on the link (where the link, not the store, bounds
    a worker: the scaling target) and with no delay (only the machine and sqld bound it)."""
    cases: list[tuple[str, dict[str, str], tuple[int, int], str, str, Proxy | None]]
    if isinstance(at, Path):
        report.section("1a. drain outbox entries, local file (LibsqlStore, WAL)")
        cases = [
            (f"file {sync}", {"synchronous": sync}, sizes, target, "", None)
            for sync, sizes, target in (
                ("FULL", plan.file_full, ">= 8"),
                ("NORMAL", plan.file_normal, ""),
            )
        ]
    else:
        report.section("1b. drain outbox entries, sqld (LibsqlStore over HTTP)")
        link = f"sqld {at.link.delay_ms:g} ms link"
        cases = [
            (link, {"database": at.link.url}, plan.link, ">= 20", ">= 3", at.link),
            ("sqld no delay", {"database": at.count.url}, plan.no_delay, "", "", at.count),
        ]
    for where, job, sizes, ratio_target, scale, proxy in cases:
        runs = {
            batched: [
                drained(procs[:k], job | {"batched": batched}, n, at, proxy) for k in plan.workers
            ]
            for batched, n in zip((False, True), sizes, strict=True)
        }
        report_drains(report, where, runs, ratio_target, scale)


# --- 2. engine-like delivery: the handler's round trips ---


def today(store: Store, entry: OutboxEntry) -> int:
    """Today's handler: load the target, commit the event's effect (its dedupe marker), then
    ack the entry on its own. Returns the store calls it made."""
    assert entry.target_id is not None
    exe = store.load(entry.target_id)
    if exe is None:
        raise RuntimeError(f"no target {entry.target_id!r}")
    store.commit(exe, [], processed_event_id=entry.event.id)
    store.ack_outbox(entry.seq)
    return 3


def one_trip(store: Store, entry: OutboxEntry) -> int:
    """With the relay primitives: the target and its dedupe check in one read, the effect and
    the ack in one commit."""
    assert entry.target_id is not None
    exe, seen = store.load_for_event(entry.target_id, entry.event.id)
    if exe is None:
        raise RuntimeError(f"no target {entry.target_id!r}")
    if seen:  # handled before: only consume the entry
        store.ack([entry])
    else:
        store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
    return 2


async def one_trip_async(store: AsyncLibsqlStore, entry: OutboxEntry) -> int:
    """`one_trip` on an async store, for `AsyncRelay`."""
    assert entry.target_id is not None
    exe, seen = await store.load_for_event(entry.target_id, entry.event.id)
    if exe is None:
        raise RuntimeError(f"no target {entry.target_id!r}")
    if seen:
        await store.ack([entry])
    else:
        await store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
    return 2


SHAPES: dict[str, Callable[[Store, OutboxEntry], int]] = {
    "load + commit + ack_outbox": today,
    "load_for_event + commit(acks=)": one_trip,
}
BY_HAND = "load + commit + ack_outbox"  # the hand-written loop the relay runtime replaces


@dataclass
class Delivery:
    shape: str
    events: int  # seeded
    seconds: float
    claims: int
    calls: int  # store calls, the claims included
    cpu: float  # seconds, this process
    duplicates: int
    lost: int
    left: int  # entries in the outbox afterwards
    bumps: int  # the targets' versions, after less before: one a delivery
    link_requests: int | None = None  # counted by the proxy (remote): retries too

    @property
    def rate(self) -> float:
        return self.events / self.seconds

    @property
    def requests_per_event(self) -> float:
        return (self.link_requests if self.link_requests is not None else self.calls) / self.events


async def maybe(result: Any) -> Any:
    """A sync store's result, or an async store's awaited."""
    return await result if inspect.isawaitable(result) else result


async def versions(store: Any) -> int:
    """The targets' versions, summed."""
    page = await maybe(store.list_executions(definition_id=TARGET_DEF, limit=1000))
    return sum(s.version for s in page.items)


async def deliver(
    shape: str, store: Any, check: Any, seeded: list[int], proxy: Proxy | None
) -> Delivery:
    """Drain the outbox until a round handles nothing: by a hand-written loop of `SHAPES` in
    this process, `Relay.run_once` or `AsyncRelay.run_once` (on this loop); `check` (not
    behind the proxy) reads the targets' versions and what is left, outside the timing."""
    seqs: Counter[int] = Counter()
    calls = [0]  # the handlers' store calls
    handler = SHAPES.get(shape, one_trip)

    def handle(entry: OutboxEntry) -> None:
        seqs[entry.seq] += 1
        calls[0] += handler(store, entry)

    async def ahandle(entry: OutboxEntry) -> None:
        seqs[entry.seq] += 1
        calls[0] += await one_trip_async(store, entry)

    def by_hand() -> int:
        entries = store.claim_outbox("deliverer", limit=LIMIT)
        for entry in entries:
            handle(entry)
        return len(entries)

    run_once: Callable[[], Any] = by_hand
    if shape == "Relay":
        run_once = Relay(store, "relay", on_outbox=handle, batch=LIMIT).run_once
    elif shape == ASYNC_RELAY:
        relay = AsyncRelay(store, "arelay", on_outbox=ahandle, batch=LIMIT, concurrency=CONCURRENCY)
        run_once = relay.run_once
    before, rounds = await versions(check), 1
    took: dict[str, Any] = {"link_requests": proxy.requests() if proxy else None}
    cpu, start = time.process_time(), time.perf_counter()
    while await maybe(run_once()):
        rounds += 1
    took["seconds"], took["cpu"] = time.perf_counter() - start, time.process_time() - cpu
    if proxy:
        took["link_requests"] = proxy.requests() - took["link_requests"]
    left, bumps = len(await maybe(check.pending_outbox())), await versions(check) - before
    acks = 0 if shape in SHAPES else rounds - 1  # a relay's ack of each round that handled
    return Delivery(
        shape,
        len(seeded),
        claims=rounds,
        calls=rounds + acks + calls[0],
        duplicates=seqs.total() - len(seqs),
        lost=sum(1 for seq in seeded if seq not in seqs),
        left=left,
        bumps=bumps,
        **took,
    )


def delivered(shape: str, n: int, at: Path | Served) -> Delivery:
    """`n` events, to the targets, from commits of a source, delivered by `shape`: on a fresh
    file in `at` at FULL (removed afterwards), or on sqld through the link (seeded, and
    checked by a sync shape, directly)."""
    run = next(RUNS)  # a fresh file, or event ids not seen before
    path = at / f"deliver-{run}.db" if isinstance(at, Path) else None
    url, direct, proxy = str(path), str(path), None
    opts: dict[str, Any] = {"synchronous": "FULL"}
    if isinstance(at, Served):
        url, direct, proxy = at.link.url, at.srv.url, at.link
        opts = {"auth_token": at.srv.token, "timeout": TIMEOUT}
    with LibsqlStore(direct, **opts) as check:
        targets = [f"target-{i:04d}" for i in range(min(TARGETS, n))]
        for eid in targets:
            if check.load(eid) is None:
                check.commit(Execution(id=eid, definition_id=TARGET_DEF), [])
        source = check.load("source") or Execution(id="source", definition_id="relay-bench-source")
        emits = [(targets[i % len(targets)], Event(name="n", id=f"e{run}-{i}")) for i in range(n)]
        seeded = [
            seq for k in range(0, n, EMITS) for seq in check.commit(source, emits[k : k + EMITS])
        ]
        if shape != ASYNC_RELAY:
            with LibsqlStore(url, **opts) if proxy else contextlib.nullcontext(check) as store:
                done = asyncio.run(deliver(shape, store, check, seeded, proxy))

    async def deliver_async() -> Delivery:  # the seeding store closed: on a file, the only one
        async with await AsyncLibsqlStore.create(url, **opts) as store:
            return await deliver(shape, store, store, seeded, proxy)

    if shape == ASYNC_RELAY:
        done = asyncio.run(deliver_async())
    if path:
        path.unlink()
    return done


def report_rates(report: Report, label: str, runs: list[Delivery]) -> None:
    for d in runs:
        shown = f"{d.rate:,.0f} ({d.requests_per_event:.2f} req, CPU {d.cpu / d.seconds:.0%})"
        report.add(f"{label}, {d.shape}: events/s", shown, **asdict(d))


def report_off(report: Report, label: str, runs: list[Delivery]) -> None:
    """Deliveries not made once, entries left, version bumps not one a delivery."""
    bad = sum(d.duplicates + d.lost + d.left + abs(d.bumps - d.events) for d in runs)
    report.add(f"{label}: lost / duplicated / version bumps off", str(bad), "0", bad == 0)


def bench_delivery(report: Report, plan: Plan, at: Path | Served) -> None:
    """2a on files in `at`, or 2b on sqld through the link."""
    if isinstance(at, Path):
        n, where, target = plan.delivery[0], "file FULL", ">= 1.6"
        report.section(f"2a. engine-like delivery of {n:,} events, local file (LibsqlStore, FULL)")
    else:
        n, where, target = plan.delivery[1], f"sqld {at.link.delay_ms:g} ms link", ""
        report.section(f"2b. engine-like delivery of {n:,} events, {where}")
    runs = [delivered(shape, n, at) for shape in SHAPES]
    report_rates(report, f"delivery {where}", runs)
    old, new = runs
    ratio = new.rate / old.rate
    report.add(f"delivery {where}: one-trip / today", f"{ratio:.2f}", target, meets(ratio, target))
    if isinstance(at, Served):  # the handler's own round trips, the claims left out
        mine, theirs = (d.requests_per_event - d.claims / d.events for d in (new, old))
        report.add(
            f"delivery {where}: handler requests an event (today's)",
            f"{mine:.2f} ({theirs:.2f})",
            "2 (today 3)",
            mine <= 2.0 + 1e-9,
        )
    report_off(report, f"delivery {where}", runs)


# --- 3. claim cost: 1M pending and 100k dead letters / 1k pending ---


def claim_db(path: Path, n: int, dead: int) -> float:
    """Seeded with stdlib sqlite3 and closed before this process opens it with libsql."""
    t0 = time.perf_counter()
    with contextlib.closing(local_db(path)) as conn:
        conn.execute("BEGIN")
        if dead:
            conn.execute(SEED_DEAD_OUTBOX, (dead, MAX_ATTEMPTS))
            conn.execute(SEED_DEAD_TIMERS, (dead, MAX_ATTEMPTS))
        conn.execute(SEED_OUTBOX, (dead, n))
        conn.execute(SEED_TIMERS, (n,))
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    return time.perf_counter() - t0


def timed_claim(store: Store, kind: str, max_attempts: int | None, first: float) -> float:
    """One claim, timed; then its rows given back (`revive` clears the claim and the attempt
    it counted), so that the next call finds the same backlog."""
    t0 = time.perf_counter()
    got: list[Any]
    head: float | None
    if kind == "claim_outbox":
        got = store.claim_outbox("w", limit=LIMIT, max_attempts=max_attempts)
        head = got[0].seq if got else None
    else:
        got = store.claim_due_timers("w", NOW, limit=LIMIT, max_attempts=max_attempts)
        head = got[0].fire_at if got else None
    took = time.perf_counter() - t0
    assert len(got) == LIMIT and head == first, (kind, len(got), head, first)
    if store.revive(got) != LIMIT:
        raise RuntimeError(f"{kind}: the claimed rows were not all given back")
    return took


def bench_claim_cost(report: Report, plan: Plan, tmp: Path) -> None:
    small, large = sizes = plan.sizes
    report.section(
        f"3. claim cost (limit {LIMIT}), local file: {large:,} pending and {plan.dead:,} dead"
        f" / {small:,} pending"
    )
    dead = {small: 0, large: plan.dead}
    for n in sizes:
        took = claim_db(tmp / f"claim-{n}.db", n, dead[n])
        print(f"    built {n:,} entries and due timers, {dead[n]:,} dead of each, in {took:.1f} s")
    best: dict[int, dict[str, float]] = {n: {} for n in sizes}
    calls: dict[int, dict[str, Callable[[], float]]] = {}
    with contextlib.ExitStack() as stack:
        for n in sizes:  # each claim times itself and gives its rows back through one store
            path = tmp / f"claim-{n}.db"
            store = stack.enter_context(LibsqlStore(path, synchronous="NORMAL", migrate=False))
            for kind in ("outbox", "timer"):  # the seeded dead letters are the store's
                letters = store.dead_letters(kind=kind, limit=3)
                assert len(letters) == min(3, dead[n]), (kind, letters)
                assert not dead[n] or letters[0].attempts == MAX_ATTEMPTS, letters[0]
            calls[n] = {
                kind + ("" if tries is None else f", max_attempts={tries}"): functools.partial(
                    timed_claim, store, kind, tries, first
                )
                for tries in (None, MAX_ATTEMPTS)
                for kind, first in (("claim_outbox", dead[n] + 1), ("claim_due_timers", 1001.0))
            }
        for fns in calls.values():
            for fn in fns.values():
                for _ in range(5):
                    fn()  # warm: the pages, the statements
        for _ in range(plan.rounds):  # sizes take turns; each keeps its best round's median
            for n, fns in calls.items():
                for name, fn in fns.items():
                    median = statistics.median(fn() for _ in range(plan.calls))
                    best[n][name] = min(median, best[n].get(name, median))
    for name in best[small]:
        ratio = best[large][name] / best[small][name]
        us = {str(n): round(best[n][name] * 1e6, 1) for n in sizes}
        report.add(
            f"{name}: {large // 1000}k pending + {plan.dead // 1000}k dead / {small // 1000}k",
            f"{ratio:.2f} ({us[str(small)]} / {us[str(large)]} us)",
            "<= 2",
            ratio <= 2,
            us=us,
        )


# --- 4. the relay runtime: Relay and AsyncRelay against the hand-written loop ---


def fsync_ms(directory: Path, n: int = 50) -> float:
    """The median write and fsync of 4 KiB in `directory`, in ms: what synchronous=FULL
    adds to each write transaction, and so how much an event's one write less saves."""
    took = []
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        for _ in range(n):
            t0 = time.perf_counter()
            f.write(b"x" * 4096)
            f.flush()
            os.fsync(f.fileno())
            took.append(time.perf_counter() - t0)
    return statistics.median(took) * 1e3


def bench_relay_local(report: Report, plan: Plan, tmp: Path) -> None:
    n, reps, where = plan.relay_file, plan.relay_reps, "file FULL"
    report.section(
        f"4a. Relay and AsyncRelay, local file (LibsqlStore, FULL): {n:,} events a run, the"
        f" shapes taking turns {reps} times (each keeps its fastest)"
    )
    every: dict[str, list[Delivery]] = {shape: [] for shape in (*SHAPES, "Relay", ASYNC_RELAY)}
    fsyncs = []
    for _ in range(reps):
        fsyncs.append(fsync_ms(tmp))
        for shape, runs in every.items():
            runs.append(delivered(shape, n, tmp))
    fsync = statistics.median(fsyncs)
    fastest = [max(ds, key=lambda d: d.rate) for ds in every.values()]
    report_rates(report, f"relay {where}", fastest)
    by_hand, bare, relay, arelay = fastest  # bare: the Relay's handler in a bare claim loop
    report.add(
        f"relay {where}: Relay / hand-written loop",
        f"{relay.rate / by_hand.rate:.2f} (a write and fsync of 4 KiB here: {fsync:.2f} ms)",
        ">= 1.6",
        relay.rate / by_hand.rate >= 1.6,
        rates={shape: [round(d.rate, 1) for d in ds] for shape, ds in every.items()},
        fsync_ms=round(fsync, 3),
    )
    report.add(
        f"relay {where}: Relay / its handler in a bare loop", f"{relay.rate / bare.rate:.2f}"
    )
    report.add(
        f"relay {where}: AsyncRelay / hand-written loop", f"{arelay.rate / by_hand.rate:.2f}"
    )
    report_off(report, f"relay {where}", [d for ds in every.values() for d in ds])


def bench_relay_remote(report: Report, plan: Plan, on: Served) -> None:
    by_hand_n, n = plan.relay_link
    where = f"sqld {on.link.delay_ms:g} ms link"
    report.section(
        f"4b. AsyncRelay, {where}: {by_hand_n:,} events by hand (sync), {n:,} by AsyncRelay"
    )
    runs = [delivered(BY_HAND, by_hand_n, on), delivered(ASYNC_RELAY, n, on)]
    report_rates(report, f"relay {where}", runs)
    ratio = runs[1].rate / runs[0].rate
    report.add(
        f"relay {where}: AsyncRelay / hand-written sync loop", f"{ratio:.1f}", ">= 15", ratio >= 15
    )
    cpu = {d.shape: d.cpu / (d.link_requests or d.calls) * 1e3 for d in runs}
    report.add(
        f"relay {where}: client CPU a request, AsyncRelay (by hand), ms",
        f"{cpu[ASYNC_RELAY]:.2f} ({cpu[BY_HAND]:.2f})",
        cpu_ms_a_request={shape: round(ms, 3) for shape, ms in cpu.items()},
    )
    report_off(report, f"relay {where}", runs)


async def wakeups(kind: str, path: Path, n: int) -> tuple[list[float], list[float], int]:
    """An idle relay (poll=WAKE_POLL): `Relay.run` in a thread, or `AsyncRelay.run` as a task
    of this loop sharing its store; this loop commits one emit at a time, waits for its
    handler to start, then pauses. From before each commit to its handler's start, the commit
    call's own, and the events not delivered once or left."""
    starts: dict[str, float] = {}
    delivered: Counter[str] = Counter()
    arrived = threading.Event()

    def handle(entry: OutboxEntry) -> None:
        starts.setdefault(entry.event.id, time.perf_counter())
        delivered[entry.event.id] += 1
        arrived.set()

    async def ahandle(entry: OutboxEntry) -> None:
        handle(entry)

    seconds, commits = [], []
    target = Execution(id="wake-target", definition_id=TARGET_DEF)
    source = Execution(id="wake-source", definition_id="relay-bench-source")
    store: Any
    if kind == "Relay":
        store = LibsqlStore(path, synchronous="FULL")
        relay: Any = Relay(store, "waker", on_outbox=handle, poll=WAKE_POLL)
        running: Any = asyncio.create_task(asyncio.to_thread(relay.run))
    else:
        store = await AsyncLibsqlStore.create(path, synchronous="FULL")
        relay = AsyncRelay(store, "awaker", on_outbox=ahandle, poll=WAKE_POLL)
        running = asyncio.create_task(relay.run())
    try:
        await maybe(store.commit(target, []))
        await maybe(store.commit(source, []))
        for i in range(n):
            await asyncio.sleep(WAKE_PAUSE)  # the relay idle in its poll
            arrived.clear()
            event = Event(name="n", id=f"wake-{i}")
            t0 = time.perf_counter()
            await maybe(store.commit(source, [(target.id, event)]))
            commits.append(time.perf_counter() - t0)
            if not await asyncio.to_thread(arrived.wait, WAKE_POLL + 10):
                raise RuntimeError(f"the relay never handled {event.id}")
            seconds.append(starts[event.id] - t0)
    finally:
        relay.stop()
        await asyncio.wait_for(running, 30)  # run() returns after stop(), or this times out
        left = len(await maybe(store.pending_outbox()))
        await maybe(store.close())
    bad = left + abs(delivered.total() - n) + (len(delivered) - n)
    return seconds, commits, bad


def bench_wakeup(report: Report, plan: Plan, tmp: Path) -> None:
    n = plan.wakeups
    report.section(
        f"4c. wake-up after a commit of this process, idle relay (poll={WAKE_POLL:g}), local"
        f" file (FULL): {n} commits of one emit, {WAKE_PAUSE * 1e3:g} ms apart"
    )

    def ms(values: list[float], *qs: int) -> dict[str, float]:
        return {f"p{q}": round(quantile(values, q / 100) * 1e3, 2) for q in qs}

    bad = 0
    for kind, target in (("Relay", "<= 20"), ("AsyncRelay", "")):
        seconds, commits, off = asyncio.run(wakeups(kind, tmp / f"wake-{kind}.db", n))
        bad += off
        took, commit_ms = ms(seconds, 50, 90, 99, 100), ms(commits, 50, 99)
        after_ms = ms([s - c for s, c in zip(seconds, commits, strict=True)], 50, 99)
        key = f"wake-up after a commit, idle {kind} (poll={WAKE_POLL:g}), file"
        report.add(
            f"{key}: p50 ms",
            f"{took['p50']:.1f} (the commit call's own {commit_ms['p50']}, its return to the"
            f" handler {after_ms['p50']})",
            ms=took,
        )
        report.add(
            f"{key}: p99 ms",
            f"{took['p99']:.1f} (max {took['p100']}; the commit call's own {commit_ms['p99']},"
            f" its return to the handler {after_ms['p99']})",
            target,
            meets(took["p99"], target),
            commit_ms=commit_ms,
            after_commit_ms=after_ms,
        )
    report.add("wake-up: events not delivered once, or left", str(bad), "0", bad == 0)


def counting(counts: Counter[str], name: str, call: Callable[..., Any]) -> Callable[..., Any]:
    def counted(*args: Any, **kwargs: Any) -> Any:
        counts[name] += 1
        return call(*args, **kwargs)

    return counted


def bench_idle(report: Report, plan: Plan, tmp: Path) -> None:
    """The process's CPU while a Relay with nothing to do runs, less the same process idle
    as long (the JSON also has the relay thread's own CPU, and its claims)."""
    seconds = plan.idle_seconds
    report.section(
        f"4d. idle Relay (poll={IDLE_POLL:g}; outbox, spawn and timer handlers), local file:"
        f" {seconds:g} s idle, {seconds:g} s with the relay"
    )
    called: list[object] = []
    claims: Counter[str] = Counter()
    thread_cpu: list[float] = []
    with LibsqlStore(tmp / "idle.db", synchronous="FULL") as store:
        for name in ("claim_outbox", "claim_spawns", "claim_due_timers"):
            # An instance attribute over the method, to count what the relay asks for.
            setattr(store, name, counting(claims, name, getattr(store, name)))
        on = called.append
        relay = Relay(store, "idler", on_outbox=on, on_spawn=on, on_timer=on, poll=IDLE_POLL)

        def run() -> None:
            t0 = time.thread_time()
            relay.run()
            thread_cpu.append(time.thread_time() - t0)

        cpu = time.process_time()
        time.sleep(seconds)
        idle = time.process_time() - cpu
        thread = threading.Thread(target=run, name="bench-idle-relay", daemon=True)
        cpu, wall = time.process_time(), time.perf_counter()
        thread.start()
        time.sleep(seconds)
        used, wall = time.process_time() - cpu, time.perf_counter() - wall
        relay.stop()
        thread.join(30)
        if thread.is_alive():
            raise RuntimeError("Relay.run did not return after stop()")
    share = max(0.0, used - idle) / wall * 100
    report.add(
        f"idle Relay (poll={IDLE_POLL:g}), file: CPU % of a core",
        f"{share:.3f} (process CPU {used * 1e3:.1f} ms with the relay, {idle * 1e3:.1f} ms"
        f" without; its thread's {thread_cpu[0] * 1e3:.1f} ms; {claims['claim_outbox']} rounds)",
        "<= 1",
        share <= 1 and not called,
        process_cpu_s=round(used, 4),
        idle_cpu_s=round(idle, 4),
        thread_cpu_s=round(thread_cpu[0], 4),
        wall_s=round(wall, 3),
        claims=dict(claims),
        handled=len(called),
    )


def main() -> None:
    args = parser(__doc__, quick="fewer entries and repetitions")
    args.add_argument("--delay-ms", type=float, default=20.0, help="the link's delay a request")
    args.add_argument(
        "--only",
        action="append",
        metavar="SECTION",
        help="run only this section (1a ... 4d, or a number for all its parts); repeatable",
    )
    args.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = args.parse_args()
    if ns.worker:
        return worker()
    only = tuple(ns.only or ())
    if unknown := [o for o in only if not any(s.startswith(o) for s in SECTIONS)]:
        args.error(f"--only {unknown[0]}: no such section (they are {', '.join(SECTIONS)})")
    wanted = [s for s in SECTIONS if not only or s.startswith(only)]
    plan = PLANS[mode(ns)]
    took: dict[str, float] = {}  # seconds a section, for the JSON
    meta = {"only": list(only) or None, "plan": asdict(plan), "delay_ms": ns.delay_ms}
    with (
        Report("relays", mode(ns), section_seconds=took, **meta) as report,
        tempfile.TemporaryDirectory(prefix="harel-relays-") as name,
        contextlib.ExitStack() as stack,
    ):
        tmp, procs = Path(name), []  # the workers, started once: no drain waits for them
        if {"1a", "1b"} & set(wanted):
            for _ in range(max(plan.workers)):
                procs.append(Child(module("relays", "--worker")))
                stack.callback(procs[-1].close, 10)
        if {"1b", "2b", "4b"} & set(wanted):
            on = stack.enter_context(served(tmp, ns.delay_ms))
        sections: dict[str, Callable[[], None]] = {
            "1a": lambda: bench_drains(report, plan, procs, tmp),
            "1b": lambda: bench_drains(report, plan, procs, on),
            "2a": lambda: bench_delivery(report, plan, tmp),
            "2b": lambda: bench_delivery(report, plan, on),
            "3": lambda: bench_claim_cost(report, plan, tmp),
            "4a": lambda: bench_relay_local(report, plan, tmp),
            "4b": lambda: bench_relay_remote(report, plan, on),
            "4c": lambda: bench_wakeup(report, plan, tmp),
            "4d": lambda: bench_idle(report, plan, tmp),
        }
        for section in wanted:
            t0 = time.time()
            sections[section]()
            took[section] = round(time.time() - t0, 1)


if __name__ == "__main__":
    main()
