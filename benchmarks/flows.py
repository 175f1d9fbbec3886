"""Flow control (issue 49): what the claims' round-robin across flow keys costs against the
FIFO claims of the revision before it, and what it buys a key with a trickle of work behind
another key's burst. Not a test: the figures depend on the machine; the ratios, each against
its baseline measured in the same run, carry across.

    python -m benchmarks.flows                  # full: ~2 minutes on 2 cores
    python -m benchmarks.flows --quick          # a smaller burst, fewer repetitions (~35 s)
    python -m benchmarks.flows --only 3         # one section: 1 claims, 2 trickle, 3 engine,
                                                #   4 a hop's store calls
    python -m benchmarks.flows --only 3 --pairs 5   # more runs of each revision in section 3
    python -m benchmarks.flows --smoke          # every section once, tiny: that it works
    python -m benchmarks.flows --against REV    # another baseline (default e3ed20a, FIFO)

Every figure is measured in helper processes, each running one revision's code (this tree's,
or the baseline's ``harel_store`` and ``sql`` from ``git archive``, first on its PYTHONPATH)
on a database that revision made: the schemas differ (0011), and the baseline refuses a file
at this tree's revision.

1. Claim cost: a file (synchronous NORMAL) with 100,000 pending outbox entries, each to one
   of 1,000 keys drawn at random (the rows written with libsql after the store migrated the
   file and closed: the same rows on both revisions, ranked in each key as the store ranks
   them), a process for each variant. The median ``claim_outbox(worker, limit=100)``, its
   rows handed back with ``release`` after each timing, so that every claim sees the same
   backlog: this tree's round-robin with no flow set, and with 10 keys paused and 10 at
   ``concurrency=2``, against the baseline's FIFO claim; the processes take turns, round
   after round.
2. Trickle latency: a ``Relay`` (its defaults: batch 100, poll 1 s; file at FULL) whose
   outbox handler consumes each entry in a commit of its target (``commit(exe, [],
   processed_event_id=, acks=)``) drains a burst of 10,000 entries to key A (5,000 with
   ``--quick``), while another process commits one entry to key B every ``gap`` to ``2 gap``
   seconds: from B's commit returned to its handler's start (CLOCK_MONOTONIC, shared by the
   processes), p50 and p99, for the B entries committed before the burst drained; in ms and
   in the relay's rounds (each latency over its run's median time from one claim to the
   next while the burst drains); the claims that started meanwhile (1: the first claim
   after the commit took it); the relay's CPU an entry of the burst. The revisions take
   turns; on the baseline (FIFO) B waits behind the burst.
3. The engine of ``benchmarks.engine`` (the file topology, two worker processes running a
   ``Relay`` each, no flow set) on this tree and on the baseline, the runs taking turns
   (this tree first, then the baseline first, ...): orders/s (32 in flight), an order's end
   to end p50 and p99 (one at a time) and the workers' CPU an order (over the 32 in
   flight), the medians of the runs.
4. Where the time goes: the store calls of a relay hop, one entry at a time, on a fresh file
   (synchronous NORMAL) of each revision, the processes taking turns: a commit with one
   emit, the relay's ``claim_work`` (every kind), the handler's ``commit(acks=)``,
   ``peek_work``, a commit with two spawns and a timer; the median of each and the WAL
   pages it appended (no checkpoint meanwhile).

Prints a table and writes JSON to ``benchmarks/results/flows-<timestamp>.json`` (not in a
smoke run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import json
import os
import random
import select
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import libsql

from benchmarks import engine
from benchmarks.harness import ROOT, Child, Report, cpu_spent, mode, parser, quantile
from harel_store import Event, Execution, LibsqlStore, OutboxEntry, Relay, TimerOp

BASELINE = "e3ed20a"  # the revision before flow control: FIFO claims
LIMIT = 100  # entries a claim asks for (a Relay's default batch)
PAUSED = 10  # keys paused, in the claim cost with flows
LIMITED = 10  # keys at concurrency LIMITED_TO, beside them
LIMITED_TO = 2
WORKER = "bench"
SECTIONS = ("1", "2", "3", "4")
# Section 4: the store calls of a relay hop, in the order a hop makes them.
OPS = (
    "commit, 1 emit",
    "claim_work (every kind; 1 entry)",
    "handler's commit(acks=)",
    "peek_work",
    "commit, 2 spawns + 1 timer",
)

# Pending outbox entries as a commit writes them (sql/queries.sql, insert_outbox): ?1 a JSON
# array of [target, rank] (seq n + 1 for its n-th element). On a schema with flow keys (0011)
# each carries its key (its target: the root key, no "." in it) and its rank in the key
# (1, 2, 3, ... in seq order, as a key with no live item starts at the flow clock, 0 here).
SEED = """
INSERT INTO harel_outbox (seq, target_id, source_id, event, created_at{columns})
SELECT key + 1, json_extract(value, '$[0]'), 'seeder',
       json_object('name', 'n', 'id', 'e' || key, 'payload', json_object()),
       (julianday('now') - 2440587.5) * 86400.0{values}
FROM json_each(?1)
"""
FLOW_COLUMNS = ", flow_key, flow_rank", ", json_extract(value, '$[0]'), json_extract(value, '$[1]')"


@dataclasses.dataclass(frozen=True)
class Plan:
    entries: int  # 1: pending outbox entries
    keys: int  # 1: the keys they are spread over
    rounds: int  # 1: rounds, the processes taking turns in each
    calls: int  # 1: timed claims a process makes a round
    burst: int  # 2: entries of key A
    gap: float  # 2: the least seconds between two of key B's entries (at most twice it)
    trickles: int  # 2: runs of each revision, taking turns (latencies pooled)
    engine: engine.Plan  # 3: latency and throughput orders (link and idle figures unused)
    pairs: int  # 3: runs of each revision
    settle: float  # 3: seconds the workers get to settle before orders, and after
    hops: int  # 4: hops a round


PLANS = {
    "full": Plan(
        100_000, 1_000, rounds=10, calls=40, burst=10_000, gap=0.2, trickles=2,
        engine=engine.Plan(150, 600, 0, 0, concurrency=32, idle_s=0.0), pairs=3,
        settle=0.3, hops=200,
    ),
    "quick": Plan(
        100_000, 1_000, rounds=5, calls=30, burst=5_000, gap=0.12, trickles=1,
        engine=engine.Plan(60, 300, 0, 0, concurrency=32, idle_s=0.0), pairs=2,
        settle=0.3, hops=100,
    ),
    # Every section once on tiny sizes: that the module works, not what it measures.
    "smoke": Plan(
        2_000, 50, rounds=1, calls=3, burst=300, gap=0.02, trickles=1,
        engine=engine.Plan(4, 8, 0, 0, concurrency=4, idle_s=0.0), pairs=1,
        settle=0.05, hops=5,
    ),
}  # fmt: skip


def key_name(n: int) -> str:
    return f"k{n:04d}"


# --- the helper processes: one revision's code each, on a database it made ---


def code_of(revision: str, into: Path) -> Path:
    """That revision's ``harel_store``, ``sql`` and ``migrations`` (``git archive``), in
    ``into``: first on a helper's PYTHONPATH, the benchmarks (this tree's) after it."""
    into.mkdir(parents=True)
    tar = subprocess.run(
        ["git", "archive", revision, "harel_store", "sql", "migrations"],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return into


def env_of(code: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{ROOT}", "RUST_LOG": "off"}


def helper(code: Path, cwd: Path, **job: Any) -> Child:
    """A helper process on ``code`` running ``job`` (see `child`), from ``cwd`` (not the
    repository: its harel_store would come first)."""
    command = [sys.executable, "-m", "benchmarks.flows", "--child", json.dumps(job)]
    return Child(command, env=env_of(code), cwd=cwd)


def seed(path: str, targets: list[str]) -> float:
    """Pending outbox entries, one to each of ``targets`` in order, written with libsql into a
    file the store migrated and closed (no other connection open in this process); the
    seconds it took."""
    t0 = time.perf_counter()
    conn = libsql.connect(path)
    try:
        table = conn.execute("PRAGMA table_info(harel_outbox)", ()).fetchall()
        flows = any(row[1] == "flow_key" for row in table)
        ranks: dict[str, int] = {}
        rows = []
        for target in targets:
            ranks[target] = ranks.get(target, 0) + 1
            rows.append([target, ranks[target]])
        columns, values = FLOW_COLUMNS if flows else ("", "")
        conn.execute("BEGIN IMMEDIATE", ())
        conn.execute(SEED.format(columns=columns, values=values), (json.dumps(rows),))
        conn.commit()
    finally:
        conn.close()
    return time.perf_counter() - t0


def claims_child(job: dict[str, Any]) -> None:
    """Section 1's process: seed, set the flows (``flowed``), say ready (the seeding's seconds
    and the keys in a claim), then for each line N: N claims timed, as a JSON list."""
    path = job["path"]
    LibsqlStore(path, synchronous="NORMAL").close()  # the schema of this code
    rng = random.Random(job["seed"])
    seeded = seed(path, [key_name(rng.randrange(job["keys"])) for _ in range(job["entries"])])
    paused = {key_name(k) for k in range(PAUSED)} if job["flowed"] else set()
    limited = {key_name(k) for k in range(PAUSED, PAUSED + LIMITED)} if job["flowed"] else set()
    with LibsqlStore(path, synchronous="NORMAL", migrate=False) as store:
        for key in sorted(paused):
            store.pause_flow(key)
        for key in sorted(limited):
            store.set_flow(key, concurrency=LIMITED_TO)
        keys: list[int] = []

        def timed() -> float:
            t0 = time.perf_counter()
            got = store.claim_outbox(WORKER, limit=LIMIT)
            took = time.perf_counter() - t0
            targets = [entry.target_id for entry in got]
            if len(got) != LIMIT or paused & set(targets):
                raise RuntimeError(f"a claim took {len(got)} entries, of keys {targets}")
            if any(targets.count(key) > LIMITED_TO for key in limited):
                raise RuntimeError(f"a claim took more than {LIMITED_TO} of a key: {targets}")
            keys.append(len(set(targets)))
            if store.release(WORKER, got) != LIMIT:
                raise RuntimeError("the claimed entries were not all handed back")
            return took

        for _ in range(5):
            timed()  # warm: the pages, the statements
        print(json.dumps({"seeded": seeded, "keys": keys[-1]}), flush=True)
        while line := sys.stdin.readline():
            print(json.dumps([timed() for _ in range(int(line))]), flush=True)


def relay_child(job: dict[str, Any]) -> None:
    """Section 2's relay: the targets and the producer's execution saved, the burst to A
    seeded; ready; at "go" a Relay runs, handlers and claims timed. It prints "drained" when
    the last of A's entries is handled, and stops once told (a line "expect N") of the N
    entries of B and all are handled; then their handler starts, its claims (start, entries)
    and when the burst drained, as JSON."""
    path = job["path"]
    with LibsqlStore(path) as store:
        for name in ("A", "B", "producer"):
            store.save(Execution(id=name, definition_id="flows-bench"))
    seed(path, ["A"] * job["burst"])
    store = LibsqlStore(path, migrate=False)
    targets = {name: store.load(name) for name in ("A", "B")}
    if None in targets.values():
        raise RuntimeError("the trickle's targets A and B are not in the database")
    starts: dict[str, float] = {}
    handled: dict[str, set[str]] = {"A": set(), "B": set()}
    claims: list[tuple[float, int]] = []
    expected: list[int] = []
    drained: list[float] = []
    cpu: list[float] = []  # the process's CPU seconds at "go", then to the burst's last entry
    lock = threading.Lock()

    claim_work = store.claim_work

    def claim(*args: Any, **kwargs: Any) -> Any:  # an instance attribute over the method
        t0 = time.monotonic()
        got = claim_work(*args, **kwargs)
        claims.append((t0, len(got.outbox)))
        return got

    store.claim_work = claim

    def done() -> None:
        with lock:
            if drained and expected and len(handled["B"]) >= expected[0]:
                relay.stop()

    def handle(entry: OutboxEntry) -> None:
        start = time.monotonic()
        starts.setdefault(entry.event.id, start)
        target = entry.target_id or ""
        exe = targets[target]
        assert exe is not None
        store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
        handled[target].add(entry.event.id)
        if target == "A" and len(handled["A"]) == job["burst"] and not drained:
            drained.append(start)
            cpu.append(time.process_time() - cpu[0])
            print("drained", flush=True)
        done()

    relay = Relay(store, "trickle", on_outbox=handle)
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return

    def told() -> None:
        for line in sys.stdin:
            word, _, count = line.partition(" ")
            if word == "expect":
                expected.append(int(count))
                done()
        relay.stop()  # stdin closed: the parent is gone

    threading.Thread(target=told, daemon=True).start()
    cpu.append(time.process_time())
    relay.run()
    b = {event: starts[event] for event in handled["B"]}
    out = {"starts": b, "claims": claims, "drained": drained[0], "cpu": cpu[1]}
    print(json.dumps(out), flush=True)
    store.close()


def trickle_child(job: dict[str, Any]) -> None:
    """Section 2's producer: ready (started beside the relay, which makes the file); at
    "go", one entry to B, then a pause, until a line comes; then each entry's id and when
    its commit returned, as JSON."""
    rng = random.Random(job["seed"])
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    with LibsqlStore(job["path"], migrate=False) as store:
        exe = store.load("producer")
        assert exe is not None
        commits: list[tuple[str, float]] = []
        while True:
            event = Event(name="n", id=f"b-{len(commits)}")
            store.commit(exe, [("B", event)])
            commits.append((event.id, time.monotonic()))
            pause = rng.uniform(1.0, 2.0) * job["gap"]
            if select.select([sys.stdin], [], [], pause)[0]:
                break
        print(json.dumps(commits), flush=True)


def timed(
    wal: Path, page: int, out: list[tuple[float, int]], call: Any, *args: Any, **kw: Any
) -> Any:
    """``call(*args, **kw)``, its seconds and the WAL pages it appended noted in ``out``."""
    before = wal.stat().st_size // (page + 24)
    t0 = time.perf_counter()
    got = call(*args, **kw)
    out.append((time.perf_counter() - t0, wal.stat().st_size // (page + 24) - before))
    return got


def ops_child(job: dict[str, Any]) -> None:
    """Section 4's process: a fresh file (synchronous NORMAL, no automatic checkpoint, so that
    its WAL only grows); ready; then for each line N: N hops, each store call of a hop timed
    on its own, as JSON: the seconds and the WAL pages appended of each call, by call."""
    path = job["path"]
    with LibsqlStore(path, synchronous="NORMAL") as store:
        conn = store._conn.db  # type: ignore[attr-defined]  # the store's own connection: another library's would unlink the WAL
        conn.execute("PRAGMA wal_autocheckpoint = 0", ())
        ((page,),) = conn.execute("PRAGMA page_size", ()).fetchall()
        source = Execution(id="source", definition_id="flows-bench")
        target = Execution(id="A", definition_id="flows-bench")
        store.save(source)
        store.save(target)
        wal = Path(f"{path}-wal")
        hops = itertools.count()
        print("ready", flush=True)
        while line := sys.stdin.readline():
            times: dict[str, list[float]] = {op: [] for op in OPS}
            pages: dict[str, list[int]] = {op: [] for op in OPS}
            for _ in range(int(line)):
                n, hop = next(hops), list[tuple[float, int]]()
                timed(wal, page, hop, store.commit, source, [("A", Event(name="n", id=f"e-{n}"))])
                held = timed(wal, page, hop, store.claim_work, WORKER, time.time()).outbox
                if len(held) != 1:
                    raise RuntimeError(f"a hop's claim took {len(held)} entries, not 1")
                event = held[0].event.id
                timed(wal, page, hop, store.commit, target, [], event, acks=held)
                timed(wal, page, hop, store.peek_work, time.time())
                spawns: list[tuple[str, str, dict[str, Any]]]
                spawns = [(f"c-{n}-{k}", "child", {}) for k in range(2)]
                timers = [TimerOp.schedule("t", 1e9 + n)]  # never due
                timed(wal, page, hop, store.commit, source, [], spawns=spawns, timers=timers)
                store.ack(store.claim_spawns(WORKER))  # the next hop finds only its own entry
                for op, (seconds, appended) in zip(OPS, hop, strict=True):
                    times[op].append(seconds)
                    pages[op].append(appended)
            print(json.dumps({"times": times, "pages": pages}), flush=True)


def child(job: dict[str, Any]) -> None:
    if job["kind"] == "migrate":
        LibsqlStore(job["path"]).close()
    else:
        kinds = {"claims": claims_child, "relay": relay_child, "trickle": trickle_child}
        (kinds | {"ops": ops_child})[job["kind"]](job)


# --- 1. claim cost ---


def bench_claims(report: Report, plan: Plan, codes: dict[str, Path], tmp: Path) -> None:
    this, base = codes
    report.section(
        f"1. claim cost: claim_outbox(limit={LIMIT}), {plan.entries:,} pending entries over"
        f" {plan.keys:,} keys, file (NORMAL): median of {plan.rounds} x {plan.calls} claims"
    )
    variants = {  # name: (revision, flows set)
        f"FIFO ({base})": (base, False),
        "round-robin, no flows": (this, False),
        f"round-robin, {PAUSED} keys paused, {LIMITED} at concurrency {LIMITED_TO}": (this, True),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    ready: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        procs: dict[str, Child] = {}
        for i, (name, (revision, flowed)) in enumerate(variants.items()):
            job = {"kind": "claims", "path": str(tmp / f"claims-{i}.db"), "flowed": flowed}
            job |= {"entries": plan.entries, "keys": plan.keys, "seed": 49}
            procs[name] = helper(codes[revision], tmp, **job)
            stack.callback(procs[name].close, 60)
        for name, proc in procs.items():
            ready[name] = json.loads(proc.line(300))
        for r in range(plan.rounds):
            for name in list(procs)[:: 1 if r % 2 == 0 else -1]:
                procs[name].send(str(plan.calls))
                samples[name] += json.loads(procs[name].line(300))
    us = {name: statistics.median(times) * 1e6 for name, times in samples.items()}
    fifo, plain, with_flows = us  # the variants, in order
    seeded = ", ".join(f"{r['seeded']:.1f}" for r in ready.values())
    print(f"    seeded in {seeded} s; keys in a claim: {[r['keys'] for r in ready.values()]}")
    for name, target in ((plain, "<= 1.5"), (with_flows, "<= 2")):
        ratio = us[name] / us[fifo]
        report.add(
            f"claim_outbox {name} / FIFO",
            f"{ratio:.2f} ({us[name]:.0f} / {us[fifo]:.0f} us)",
            target,
            ratio <= float(target.split()[1]),
            ratio=round(ratio, 4),
            us={n: round(v, 1) for n, v in us.items()},
            p90_us={n: round(quantile(t, 0.9) * 1e6, 1) for n, t in samples.items()},
            samples=len(samples[name]),
        )
    report.add(
        f"keys in a claim of {LIMIT}: FIFO | round-robin | with flows",
        " | ".join(str(r["keys"]) for r in ready.values()),
    )


# --- 2. trickle latency ---


def trickle(code: Path, plan: Plan, tmp: Path) -> dict[str, Any]:
    """One run of section 2 on ``code``: for each entry of B committed before the burst
    drained, its latency (seconds, and in this run's rounds) and the claims that started
    after its commit up to its handler's start (the one that took it among them); the
    relay's round (seconds) and how long the burst took to drain."""
    tmp.mkdir()
    job = {"path": str(tmp / "trickle.db"), "burst": plan.burst, "gap": plan.gap, "seed": 49}
    with contextlib.ExitStack() as stack:
        relay = helper(code, tmp, kind="relay", **job)
        stack.callback(relay.close, 60)
        producer = helper(code, tmp, kind="trickle", **job)
        stack.callback(producer.close, 60)
        for proc in (relay, producer):
            if (line := proc.line(300)) != "ready":
                raise RuntimeError(f"a helper did not start: {line!r}")
        relay.send("go")
        producer.send("go")
        began = time.monotonic()
        if (line := relay.line(600)) != "drained":
            raise RuntimeError(f"the relay said {line!r}")
        producer.send("stop")
        commits = json.loads(producer.line(60))
        relay.send(f"expect {len(commits)}")
        out = json.loads(relay.line(120))
    drained = out["drained"]
    claims = [at for at, _ in out["claims"]]
    round_s = statistics.median(
        b - a for a, b in itertools.pairwise(c for c in claims if c <= drained)
    )
    latency, waited, after = [], [], []
    for event, at in commits:
        if at < drained:
            start = out["starts"][event]
            latency.append(start - at)
            waited.append(sum(at < claim <= start for claim in claims))
            after.append((start - max(c for c in claims if c <= start)) / round_s)
    if not latency:
        raise RuntimeError("no entry of B was committed before the burst drained")
    rounds = [s / round_s for s in latency]
    return {"latency": latency, "rounds": rounds, "waited": waited, "after": after,
            "round": round_s, "drain": drained - began, "cpu": out["cpu"]}  # fmt: skip


def bench_trickle(report: Report, plan: Plan, codes: dict[str, Path], tmp: Path) -> None:
    this, base = codes
    report.section(
        f"2. trickle latency: a Relay drains {plan.burst:,} entries to key A while key B gets"
        f" one every {plan.gap:g} - {2 * plan.gap:g} s; B's commit returned to its handler's"
        f" start, in rounds (latency / the run's median round); {plan.trickles} run(s) each,"
        " taking turns"
    )
    done: dict[str, list[dict[str, Any]]] = {this: [], base: []}
    for i in range(plan.trickles):
        for revision in (this, base)[:: 1 if i % 2 == 0 else -1]:
            at = tmp / f"trickle-{i}-{len(done[revision])}-{revision.replace(' ', '-')}"
            done[revision].append(trickle(codes[revision], plan, at))
    for revision, target in ((this, "<= 2"), (base, "")):
        runs = done[revision]
        pooled = {k: [v for run in runs for v in run[k]] for k in ("latency", "rounds", "waited")}
        latency, rounds, waited = pooled["latency"], pooled["rounds"], pooled["waited"]
        after = [v for run in runs for v in run["after"]]
        p50, p99 = quantile(rounds, 0.5), quantile(rounds, 0.99)
        ms = [quantile(latency, q) * 1e3 for q in (0.5, 0.99)]
        round_ms = [run["round"] * 1e3 for run in runs]
        name = "round-robin" if revision == this else f"FIFO ({base})"
        report.add(
            f"{name}: B's latency p50 / p99, in rounds",
            f"{p50:.2f} / {p99:.2f} ({ms[0]:.1f} / {ms[1]:.1f} ms; a round"
            f" {statistics.median(round_ms):.1f} ms; {len(latency)} entries of B)",
            target,
            None if not target else p99 <= 2,
            p50_rounds=round(p50, 3),
            p99_rounds=round(p99, 3),
            max_rounds=round(max(rounds), 3),
            p50_ms=round(ms[0], 2),
            p99_ms=round(ms[1], 2),
            max_ms=round(max(latency) * 1e3, 2),
            round_ms=[round(r, 2) for r in round_ms],
            entries_of_b=len(latency),
        )
        report.add(
            f"{name}: claims from B's commit to its handler, p50 / p99 / max",
            f"{quantile(waited, 0.5):.0f} / {quantile(waited, 0.99):.0f} / {max(waited)}"
            f" (from the claim that took it to its handler: p50 {quantile(after, 0.5):.2f},"
            f" p99 {quantile(after, 0.99):.2f} rounds)",
            waited_max=max(waited),
            after_claim_rounds_p50=round(quantile(after, 0.5), 3),
        )
    cpu = {rev: statistics.median(run["cpu"] for run in runs) for rev, runs in done.items()}
    drains = {rev: [round(run["drain"], 2) for run in runs] for rev, runs in done.items()}
    report.add(
        f"the burst: relay CPU an entry (us), this tree | {base}",
        f"{cpu[this] / plan.burst * 1e6:.0f} | {cpu[base] / plan.burst * 1e6:.0f}"
        f" ({cpu[this] / cpu[base]:.2f}x); drained in {drains[this]} | {drains[base]} s",
        cpu_s={rev: [round(run["cpu"], 3) for run in runs] for rev, runs in done.items()},
        drain_s=drains,
    )


# --- 3. the engine, no flows set ---


def engine_run(code: Path, plan: engine.Plan, settle: float, tmp: Path) -> dict[str, float]:
    """`benchmarks.engine`'s file topology with Relay on ``code``, the file migrated by that
    code: its latency figures (orders one at a time) and orders/s (``plan.concurrency`` at a
    time)."""
    tmp.mkdir()
    url = str(tmp / "engine.db")
    helper(code, tmp, kind="migrate", path=url).close(60)
    where = engine.Topology(url, env_of(code), tmp)
    figures: dict[str, float] = {}
    lat_log, tp_log = tmp / "latency.jsonl", tmp / "throughput.jsonl"
    with engine.workers(where, "sync", lat_log) as procs:
        time.sleep(settle)  # the workers' first look is done: they wait
        engine.submit(where, "lat", lat_log, plan.latency, 1)
        time.sleep(settle)  # the last reminders fire
        with cpu_spent({str(i): proc.proc.pid for i, proc in enumerate(procs)}) as cpu:
            took, _ = engine.submit(where, "tp", tp_log, plan.throughput, plan.concurrency)
    figures["orders/s"] = plan.throughput / took
    figures["workers' CPU an order ms"] = sum(cpu.values()) / plan.throughput * 1e3
    # The end to end figures are the latency orders' (in their log, the submitter's records);
    # the workers' records (the hops) count the throughput orders' too.
    engine.latency_figures(lat_log, figures)
    return figures


def bench_engine(report: Report, plan: Plan, codes: dict[str, Path], tmp: Path) -> None:
    this, base = codes
    report.section(
        f"3. engine (benchmarks.engine, file, Relay, no flows): this tree / {base},"
        f" {plan.pairs} runs each taking turns"
    )
    runs: dict[str, list[dict[str, float]]] = {this: [], base: []}
    for pair in range(plan.pairs):
        for revision in (this, base)[:: 1 if pair % 2 == 0 else -1]:
            print(f"    {revision}, run {pair + 1}", flush=True)
            at = tmp / f"engine-{pair}-{len(runs[this]) + len(runs[base])}"
            runs[revision].append(engine_run(codes[revision], plan.engine, plan.settle, at))
    for figure, target in (("orders/s", ">= 0.95"), ("end to end p50 ms", "<= 1.05")):
        mine = statistics.median(run[figure] for run in runs[this])
        theirs = statistics.median(run[figure] for run in runs[base])
        ratio = mine / theirs
        bound = float(target.split()[1])
        report.add(
            f"engine {figure}: this tree / {base}",
            f"{ratio:.3f} ({mine:.1f} / {theirs:.1f})",
            target,
            ratio >= bound if target.startswith(">=") else ratio <= bound,
            ratio=round(ratio, 4),
            runs={rev: [round(run[figure], 2) for run in done] for rev, done in runs.items()},
        )
    for figure in ("end to end p99 ms", "workers' CPU an order ms"):
        values = {rev: statistics.median(run[figure] for run in done) for rev, done in runs.items()}
        report.add(
            f"engine {figure}: this tree | {base}",
            f"{values[this]:.2f} | {values[base]:.2f} ({values[this] / values[base]:.2f}x)",
            runs={rev: [round(run[figure], 2) for run in done] for rev, done in runs.items()},
        )


# --- 4. where the time goes: a relay hop's store calls ---


def bench_ops(report: Report, plan: Plan, codes: dict[str, Path], tmp: Path) -> None:
    this, base = codes
    report.section(
        f"4. a relay hop's store calls, file (NORMAL): median this tree / {base},"
        f" {plan.rounds} x {plan.hops} hops taking turns; WAL pages a call"
    )
    samples: dict[str, dict[str, list[float]]] = {rev: {op: [] for op in OPS} for rev in codes}
    pages: dict[str, dict[str, list[int]]] = {rev: {op: [] for op in OPS} for rev in codes}
    with contextlib.ExitStack() as stack:
        procs = {}
        for i, (revision, code) in enumerate(codes.items()):
            procs[revision] = helper(code, tmp, kind="ops", path=str(tmp / f"ops-{i}.db"))
            stack.callback(procs[revision].close, 60)
        for revision, proc in procs.items():
            if (line := proc.line(120)) != "ready":
                raise RuntimeError(f"{revision}: the helper said {line!r}")
            proc.send("20")  # warm: the pages, the statements
            proc.line(120)
        for r in range(plan.rounds):
            for revision in list(procs)[:: 1 if r % 2 == 0 else -1]:
                procs[revision].send(str(plan.hops))
                out = json.loads(procs[revision].line(300))
                for op in OPS:
                    samples[revision][op] += out["times"][op]
                    pages[revision][op] += out["pages"][op]
    for op in OPS:
        us = {rev: statistics.median(samples[rev][op]) * 1e6 for rev in codes}
        wal = {rev: statistics.mean(pages[rev][op]) for rev in codes}
        report.add(
            f"{op}: this tree / {base}",
            f"{us[this] / us[base]:.2f} ({us[this]:.0f} / {us[base]:.0f} us;"
            f" WAL pages {wal[this]:.1f} / {wal[base]:.1f})",
            ratio=round(us[this] / us[base], 4),
            us={rev: round(v, 1) for rev, v in us.items()},
            wal_pages={rev: round(v, 2) for rev, v in wal.items()},
        )


def main() -> None:
    args = parser(__doc__, quick="a smaller burst, fewer repetitions (~35 s)")
    args.add_argument("--against", default=BASELINE, metavar="REV", help="the baseline revision")
    args.add_argument("--only", action="append", choices=SECTIONS, help="one section (repeatable)")
    args.add_argument("--pairs", type=int, metavar="N", help="section 3: runs of each revision")
    args.add_argument("--child", help=argparse.SUPPRESS)
    ns = args.parse_args()
    if ns.child:
        return child(json.loads(ns.child))
    plan = PLANS[mode(ns)]
    if ns.pairs:
        plan = dataclasses.replace(plan, pairs=ns.pairs)
    wanted = [s for s in SECTIONS if not ns.only or s in ns.only]
    took: dict[str, float] = {}
    meta = {
        "plan": dataclasses.asdict(plan),
        "against": ns.against,
        "only": ns.only,
        "section_s": took,
    }
    with (
        Report("flows", mode(ns), **meta) as report,
        tempfile.TemporaryDirectory(prefix="harel-flows-") as name,
    ):
        tmp = Path(name)
        codes = {"this tree": ROOT, ns.against: code_of(ns.against, tmp / "against")}
        sections = {"1": bench_claims, "2": bench_trickle, "3": bench_engine, "4": bench_ops}
        for section in wanted:
            t0 = time.time()
            sections[section](report, plan, codes, tmp)
            took[section] = round(time.time() - t0, 1)


if __name__ == "__main__":
    main()
