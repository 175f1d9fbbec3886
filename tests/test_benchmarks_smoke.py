"""Every benchmark runs: ``python -m benchmarks.<module> --smoke`` (tiny sizes, every section
once) exits 0, with no traceback, and prints what each of its sections prints, so that a
benchmark that breaks, or silently measures nothing, fails here. No figure is checked: a
smoke run's figures mean nothing.

The benchmarks that need a libSQL server start their own sqld on 127.0.0.1
(``tests.sqld``); ``benchmarks.instructions`` runs this tree's commits under valgrind's
callgrind, uncounted, and counts a bare interpreter's start."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TIMEOUT = 600.0  # seconds a smoke run may take at most (they take seconds to a minute)

# What each module's output must hold: its sections' headings and its table's rows, the
# last section's included (the run reached the end and printed its table).
EXPECTED: dict[str, tuple[str, ...]] = {
    "http_client": (
        "32 requests of SELECT 1 per run; per request:",
        "client                 CPU ms  wall ms",
        "httpx sync",
        "ours sync",
        "httpx async x16",
        "ours async x16",
        "ours / httpx:",
        "  async x16    CPU",
    ),
    "instructions": (
        "instructions per commit, in memory: this tree / HEAD",
        "  sqlite no-trace",
        "instructions to start a bare interpreter",
        "instructions per commit, sqlite no-trace: OpenTelemetry API, no provider / none",
        "  this tree ",
    ),
    "run": (
        "commits: store / bare connection, same statements and pragmas",
        "WAL pages per typical commit (60 commits, WAL held by a reader)",
        "commit time: new shape / previous shape, bare connection, same commit",
        "reads: page latency at [1000, 2000] executions",
        "async twin: AsyncLibsqlStore / LibsqlStore on a file",
        "memory: peak RSS of the same run over each dataset",
        "commit libsql vs sqlite file/FULL/no-trace",
        "wal pages new/previous shape (trace ring full)",
        "commit new/previous shape sqlite/file/FULL/ring-full",
        "sqlite load_for_event / bare pk select @2k",
        "async loop lag max / idle loop lag max, 16 task(s)",
        "peak RSS 2k/1k",
        "smoke run, ",
    ),
    "remote": (
        "1. HTTP requests per operation (counting proxy, no delay)",
        "libsql driver, replica: commit + next read",
        "2. Latency on the 20 ms link, median / one bare request",
        "before: libsql replica open + sync + close",
        "3. Group commit on the remote primary, 20 ms link",
        "async commits/s, 128 tasks",
        "ceiling, 32 tasks / the fastest bare round trip",
        "sqld's CPU a commit alone at 128 tasks",
        "version = commits returned = markers = steps",
        "reads/s, 32 tasks / 32 bare keep-alive connections",
        "4. Event-loop lag: a 1 ms ticker's delay, p99 and max / idle",
        "file, sqlite3 (the twin's thread wrapper)",
        "before: commit, then libsql's sync() on a thread",
        "5. Client CPU a request (load), loopback sqld",
        "async twin",
        "4b. Event-loop lag on a select() loop",
        "6. 200 commits from 32 tasks of one store, loopback",
        "sqld wedged",
        "smoke run, JSON not written",
    ),
    "relays": (
        "1a. drain outbox entries, local file",
        "drain file NORMAL: lost / duplicated",
        "1b. drain outbox entries, sqld",
        "drain sqld no delay: lost / duplicated",
        "2a. engine-like delivery",
        "2b. engine-like delivery",
        "delivery sqld 20 ms link: handler requests an event",
        "3. claim cost (limit 100)",
        "claim_due_timers, max_attempts=10: 2k pending + 1k dead / 1k",
        "4a. Relay and AsyncRelay, local file",
        "relay file FULL: AsyncRelay / hand-written loop",
        "4b. AsyncRelay, sqld 20 ms link",
        "relay sqld 20 ms link: lost / duplicated / version bumps off",
        "4c. wake-up after a commit",
        "wake-up: events not delivered once, or left",
        "4d. idle Relay",
        "idle Relay (poll=1), file: CPU % of a core",
        "smoke run, ",
    ),
    "engine": (
        "file/sync: this tree",
        "link/async: this tree",
        "file/sync\n  end to end p50 ms",
        "hop to another process p99 ms",
        "timer lateness p99 ms",
        "write transactions an order",
        "batches an order: commit",
        "sqld/sync\n",
        "idle CPU of sqld %",
        "link/async\n",
        "end to end p50 round trips",
        "requests an order",
        "CPU an order: submitter ms",
        "CPU an order: link proxy ms",
        "ceiling, all cores / CPU an order: orders/s",
        "smoke run, JSON not written",
    ),
    "retention": (
        "WAL pages per typical commit (60 commits), before / after 0007",
        "wal pages/commit first marker after - before",
        "seeded 10,000 finished + 1,000 running executions, scattered",
        "seeded 10,000 finished + 1,000 running executions, ordered",
        "gc, limit=1000: 10,000 finished roots, 1,000 running",
        "file MB after VACUUM",
        "gc, limit=250 (raw profile of 5 batches first)",
        "purge_finished limit=250 executions/s",
        "a concurrent writer (another process",
        "writer p99 commit during gc / without",
        "gc, limit=1000 ids in update order",
        "purge_finished limit=1000 ids in update order executions/s",
        "smoke run (10,000 finished executions)",
    ),
    "group": (
        "file, synchronous=FULL: commits/s (best of 1)",
        "32 tasks / 1, this tree",
        "8 threads / 1, this tree",
        "file, synchronous=NORMAL: commits/s (best of 1)",
        "a lone commit's rate, this tree / 0f8bb95",
        "fsync + fdatasync calls a commit, 32 tasks, FULL (strace)",
        "smoke run, JSON not written",
    ),
    "fleet": (
        "1. commits/s of one process, 32 tasks a database, 20 ms link",
        "4 primaries / 1",
        "4 primaries: client CPU a commit",
        "4 databases / 1",
        "by id: fleet / one store",
        "newest first: fleet / one store",
        "share moved",
        "smoke run, JSON not written",
    ),
    "flows": (
        "1. claim cost: claim_outbox(limit=100)",
        "claim_outbox round-robin, no flows / FIFO",
        "claim_outbox round-robin, 10 keys paused, 10 at concurrency 2 / FIFO",
        "keys in a claim of 100: FIFO | round-robin | with flows",
        "2. trickle latency",
        "round-robin: B's latency p50 / p99, in rounds",
        "FIFO (e3ed20a): claims from B's commit to its handler",
        "the burst: relay CPU an entry (us), this tree | e3ed20a",
        "3. engine (benchmarks.engine, file, Relay, no flows)",
        "engine orders/s: this tree / e3ed20a",
        "engine workers' CPU an order ms",
        "4. a relay hop's store calls",
        "commit, 2 spawns + 1 timer: this tree / e3ed20a",
        "smoke run, JSON not written",
    ),
    "ui": (
        "1. server time of a page (ASGI, in this process)",
        "/executions, first page: ",
        "/executions, its Next page: ",
        "/executions/{id}, 20 steps: ",
        "2. pages over a fleet of 4 files",
        "/ over 4 files: median",
        "3a. a page opened alone on the idle file, cold",
        "3b. 10 live pages on the idle file",
        "statements of the watch (PRAGMA data_version)",
        "bytes of the 10 streams",
        "3c. a commit by another process, 10 pages listening",
        "until all 10 streams told, worst of",
        "4. the commit path, the ui extra installed, no console",
        "imported by commits (LibsqlStore, SqliteStore)",
        "python -m benchmarks.instructions --against",
        "smoke run, JSON not written",
    ),
}
SERVED = {"http_client", "remote", "relays", "engine", "fleet"}  # start their own sqld


@pytest.mark.parametrize(
    "module",
    [
        pytest.param(m, marks=[pytest.mark.slow, *([pytest.mark.sqld] if m in SERVED else [])])
        for m in EXPECTED
    ],
)
def test_benchmark_smoke(module: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{module}", "--smoke"],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        check=False,
    )
    shown = (
        f"exit {proc.returncode}\n--- stdout (its end)\n{proc.stdout[-6000:]}"
        f"\n--- stderr (its end)\n{proc.stderr[-6000:]}"
    )
    assert proc.returncode == 0, shown
    assert "Traceback" not in proc.stdout + proc.stderr, shown
    missing = [text for text in EXPECTED[module] if text not in proc.stdout]
    assert not missing, f"not printed: {missing}\n{shown}"
