"""harel-store benchmarks: figures are ratios against a baseline measured in this run.

    python -m benchmarks.run            # full: 1k / 100k / 1M executions, longer commit runs
    python -m benchmarks.run --quick    # the same figures, fewer repetitions
    python -m benchmarks.run --smoke    # every section once, tiny (1k / 2k): that it works

Sections: commits (the store against the same statements on a bare connection); WAL pages
per typical commit (the store, and a bare connection with the previous write shape -- schema
0002, every summary column in the CAS update's SET -- and with the new one: a count of pages,
not a ratio, the machine does not change it); commit time of the new shape against the
previous one on a bare connection; listing and timer-sweep latency at 1k / 100k / 1M
executions; the async twin; peak RSS.

Prints a table and writes JSON to ``benchmarks/results/run-<timestamp>.json`` (not in a smoke
run). Not a test: the numbers depend on the machine and its load; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import os
import resource
import sqlite3
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import libsql

from benchmarks.harness import (
    Child,
    Report,
    alternate,
    best,
    median_call,
    mode,
    module,
    parser,
    quantile,
    ticked,
)
from harel_store import AsyncLibsqlStore, Event, Execution, LibsqlStore, SqliteStore, TimerOp
from harel_store.checks import encode_cursor
from harel_store.schema import describe
from harel_store.sql import QUERIES, SQL_DIR, split_statements
from harel_store.store import DEFAULT_TRACE_MAX, Store

NOW = 2000.0  # the sweep's "now": 100 timers are due at or before it in every dataset
DRIVERS: dict[str, Any] = {"libsql": LibsqlStore, "sqlite": SqliteStore}
POOL = 100  # executions the commits cycle through
STEP = {"state": "main.wait", "event": "tick"}  # the trace step of every benchmark commit
STEP_JSON = json.dumps(STEP, separators=(",", ":"))
WAL_COMMITS = 60
RING_FULL = (False, True)  # the trace rings as a young execution's, then full (every step trims)


def usec(seconds: float) -> float:
    return round(seconds * 1e6, 1)


# --- commits: the store against the same statements on a bare connection ---
def bare_connection(driver: str, database: str, synchronous: str) -> Any:
    """The store's driver and pragmas, with no store code."""
    if driver == "libsql":
        conn = libsql.connect(database)
    else:
        conn = sqlite3.connect(database, isolation_level=None, check_same_thread=False)
    conn.execute("PRAGMA busy_timeout = 5000", ())
    if database != ":memory:":
        conn.execute("PRAGMA journal_mode = WAL", ()).fetchall()
    conn.execute(f"PRAGMA synchronous = {synchronous}", ())
    return conn


def executions(prefix: str = "exe") -> list[Execution]:
    return [
        Execution(
            id=f"{prefix}-{i:05d}",
            definition_id="order",
            active_path="main.wait",
            context={"order": i, "customer": f"c-{i}", "items": [1, 2, 3], "note": "x" * 40},
        )
        for i in range(POOL)
    ]


_FIRE_AT = itertools.count()


def fire_times(n: int) -> list[float]:
    """Timer times never used before in this process: each commit re-arms its timer to a new
    time, as the engine does (SQLite does not write a row rewritten to what it holds)."""
    return [1e9 + next(_FIRE_AT) for _ in range(n)]


def store_commits(store: Store, n: int, trace: bool) -> Callable[[], float]:
    exes = executions()
    for exe in exes:
        store.save(exe)
    # What the engine hands over is built before the clock starts, as for the floor.
    events = [Event(name="tick", payload={"n": i}) for i in range(n)]

    def run() -> float:
        ids = [f"in-{time.perf_counter_ns()}-{i}" for i in range(n)]  # fresh dedupe markers
        timers = [[TimerOp.schedule("main.wait", at)] for at in fire_times(n)]
        t0 = time.perf_counter()
        for i in range(n):
            exe = exes[i % POOL]
            store.commit(
                exe,
                [(exe.id, events[i])],
                processed_event_id=ids[i],
                timers=timers[i],
                trace=STEP if trace else None,
            )
        return (time.perf_counter() - t0) / n

    return run


# A commit's write shape: the schema it runs on (scripts of sql/, in order), its CAS update and
# its dedupe marker's statements (SQL, bind).
Shape = tuple[tuple[str, ...], str, tuple[tuple[str, Callable[..., Any]], ...]]
MARKS = tuple((QUERIES[q].sql, QUERIES[q].bind) for q in ("mark_processed",))  # its trigger
# Revision 0002 (markers, timers and trace as rowid tables) and the later migrations that only
# add columns and indexes, so that the statements of queries.sql run on it.
PREVIOUS = tuple(
    f"migrations/{script.name}"
    for number in (1, 2, 4, 5, 6, 7, 8, 10, 11)
    for script in sorted((SQL_DIR / "migrations").glob(f"{number:04d}_*.up.sql"))
)
SHAPES: dict[str, Shape] = {
    # Every summary column in SET (all of harel_executions' index entries rewritten).
    "previous": (PREVIOUS, "update_execution", MARKS),
    # Head (0003, WITHOUT ROWID); status and parent_id checked in WHERE, not SET: what the
    # store issues for a typical commit.
    "new": (("schema.sql",), "update_execution_data", MARKS),
}


def floor_commits(
    conn: Any, n: int, trace: bool, shape: Shape = SHAPES["new"]
) -> Callable[..., float]:
    """The statements one commit issues (queries.sql), parameters prepared in advance, on a
    fresh schema of ``shape``: ``run(marker=True)`` makes ``n`` commits (without their dedupe
    marker if not ``marker``), the seconds a commit."""
    scripts, update, marks = shape
    for script in scripts:
        for stmt in split_statements((SQL_DIR / script).read_text(encoding="utf-8")):
            conn.execute(stmt, ())
    conn.commit()
    sql = {name: query.sql for name, query in QUERIES.items()}
    bind = {name: query.bind for name, query in QUERIES.items()}
    exes = executions()
    versions = [1] * POOL
    payloads = [exe.model_dump_json() for exe in exes]
    summary = ("running", None, "main.wait", None, None)
    conn.execute(sql["begin"], bind["begin"](()))
    for i, exe in enumerate(exes):
        params = (exe.id, "order", payloads[i], 1, *summary)
        conn.execute(sql["insert_execution"], bind["insert_execution"](params))
    conn.commit()
    events = [Event(name="tick", payload={"n": i}).model_dump_json() for i in range(n)]
    step = STEP_JSON

    def run(marker: bool = True) -> float:
        ids = [f"in-{time.perf_counter_ns()}-{i}" for i in range(n)]
        fire = fire_times(n)
        t0 = time.perf_counter()
        for i in range(n):
            k = i % POOL
            eid = exes[k].id
            conn.execute(sql["begin"], bind["begin"](()))
            v = versions[k]
            cur = conn.execute(sql[update], bind[update]((eid, payloads[k], v + 1, v, *summary)))
            assert cur.rowcount == 1
            versions[k] = v + 1
            outbox = bind["insert_outbox"]((eid, eid, events[i], None, eid))  # no trace context
            conn.execute(sql["insert_outbox"], outbox).fetchone()
            for statement, bound in marks if marker else ():
                conn.execute(statement, bound((eid, ids[i])))
            timer = bind["schedule_timer"]((eid, "main.wait", fire[i], None, eid))
            conn.execute(sql["schedule_timer"], timer)
            if trace:
                (idx,) = conn.execute(
                    sql["append_trace"], bind["append_trace"]((eid, step))
                ).fetchone()
                if idx >= DEFAULT_TRACE_MAX:
                    conn.execute(sql["trim_trace"], bind["trim_trace"]((eid, DEFAULT_TRACE_MAX)))
            conn.commit()
        return (time.perf_counter() - t0) / n

    return run


FILL_TRACE = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < ?)
INSERT INTO harel_trace (execution_id, idx, entry, recorded_at)
SELECT e.id, seq.n, ?, (julianday('now') - 2440587.5) * 86400.0 FROM harel_executions AS e, seq
"""


def fill_trace_rings(conn: Any) -> None:
    """Every execution's trace ring full (each commit then trims one), through ``conn``: another
    SQLite library's connection would delete the WAL on close. No checkpoint meanwhile."""
    ((every,),) = conn.execute("PRAGMA wal_autocheckpoint", ()).fetchall()
    conn.execute("PRAGMA wal_autocheckpoint = 0", ())
    conn.execute("BEGIN IMMEDIATE", ())
    conn.execute(FILL_TRACE, (DEFAULT_TRACE_MAX, STEP_JSON))
    conn.commit()
    conn.execute(f"PRAGMA wal_autocheckpoint = {every}", ())


def commits_on(
    who: str, driver: str, database: str, sync: str, n: int, trace: bool
) -> tuple[Any, Callable[[], float], Callable[[], None]]:
    """``n`` commits a run on a fresh database, of the store ("store") or of a bare connection
    with the shape ``who``: the connection, the run and what closes it."""
    if who == "store":
        store = DRIVERS[driver](database, synchronous=sync)
        return store._conn.db, store_commits(store, n, trace), store.close
    conn = bare_connection(driver, database, sync)
    return conn, floor_commits(conn, n, trace, SHAPES[who]), conn.close


def race(
    dbs: dict[str, str], driver: str, sync: str, n: int, rounds: int, trace: bool, full: bool
) -> dict[str, list[float]]:
    """The commit runs of ``dbs`` (who: database, see commits_on), trace rings ``full`` or
    not, each warmed up once, then in turns for ``rounds``: each round's seconds a commit."""
    runs: dict[str, Callable[[], float]] = {}
    closes = []
    for who, db in dbs.items():
        conn, runs[who], close = commits_on(who, driver, db, sync, n, trace)
        closes.append(close)
        if full:
            fill_trace_rings(conn)
        runs[who]()  # warm up
    times = alternate(runs, rounds)
    for close in closes:
        close()
    return times


def bench_commits(report: Report, tmp: Path, n: int, rounds: int) -> None:
    report.section("commits: store / bare connection, same statements and pragmas")
    per_commit: dict[str, float] = {}
    places = (("file", "NORMAL"), ("file", "FULL"), ("memory", "NORMAL"))
    for (place, sync), driver, trace in itertools.product(places, DRIVERS, (True, False)):
        where = f"file/{sync}" if place == "file" else place
        tag = f"{driver}/{where}/{'trace' if trace else 'no-trace'}"
        name = tag.replace("/", "-")
        dbs = {who: str(tmp / f"{who}-{name}") for who in ("store", "new")}
        if place == "memory":
            dbs = dict.fromkeys(dbs, ":memory:")
        m = max(50, n // 10) if sync == "FULL" else n  # FULL syncs every commit: fewer of them
        times = race(dbs, driver, sync, m, rounds, trace, False)
        s, f = best(times["store"]), best(times["new"])
        per_commit[tag] = s
        target = "<= 1.15" if where == "file/NORMAL" else ""
        report.add(f"commit {tag}", s / f, target, commits=m, store_us=usec(s), floor_us=usec(f))
    for tag, s in per_commit.items():  # LibsqlStore time / SqliteStore time per commit
        if tag.startswith("libsql/file"):
            rest = tag.removeprefix("libsql/")
            target = "<= 1.20" if "NORMAL" in tag else ""
            report.add(f"commit libsql vs sqlite {rest}", s / per_commit[f"sqlite/{rest}"], target)


# --- the write shape: previous (0002, all summary columns in SET) against new (head) ---
def table_kinds(database: Path) -> dict[str, bool]:
    """The store's tables and whether each is WITHOUT ROWID."""
    conn = sqlite3.connect(database)
    try:
        tables = describe(conn).items()  # and the views and triggers, under "view ...": skipped
        return {table: info["without_rowid"] for table, info in tables if "without_rowid" in info}
    finally:
        conn.close()


def wal_pages(database: Path, run: Callable[[], float]) -> tuple[float, int, dict[int, int]]:
    """WAL frames (pages) one ``run`` of WAL_COMMITS commits appends: per commit, in all, and
    how many commits wrote each number of pages. A reader keeps a snapshot open meanwhile, so
    the WAL cannot restart from its beginning."""
    reader = sqlite3.connect(database, isolation_level=None)
    reader.execute("BEGIN")
    reader.execute("SELECT count(*) FROM harel_executions").fetchone()
    (page,) = reader.execute("PRAGMA page_size").fetchone()
    wal = Path(f"{database}-wal")
    before, header = wal.stat().st_size, wal.read_bytes()[:32]
    run()
    frames, rest = divmod(wal.stat().st_size - before, page + 24)
    # A WAL written over from its start (after a complete checkpoint) has new salts.
    assert rest == 0 and wal.read_bytes()[:32] == header, (rest, "the WAL restarted")
    reader.execute("ROLLBACK")
    reader.close()
    # Each frame's header: its page number, then the database size (nonzero: a commit's last).
    wal_bytes = wal.read_bytes()[before:]
    sizes: Counter[int] = Counter()
    pages = 0
    for offset in range(0, len(wal_bytes), page + 24):
        pages += 1
        if int.from_bytes(wal_bytes[offset + 4 : offset + 8], "big"):
            sizes[pages] += 1
            pages = 0
    assert sum(sizes.values()) == WAL_COMMITS and not pages, (sizes, pages)
    return frames / WAL_COMMITS, frames, dict(sorted(sizes.items()))


def bench_wal(report: Report, tmp: Path) -> None:
    """WAL frames a typical commit appends (a page count, not a ratio), synchronous NORMAL:
    SqliteStore at head, then bare sqlite3 with each shape."""
    report.section(f"WAL pages per typical commit ({WAL_COMMITS} commits, WAL held by a reader)")
    for ring_full in RING_FULL:
        suffix = " (trace ring full)" if ring_full else ""
        pages: dict[str, tuple[float, int, dict[int, int]]] = {}
        kinds: dict[str, dict[str, bool]] = {}
        for who in ("store", "previous", "new"):
            db = tmp / f"wal-{who}{'-ring' if ring_full else ''}.db"
            conn, run, close = commits_on(who, "sqlite", str(db), "NORMAL", WAL_COMMITS, True)
            conn.execute("PRAGMA wal_autocheckpoint = 0")
            if ring_full:
                fill_trace_rings(conn)
            run()  # warm up: each execution measured next has its marker, timer and trace
            pages[who] = wal_pages(db, run)
            close()
            kinds[who] = table_kinds(db)
        assert kinds["store"] == kinds["new"] != kinds["previous"], kinds
        for who, (per, frames, sizes) in pages.items():
            label = f"wal pages/commit {'store' if who == 'store' else f'bare {who} shape'}"
            target = "<= 8" if who == "store" and not ring_full else ""
            report.add(f"{label}{suffix}", per, target, frames=frames, by_pages=sizes)
        ratio = pages["new"][0] / pages["previous"][0]
        report.add(f"wal pages new/previous shape{suffix}", ratio)


def bench_shape(report: Report, tmp: Path, n: int, rounds: int) -> None:
    report.section("commit time: new shape / previous shape, bare connection, same commit")
    for ring_full, sync, driver in itertools.product(RING_FULL, ("NORMAL", "FULL"), DRIVERS):
        tag = f"{driver}/file/{sync}" + ("/ring-full" if ring_full else "")
        # FULL syncs every commit: fewer of them keep the run short (but long enough to even
        # out the syncs' jitter: more rounds than bench_commits). A young trace ring must not
        # fill up over the warm-up and the rounds.
        m = min(n // 2 if sync == "FULL" else n, POOL * (DEFAULT_TRACE_MAX // (rounds + 1)))
        dbs = {shape: str(tmp / f"shape-{shape}-{tag.replace('/', '-')}.db") for shape in SHAPES}
        times = race(dbs, driver, sync, m, rounds, True, ring_full)
        new, previous = best(times["new"]), best(times["previous"])
        paired = [a / b for a, b in zip(times["new"], times["previous"], strict=True)]
        # Targets on sqlite3 only: libsql's costlier statement calls dilute the ratio and its
        # FULL rows spread wider between runs (0.75 - 1.0 here).
        target = ""
        if driver == "sqlite" and not ring_full:
            target = "<= 0.75" if sync == "NORMAL" else "<= 0.90"
        raw: dict[str, Any] = {"new_us": usec(new), "previous_us": usec(previous), "commits": m}
        # a cross-check on noise: the median ratio of each round's two adjacent runs
        raw["median_round_ratio"] = round(statistics.median(paired), 4)
        report.add(f"commit new/previous shape {tag}", new / previous, target, **raw)


# --- datasets for the read benchmarks, built with bulk SQL ---

BUILD_EXECUTIONS = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :n),
rows AS (
  SELECT n, printf('exe-%08d', n) AS id, 'def-' || (n % 4) AS def,
         CASE (n / 4) % 10 WHEN 8 THEN 'failed' WHEN 9 THEN 'cancelled'
              ELSE CASE WHEN (n / 4) % 10 < 4 THEN 'running' ELSE 'finished' END END AS st,
         CASE WHEN (n / 40) % 2 = 0 THEN NULL ELSE printf('exe-%08d', n - 40) END AS parent
  FROM seq)
INSERT INTO harel_executions
    (id, definition_id, data, version, status, outcome, active_path, parent_id, finished_at,
     created_at, updated_at)
SELECT id, def,
       json_object('id', id, 'definition_id', def, 'version', 1, 'status', st,
                   'outcome', NULL, 'active_path', 'main.wait', 'parent_id', parent,
                   'finished_at', NULL,
                   'context', json_object('order', n, 'customer', 'c-' || (n % 977),
                                          'items', json_array(1, 2, 3), 'note', 'typical')),
       1, st, NULL, 'main.wait', parent, NULL,
       -- update times spread over the ids, one per execution: [T0, T0 + n)
       :t0 + (n * 7919) % :n - 60.0, :t0 + (n * 7919) % :n
FROM rows
"""
T0 = 1.7e9  # the datasets' first update time (7919 is prime: n * 7919 % n visits every slot)
# 100 timers due at or before NOW, spread over the ids; the rest far in the future.
BUILD_TIMERS = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :n)
INSERT INTO harel_timers (execution_id, path, fire_at)
SELECT printf('exe-%08d', n), 'main.wait',
       CASE WHEN n % (:n / 100) = 0 THEN 1000.0 + n / (:n / 100) ELSE 1e9 + n END
FROM seq
"""
BUILD_PROCESSED = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :n)
INSERT INTO harel_processed_events (execution_id, event_id)
SELECT printf('exe-%08d', n), 'ev-' || n FROM seq
"""


def build_dataset(path: Path, n: int) -> float:
    t0 = time.perf_counter()
    SqliteStore(path).close()  # the schema at head, made by the store
    conn = sqlite3.connect(path, isolation_level=None)
    conn.execute("PRAGMA synchronous = OFF")
    conn.execute("BEGIN")
    for sql in (BUILD_EXECUTIONS, BUILD_TIMERS, BUILD_PROCESSED):
        conn.execute(sql, {"n": n, "t0": T0})
    conn.execute("COMMIT")
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return time.perf_counter() - t0


LISTINGS: dict[str, dict[str, Any]] = {
    "status": {"status": "running"},
    "definition+status": {"definition_id": "def-1", "status": "running"},
    "statuses any-of": {"status": ["failed", "cancelled"]},
    "roots+status": {"roots_only": True, "status": "running"},
    "unfiltered": {},
    "newest": {"newest_first": True},
    "newest+status": {"newest_first": True, "status": "running"},
}


def read_latencies(path: Path, n: int, driver: str, iterations: int) -> dict[str, float]:
    """The median latency of each listing's first and middle page, the timer sweep, a load and
    the same row read by a bare primary-key select."""
    store = DRIVERS[driver](path, migrate=False)
    calls: dict[str, Callable[[], object]] = {}
    middle = f"exe-{n // 2:08d}"
    for name, kwargs in LISTINGS.items():
        # The middle of the listing: of the ids, or of the update times.
        timed = kwargs.get("newest_first", False)
        cursor = encode_cursor("", "newest", T0 + n // 2) if timed else encode_cursor(middle)
        page = functools.partial(store.list_executions, limit=50, **kwargs)
        calls[f"list {name} (first page)"] = page
        calls[f"list {name} (middle page)"] = functools.partial(page, cursor=cursor)
    calls["due_timers 100 due"] = functools.partial(store.due_timers, NOW)
    ids = [f"exe-{(i * 7919) % n:08d}" for i in range(iterations)]
    loads, selects, conn = iter(ids * 40), iter(ids * 40), store._conn.db
    sql = "SELECT data FROM harel_executions WHERE id = ?"
    calls["load_for_event"] = lambda: store.load_for_event(next(loads), "ev-1")
    calls["bare pk select"] = lambda: conn.execute(sql, (next(selects),)).fetchone()
    out = {figure: median_call(call, iterations) for figure, call in calls.items()}
    assert len(due := store.due_timers(NOW)) == 100, len(due)
    store.close()
    return out


def bench_reads(
    report: Report, tmp: Path, sizes: list[int], iterations: int, rounds: int
) -> dict[int, Path]:
    report.section(f"reads: page latency at {sizes} executions (ratios against the smallest)")
    paths = {n: tmp / f"data-{n}.db" for n in sizes}
    for n, path in paths.items():
        took = build_dataset(path, n)
        print(f"  built {n} executions, timers, markers in {took:.1f}s", flush=True)
    small, large = sizes[0], sizes[-1]
    for driver in DRIVERS:
        # Sizes take turns, round after round; each figure keeps its best round's median.
        lat: dict[int, dict[str, float]] = {n: {} for n in sizes}
        for _, n in itertools.product(range(rounds), sizes):
            for figure, value in read_latencies(paths[n], n, driver, iterations).items():
                lat[n][figure] = min(value, lat[n].get(figure, value))
        for figure in lat[small]:
            if figure in ("load_for_event", "bare pk select"):
                continue
            for n in sizes[1:]:
                report.add(
                    f"{driver} {figure} {n // 1000}k/{small // 1000}k",  # median latency
                    lat[n][figure] / lat[small][figure],
                    "<= 2" if n == large else "",
                    us={str(k): usec(v[figure]) for k, v in lat.items()},
                )
        store, bare = lat[large]["load_for_event"], lat[large]["bare pk select"]
        label = f"{driver} load_for_event / bare pk select @{large // 1000}k"
        report.add(label, store / bare, store=usec(store), bare=usec(bare))
    return paths


# --- async twin: throughput against the sync store, and the event-loop lag it causes ---
async def _async_run(path: Path, n: int, tasks: int) -> tuple[float, list[float]]:
    """``n`` commits from ``tasks`` tasks of an AsyncLibsqlStore: the seconds a commit, and
    the ticker's delays meanwhile."""
    store = await AsyncLibsqlStore.create(path, synchronous="NORMAL")
    exes = executions()
    for exe in exes:
        await store.save(exe)

    async def worker(k: int) -> None:
        for i in range(k, n, tasks):
            exe = exes[i % POOL] if tasks == 1 else exes[k % POOL]
            await store.commit(
                exe,
                [(exe.id, Event(name="tick"))],
                processed_event_id=f"in-{k}-{i}",
                timers=[TimerOp.schedule("main.wait", 1e9 + i)],
                trace={"step": i},
            )

    t0 = time.perf_counter()
    lags = await ticked(asyncio.gather(*(worker(k) for k in range(tasks))))
    took = (time.perf_counter() - t0) / n
    await store.close()
    return took, lags


def bench_async(report: Report, tmp: Path, n: int) -> None:
    report.section("async twin: AsyncLibsqlStore / LibsqlStore on a file (WAL, NORMAL)")
    sync_store = LibsqlStore(tmp / "sync.db", synchronous="NORMAL")
    run = store_commits(sync_store, n, trace=True)
    run()
    sync_t = best([run() for _ in range(3)])
    sync_store.close()
    for tasks in (1, 16):
        took, lags = asyncio.run(_async_run(tmp / f"async-{tasks}.db", n, tasks))
        idle = max(asyncio.run(ticked(asyncio.sleep(max(0.5, took * n)))))
        label = f"async commit time / sync, {tasks} task(s)"
        report.add(label, took / sync_t, async_us=usec(took), sync_us=usec(sync_t))
        report.add(
            f"async loop lag max / idle loop lag max, {tasks} task(s)",  # a 1 ms ticker's
            max(lags) / idle,
            max_lag_ms=round(max(lags) * 1e3, 3),
            p99_lag_ms=round(quantile(lags, 0.99) * 1e3, 3),
            idle_max_lag_ms=round(idle * 1e3, 3),
            sync_commit_ms=round(sync_t * 1e3, 3),
            gil_switch_interval_ms=round(sys.getswitchinterval() * 1e3, 3),
        )


# --- memory: peak RSS of a run over the smallest and the largest dataset ---
def rss_child(path: Path, n: int) -> None:
    """Walk listing pages, sweep timers, load and commit: then report peak RSS (KiB)."""
    store = LibsqlStore(path, migrate=False, synchronous="NORMAL")
    cursor = None
    for _ in range(200):
        cursor = store.list_executions(status="running", limit=200, cursor=cursor).next_cursor
        if cursor is None:
            break
    store.due_timers(NOW)
    for i in range(2000):
        store.load_for_event(f"exe-{(i * 7919) % n:08d}", "ev-1")
    store_commits(store, 500, trace=True)()
    store.close()
    print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)


def bench_memory(report: Report, paths: dict[int, Path]) -> None:
    report.section("memory: peak RSS of the same run over each dataset")
    rss = {}
    for n, path in paths.items():
        rss[n] = int(Child(module("run", "--rss-child", str(path), str(n))).close(600).split()[-1])
    small, large = min(rss), max(rss)
    mib = {str(k): round(v / 1024, 1) for k, v in rss.items()}
    label = f"peak RSS {large // 1000}k/{small // 1000}k"
    report.add(label, rss[large] / rss[small], "flat (~1)", rss_mib=mib)


def main() -> None:
    args = parser(__doc__, quick="fewer repetitions (about a minute)")
    args.add_argument("--rss-child", nargs=2, help=argparse.SUPPRESS)
    ns = args.parse_args()
    if ns.rss_child:
        rss_child(Path(ns.rss_child[0]), int(ns.rss_child[1]))
        return
    sizes = [1_000, 2_000] if ns.smoke else [1_000, 100_000, 1_000_000]
    # commits a run, rounds of bench_commits, iterations of a latency, rounds of bench_shape
    # (the ratio of two close times: more rounds) and of bench_reads
    commits, rounds, iterations, shape_rounds, read_rounds = {
        "full": (2000, 9, 500, 11, 5),
        "quick": (400, 5, 200, 11, 3),
        "smoke": (100, 1, 5, 1, 1),
    }[mode(ns)]
    with Report("run", mode(ns)) as report, tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        bench_commits(report, tmp, commits, rounds)
        bench_wal(report, tmp)
        bench_shape(report, tmp, commits, shape_rounds)
        paths = bench_reads(report, tmp, sizes, iterations, read_rounds)
        bench_async(report, tmp, commits)
        bench_memory(report, {sizes[0]: paths[sizes[0]], sizes[-1]: paths[sizes[-1]]})


if __name__ == "__main__":
    main()
