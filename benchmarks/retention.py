"""harel-store retention benchmark: gc of a large file (purge_finished, forget_processed).

    python -m benchmarks.retention            # full: 1M finished executions (~13 min on 2 cores)
    python -m benchmarks.retention --quick    # 50k finished executions (well under a minute)
    python -m benchmarks.retention --smoke    # 10k, every section once: that it works

The dataset, seeded with bulk SQL: N finished roots as a commit leaves them and N/10 running
executions that must survive, all last updated two days ago in an order unrelated to the ids
(as with random ids). Each measurement runs on a copy of it through ``LibsqlStore(path)`` (WAL,
synchronous FULL); counts are checked with sqlite3 after. Measured:

- gc rate: ``purge_finished(before, limit=1000)`` until 0 (executions/s), then
  ``forget_processed(before)`` (markers/s); the same at limit=250, capped in time, and at
  limit=1000 on a dataset whose ids sort as their update times (the best case);
- before those two, a raw profile of 5 batches on stdlib sqlite3: WAL pages per purged
  execution, ms per batch of each statement and of a checkpoint of those pages;
- a gc batch's longest and p99 call and write transaction (BEGIN IMMEDIATE to COMMIT);
- a concurrent writer process (a typical commit every ~2 ms): its p99 commit latency during a
  gc pass over without gc;
- the file's size before gc, after gc (checkpointed) and after VACUUM;
- WAL pages per typical commit before / after the marker time (migration 0007), on bare
  sqlite3 as ``benchmarks.run`` counts them, and of an execution's first marker.

Prints a table and writes JSON to ``benchmarks/results/retention-<timestamp>.json`` (not in a
smoke run). Not a test: absolute times depend on the machine (the file sits in its page cache).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import select
import shutil
import sqlite3
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import run
from benchmarks.harness import Child, Report, mode, module, parser, quantile
from harel_store import Event, Execution, LibsqlStore, SqliteStore, TimerOp
from harel_store.errors import StoreBusy
from harel_store.sql import QUERIES, SQL_DIR
from harel_store.store import COMPANIONS

TRACE_STEPS = 10  # trace rows of every seeded execution
RUNNING_MARKERS = 5  # old markers of every seeded running execution
AGE = 2 * 86400.0  # the seeded rows were last updated about this long ago
HORIZON = 3600.0  # gc removes what is older than an hour
WRITER_INTERVAL = 0.002  # the concurrent writer's pause between commits, seconds
WRITER_WARMUP = 300  # its commits before it measures (each execution has its marker)
PROFILE_BATCHES = 5  # batches of the raw profile (limit 1000)


def file_mb(path: Path) -> float:
    return path.stat().st_size / 1e6 if path.exists() else 0.0


def synced(path: Path) -> Path:
    """``path``, its pages written out: a measurement's first fsync must not write them."""
    with path.open("rb+") as f:
        os.fsync(f.fileno())
    return path


def run_sql(path: Path, *statements: str) -> float:
    """The statements on stdlib sqlite3 (no libsql connection open on ``path``); seconds."""
    t0 = time.perf_counter()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for sql in statements:
            conn.execute(sql).fetchall()
    return time.perf_counter() - t0


# --- the dataset, seeded with bulk SQL ---

CLOCK = "(julianday('now') - 2440587.5) * 86400.0"

# total = N finished + N/10 running; n % 11 == 10 is running. Update times spread over
# [old, old + total * 0.01 s), the order placing each id in it.
ORDERS = {
    "scattered": "((n * 7919) % :total)",  # unrelated to the ids, as random ids (7919: prime)
    "ordered": "n",  # ids in update order, as ids made from the time (the best case)
}
SEED_EXECUTIONS = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :total),
rows AS (
  SELECT printf('exe-%08d', n) AS id, n % 11 = 10 AS running,
         {clock} - :age + {order} * 0.01 AS at
  FROM seq)
INSERT INTO harel_executions
    (id, definition_id, data, version, status, outcome, active_path, parent_id, finished_at,
     created_at, updated_at, markers_since)
SELECT id, 'order',
       iif(running, json_set(:running_json, '$.id', id),
           json_set(:finished_json, '$.id', id, '$.finished_at', at)),
       12, iif(running, 'running', 'finished'), iif(running, NULL, 'done'),
       iif(running, 'main.wait', 'main.done'), NULL, iif(running, NULL, at),
       at - 600.0, at, at - 300.0 - iif(running, :markers - 1, 0)
FROM rows
"""
# In primary-key order, as the b-trees like it.
SEED_TRACE = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :rows)
INSERT INTO harel_trace (execution_id, idx, entry, recorded_at)
SELECT printf('exe-%08d', n / :steps), n % :steps,
       json_object('event', 'tick', 'transition', 'main.wait -> main.wait',
                   'at', 1.7e9 + n / :steps + (n % :steps) * 0.5),
       1.7e9 + n / :steps + (n % :steps) * 0.5
FROM seq
"""
# One marker per finished execution, RUNNING_MARKERS per running one; event ids as
# Event.id makes them (32 hex digits).
SEED_MARKERS = """
WITH RECURSIVE k(i) AS (SELECT 0 UNION ALL SELECT i + 1 FROM k WHERE i + 1 < :markers)
INSERT INTO harel_processed_events (execution_id, event_id, recorded_at)
SELECT e.id, lower(hex(randomblob(16))), e.updated_at - 300.0 - k.i
FROM harel_executions AS e JOIN k ON k.i < CASE WHEN e.status = 'running' THEN :markers ELSE 1 END
ORDER BY e.id
"""
SEED_TIMERS = """
INSERT INTO harel_timers (execution_id, path, fire_at)
SELECT id, 'main.wait', updated_at + 3600.0 FROM harel_executions ORDER BY id
"""
SEED_REST = (SEED_TRACE, SEED_MARKERS, SEED_TIMERS)


def representative(status: str) -> str:
    """A representative Execution's JSON (its id and finished_at are set per row)."""
    final = status != "running"
    return Execution(
        id="exe-00000000",
        definition_id="order",
        version=12,
        status=status,  # type: ignore[arg-type]
        outcome="done" if final else None,
        active_path="main.done" if final else "main.wait",
        finished_at=1.7e9 if final else None,
        context={"order": 1, "customer": "c-1", "items": [1, 2, 3], "note": "x" * 40},
    ).model_dump_json()


def seed(path: Path, n: int, order: str) -> Path:
    """``n`` finished roots and ``n // 10`` running executions, updated in ORDERS[order]."""
    t0 = time.perf_counter()
    SqliteStore(path).close()  # the schema at head, made by the store
    total = n + n // 10
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA journal_mode = DELETE").fetchall()  # a rollback journal of ~nothing
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -1000000")  # 1 GB: the random index inserts in RAM
        params = {
            "total": total,
            "age": AGE,
            "markers": RUNNING_MARKERS,
            "rows": total * TRACE_STEPS,
            "steps": TRACE_STEPS,
            "running_json": representative("running"),
            "finished_json": representative("finished"),
        }
        conn.execute("BEGIN")
        for sql in (SEED_EXECUTIONS.format(clock=CLOCK, order=ORDERS[order]), *SEED_REST):
            conn.execute(sql, params)
        conn.execute("COMMIT")
        conn.execute("PRAGMA journal_mode = WAL").fetchall()
    synced(path)  # written with synchronous OFF: out before any measurement
    took = time.perf_counter() - t0
    counts = table_counts(path)
    print(
        f"seeded {n:,} finished + {n // 10:,} running executions, {order},"
        f" in {took:.1f}s: {file_mb(path):.0f} MB, {counts}",
        flush=True,
    )
    assert counts["final"] == n and counts["running"] == n // 10, counts
    assert counts["trace"] == total * TRACE_STEPS and counts["timers"] == total, counts
    assert counts["markers"] == n + n // 10 * RUNNING_MARKERS and not counts["orphans"], counts
    return path


COUNTS = {  # what table_counts counts: FROM ...
    "final": "harel_executions WHERE status IN ('finished', 'failed', 'cancelled')",
    "running": "harel_executions WHERE status = 'running'",
    "seeded_running": "harel_executions WHERE status = 'running' AND id LIKE 'exe-%'",
    "trace": "harel_trace",
    "seeded_trace": "harel_trace WHERE execution_id LIKE 'exe-%'",
    "markers": "harel_processed_events",
    "seeded_markers": "harel_processed_events WHERE execution_id LIKE 'exe-%'",
    "timers": "harel_timers",
    "seeded_timers": "harel_timers WHERE execution_id LIKE 'exe-%'",
    "seeded_markers_since": "harel_executions WHERE markers_since IS NOT NULL AND id LIKE 'exe-%'",
}
ORPHANS = " + ".join(
    f"(SELECT COUNT(*) FROM {table} WHERE execution_id NOT IN (SELECT id FROM harel_executions))"
    for table in ("harel_trace", "harel_processed_events", "harel_timers")
)


def table_counts(path: Path) -> dict[str, int]:
    """What the file holds (stdlib sqlite3: call it only with no libsql connection open)."""
    with contextlib.closing(sqlite3.connect(path)) as conn:
        counts = {
            k: conn.execute(f"SELECT COUNT(*) FROM {v}").fetchone()[0] for k, v in COUNTS.items()
        }
        return counts | {"orphans": conn.execute(f"SELECT {ORPHANS}").fetchone()[0]}


def check_left(db: Path, n: int, left: int) -> dict[str, int]:
    """The file's counts once a drain left ``left`` finished roots (and took nothing else)."""
    after, running = table_counts(db), n // 10
    assert after["final"] == left and after["seeded_running"] == running, after
    assert after["seeded_markers"] == running * RUNNING_MARKERS + left, after
    assert after["seeded_trace"] == (running + left) * TRACE_STEPS and not after["orphans"], after
    return after


# --- the store's gc, its statements and write transactions timed ---


@dataclass
class Drain:
    removed: int
    seconds: float
    calls: list[float]
    transactions: list[float]
    shares: dict[str, float]  # each statement's share of the seconds, largest first
    finished: bool  # called until it returned 0 (not stopped by a deadline)


class Gc:
    """``LibsqlStore(path)`` timing each statement (queries.sql name) and write transaction
    (BEGIN IMMEDIATE returned to COMMIT returned), its connection's methods wrapped."""

    def __init__(self, path: Path) -> None:
        self.store = LibsqlStore(path)
        self.by_name: defaultdict[str, float] = defaultdict(float)
        self.transactions: list[float] = []
        self._begun = 0.0
        conn: Any = self.store._conn
        conn._execute = self._timed(conn._execute, lambda query, params: query.name)
        conn._result = self._timed(conn._result, lambda query, cur: query.name)
        conn._commit = self._timed(conn._commit, lambda: "commit")
        self.before = self.store.clock() - HORIZON

    def _timed(self, method: Callable[..., Any], name: Callable[..., str]) -> Callable[..., Any]:
        def timed(*args: Any) -> Any:
            t0 = time.perf_counter()
            out = method(*args)
            t1 = time.perf_counter()
            self.by_name[key := name(*args)] += t1 - t0
            if key == "begin":
                self._begun = t1
            elif key == "commit":
                self.transactions.append(t1 - self._begun)
            return out

        return timed

    def drain(self, call: Callable[[], int], deadline: float | None = None) -> Drain:
        """Call until it removes nothing (or the deadline, time.monotonic(), passes)."""
        self.by_name.clear()
        self.transactions.clear()
        calls: list[float] = []
        removed = 0
        t0 = time.perf_counter()
        while True:
            c0 = time.perf_counter()
            k = call()
            calls.append(time.perf_counter() - c0)
            removed += k
            if not k or (deadline is not None and time.monotonic() >= deadline):
                break
            if len(calls) % 200 == 0:
                rate = removed / (time.perf_counter() - t0)
                print(f"    ... {removed:,} removed ({rate:,.0f}/s)", flush=True)
        seconds = time.perf_counter() - t0
        by_time = sorted(self.by_name.items(), key=lambda kv: -kv[1])
        shares = {name: round(spent / seconds, 4) for name, spent in by_time}
        return Drain(removed, seconds, calls, list(self.transactions), shares, not k)


def add_drain(
    report: Report, tag: str, what: str, d: Drain, rate_target: str = "", rows: bool = True
) -> None:
    """The drain's rate; with ``rows``, its longest and p99 calls and write transactions."""
    report.add(
        f"{tag} {what}/s",  # removed per second, calls until 0 (wall time)
        d.removed / d.seconds,
        rate_target,
        unit=f"{what[:4]}/s",
        removed=d.removed,
        seconds=round(d.seconds, 3),
        calls=len(d.calls),
        time_by_statement=d.shares,
        drained=d.finished,
        longest_call_ms=round(max(d.calls) * 1e3, 3),
        longest_tx_ms=round(max(d.transactions) * 1e3, 3),
    )
    for name, samples in (("call", d.calls), ("write tx", d.transactions)) if rows else ():
        p99 = quantile(samples, 0.99) * 1e3  # a call's: an upper bound of its write tx's
        target = "<= 20" if what == "executions" else ""
        median = round(quantile(samples, 0.5) * 1e3, 3)
        report.add(
            f"{tag} longest {name} ms", max(samples) * 1e3, target, unit="ms", median_ms=median
        )
        report.add(f"{tag} p99 {name} ms", p99, unit="ms")


# --- the sections ---


def bench_gc(report: Report, tmp: Path, seeded: Path, n: int) -> None:
    running = n // 10
    report.section(f"gc, limit=1000: {n:,} finished roots, {running:,} running")
    db = synced(shutil.copyfile(seeded, tmp / "gc-1000.db"))
    before_mb = file_mb(db)
    gc = Gc(db)
    t0 = time.perf_counter()
    counts = gc.store.retention_counts(finished_before=gc.before, markers_before=gc.before)
    dry = time.perf_counter() - t0
    assert counts == (n, n + running * RUNNING_MARKERS, 0), counts
    purged = gc.drain(lambda: gc.store.purge_finished(gc.before, limit=1000))
    forgot = gc.drain(lambda: gc.store.forget_processed(gc.before))
    gc.store.close()
    add_drain(report, "purge_finished limit=1000", "executions", purged, ">= 5000")
    add_drain(report, "forget_processed limit=10000", "markers", forgot)
    report.add("retention_counts (dry run) s", dry, unit="s")  # over the seeded file
    assert purged.finished and purged.removed == n, purged.removed
    assert forgot.finished and forgot.removed == running * RUNNING_MARKERS, forgot.removed
    wal_mb = file_mb(Path(f"{db}-wal"))
    run_sql(db, "PRAGMA wal_checkpoint(TRUNCATE)")
    after = table_counts(db)
    assert after["final"] == after["markers"] == after["seeded_markers_since"] == 0, after
    assert after["running"] == after["timers"] == running and not after["orphans"], after
    assert after["trace"] == running * TRACE_STEPS, after
    gc_mb = file_mb(db)
    took = run_sql(db, "VACUUM", "PRAGMA wal_checkpoint(TRUNCATE)")
    vacuum_mb = file_mb(db)
    assert table_counts(db) == after
    db.unlink()
    report.add("file MB before gc", before_mb, unit="MB")  # the seeded file, checkpointed
    report.add("file MB after gc", gc_mb, unit="MB", wal_mb_before_checkpoint=round(wal_mb, 1))
    report.add("file MB after VACUUM", vacuum_mb, unit="MB", vacuum_s=round(took, 2))


def raw_profile(report: Report, path: Path, tag: str, limit: int = 1000) -> int:
    """PROFILE_BATCHES batches of purge_finished's statements on stdlib sqlite3, the WAL not
    checkpointed meanwhile, then a checkpoint of it (as an automatic one); executions removed."""
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        for pragma in ("journal_mode = WAL", "synchronous = FULL", "wal_autocheckpoint = 0"):
            conn.execute(f"PRAGMA {pragma}").fetchall()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        (page,) = conn.execute("PRAGMA page_size").fetchone()
        (before,) = conn.execute(f"SELECT {CLOCK} - {HORIZON}").fetchone()
        ms: defaultdict[str, float] = defaultdict(float)
        removed = 0

        def timed(name: str, *params: Any) -> Any:
            t0 = time.perf_counter()
            query = QUERIES.get(name)
            cur = conn.execute(query.sql, query.bind(params)) if query else conn.execute(name)
            rows = cur.fetchall()
            ms[name] += (time.perf_counter() - t0) * 1e3 / PROFILE_BATCHES
            return rows

        for _ in range(PROFILE_BATCHES):
            trees = timed("finished_trees", before, limit)
            members = json.dumps([[row[1], row[2]] for row in trees])
            ids = json.dumps([row[1] for row in trees])
            timed("BEGIN IMMEDIATE")
            timed("purge_executions", members)
            for name in COMPANIONS:
                timed(f"purge_{name}", ids)
            timed("COMMIT")
            removed += len(trees)
        frames = (Path(f"{path}-wal").stat().st_size - 32) // (page + 24)
        t0 = time.perf_counter()
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)").fetchall()
        ms["checkpoint"] = (time.perf_counter() - t0) * 1e3 / PROFILE_BATCHES
    statements = {k: round(v, 2) for k, v in ms.items()}
    label, pages = f"raw batch{tag}: WAL pages per purged execution", frames / removed
    report.add(label, pages, unit="pages", removed=removed, statement_ms_per_batch=statements)
    report.add(f"raw batch{tag}: ms per 1000-batch", round(sum(ms.values()), 2), unit="ms")
    return removed


def bench_drain(
    report: Report, tmp: Path, seeded: Path, n: int, limit: int, cap: float, tag: str, target: str
) -> None:
    """A raw profile, then purge_finished(limit) until 0 or ``cap`` seconds have passed."""
    report.section(f"gc, limit={limit}{tag} (raw profile of {PROFILE_BATCHES} batches first)")
    db = synced(shutil.copyfile(seeded, tmp / f"gc-{limit}{tag.replace(' ', '-')}.db"))
    profiled = raw_profile(report, db, tag)
    gc = Gc(db)
    deadline = time.monotonic() + cap
    purged = gc.drain(lambda: gc.store.purge_finished(gc.before, limit=limit), deadline)
    gc.store.close()
    add_drain(report, f"purge_finished limit={limit}{tag}", "executions", purged, target)
    left = n - profiled - purged.removed
    assert not purged.finished or left == 0, left
    check_left(db, n, left)
    db.unlink()


def writer_main(database: Path, interval: float) -> None:
    """The concurrent writer: typical commits until stdin closes, then each measured one's
    (time.monotonic() start, latency) as JSON."""
    store = LibsqlStore(database)
    exes = run.executions("writer")
    for exe in exes:
        store.save(exe)
    samples: list[tuple[float, float]] = []
    busy = i = 0
    prefix = f"w-{os.getpid()}-{time.time_ns()}"
    while True:
        exe = exes[i % run.POOL]
        event = Event(name="tick", payload={"n": i})
        timers = [TimerOp.schedule("main.wait", 1e9 + i)]
        start, t0 = time.monotonic(), time.perf_counter()
        try:
            store.commit(
                exe, [(exe.id, event)], processed_event_id=f"{prefix}-{i}", timers=timers,
                trace=run.STEP,
            )  # fmt: skip
        except StoreBusy:
            busy += 1
        latency = time.perf_counter() - t0
        i += 1
        if i == WRITER_WARMUP:
            print("ready", flush=True)
        elif i > WRITER_WARMUP:
            samples.append((start, latency))
        if select.select([sys.stdin], [], [], interval)[0]:  # the pause; stdin closed: done
            break
    store.close()
    print(json.dumps({"samples": samples, "busy": busy}), flush=True)


def bench_concurrent(
    report: Report, tmp: Path, seeded: Path, n: int, baseline: float, cap: float
) -> None:
    report.section(
        f"a concurrent writer (another process, a commit every {WRITER_INTERVAL * 1e3:.0f} ms):"
        f" {baseline:.0f} s without gc, then during gc limit=1000 (at most {cap:.0f} s)"
    )
    db = synced(shutil.copyfile(seeded, tmp / "gc-writer.db"))
    writer = Child(module("retention", "--writer", str(db), str(WRITER_INTERVAL)))
    try:
        assert writer.line() == "ready"
        b0 = time.monotonic()
        time.sleep(baseline)
        b1 = time.monotonic()
        gc = Gc(db)
        g0 = time.monotonic()
        purged = gc.drain(lambda: gc.store.purge_finished(gc.before, limit=1000), g0 + cap)
        g1 = time.monotonic()
        out = json.loads(writer.close())
        gc.store.close()
    finally:
        writer.close(0)  # only on failure is it still running
    ms: dict[str, dict[str, float]] = {}  # the writer's commits, without gc and during it
    for label, (start, end) in (("without", (b0, b1)), ("during", (g0, g1))):
        times = [latency for at, latency in out["samples"] if start <= at < end]
        ms[label] = {"commits": len(times), "seconds": round(end - start, 2)}
        ms[label] |= {f"p{q}": round(quantile(times, q / 100) * 1e3, 3) for q in (50, 99, 100)}
    ratio = ms["during"]["p99"] / ms["without"]["p99"]
    report.add("writer p99 commit during gc / without", ratio, "<= 3", unit="ratio", commits=ms)
    report.add("writer p99 commit ms without gc", ms["without"]["p99"], unit="ms", busy=out["busy"])
    report.add("writer p99 commit ms during gc", ms["during"]["p99"], unit="ms")
    report.add("writer max commit ms during gc", ms["during"]["p100"], unit="ms")
    add_drain(report, "purge_finished limit=1000 with writer", "executions", purged, rows=False)
    left = n - purged.removed
    after = check_left(db, n, left)
    assert after["running"] == n // 10 + run.POOL and (left == 0) == purged.finished, after
    db.unlink()


# --- WAL pages per typical commit, before / after the marker time (0007) ---

# The previous head, 0006, as the migration chain builds it, then the later ones that only
# add what the inserts write (0008, 0010, 0011): the two shapes differ by 0007 alone (and
# 0012, its marker's trigger, which needs 0007's columns).
PREVIOUS_HEAD = tuple(  # 0001..0006, 0008, 0010 and 0011
    f"migrations/{p.name}"
    for p in sorted((SQL_DIR / "migrations").glob("00*.up.sql"))
    if p.name[:4] not in ("0007", "0009", "0012")
)
OLD_MARK = "INSERT OR IGNORE INTO harel_processed_events (execution_id, event_id) VALUES (?, ?)"
MARKER_SHAPES: dict[str, run.Shape] = {
    "before": (PREVIOUS_HEAD, "update_execution_data", ((OLD_MARK, lambda params: params),)),
    "after": (("schema.sql",), "update_execution_data", run.MARKS),
}


def bench_wal_markers(report: Report, tmp: Path) -> None:
    """WAL frames appended per commit, bare sqlite3 NORMAL: before, 0001..0006, 0008, 0010 and the
    old marker insert; after, schema.sql with mark_processed (and its trigger, 0012)."""
    report.section(f"WAL pages per typical commit ({run.WAL_COMMITS} commits), before / after 0007")
    for first, label in ((False, "typical"), (True, "first marker")):
        line, pages = f"wal pages/commit {label}", {}
        for shape in MARKER_SHAPES:
            db = tmp / f"wal-{shape}{'-first' if first else ''}.db"
            conn = run.bare_connection("sqlite", str(db), "NORMAL")
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            commits = run.floor_commits(conn, run.WAL_COMMITS, True, MARKER_SHAPES[shape])
            # Warm-up: each execution measured next has its timer and trace, and (unless its
            # first marker is measured) its markers and markers_since.
            commits(not first)
            pages[shape], frames, sizes = run.wal_pages(db, commits)
            conn.close()
            kinds = run.table_kinds(db)
            assert kinds["harel_processed_events"], (shape, kinds)  # WITHOUT ROWID in both
            with contextlib.closing(sqlite3.connect(db)) as probe:
                columns = {row[1] for row in probe.execute("PRAGMA table_info(harel_executions)")}
            assert ("markers_since" in columns) == (shape == "after"), (shape, columns)
            report.add(f"{line} {shape}", pages[shape], unit="pages", frames=frames, by_pages=sizes)
        more, target = pages["after"] - pages["before"], "<= +0.2" if not first else ""
        report.add(f"{line} after - before", more, target, unit="pages")


def main() -> None:
    args = parser(__doc__, quick="50k executions (well under 1 min)")
    args.add_argument("--size", type=int, help="finished executions (overrides the mode's)")
    args.add_argument("--writer", nargs=2, help=argparse.SUPPRESS)
    ns = args.parse_args()
    if ns.writer:
        writer_main(Path(ns.writer[0]), float(ns.writer[1]))
        return
    # Finished executions (in smoke, more than the raw profile removes), the writer's baseline
    # and the most a capped drain runs (seconds; the first limit=1000 drain is never capped).
    size, baseline, cap = {
        "full": (1_000_000, 15.0, 45.0),
        "quick": (50_000, 4.0, 8.0),
        "smoke": (10_000, 0.5, 2.0),
    }[mode(ns)]
    n = ns.size or size
    n -= n % 10
    meta = {
        "finished_executions": n,
        "writer_interval_s": WRITER_INTERVAL,
        "caps_s": {"writer_baseline": baseline, "capped_drains": cap},
    }
    detail = f" ({n:,} finished executions)"
    with (
        Report("retention", mode(ns), detail, **meta) as report,
        tempfile.TemporaryDirectory() as name,
    ):
        tmp = Path(name)
        bench_wal_markers(report, tmp)
        seeded = {order: seed(tmp / f"seeded-{order}.db", n, order) for order in ORDERS}
        bench_gc(report, tmp, seeded["scattered"], n)
        bench_drain(report, tmp, seeded["scattered"], n, 250, cap, "", ">= 5000")
        bench_concurrent(report, tmp, seeded["scattered"], n, baseline, min(cap, 30.0))
        bench_drain(report, tmp, seeded["ordered"], n, 1000, cap, " ids in update order", "")


if __name__ == "__main__":
    main()
