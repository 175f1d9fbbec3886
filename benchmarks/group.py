"""Group commit on a local file: commits/s of 1, 8 and 32 tasks of one `AsyncLibsqlStore`
and of 1 and 8 threads sharing one `LibsqlStore`, at synchronous FULL and NORMAL; the fsync
and fdatasync calls a commit costs with 32 tasks (strace); each against another revision's
code in the same run (``--against``, default ``0f8bb95``: before group commit).

    python -m benchmarks.group                  # full: 3 rounds of 4,000 commits a run
    python -m benchmarks.group --quick          # 2 rounds of 2,000
    python -m benchmarks.group --smoke          # that it works: one round of 64
    python -m benchmarks.group --against REV

Each run is a child process on a fresh file (the code under test imported from its tree):
every worker commits to an execution of its own, an emit and a dedupe marker a commit, the
workers started together; its figure is the best of the rounds. The remote figures of the
same issue are in ``benchmarks.remote`` (section 3).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.harness import ROOT, Report, archive, best, mode, parser

CHILD = """
import asyncio, sys, threading, time
sys.path.insert(0, sys.argv[1])
from harel_store import AsyncLibsqlStore, Event, Execution, LibsqlStore

path, how, workers, n, synchronous = sys.argv[2:7]
workers, n = int(workers), int(n)
store = LibsqlStore(path, synchronous=synchronous)
exes = [Execution(id=f"e{i}", definition_id="bench") for i in range(workers)]
each = max(1, n // workers)

def emit(exe, i):
    return [(None, Event(name="go", id=f"{exe.id}-{i}"))]

async def tasks():
    a = AsyncLibsqlStore(store)
    for exe in exes:
        await a.commit(exe, [])
    async def one(exe):
        for i in range(each):
            await a.commit(exe, emit(exe, i), f"in-{exe.id}-{i}")
    start = time.perf_counter()
    await asyncio.gather(*(one(exe) for exe in exes))
    return time.perf_counter() - start

def threads():
    for exe in exes:
        store.commit(exe, [])
    def one(exe):
        for i in range(each):
            store.commit(exe, emit(exe, i), f"in-{exe.id}-{i}")
    started = [threading.Thread(target=one, args=(exe,)) for exe in exes]
    start = time.perf_counter()
    for t in started:
        t.start()
    for t in started:
        t.join()
    return time.perf_counter() - start

took = asyncio.run(tasks()) if how == "tasks" else threads()
print(each * workers / took)
"""

# (how, workers): the runs, each at FULL and NORMAL; the ratios against 1 worker of its kind
RUNS = [("tasks", 1), ("tasks", 8), ("tasks", 32), ("threads", 1), ("threads", 8)]
TARGETS = {("FULL", "tasks", 32): ">= 3", ("FULL", "threads", 8): ">= 1.8"}
SYNC_CALLS = re.compile(r"^\s*[\d.]+\s+[\d.]+\s+\d+\s+(\d+)\s+(?:\d+\s+)?f(?:data)?sync$", re.M)


def commits(code: Path, tmp: Path, how: str, workers: int, n: int, sync: str) -> float:
    """Commits/s of one run on a fresh file."""
    db = tmp / f"{how}-{workers}-{sync}.db"
    for leftover in tmp.glob(f"{db.name}*"):
        leftover.unlink()
    args = [sys.executable, "-c", CHILD, str(code), str(db), how, str(workers), str(n), sync]
    out = subprocess.run(args, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return float(out.split()[-1])


def sync_calls(code: Path, tmp: Path, n: int) -> float | None:
    """fsync and fdatasync calls a commit, 32 tasks at FULL (None: no strace here)."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    db = tmp / "strace.db"
    for leftover in tmp.glob("strace.db*"):
        leftover.unlink()
    args = [sys.executable, "-c", CHILD, str(code), str(db), "tasks", "32", str(n), "FULL"]
    trace = [strace, "-f", "-c", "-e", "trace=fsync,fdatasync", *args]
    done = subprocess.run(trace, check=True, capture_output=True, text=True, cwd=ROOT)
    calls = sum(int(c) for c in SYNC_CALLS.findall(done.stderr))
    return calls / (n // 32 * 32 + 32)  # the first commit of each execution too


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--against", default="0f8bb95", metavar="REV", help="the code to compare")
    ns = args.parse_args()
    run = mode(ns)
    rounds, n = {"smoke": (1, 64), "quick": (2, 2000), "full": (3, 4000)}[run]
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        Report("group", run, against=ns.against, rounds=rounds, commits=n) as report,
    ):
        tmp = Path(tmp_name)
        codes = {"this tree": ROOT, ns.against: archive(ns.against, tmp / "against")}
        rates: dict[tuple[str, str, str, int], float] = {}
        for sync in ("FULL", "NORMAL"):
            report.section(f"file, synchronous={sync}: commits/s (best of {rounds})")
            for how, workers in RUNS:
                for name, code in codes.items():
                    samples = [commits(code, tmp, how, workers, n, sync) for _ in range(rounds)]
                    rates[name, sync, how, workers] = rate = best(samples)
                    label = f"{workers} {how if workers > 1 else how[:-1]}, {name}"
                    report.add(label, rate, unit="commits/s")
            for how, workers in RUNS:
                if workers == 1:
                    continue
                for name in codes:
                    ratio = rates[name, sync, how, workers] / rates[name, sync, how, 1]
                    target = TARGETS.get((sync, how, workers), "") if name == "this tree" else ""
                    report.add(f"{workers} {how} / 1, {name}", ratio, target, unit="x")
            lone = rates["this tree", sync, "threads", 1] / rates[ns.against, sync, "threads", 1]
            report.add(f"a lone commit's rate, this tree / {ns.against}", lone, ">= 0.95", unit="x")
        report.section("fsync + fdatasync calls a commit, 32 tasks, FULL (strace)")
        for name, code in codes.items():
            calls = sync_calls(code, tmp, n)
            target = "<= 0.2" if name == "this tree" else ""
            if calls is None:
                report.add(name, "strace not found")
            else:
                report.add(name, calls, target, unit="calls")


if __name__ == "__main__":
    main()
