"""Claimable relays: how fast worker processes drain the outbox with an ack per entry and
with one ack a batch, what an engine-like delivery costs in each shape, what a claim costs
as the backlog (and its dead letters) grows, and what the relay runtime (`Relay`,
`AsyncRelay`) delivers, how soon it wakes and what it costs idle. Not a test: the figures
depend on the machine; the ratios, each against a baseline measured in the same run, carry
across.

    python -m benchmarks.relays              # full: ~4-6 minutes on 2 cores (section 4: ~2)
    python -m benchmarks.relays --quick      # fewer entries and repetitions (~2-3 minutes)
    python -m benchmarks.relays --only 4b    # one section (a number: all its parts)
    python -m benchmarks.relays --smoke      # every section once, tiny: that it works

1. Drains: the outbox seeded with bulk SQL (a recursive CTE; each event ``{"name": "n",
   "id": "<seq>", "payload": {}}``), then 1, 2 and 4 worker *processes* (a pool of
   ``--worker`` processes, started once; each drain opens its own stores), each looping
   ``claim_outbox(worker, limit=100)`` until a claim comes back empty, acking either each
   entry on its own (``ack_outbox(seq)``: today's relay) or the whole batch with one
   ``store.ack(entries)`` (one transaction; one request remote). Entries/s (and per
   worker), the scaling from 1 worker, and the batch's rate over the per-entry rate at the
   same worker count (the batch drains are given more entries, so that they are not timed
   over a few batches); then a check that every seeded entry was delivered exactly once and
   the outbox is empty. (a) A local file (LibsqlStore, WAL) at ``synchronous=FULL`` (each
   ack transaction an fsync) and at ``NORMAL``; (b) sqld behind the 20 ms link proxy of
   ``benchmarks.remote`` (LibsqlStore over HTTP), with fewer entries: an ack is a request
   of its own, ~21 ms; and (c) sqld with no delay (``benchmarks.remote``'s counting proxy),
   where the machine and sqld's one writer bound the rate, not the link.
2. Engine-like delivery: 100 target executions (committed through the store) and events
   addressed to them (a source execution's commits, 250 emits each), then this process
   drains with ``claim_outbox(limit=100)`` and, per entry, today's handler (``load``, then
   ``commit(target, [], processed_event_id=event.id)``, then ``ack_outbox(seq)``) or the
   one-trip handler (``load_for_event(target, event.id)``, then ``commit(target, [],
   processed_event_id=event.id, acks=(entry,))``). Events/s of the one-trip shape over
   today's, (a) on a local file at ``synchronous=FULL`` and (b) on sqld behind the 20 ms
   link, where the proxy counts the requests an event (claims included; the target is the
   handler's share). Checked: each event delivered once, the outbox empty, one version
   bump of a target per event.
3. Claim cost: the median ``claim_outbox(limit=100)`` and ``claim_due_timers(limit=100)``,
   without and with ``max_attempts=10`` (the relay runtime's default: the claim then runs
   the dead-letter sweep first), on a local file with 1M entries (due timers) pending and
   100k dead letters of each kind, over the same with 1k pending and none. The dead letters
   sit where a naive claim would meet them first: the oldest outbox seqs (stored negated,
   as the store keeps a dead entry) and the earliest due ``fire_at`` times. The claimed
   rows are given back with ``store.revive`` (claim and attempts cleared) between calls,
   so every call claims from the same backlog.
4. The relay runtime, with section 2's seeding and the engine-like handler
   (``load_for_event``; if seen, return; else ``commit(target, [], processed_event_id=...,
   acks=(entry,))``, the round's ``ack`` then a no-op), against the hand-written loop
   (section 2's today: ``claim_outbox(limit=100)``, then per entry ``load``, ``commit``,
   ``ack_outbox(seq)``; sync, one thread). (a) A local file at ``synchronous=FULL``:
   events/s of ``Relay(store, "relay", on_outbox=handler, batch=100)`` driven by
   ``run_once()`` until it returns 0, and of ``AsyncRelay(..., concurrency=32)`` over
   ``AsyncLibsqlStore`` the same way, each over the hand-written loop, and the Relay over
   its own handler in a bare claim loop (the runtime's own cost); a fresh file a run, the
   four shapes taking turns three times, each keeping its fastest run (the median fsync of
   the file system beside them: FULL's cost, which the one write an event less saves).
   (b) sqld behind the 20 ms link: the AsyncRelay over the hand-written sync loop (given
   fewer events; the store's writes go one request at a time, each
   carrying every commit that waited for it), and the client CPU a request. (c) Wake-up:
   an idle relay with ``poll=30`` on a local file, ``Relay.run()`` in a thread (and then
   ``AsyncRelay.run()`` as a task of this loop, sharing its store with the committing task);
   one emit to an existing target committed at a time, 20 ms after the last handler started,
   timed from before the ``commit`` call to the handler's start (p50, p99; the commit call's
   own time in the JSON). (d) Idle CPU: ``Relay.run()`` with ``poll=1`` and a handler of each kind
   (three claims a round) in a thread on an empty file for 5 s (quick) or 15 s (full): the
   process CPU meanwhile, less the same process idle as long, as a share of one core (the
   relay thread's own CPU and its claims in the JSON). Checked: each event delivered once
   (one version bump a target a delivery), the outbox empty, ``run()`` returning after
   ``stop()``.

Each drain's line shows its requests an entry (claims, acks and the last empty claims, over
the entries; remote, as the proxy counted them, retries included). No file is open in two
SQLite libraries at once in one process (closing the second one unlinks the first one's
WAL): a drain's file is migrated (SqliteStore) and seeded with stdlib ``sqlite3`` here and
opened with libsql only by the workers, other processes; a claim-cost file is seeded with
``sqlite3``, closed, then opened with LibsqlStore, which also gives the claimed rows back;
the delivery and relay-runtime files are the store's alone, seeded through it (sqld's
through a store not behind the proxy; a file for the AsyncRelay through a LibsqlStore closed
before the async store opens it). Prints a table and writes JSON to
``benchmarks/results/relays-<timestamp>.json`` (the seconds of each section in its
``meta``; ``--smoke``: not written, its figures mean nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import select
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/relays.py` as well as `-m benchmarks.relays`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet

from benchmarks.remote import TIMEOUT, Proxy
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
from harel_store.connection import http
from harel_store.store import Store
from tests.sqld import SQLD_VERSION, SqldServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
LIMIT = 100  # entries a claim asks for
NOW = 1e9  # the timer sweep's "now": every seeded timer is due
SIZES = (1_000, 1_000_000)  # pending rows for the claim cost (--smoke: fewer)
DEAD = 100_000  # dead letters of each kind beside the larger backlog (--smoke: fewer)
MAX_ATTEMPTS = 10  # the relay runtime's default
TARGETS = 100  # executions the engine-like delivery addresses
TARGET_DEF = "relay-bench-target"
EMITS = 250  # emits a seeding commit
CONCURRENCY = 32  # AsyncRelay's handlers in flight
ASYNC_RELAY = f"AsyncRelay (concurrency {CONCURRENCY})"
WAKE_POLL = 30.0  # an idle relay's poll in the wake-up timings: only the signal wakes it
WAKE_PAUSE = 0.02  # seconds between a handler's start and the next commit
IDLE_POLL = 1.0

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
# (in the order they died) and the attempts that reached the limit. The dead timers are
# due before every live one.
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
    delivery_file: int  # events a delivery run, each shape
    delivery_link: int
    rounds: int  # of the claim-cost timings, the sizes taking turns
    calls: int  # timed claims per size and round
    relay_file: int  # events a relay-runtime run on the file, each shape
    relay_reps: int  # runs of each shape on the file, taking turns
    relay_link: tuple[int, int]  # events on the link: by hand, by AsyncRelay
    wakeups: int  # commits timed to their handler, each relay
    idle_seconds: float  # an idle relay's CPU is measured over, and the baseline too
    sizes: tuple[int, int] = SIZES  # pending rows for the claim cost, small and large
    dead: int = DEAD  # dead letters of each kind beside the larger backlog


QUICK = Plan(
    workers=(1, 2, 4),
    file_full=(1_000, 10_000),
    file_normal=(10_000, 20_000),
    link=(400, 2_000),
    no_delay=(400, 4_000),
    delivery_file=400,
    delivery_link=100,
    rounds=3,
    calls=30,
    relay_file=500,
    relay_reps=3,
    relay_link=(100, 1_000),
    wakeups=100,
    idle_seconds=5.0,
)
FULL = Plan(
    workers=(1, 2, 4),
    file_full=(2_000, 40_000),
    file_normal=(20_000, 100_000),
    link=(800, 10_000),
    no_delay=(800, 10_000),
    delivery_file=1_500,
    delivery_link=200,
    rounds=5,
    calls=60,
    relay_file=1_500,
    relay_reps=3,
    relay_link=(200, 3_000),
    wakeups=200,
    idle_seconds=15.0,
)
# Every section once on tiny sizes: that the module works, not what it measures.
SMOKE = Plan(
    workers=(1, 2),
    file_full=(2 * LIMIT, 2 * LIMIT),
    file_normal=(2 * LIMIT, 2 * LIMIT),
    link=(LIMIT, 2 * LIMIT),
    no_delay=(2 * LIMIT, 2 * LIMIT),
    delivery_file=50,
    delivery_link=20,
    rounds=1,
    calls=1,
    relay_file=50,
    relay_reps=1,
    relay_link=(20, 50),
    wakeups=5,
    idle_seconds=0.5,
    sizes=(1_000, 2_000),
    dead=1_000,
)


@dataclass
class Report:
    rows: list[tuple[str, str, str, bool | None]] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def add(
        self, key: str, shown: str, target: str = "", met: bool | None = None, **raw: Any
    ) -> None:
        self.data[key] = {"shown": shown, "target": target or None, "met": met, **raw}
        self.rows.append((key, shown, target, met))
        flag = "" if met is None else ("ok" if met else "MISSED")
        print(f"  {key:<72} {shown:>16}  {target} {flag}".rstrip(), flush=True)


def meets(value: float, target: str) -> bool | None:
    """Whether `value` meets a target such as ">= 8" or "<= 2" (None: no target)."""
    if not target:
        return None
    op, bound = target.split()
    return value >= float(bound) if op == ">=" else value <= float(bound)


# --- a worker process: claim, deliver (note the seq), ack; until a claim comes back empty ---


def worker() -> None:
    """A pool process. For each job (a JSON line: database, name, token, synchronous,
    batched): open the store, say ready, wait for go, drain, close the store, print a JSON
    line. Exits when stdin closes."""
    while line := sys.stdin.readline():
        job = json.loads(line)
        database = job["database"]
        if database.startswith("http"):
            store = LibsqlStore(database, auth_token=job["token"], timeout=TIMEOUT)
        else:
            store = LibsqlStore(database, synchronous=job["synchronous"], migrate=False)
        print("ready", flush=True)
        if sys.stdin.readline().strip() != "go":
            return
        seqs: list[int] = []
        claims = acks = mismatched = 0
        cpu = time.process_time()
        while True:
            claims += 1
            entries = store.claim_outbox(job["name"], limit=LIMIT)
            if not entries:
                break
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
        ended = time.monotonic()
        cpu = time.process_time() - cpu
        store.close()
        out = {"seqs": seqs, "claims": claims, "acks": acks, "mismatched": mismatched}
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


class Pool:
    """Worker processes (``--worker``), started once for the run (a drain of k workers
    uses the first k), so that no drain waits for interpreters to start."""

    def __init__(self, size: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        args = [sys.executable, "-m", "benchmarks.relays", "--worker"]
        pipe = subprocess.PIPE
        self.procs = [
            subprocess.Popen(args, cwd=ROOT, env=env, stdin=pipe, stdout=pipe, text=True)
            for _ in range(size)
        ]

    @staticmethod
    def _send(proc: subprocess.Popen[str], line: str) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    @staticmethod
    def _read(proc: subprocess.Popen[str], timeout: float) -> str:
        # One line a step and nothing written ahead of it: the pipe's buffer is empty here.
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], timeout)
        line = proc.stdout.readline() if ready else ""
        if not line:
            raise RuntimeError(f"a worker did not answer in {timeout:g} s (exit {proc.poll()})")
        return line

    def drain(
        self,
        database: str,
        workers: int,
        seeded: range,
        left: Callable[[], int],
        *,
        token: str = "",
        batched: bool = False,
        synchronous: str = "FULL",
        proxy: Proxy | None = None,
    ) -> Drain:
        """Let `workers` workers go at once on the seeded outbox, and check what they
        delivered against `seeded` (the seqs); `proxy` (remote) counts the requests."""
        procs = self.procs[:workers]
        job = {"database": database, "token": token, "synchronous": synchronous}
        for i, proc in enumerate(procs):
            self._send(proc, json.dumps(job | {"name": f"w{i}", "batched": batched}))
        for proc in procs:
            if self._read(proc, 60).strip() != "ready":
                raise RuntimeError("a worker did not open its store")
        before = proxy.requests() if proxy else 0
        started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on Linux
        for proc in procs:
            self._send(proc, "go")
        outs = [json.loads(self._read(proc, 600)) for proc in procs]
        requests = proxy.requests() - before if proxy else None
        counts = Counter(seq for out in outs for seq in out["seqs"])
        return Drain(
            workers=workers,
            batched=batched,
            entries=len(seeded),
            seconds=max(out["ended"] for out in outs) - started,
            claims=sum(out["claims"] for out in outs),
            acks=sum(out["acks"] for out in outs),
            cpu=sum(out["cpu"] for out in outs),
            delivered=counts.total(),
            duplicates=counts.total() - len(counts),
            lost=sum(1 for seq in seeded if seq not in counts),
            left=left(),
            mismatched=sum(out["mismatched"] for out in outs),
            link_requests=requests,
        )

    def close(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # the worker exits
        for proc in self.procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()


def local_db(path: Path) -> sqlite3.Connection:
    """A file migrated to head (SqliteStore: stdlib sqlite3, as the seeding), and a stdlib
    connection to seed it. This process never opens that file with libsql."""
    SqliteStore(path, synchronous="OFF").close()
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    return conn


def rows_left(conn: sqlite3.Connection) -> int:
    return int(conn.execute(OUTBOX_LEFT).fetchone()[0])


def pipeline(url: str, token: str, sql: str, *args: int) -> int:
    """One statement on sqld directly (not through a proxy), for seeding and checking: the
    first column of its first row, or else the number of rows it changed."""
    stmt = {"sql": sql, "args": [{"type": "integer", "value": str(a)} for a in args]}
    body = {"baton": None, "requests": [{"type": "execute", "stmt": stmt}, {"type": "close"}]}
    client = http.Client(
        url, headers={"Authorization": f"Bearer {token}"}, timeout=60.0, ssl_context=None
    )
    try:
        reply = client.post("/v3/pipeline", json.dumps(body).encode())
    finally:
        client.close()
    if reply.status != 200:
        raise RuntimeError(f"sqld answered HTTP {reply.status}: {reply.text[:200]}")
    first = json.loads(reply.body)["results"][0]
    if first["type"] != "ok":
        raise RuntimeError(f"{sql.split()[0]} on sqld failed: {first}")
    rows = first["response"]["result"]["rows"]
    return int(rows[0][0]["value"]) if rows else first["response"]["result"]["affected_row_count"]


def workers_label(n: int) -> str:
    return f"{n} worker" + "s" * (n > 1)


def report_drains(
    report: Report,
    where: str,
    runs: dict[bool, list[Drain]],
    ratio_target: str,
    scale_target: str = "",
) -> None:
    """Each drain's rate; per ack shape, the most workers over 1; per worker count, one ack
    a batch over an ack per entry (`ratio_target`); whether anything was lost."""
    for batched, drains in runs.items():
        how = "one ack a batch" if batched else "ack per entry"
        for d in drains:
            report.add(
                f"drain {where}, {how}, {workers_label(d.workers)}: entries/s (a worker)",
                f"{d.rate:,.0f} ({d.rate / d.workers:,.0f})",
                **asdict(d),
                entries_per_s=round(d.rate, 1),
                entries_per_s_a_worker=round(d.rate / d.workers, 1),
                requests_per_entry=round(d.requests_per_entry, 4),
            )
        one, most = drains[0], drains[-1]
        if most.workers > 1:
            aim = "" if batched else scale_target
            ratio = most.rate / one.rate
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
    dups = sum(d.duplicates for d in drains)
    bad = sum(d.mismatched for d in drains)
    shown = f"{lost} / {dups}"
    report.add(f"drain {where}: lost / duplicated", shown, "0 / 0", lost == dups == bad == 0)


def print_drain(d: Drain) -> None:
    how = "batch acks" if d.batched else "entry acks"
    print(
        f"    {d.workers} worker(s), {how}: {d.entries} entries in {d.seconds:.2f} s,"
        f" {d.rate:,.0f}/s, {d.requests_per_entry:.3f} requests an entry"
        f" ({d.claims} claims, {d.acks} acks), worker CPU {d.cpu / d.seconds:.0%};"
        f" delivered {d.delivered}, duplicates {d.duplicates}, lost {d.lost},"
        f" left {d.left}, event id != seq {d.mismatched}",
        flush=True,
    )


def bench_local(report: Report, plan: Plan, tmp: Path, pool: Pool) -> None:
    print("1a. drain outbox entries, local file (LibsqlStore, WAL)", flush=True)
    for sync, sizes, target in (("FULL", plan.file_full, ">= 8"), ("NORMAL", plan.file_normal, "")):
        runs: dict[bool, list[Drain]] = {}
        for batched, n in zip((False, True), sizes, strict=True):
            print(f"    synchronous={sync}, {n:,} entries a drain", flush=True)
            runs[batched] = []
            for workers in plan.workers:
                path = tmp / f"drain-{sync}-{workers}{'-batched' if batched else ''}.db"
                with contextlib.closing(local_db(path)) as conn:
                    conn.execute(SEED_OUTBOX, (0, n))
                    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
                    left = functools.partial(rows_left, conn)
                    seeded = range(1, n + 1)
                    drained = pool.drain(
                        str(path), workers, seeded, left, batched=batched, synchronous=sync
                    )
                runs[batched].append(drained)
                print_drain(drained)
                path.unlink()
        report_drains(report, f"file {sync}", runs, target)


def bench_remote(
    report: Report, plan: Plan, pool: Pool, srv: SqldServer, link: Proxy, count: Proxy
) -> None:
    print("1b. drain outbox entries, sqld (LibsqlStore over HTTP)", flush=True)
    left = functools.partial(pipeline, srv.url, srv.token, OUTBOX_LEFT)
    base = 0
    # On the link: the acks per entry (scaling target: the link, not the store, bounds a
    # worker) and a batch's ack; then the same with no delay, where only the machine and
    # sqld bound the rate.
    runs = (
        (link, f"sqld {link.delay_ms:g} ms link", plan.link, ">= 20", ">= 3"),
        (count, "sqld no delay", plan.no_delay, "", ""),
    )
    for proxy, where, sizes, ratio_target, scale_target in runs:
        drains: dict[bool, list[Drain]] = {}
        for batched, n in zip((False, True), sizes, strict=True):
            print(f"    {where}: {n:,} entries a drain", flush=True)
            drains[batched] = []
            for workers in plan.workers:
                base += 10_000_000
                assert pipeline(srv.url, srv.token, SEED_OUTBOX, base, n) == n
                seeded = range(base + 1, base + n + 1)
                drained = pool.drain(
                    proxy.url, workers, seeded, left, token=srv.token, batched=batched, proxy=proxy
                )
                drains[batched].append(drained)
                print_drain(drained)
        report_drains(report, where, drains, ratio_target, scale_target)


# --- engine-like delivery: the handler's round trips ---


def today(store: Store, entry: OutboxEntry) -> int:
    """Today's handler: load the target, commit the event's effect (its dedupe marker),
    then ack the entry on its own. Returns the store calls it made."""
    assert entry.target_id is not None
    exe = store.load(entry.target_id)
    if exe is None:
        raise RuntimeError(f"no target {entry.target_id!r}")
    store.commit(exe, [], processed_event_id=entry.event.id)
    store.ack_outbox(entry.seq)
    return 3


def one_trip(store: Store, entry: OutboxEntry) -> int:
    """The handler with the relay primitives: the target and its dedupe check in one read,
    the effect and the ack in one commit."""
    assert entry.target_id is not None
    exe, seen = store.load_for_event(entry.target_id, entry.event.id)
    if exe is None:
        raise RuntimeError(f"no target {entry.target_id!r}")
    if seen:  # handled before: only consume the entry
        store.ack([entry])
    else:
        store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
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
        sent = self.link_requests if self.link_requests is not None else self.calls
        return sent / self.events

    @property
    def handler_requests_per_event(self) -> float:
        """The handler's own: the claims left out."""
        sent = self.link_requests if self.link_requests is not None else self.calls
        return (sent - self.claims) / self.events


def make_targets(store: Store, n: int, prefix: str = "target") -> list[str]:
    ids = [f"{prefix}-{i:04d}" for i in range(n)]
    for eid in ids:
        store.commit(Execution(id=eid, definition_id=TARGET_DEF), [])
    return ids


def seed_events(store: Store, source: Execution, targets: list[str], tag: str, n: int) -> list[int]:
    """`n` events addressed round-robin to `targets`, emitted by `source`'s commits; their
    seqs."""
    seqs: list[int] = []
    for start in range(0, n, EMITS):
        emits = [
            (targets[i % len(targets)], Event(name="n", id=f"{tag}-{i}"))
            for i in range(start, min(n, start + EMITS))
        ]
        seqs += store.commit(source, emits)
    return seqs


def versions(store: Store) -> int:
    return sum(s.version for s in store.list_executions(definition_id=TARGET_DEF, limit=1000).items)


def deliver(
    store: Store, shape: str, seeded: list[int], check: Store, proxy: Proxy | None = None
) -> Delivery:
    """Drain the outbox in this process with the handler `shape`; `check` (a store not
    behind the proxy) reads the targets' versions and what is left."""
    handler = SHAPES[shape]
    before_versions = versions(check)
    counts: Counter[int] = Counter()
    claims = calls = 0
    before = proxy.requests() if proxy else 0
    cpu = time.process_time()
    started = time.perf_counter()
    while True:
        claims += 1
        entries = store.claim_outbox("deliverer", limit=LIMIT)
        if not entries:
            break
        for entry in entries:
            counts[entry.seq] += 1
            calls += handler(store, entry)
    seconds = time.perf_counter() - started
    cpu = time.process_time() - cpu
    requests = proxy.requests() - before if proxy else None
    return Delivery(
        shape=shape,
        events=len(seeded),
        seconds=seconds,
        claims=claims,
        calls=calls + claims,
        cpu=cpu,
        duplicates=counts.total() - len(counts),
        lost=sum(1 for seq in seeded if seq not in counts),
        left=len(check.pending_outbox()),
        bumps=versions(check) - before_versions,
        link_requests=requests,
    )


def print_delivery(d: Delivery) -> None:
    print(
        f"    {d.shape}: {d.events} events in {d.seconds:.2f} s, {d.rate:,.0f}/s,"
        f" {d.requests_per_event:.3f} requests an event ({d.claims} claims), CPU"
        f" {d.cpu / d.seconds:.0%}; duplicates {d.duplicates}, lost {d.lost}, left {d.left},"
        f" version bumps {d.bumps}",
        flush=True,
    )


def report_rates(report: Report, label: str, runs: list[Delivery]) -> None:
    """A row of events/s (and requests an event) for each run."""
    for d in runs:
        report.add(
            f"{label}, {d.shape}: events/s",
            f"{d.rate:,.0f} ({d.requests_per_event:.2f} req)",
            **asdict(d),
            events_per_s=round(d.rate, 1),
            requests_per_event=round(d.requests_per_event, 4),
        )


def report_deliveries(
    report: Report, where: str, runs: list[Delivery], rate_target: str, link: bool
) -> None:
    report_rates(report, f"delivery {where}", runs)
    old, new = runs
    ratio = new.rate / old.rate
    report.add(
        f"delivery {where}: one-trip / today",
        f"{ratio:.2f}",
        rate_target,
        meets(ratio, rate_target),
    )
    if link:  # the handler's round trips, the claims (1 in 100 events) aside
        mine, theirs = new.handler_requests_per_event, old.handler_requests_per_event
        report.add(
            f"delivery {where}: handler requests an event (today's)",
            f"{mine:.2f} ({theirs:.2f})",
            "2 (today 3)",
            mine <= 2.0 + 1e-9,
            one_trip=round(mine, 4),
            today=round(theirs, 4),
        )
    bad = sum(d.duplicates + d.lost + d.left + abs(d.bumps - d.events) for d in runs)
    report.add(f"delivery {where}: lost / duplicated / version bumps off", str(bad), "0", bad == 0)


def bench_delivery_local(report: Report, plan: Plan, tmp: Path) -> None:
    n = plan.delivery_file
    print(f"2a. engine-like delivery of {n:,} events, local file (LibsqlStore, FULL)", flush=True)
    runs = []
    for i, shape in enumerate(SHAPES):
        path = tmp / f"deliver-{i}.db"
        with LibsqlStore(path, synchronous="FULL") as store:
            targets = make_targets(store, min(TARGETS, n))
            source = Execution(id="source", definition_id="relay-bench-source")
            seeded = seed_events(store, source, targets, "e", n)
            runs.append(deliver(store, shape, seeded, store))
        print_delivery(runs[-1])
    report_deliveries(report, "file FULL", runs, ">= 1.6", link=False)


def bench_delivery_remote(report: Report, plan: Plan, srv: SqldServer, link: Proxy) -> None:
    n = plan.delivery_link
    where = f"sqld {link.delay_ms:g} ms link"
    print(f"2b. engine-like delivery of {n:,} events, {where}", flush=True)
    with (
        LibsqlStore(srv.url, auth_token=srv.token, timeout=TIMEOUT) as direct,
        LibsqlStore(link.url, auth_token=srv.token, timeout=TIMEOUT) as store,
    ):
        targets = make_targets(direct, min(TARGETS, n))
        source = Execution(id="source", definition_id="relay-bench-source")
        runs = []
        for i, shape in enumerate(SHAPES):
            seeded = seed_events(direct, source, targets, f"e{i}", n)
            runs.append(deliver(store, shape, seeded, direct, link))
            print_delivery(runs[-1])
    report_deliveries(report, where, runs, "", link=True)


# --- claim cost: 1M pending and 100k dead letters / 1k pending ---


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
    """One claim, timed; then its rows given back (not timed; `revive` clears the claim and
    the attempt it counted), so that the next call finds the same backlog."""
    t0 = time.perf_counter()
    got: list[Any]
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


@contextlib.contextmanager
def claimers(path: Path, dead: int) -> Iterator[dict[str, Callable[[], float]]]:
    """Each claim as a call that times one claim on the store and gives back its rows
    through the same store (no second SQLite library on the file in this process)."""
    store = LibsqlStore(path, synchronous="NORMAL", migrate=False)
    try:
        for kind in ("outbox", "timer"):  # the seeded dead letters are the store's
            letters = store.dead_letters(kind=kind, limit=3)
            assert len(letters) == min(3, dead), (kind, letters)
            assert not dead or letters[0].attempts == MAX_ATTEMPTS, letters[0]
        calls = {}
        for attempts in (None, MAX_ATTEMPTS):
            suffix = "" if attempts is None else f", max_attempts={attempts}"
            outbox = functools.partial(timed_claim, store, "claim_outbox", attempts, dead + 1)
            timers = functools.partial(timed_claim, store, "claim_due_timers", attempts, 1001.0)
            calls["claim_outbox" + suffix] = outbox
            calls["claim_due_timers" + suffix] = timers
        yield calls
    finally:
        store.close()


def bench_claim_cost(report: Report, plan: Plan, tmp: Path) -> None:
    sizes = plan.sizes
    small, large = sizes
    title = f"3. claim cost (limit {LIMIT}), local file: {large:,} pending and {plan.dead:,} dead"
    print(f"{title} / {small:,} pending", flush=True)
    dead = {small: 0, large: plan.dead}
    paths = {n: tmp / f"claim-{n}.db" for n in sizes}
    for n, path in paths.items():
        took = claim_db(path, n, dead[n])
        print(
            f"    built {n:,} outbox entries and due timers, {dead[n]:,} dead letters of each,"
            f" in {took:.1f} s",
            flush=True,
        )
    best: dict[int, dict[str, float]] = {n: {} for n in sizes}
    with contextlib.ExitStack() as stack:
        calls = {n: stack.enter_context(claimers(path, dead[n])) for n, path in paths.items()}
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
            f"{ratio:.2f}",
            "<= 2",
            ratio <= 2,
            us=us,
        )
        print(f"    {name}: {us[str(small)]} us at {small:,}, {us[str(large)]} us at {large:,}")


# --- the relay runtime: Relay and AsyncRelay against the hand-written loop ---


@dataclass
class Seen:
    """What a relay's handlers were given: the deliveries by seq, and their store calls."""

    seqs: Counter[int] = field(default_factory=Counter)
    calls: int = 0


def relay_handler(store: Store, seen: Seen) -> Callable[[OutboxEntry], None]:
    """The engine-like handler for `Relay`: the target and its dedupe check in one read,
    the effect and the entry's consumption in one commit (the round's `ack` of the entry
    then removes nothing)."""

    def handle(entry: OutboxEntry) -> None:
        seen.seqs[entry.seq] += 1
        assert entry.target_id is not None
        exe, done = store.load_for_event(entry.target_id, entry.event.id)
        seen.calls += 1
        if exe is None:
            raise RuntimeError(f"no target {entry.target_id!r}")
        if not done:
            store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
            seen.calls += 1

    return handle


def async_handler(store: AsyncLibsqlStore, seen: Seen) -> Callable[[OutboxEntry], Awaitable[None]]:
    """`relay_handler` as a coroutine, for `AsyncRelay`."""

    async def handle(entry: OutboxEntry) -> None:
        seen.seqs[entry.seq] += 1
        assert entry.target_id is not None
        exe, done = await store.load_for_event(entry.target_id, entry.event.id)
        seen.calls += 1
        if exe is None:
            raise RuntimeError(f"no target {entry.target_id!r}")
        if not done:
            await store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
            seen.calls += 1

    return handle


def relay_delivery(
    shape: str, seeded: list[int], seen: Seen, rounds: int, timed: tuple[float, float], **after: Any
) -> Delivery:
    """A relay's drain (`timed`: its seconds and CPU seconds) as a `Delivery`: a claim a
    round (the last one empty), an ack a round that handled something, and the handlers'
    calls."""
    seconds, cpu = timed
    return Delivery(
        shape=shape,
        events=len(seeded),
        seconds=seconds,
        claims=rounds,
        calls=rounds + (rounds - 1) + seen.calls,
        cpu=cpu,
        duplicates=seen.seqs.total() - len(seen.seqs),
        lost=sum(1 for seq in seeded if seq not in seen.seqs),
        **after,
    )


def drive_relay(store: Store, seeded: list[int]) -> Delivery:
    """`Relay.run_once` in this thread until a round handles nothing."""
    seen = Seen()
    relay = Relay(store, "relay", on_outbox=relay_handler(store, seen), batch=LIMIT)
    before_versions = versions(store)
    rounds = 0
    cpu = time.process_time()
    started = time.perf_counter()
    while True:
        rounds += 1
        if not relay.run_once():
            break
    timed = (time.perf_counter() - started, time.process_time() - cpu)
    return relay_delivery(
        "Relay",
        seeded,
        seen,
        rounds,
        timed,
        bumps=versions(store) - before_versions,
        left=len(store.pending_outbox()),
    )


async def aversions(store: AsyncLibsqlStore) -> int:
    page = await store.list_executions(definition_id=TARGET_DEF, limit=1000)
    return sum(s.version for s in page.items)


async def drive_async_relay(
    store: AsyncLibsqlStore, seeded: list[int], proxy: Proxy | None = None
) -> Delivery:
    """`AsyncRelay.run_once` on this loop until a round handles nothing; the checks go
    through the same store, outside the timed part and the requests counted."""
    seen = Seen()
    handler = async_handler(store, seen)
    relay = AsyncRelay(store, "arelay", on_outbox=handler, batch=LIMIT, concurrency=CONCURRENCY)
    before_versions = await aversions(store)
    before = proxy.requests() if proxy else 0
    rounds = 0
    cpu = time.process_time()
    started = time.perf_counter()
    while True:
        rounds += 1
        if not await relay.run_once():
            break
    timed = (time.perf_counter() - started, time.process_time() - cpu)
    requests = proxy.requests() - before if proxy else None
    return relay_delivery(
        ASYNC_RELAY,
        seeded,
        seen,
        rounds,
        timed,
        bumps=await aversions(store) - before_versions,
        left=len(await store.pending_outbox()),
        link_requests=requests,
    )


def report_relay_checks(report: Report, where: str, runs: list[Delivery]) -> None:
    bad = sum(d.duplicates + d.lost + d.left + abs(d.bumps - d.events) for d in runs)
    report.add(f"relay {where}: lost / duplicated / version bumps off", str(bad), "0", bad == 0)


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


def relay_file_run(path: Path, shape: str, n: int) -> Delivery:
    """A fresh file with the targets and `n` events to them, drained by `shape` (a loop of
    `SHAPES`, "Relay" or the AsyncRelay); the file removed afterwards."""
    with LibsqlStore(path, synchronous="FULL") as store:
        targets = make_targets(store, min(TARGETS, n))
        source = Execution(id="source", definition_id="relay-bench-source")
        seeded = seed_events(store, source, targets, "e", n)
        if shape in SHAPES:
            run = deliver(store, shape, seeded, store)
        elif shape == "Relay":
            run = drive_relay(store, seeded)
    if shape == ASYNC_RELAY:  # the seeding store closed: the async one's is the only one

        async def drain() -> Delivery:
            async with await AsyncLibsqlStore.create(path, synchronous="FULL") as store:
                return await drive_async_relay(store, seeded)

        run = asyncio.run(drain())
    path.unlink()
    return run


def bench_relay_local(report: Report, plan: Plan, tmp: Path) -> None:
    n, reps = plan.relay_file, plan.relay_reps
    print(
        f"4a. Relay and AsyncRelay, local file (LibsqlStore, FULL): {n:,} events a run, the"
        f" shapes taking turns {reps} times (each keeps its fastest)",
        flush=True,
    )
    shapes = (*SHAPES, "Relay", ASYNC_RELAY)
    every: dict[str, list[Delivery]] = {shape: [] for shape in shapes}
    fsyncs = []
    for _ in range(reps):
        fsyncs.append(fsync_ms(tmp))
        for shape in shapes:
            every[shape].append(relay_file_run(tmp / "relay.db", shape, n))
            print_delivery(every[shape][-1])
    fsync = statistics.median(fsyncs)
    print(f"    a write and fsync of 4 KiB here: {fsync:.2f} ms (median)", flush=True)
    where = "file FULL"
    runs = [max(every[shape], key=lambda d: d.rate) for shape in shapes]
    report_rates(report, f"relay {where}", runs)
    by_hand, bare, relay, arelay = runs
    ratio = relay.rate / by_hand.rate
    report.add(
        f"relay {where}: Relay / hand-written loop",
        f"{ratio:.2f}",
        ">= 1.6",
        ratio >= 1.6,
        rates={shape: [round(d.rate, 1) for d in ds] for shape, ds in every.items()},
        fsync_ms=round(fsync, 3),
    )
    ratio = relay.rate / bare.rate  # the runtime's own cost: its handler in a bare loop
    report.add(f"relay {where}: Relay / its handler in a bare loop", f"{ratio:.2f}")
    ratio = arelay.rate / by_hand.rate
    report.add(f"relay {where}: AsyncRelay / hand-written loop", f"{ratio:.2f}")
    report_relay_checks(report, where, [d for ds in every.values() for d in ds])


def bench_relay_remote(report: Report, plan: Plan, srv: SqldServer, link: Proxy) -> None:
    by_hand_n, n = plan.relay_link
    where = f"sqld {link.delay_ms:g} ms link"
    print(
        f"4b. AsyncRelay, {where}: {by_hand_n:,} events by hand (sync), {n:,} by AsyncRelay",
        flush=True,
    )
    with (
        LibsqlStore(srv.url, auth_token=srv.token, timeout=TIMEOUT) as direct,
        LibsqlStore(link.url, auth_token=srv.token, timeout=TIMEOUT) as store,
    ):
        targets = make_targets(direct, min(TARGETS, n), prefix="relay-target")
        source = Execution(id="relay-source", definition_id="relay-bench-source")
        seeded = seed_events(direct, source, targets, "by-hand", by_hand_n)
        by_hand = deliver(store, BY_HAND, seeded, direct, link)
        print_delivery(by_hand)
        seeded = seed_events(direct, source, targets, "arelay", n)

    async def drain() -> Delivery:
        async with await AsyncLibsqlStore.create(
            link.url, auth_token=srv.token, timeout=TIMEOUT
        ) as store:
            return await drive_async_relay(store, seeded, link)

    arelay = asyncio.run(drain())
    print_delivery(arelay)
    runs = [by_hand, arelay]
    report_rates(report, f"relay {where}", runs)
    ratio = arelay.rate / by_hand.rate
    report.add(
        f"relay {where}: AsyncRelay / hand-written sync loop", f"{ratio:.1f}", ">= 15", ratio >= 15
    )
    cpu = {d.shape: d.cpu / (d.link_requests or d.calls) * 1e3 for d in runs}
    report.add(
        f"relay {where}: client CPU a request, AsyncRelay (by hand), ms",
        f"{cpu[arelay.shape]:.2f} ({cpu[by_hand.shape]:.2f})",
        cpu_ms_a_request={shape: round(ms, 3) for shape, ms in cpu.items()},
    )
    report_relay_checks(report, where, runs)


def percentile(values: list[float], p: int) -> float:
    """The `p`th percentile (100: the largest)."""
    if p == 100:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[p - 1]


@dataclass
class Wakeups:
    relay: str
    commits: int
    seconds: list[float]  # from before each commit call to its handler's start
    commit_seconds: list[float]  # each commit call's own
    delivered: Counter[str]  # handler calls by event id
    left: int  # entries in the outbox afterwards

    def p(self, q: int, of: list[float] | None = None) -> float:
        return percentile(self.seconds if of is None else of, q)

    @property
    def after_commit(self) -> list[float]:
        """From the commit's return to the handler's start."""
        return [w - c for w, c in zip(self.seconds, self.commit_seconds, strict=True)]


def wake_executions() -> tuple[Execution, Execution]:
    return (
        Execution(id="wake-target", definition_id=TARGET_DEF),
        Execution(id="wake-source", definition_id="relay-bench-source"),
    )


def relay_wakeups(path: Path, n: int) -> Wakeups:
    """`Relay.run` (poll=WAKE_POLL) in a thread; this thread commits one emit at a time and
    waits for its handler to start, then pauses."""
    starts: dict[str, float] = {}
    delivered: Counter[str] = Counter()
    arrived = threading.Event()

    def handle(entry: OutboxEntry) -> None:
        starts.setdefault(entry.event.id, time.perf_counter())
        delivered[entry.event.id] += 1
        arrived.set()

    seconds, commits = [], []
    with LibsqlStore(path, synchronous="FULL") as store:
        target, source = wake_executions()
        store.commit(target, [])
        store.commit(source, [])
        relay = Relay(store, "waker", on_outbox=handle, poll=WAKE_POLL)
        thread = threading.Thread(target=relay.run, name="bench-relay", daemon=True)
        thread.start()
        try:
            for i in range(n):
                time.sleep(WAKE_PAUSE)  # the relay idle in its poll
                arrived.clear()
                event = Event(name="n", id=f"wake-{i}")
                t0 = time.perf_counter()
                store.commit(source, [(target.id, event)])
                t1 = time.perf_counter()
                if not arrived.wait(WAKE_POLL + 10):
                    raise RuntimeError(f"the relay never handled {event.id}")
                seconds.append(starts[event.id] - t0)
                commits.append(t1 - t0)
        finally:
            relay.stop()
            thread.join(30)
        if thread.is_alive():
            raise RuntimeError("Relay.run did not return after stop()")
        left = len(store.pending_outbox())
    return Wakeups("Relay", n, seconds, commits, delivered, left)


async def async_relay_wakeups(path: Path, n: int) -> Wakeups:
    """`AsyncRelay.run` (poll=WAKE_POLL) as a task of this loop; another task commits one
    emit at a time through the same store and waits for its handler to start."""
    starts: dict[str, float] = {}
    delivered: Counter[str] = Counter()
    arrived = asyncio.Event()

    async def handle(entry: OutboxEntry) -> None:
        starts.setdefault(entry.event.id, time.perf_counter())
        delivered[entry.event.id] += 1
        arrived.set()

    seconds, commits = [], []
    async with await AsyncLibsqlStore.create(path, synchronous="FULL") as store:
        target, source = wake_executions()
        await store.commit(target, [])
        await store.commit(source, [])
        relay = AsyncRelay(store, "awaker", on_outbox=handle, poll=WAKE_POLL)
        running = asyncio.ensure_future(relay.run())
        try:
            for i in range(n):
                await asyncio.sleep(WAKE_PAUSE)
                arrived.clear()
                event = Event(name="n", id=f"wake-{i}")
                t0 = time.perf_counter()
                await store.commit(source, [(target.id, event)])
                t1 = time.perf_counter()
                try:
                    await asyncio.wait_for(arrived.wait(), WAKE_POLL + 10)
                except asyncio.TimeoutError:
                    raise RuntimeError(f"the relay never handled {event.id}") from None
                seconds.append(starts[event.id] - t0)
                commits.append(t1 - t0)
        finally:
            relay.stop()
            await asyncio.wait_for(running, 30)
        left = len(await store.pending_outbox())
    return Wakeups("AsyncRelay", n, seconds, commits, delivered, left)


def bench_wakeup(report: Report, plan: Plan, tmp: Path) -> None:
    n = plan.wakeups
    print(
        f"4c. wake-up after a commit of this process, idle relay (poll={WAKE_POLL:g}), local"
        f" file (FULL): {n} commits of one emit, {WAKE_PAUSE * 1e3:g} ms apart",
        flush=True,
    )
    runs = [
        relay_wakeups(tmp / "wake.db", n),
        asyncio.run(async_relay_wakeups(tmp / "wake-async.db", n)),
    ]
    bad = 0
    for w, target in zip(runs, ("<= 20", ""), strict=True):
        ms = {f"p{q}": round(w.p(q) * 1e3, 2) for q in (50, 90, 99, 100)}
        commit_ms = {f"p{q}": round(w.p(q, w.commit_seconds) * 1e3, 2) for q in (50, 99)}
        after_ms = {f"p{q}": round(w.p(q, w.after_commit) * 1e3, 2) for q in (50, 99)}
        print(
            f"    {w.relay}: commit to handler p50 {ms['p50']} ms, p99 {ms['p99']} ms, max"
            f" {ms['p100']} ms (the commit call's own p50 {commit_ms['p50']} ms, p99"
            f" {commit_ms['p99']} ms; its return to the handler p50 {after_ms['p50']} ms, p99"
            f" {after_ms['p99']} ms); delivered {w.delivered.total()} of {w.commits}, left"
            f" {w.left}",
            flush=True,
        )
        key = f"wake-up after a commit, idle {w.relay} (poll={WAKE_POLL:g}), file"
        report.add(f"{key}: p50 ms", f"{ms['p50']:.1f}", ms=ms)
        report.add(
            f"{key}: p99 ms",
            f"{ms['p99']:.1f}",
            target,
            meets(ms["p99"], target),
            commit_ms=commit_ms,
            after_commit_ms=after_ms,
        )
        bad += w.left + abs(w.delivered.total() - w.commits) + (len(w.delivered) - w.commits)
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
    print(
        f"4d. idle Relay (poll={IDLE_POLL:g}; outbox, spawn and timer handlers), local file:"
        f" {seconds:g} s idle, {seconds:g} s with the relay",
        flush=True,
    )
    called: list[object] = []
    claims: Counter[str] = Counter()
    with LibsqlStore(tmp / "idle.db", synchronous="FULL") as store:
        for name in ("claim_outbox", "claim_spawns", "claim_due_timers"):
            # An instance attribute over the method, to count what the relay asks for.
            setattr(store, name, counting(claims, name, getattr(store, name)))
        relay = Relay(
            store,
            "idler",
            on_outbox=called.append,
            on_spawn=called.append,
            on_timer=called.append,
            poll=IDLE_POLL,
        )
        cpu = time.process_time()
        time.sleep(seconds)
        idle = time.process_time() - cpu
        thread_cpu: list[float] = []

        def run() -> None:
            t0 = time.thread_time()
            relay.run()
            thread_cpu.append(time.thread_time() - t0)

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
    rounds = claims["claim_outbox"]
    print(
        f"    process CPU {used * 1e3:.1f} ms with the relay, {idle * 1e3:.1f} ms without;"
        f" the relay thread's own {thread_cpu[0] * 1e3:.1f} ms; {rounds} rounds"
        f" ({dict(claims)}); handled {len(called)}",
        flush=True,
    )
    report.add(
        f"idle Relay (poll={IDLE_POLL:g}), file: CPU % of a core",
        f"{share:.3f}",
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer entries and repetitions")
    parser.add_argument(
        "--smoke", action="store_true", help="every section once, tiny (no JSON written)"
    )
    parser.add_argument("--delay-ms", type=float, default=20.0, help="the link's delay a request")
    parser.add_argument(
        "--only",
        action="append",
        metavar="SECTION",
        help="run only this section (1a ... 4d, or a number for all its parts); repeatable",
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker()
    only = tuple(args.only or ())
    if unknown := [o for o in only if not any(s.startswith(o) for s in SECTIONS)]:
        parser.error(f"--only {unknown[0]}: no such section (they are {', '.join(SECTIONS)})")

    def wanted(*names: str) -> bool:
        return not only or any(name.startswith(only) for name in names)

    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    report = Report()
    started = time.time()
    took: dict[str, float] = {}  # seconds a section, for the JSON

    def section(name: str, run: Callable[..., None], *args: Any) -> None:
        if not wanted(name):
            return
        t0 = time.time()
        run(*args)
        took[name] = round(time.time() - t0, 1)

    with contextlib.ExitStack() as stack:
        tmp = Path(tempfile.mkdtemp(prefix="harel-relays-"))
        stack.callback(shutil.rmtree, tmp, ignore_errors=True)
        pool = srv = link = count = None
        if wanted("1a", "1b"):
            pool = stack.enter_context(contextlib.closing(Pool(max(plan.workers))))
        section("1a", bench_local, report, plan, tmp, pool)
        if wanted("1b", "2b", "4b"):
            srv = stack.enter_context(SqldServer(tmp / "sqld", auth=True))
            link = stack.enter_context(contextlib.closing(Proxy(srv.port or 0, args.delay_ms)))
            count = stack.enter_context(contextlib.closing(Proxy(srv.port or 0, 0.0)))
            LibsqlStore(srv.url, auth_token=srv.token, migrate=True).close()
        section("1b", bench_remote, report, plan, pool, srv, link, count)
        section("2a", bench_delivery_local, report, plan, tmp)
        section("2b", bench_delivery_remote, report, plan, srv, link)
        section("3", bench_claim_cost, report, plan, tmp)
        section("4a", bench_relay_local, report, plan, tmp)
        section("4b", bench_relay_remote, report, plan, srv, link)
        section("4c", bench_wakeup, report, plan, tmp)
        section("4d", bench_idle, report, plan, tmp)
    meta = {
        "mode": "smoke" if args.smoke else "quick" if args.quick else "full",
        "only": list(only) or None,
        "plan": asdict(plan),
        "delay_ms": args.delay_ms,
        "seconds": round(time.time() - started, 1),
        "section_seconds": took,
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "libsql": importlib.metadata.version("libsql"),
        "sqld": SQLD_VERSION,
        "cpus": os.cpu_count(),
    }
    out = RESULTS / f"relays-{time.strftime('%Y%m%d-%H%M%S')}.json"
    text = json.dumps({"meta": meta, "results": report.data}, indent=2) + "\n"
    if not args.smoke:
        RESULTS.mkdir(exist_ok=True)
        out.write_text(text)
    print(f"\n{'figure':<74} {'value':>16}  target")
    for key, shown, target, met in report.rows:
        flag = "" if met is None else ("ok" if met else "MISSED")
        print(f"{key:<74} {shown:>16}  {target} {flag}".rstrip())
    written = "not written" if args.smoke else str(out.relative_to(ROOT))
    print(f"\n{meta['mode']} run, {meta['seconds']} s; JSON: {written}")


if __name__ == "__main__":
    main()
