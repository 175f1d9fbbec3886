"""Claimable relays: how fast worker processes drain the outbox, and what a claim costs as the
backlog grows. Not a test: the figures depend on the machine; the ratios carry across.

    python -m benchmarks.relays            # full: ~2.5 minutes on 2 cores
    python -m benchmarks.relays --quick    # fewer entries and repetitions (~40 s)

1. Drains: the outbox seeded with bulk SQL (a recursive CTE; each event ``{"name": "n",
   "id": "<seq>", "payload": {}}``), then 1, 2 and 4 worker *processes* (``--worker``), each
   looping ``claim_outbox(worker, limit=100)`` and an ``ack_outbox(seq)`` per entry until a
   claim comes back empty. Entries/s, as a ratio to 1 worker; then a check that every seeded
   entry was delivered exactly once and the outbox is empty. (a) A local file (LibsqlStore,
   WAL, synchronous NORMAL); (b) sqld behind the 20 ms link proxy of ``benchmarks.remote``
   (LibsqlStore over HTTP), with fewer entries: an ack is a request of its own, ~21 ms;
   and (c) sqld with no delay (``benchmarks.remote``'s counting proxy), where the machine
   and sqld's one writer bound the rate, not the link. A what-if beside (a) and (b): the
   same claims with each batch's acks sent as one ``DELETE ... WHERE seq IN (json_each(?))``
   on a bare connection (not the store's API: what a batch ack would give).
2. Claim cost: the median ``claim_outbox(limit=100)`` and ``claim_due_timers(limit=100)``
   with 1M entries (due timers) pending, over the same with 1k, on a local file; the claimed
   rows are released with SQL between calls, so every call claims from a full backlog.

Each drain's row shows its requests an entry (claims, acks and the last empty claims, over the
entries; remote, as the proxy counted them, retries included). Prints a table and writes JSON
to ``benchmarks/results/relays-<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.metadata
import json
import os
import platform
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/relays.py` as well as `-m benchmarks.relays`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import httpx

from benchmarks.remote import TIMEOUT, Proxy
from harel_store import LibsqlStore
from tests.sqld import SQLD_VERSION, SqldServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
WORKERS = (1, 2, 4)
LIMIT = 100  # entries a claim asks for
TOKEN_ENV = "HAREL_RELAYS_TOKEN"  # how a worker process gets sqld's token
NOW = 1e9  # the timer sweep's "now": every seeded timer is due
SIZES = (1_000, 1_000_000)  # pending rows for the claim cost

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
OUTBOX_LEFT = "SELECT COUNT(*) FROM harel_outbox"
BATCH_ACK = "DELETE FROM harel_outbox WHERE seq IN (SELECT value FROM json_each(?))"


@dataclass
class Plan:
    local_entries: int  # seeded for each local drain
    remote_entries: int  # seeded for each drain on the link
    rounds: int  # of the claim-cost timings, the sizes taking turns
    calls: int  # timed claims per size and round


QUICK = Plan(local_entries=20_000, remote_entries=400, rounds=3, calls=30)
FULL = Plan(local_entries=100_000, remote_entries=2_000, rounds=5, calls=60)


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
        print(f"  {key:<64} {shown:>16}  {target} {flag}".rstrip(), flush=True)


# --- a worker process: claim, deliver (note the seq), ack; until a claim comes back empty ---


class BatchAcker:
    """The what-if: one batch's acks as one DELETE on a bare connection (one request remote)."""

    def __init__(self, database: str, token: str) -> None:
        self.remote = database.startswith("http")
        if self.remote:
            headers = {"Authorization": f"Bearer {token}"}
            self.client = httpx.Client(headers=headers, timeout=TIMEOUT)
            self.url = database.rstrip("/") + "/v3/pipeline"
        else:
            self.conn = sqlite3.connect(database, isolation_level=None, timeout=5.0)

    def ack(self, seqs: list[int]) -> None:
        if not self.remote:
            self.conn.execute(BATCH_ACK, (json.dumps(seqs),))
            return
        stmt = {"sql": BATCH_ACK, "args": [{"type": "text", "value": json.dumps(seqs)}]}
        body = {"baton": None, "requests": [{"type": "execute", "stmt": stmt}, {"type": "close"}]}
        reply = self.client.post(self.url, json=body)
        reply.raise_for_status()
        if reply.json()["results"][0]["type"] != "ok":
            raise RuntimeError(f"the batch ack failed: {reply.text[:300]}")

    def close(self) -> None:
        if self.remote:
            self.client.close()
        else:
            self.conn.close()


def worker(database: str, name: str, batched: bool) -> None:
    """Open the store, say ready, wait for go (a line on stdin), drain; print a JSON line."""
    token = os.environ.get(TOKEN_ENV, "")
    if database.startswith("http"):
        store = LibsqlStore(database, auth_token=token, timeout=TIMEOUT)
    else:
        store = LibsqlStore(database, synchronous="NORMAL", migrate=False)
    acker = BatchAcker(database, token) if batched else None
    seqs: list[int] = []
    claims = acks = mismatched = 0
    print("ready", flush=True)
    sys.stdin.readline()
    cpu = time.process_time()
    while True:
        claims += 1
        entries = store.claim_outbox(name, limit=LIMIT)
        if not entries:
            break
        for entry in entries:  # "delivery": note it, check it is the entry seeded
            seqs.append(entry.seq)
            mismatched += entry.event.id != str(entry.seq)
        if acker is not None:
            acker.ack([entry.seq for entry in entries])
            acks += 1
        else:
            for entry in entries:
                store.ack_outbox(entry.seq)
            acks += len(entries)
    ended = time.monotonic()
    cpu = time.process_time() - cpu
    store.close()
    if acker is not None:
        acker.close()
    out = {"seqs": seqs, "claims": claims, "acks": acks, "mismatched": mismatched}
    print(json.dumps(out | {"ended": ended, "cpu": cpu}), flush=True)


@dataclass
class Drain:
    workers: int
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


def drain(
    database: str,
    workers: int,
    seeded: range,
    left: Callable[[], int],
    *,
    token: str = "",
    batched: bool = False,
    proxy: Proxy | None = None,
) -> Drain:
    """Start `workers` worker processes on the seeded outbox, let them go at once, and check
    what they delivered against `seeded` (the seqs); `proxy` (remote) counts the requests."""
    env = {**os.environ, TOKEN_ENV: token, "PYTHONPATH": str(ROOT)}
    args = [sys.executable, "-m", "benchmarks.relays", "--worker", database]
    procs = [
        subprocess.Popen(
            [*args, f"w{i}", *(["--batched"] if batched else [])],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for i in range(workers)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError(f"a worker did not start (exit code {proc.wait()})")
        before = proxy.requests() if proxy else 0
        started = time.monotonic()  # CLOCK_MONOTONIC: one clock for every process on Linux
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outs = []
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode:
                raise RuntimeError(f"a worker failed (exit code {proc.returncode})")
            outs.append(json.loads(out.splitlines()[-1]))
        requests = proxy.requests() - before if proxy else None
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    counts = Counter(seq for out in outs for seq in out["seqs"])
    return Drain(
        workers=workers,
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


def local_db(path: Path) -> sqlite3.Connection:
    """A file migrated to head by the store, and a stdlib connection to seed it."""
    LibsqlStore(path, synchronous="NORMAL").close()
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
    reply = httpx.post(
        url + "/v3/pipeline", json=body, headers={"Authorization": f"Bearer {token}"}
    )
    reply.raise_for_status()
    first = reply.json()["results"][0]
    if first["type"] != "ok":
        raise RuntimeError(f"{sql.split()[0]} on sqld failed: {first}")
    rows = first["response"]["result"]["rows"]
    return int(rows[0][0]["value"]) if rows else first["response"]["result"]["affected_row_count"]


def report_drains(report: Report, where: str, drains: list[Drain], target: str) -> None:
    one = drains[0].rate
    for d in drains:
        label = f"{d.workers} worker" + "s" * (d.workers > 1)
        report.add(
            f"drain {where}, {label}: entries/s",
            f"{d.rate:,.0f} ({d.requests_per_entry:.3f} req)",
            **asdict(d),
            entries_per_s=round(d.rate, 1),
            requests_per_entry=round(d.requests_per_entry, 4),
        )
        if d.workers > 1:
            ratio = d.rate / one
            aim = target if d.workers == max(WORKERS) else ""
            met = ratio >= float(aim.split()[-1]) if aim else None
            report.add(f"drain {where}, {label} / 1 worker", f"{ratio:.2f}", aim, met)
    lost = sum(d.lost + d.left for d in drains)
    dups = sum(d.duplicates for d in drains)
    bad = sum(d.mismatched for d in drains)
    shown = f"{lost} / {dups}"
    report.add(f"drain {where}: lost / duplicated", shown, "0 / 0", lost == dups == bad == 0)


def print_drain(d: Drain, batched: bool) -> None:
    how = "batch acks" if batched else "store acks"
    print(
        f"    {d.workers} worker(s), {how}: {d.entries} entries in {d.seconds:.2f} s,"
        f" {d.rate:,.0f}/s, {d.requests_per_entry:.3f} requests an entry"
        f" ({d.claims} claims, {d.acks} acks), worker CPU {d.cpu / d.seconds:.0%};"
        f" delivered {d.delivered}, duplicates {d.duplicates}, lost {d.lost},"
        f" left {d.left}, event id != seq {d.mismatched}",
        flush=True,
    )


def bench_local(report: Report, plan: Plan, tmp: Path) -> None:
    n = plan.local_entries
    print(f"1a. drain {n:,} outbox entries, local file (LibsqlStore, WAL, NORMAL)", flush=True)
    for batched in (False, True):
        drains = []
        for workers in WORKERS:
            path = tmp / f"drain-{workers}{'-batched' if batched else ''}.db"
            conn = local_db(path)
            conn.execute(SEED_OUTBOX, (0, n))
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            left = functools.partial(rows_left, conn)
            drains.append(drain(str(path), workers, range(1, n + 1), left, batched=batched))
            conn.close()
            print_drain(drains[-1], batched)
        where = "file" + (", what-if batch ack" if batched else "")
        report_drains(report, where, drains, "")


def bench_remote(report: Report, plan: Plan, tmp: Path, delay_ms: float) -> None:
    n = plan.remote_entries
    print("1b. drain outbox entries, sqld (LibsqlStore over HTTP)", flush=True)
    with (
        SqldServer(tmp / "sqld", auth=True) as srv,
        contextlib.closing(Proxy(srv.port or 0, delay_ms)) as link,
        contextlib.closing(Proxy(srv.port or 0, 0.0)) as count,
    ):
        LibsqlStore(srv.url, auth_token=srv.token, migrate=True).close()
        left = functools.partial(pipeline, srv.url, srv.token, OUTBOX_LEFT)
        base = 0
        # On the link: the store's acks (the target); then the what-if's batch acks, many
        # more entries (a drain of a few batches would time its start and end); then the
        # store's acks with no delay, where only the machine and sqld bound the rate.
        runs = (
            (link, f"sqld {delay_ms:g} ms link", n, False, ">= 3"),
            (link, f"sqld {delay_ms:g} ms link, what-if batch ack", 5 * n, True, ""),
            (count, "sqld no delay", n, False, ""),
        )
        for proxy, where, entries, batched, target in runs:
            print(f"    {where}: {entries:,} entries a drain", flush=True)
            drains = []
            for workers in WORKERS:
                base += 10_000_000
                assert pipeline(srv.url, srv.token, SEED_OUTBOX, base, entries) == entries
                seeded = range(base + 1, base + entries + 1)
                drains.append(
                    drain(
                        proxy.url,
                        workers,
                        seeded,
                        left,
                        token=srv.token,
                        batched=batched,
                        proxy=proxy,
                    )
                )
                print_drain(drains[-1], batched)
            report_drains(report, where, drains, target)


# --- claim cost: 1M pending / 1k pending ---


def claim_db(path: Path, n: int) -> float:
    t0 = time.perf_counter()
    conn = local_db(path)
    conn.execute("BEGIN")
    conn.execute(SEED_OUTBOX, (0, n))
    conn.execute(SEED_TIMERS, (n,))
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - t0


@contextlib.contextmanager
def claimers(path: Path) -> Iterator[dict[str, Callable[[], float]]]:
    """Each claim as a call that times one claim and then releases what it claimed (not
    timed), so that the next call finds the same backlog."""
    store = LibsqlStore(path, synchronous="NORMAL", migrate=False)
    conn = sqlite3.connect(path, isolation_level=None, timeout=5.0)

    def outbox() -> float:
        t0 = time.perf_counter()
        got = store.claim_outbox("w", limit=LIMIT)
        took = time.perf_counter() - t0
        assert len(got) == LIMIT and got[0].seq == 1, got[:1]
        release = "UPDATE harel_outbox SET claimed_by = NULL, claimed_until = NULL WHERE seq <= ?"
        conn.execute(release, (got[-1].seq,))
        return took

    def timers() -> float:
        t0 = time.perf_counter()
        got = store.claim_due_timers("w", NOW, limit=LIMIT)
        took = time.perf_counter() - t0
        assert len(got) == LIMIT and got[0][2] == 1001.0, got[:1]
        release = "UPDATE harel_timers SET claimed_by = NULL, claimed_until = NULL"
        conn.execute(release + " WHERE fire_at <= ?", (got[-1][2],))
        return took

    try:
        yield {"claim_outbox": outbox, "claim_due_timers": timers}
    finally:
        conn.close()
        store.close()


def bench_claim_cost(report: Report, plan: Plan, tmp: Path) -> None:
    title = f"2. claim cost (limit {LIMIT}), local file: {SIZES[-1]:,} pending / {SIZES[0]:,}"
    print(title, flush=True)
    paths = {n: tmp / f"claim-{n}.db" for n in SIZES}
    for n, path in paths.items():
        took = claim_db(path, n)
        print(f"    built {n:,} outbox entries and due timers in {took:.1f} s", flush=True)
    best: dict[int, dict[str, float]] = {n: {} for n in SIZES}
    with contextlib.ExitStack() as stack:
        calls = {n: stack.enter_context(claimers(path)) for n, path in paths.items()}
        for fns in calls.values():
            for fn in fns.values():
                for _ in range(5):
                    fn()  # warm: the pages, the statements
        for _ in range(plan.rounds):  # sizes take turns; each keeps its best round's median
            for n, fns in calls.items():
                for name, fn in fns.items():
                    median = statistics.median(fn() for _ in range(plan.calls))
                    best[n][name] = min(median, best[n].get(name, median))
    small, large = SIZES
    for name in best[small]:
        ratio = best[large][name] / best[small][name]
        us = {str(n): round(best[n][name] * 1e6, 1) for n in SIZES}
        report.add(
            f"{name} {large // 1000}k pending / {small // 1000}k",
            f"{ratio:.2f}",
            "<= 2",
            ratio <= 2,
            us=us,
        )
        print(f"    {name}: {us[str(small)]} us at {small:,}, {us[str(large)]} us at {large:,}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer entries and repetitions")
    parser.add_argument("--delay-ms", type=float, default=20.0, help="the link's delay a request")
    parser.add_argument("--worker", nargs=2, metavar=("DATABASE", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--batched", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args.worker[0], args.worker[1], args.batched)
    plan = QUICK if args.quick else FULL
    report = Report()
    started = time.time()
    tmp = Path(tempfile.mkdtemp(prefix="harel-relays-"))
    try:
        bench_local(report, plan, tmp)
        bench_remote(report, plan, tmp, args.delay_ms)
        bench_claim_cost(report, plan, tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    meta = {
        "mode": "quick" if args.quick else "full",
        "plan": asdict(plan),
        "delay_ms": args.delay_ms,
        "seconds": round(time.time() - started, 1),
        "python": platform.python_version(),
        "sqlite": sqlite3.sqlite_version,
        "libsql": importlib.metadata.version("libsql"),
        "sqld": SQLD_VERSION,
        "cpus": os.cpu_count(),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"relays-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"meta": meta, "results": report.data}, indent=2) + "\n")
    print(f"\n{'figure':<66} {'value':>16}  target")
    for key, shown, target, met in report.rows:
        flag = "" if met is None else ("ok" if met else "MISSED")
        print(f"{key:<66} {shown:>16}  {target} {flag}".rstrip())
    print(f"\n{meta['mode']} run, {meta['seconds']} s; JSON: {out.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
