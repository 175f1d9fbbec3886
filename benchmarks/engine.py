"""An engine on the store, across processes: how fast an order crosses them, and what the
workers cost while they wait. Not a test: the figures depend on the machine.

    python -m benchmarks.engine                  # full: ~4 minutes on 2 cores
    python -m benchmarks.engine --quick          # fewer orders (~1.5 minutes)
    python -m benchmarks.engine --smoke          # every part once, tiny: that it works
    python -m benchmarks.engine --against 6ef3575   # and the same with that revision's code

The workflow (`benchmarks/engine_worker.py`): a submitter places an order, whose one commit
forks two children through the spawn relay and arms a reminder (0.1 s later) and a
timeout; each child is created, works and reports to its parent in one commit (the outbox
relay); the parent joins the reports in its context and finishes at the second, cancelling
its timeout; the submitter waits for it (`wait_for`; an older store: `load` every
millisecond). Two worker processes run a relay each (`Relay`, or `AsyncRelay`) at its
defaults (``poll`` 1 s), with handlers that let a StoreConflict escape (two reports at once).

On each of: a local file; sqld on loopback; sqld behind the 20 ms link of `benchmarks.remote`
(each request held 20 ms, each change notification 10 ms), with `Relay` and with
`AsyncRelay`:

1. latency: orders one at a time (a few ms apart): end to end (placed to `wait_for`
   returning) p50 and p99; a hop (the commit that wrote an item returned, to its handler
   starting), in the same process and in another; a timer's lateness (its fire_at to its
   handler starting). On the link, end to end also in round trips (one bare request through
   the link: its median).
2. throughput: orders 32 at a time: orders/s, and (on the link) HTTP requests an order.
3. idle: the workers waiting with nothing to do, for a few seconds: their CPU, and sqld's,
   as a share of one core.

With ``--against REV`` each topology runs again on that revision's code (`git archive`),
the figures side by side. Prints a table (targets of the issue beside the figures) and
writes JSON to ``benchmarks/results/engine-<timestamp>.json`` (``--smoke``: not written).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/engine.py` as well as `-m benchmarks.engine`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("RUST_LOG", "off")

from benchmarks.remote import Proxy, bare_request, medians
from harel_store import LibsqlStore, SqliteStore
from harel_store.connection import http
from tests.sqld import SQLD_VERSION, SqldServer

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve().with_name("engine_worker.py")
WORKERS = 2
DELAY_MS = 20.0


@dataclass(frozen=True)
class Plan:
    latency: int  # orders placed one at a time (on the link: link_latency)
    throughput: int  # orders placed `concurrency` at a time (on the link: link_throughput)
    link_latency: int
    link_throughput: int
    concurrency: int
    idle_s: float  # seconds the workers wait idle while their CPU is taken


FULL = Plan(300, 1000, 60, 400, concurrency=32, idle_s=10.0)
QUICK = Plan(100, 300, 30, 150, concurrency=32, idle_s=4.0)
SMOKE = Plan(4, 8, 2, 4, concurrency=4, idle_s=0.3)

# (topology, relay): the runs, each on this tree (and on --against's)
RUNS = (("file", "sync"), ("sqld", "sync"), ("link", "sync"), ("link", "async"))
# The targets (ms, orders/s, % of a core), by (topology, figure).
TARGETS: dict[tuple[str, str], tuple[str, float]] = {
    ("file/sync", "end to end p50 ms"): ("<=", 15),
    ("file/sync", "end to end p99 ms"): ("<=", 60),
    ("file/sync", "hop to another process p99 ms"): ("<=", 15),
    ("file/sync", "timer lateness p99 ms"): ("<=", 15),
    ("file/sync", "idle CPU of the workers %"): ("<=", 1),
    ("file/sync", "orders/s"): (">=", 200),
    ("sqld/sync", "end to end p50 ms"): ("<=", 30),
    ("sqld/sync", "end to end p99 ms"): ("<=", 100),
    ("sqld/sync", "timer lateness p99 ms"): ("<=", 30),
    ("sqld/sync", "idle CPU of sqld %"): ("<=", 1),
    ("link/async", "orders/s"): (">=", 60),
    ("link/async", "end to end p50 round trips"): ("<=", 12),
}


def quantile(values: list[float], q: float) -> float:
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class Result:
    run: str
    code: str
    figures: dict[str, float] = field(default_factory=dict)


class Topology:
    """A database for one run: a fresh file, or a fresh sqld (and the link in front of it)."""

    def __init__(self, name: str, tmp: Path, code: Path) -> None:
        self.name = name
        self.tmp = tmp
        self.env = {**os.environ, "PYTHONPATH": str(code), "RUST_LOG": "off"}
        self.server: SqldServer | None = None
        self.link: Proxy | None = None
        self.url = str(tmp / "engine.db")

    def __enter__(self) -> Topology:
        if self.name == "file":
            SqliteStore(self.url).close()  # migrated; this process opens it no more
            return self
        self.server = SqldServer(self.tmp / "sqld", auth=True).start()
        self.env["HAREL_AUTH_TOKEN"] = self.server.token
        LibsqlStore(self.server.url, auth_token=self.server.token, migrate=True).close()
        self.url = self.server.url
        if self.name == "link":
            self.link = Proxy(self.server.port or 0, DELAY_MS)
            self.url = self.link.url
        return self

    def __exit__(self, *exc: object) -> None:
        if self.link is not None:
            self.link.close()
        if self.server is not None:
            self.server.kill()  # SIGTERM waits 30 s for open notification streams

    def round_trip(self) -> float:
        """The median seconds of one bare request through the link."""
        assert self.server is not None and self.link is not None
        headers = {"Authorization": f"Bearer {self.server.token}"}
        with contextlib.closing(
            http.Client(self.link.url, headers=headers, timeout=10.0, ssl_context=None)
        ) as client:
            return medians({"bare": (bare_request(client), 10)})["bare"]


@contextlib.contextmanager
def workers(topology: Topology, relay: str, log: Path) -> Iterator[list[subprocess.Popen[str]]]:
    """The worker processes, ready; stopped (stdin closed) and their logs written at the end
    (what they log, a relay's failures, beside it: ``*.stderr``)."""
    with contextlib.ExitStack() as stack:
        yield from _workers(stack, topology, relay, log)


def _workers(
    stack: contextlib.ExitStack, topology: Topology, relay: str, log: Path
) -> Iterator[list[subprocess.Popen[str]]]:
    args = ["--async"] if relay == "async" else []
    errors = stack.enter_context(log.with_suffix(".stderr").open("a"))
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), "worker", topology.url, f"w{i}", str(log), *args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env=topology.env,
            cwd=topology.tmp,
        )
        for i in range(WORKERS)
    ]
    try:
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line != "ready\n":
                raise RuntimeError(f"a worker did not start: {line!r}")
        yield procs
    finally:
        for proc in procs:
            assert proc.stdin is not None
            with contextlib.suppress(OSError):
                proc.stdin.close()
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def submit(topology: Topology, prefix: str, log: Path, orders: int, concurrency: int) -> float:
    """Run the submitter; the seconds its orders took."""
    options = ["--orders", str(orders), "--concurrency", str(concurrency)]
    if concurrency == 1:
        options += ["--gap", "0.01"]
    done = subprocess.run(
        [sys.executable, str(WORKER), "submit", topology.url, prefix, str(log), *options],
        env=topology.env,
        cwd=topology.tmp,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the submitter failed:\n{done.stderr[-3000:]}")
    return float(done.stdout.split()[-1])


def read_log(log: Path) -> list[list[Any]]:
    return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


def latency_figures(records: list[list[Any]], result: Result) -> None:
    """End to end, hops and timers from one latency run's records."""
    figures = result.figures
    orders = [r for r in records if r[0] == "order"]
    e2e = [(done - placed) * 1e3 for _, _, placed, _, done in orders]
    figures["end to end p50 ms"] = quantile(e2e, 0.5)
    figures["end to end p99 ms"] = quantile(e2e, 0.99)
    commits = {r[1]: (r[2], r[3]) for r in records if r[0] == "commit"}
    hops: dict[bool, list[float]] = {True: [], False: []}
    for _, key, at, pid in (r for r in records if r[0] == "handle"):
        if key in commits:
            then, by = commits[key]
            hops[by == pid].append((at - then) * 1e3)
    for same, label in ((True, "in the same process"), (False, "to another process")):
        if hops[same]:
            figures[f"hop {label} p50 ms"] = quantile(hops[same], 0.5)
            figures[f"hop {label} p99 ms"] = quantile(hops[same], 0.99)
    late = [r[1] * 1e3 for r in records if r[0] == "late"]
    if late:
        figures["timer lateness p50 ms"] = quantile(late, 0.5)
        figures["timer lateness p99 ms"] = quantile(late, 0.99)


def measure(name: str, relay: str, code: Path, plan: Plan, tmp: Path, label: str) -> Result:
    result = Result(f"{name}/{relay}", label)
    link = name == "link"
    latency_n = plan.link_latency if link else plan.latency
    throughput_n = plan.link_throughput if link else plan.throughput
    with Topology(name, tmp, code) as topology:
        lat_log, tp_log = tmp / "latency.jsonl", tmp / "throughput.jsonl"
        with workers(topology, relay, lat_log) as procs:
            time.sleep(0.3)  # the workers' first look is done: they wait
            submit(topology, "lat", lat_log, latency_n, 1)
            time.sleep(0.3)  # the last reminders fire
        latency_figures(read_log(lat_log), result)
        if topology.link is not None:
            rtt = topology.round_trip()
            result.figures["round trip ms"] = rtt * 1e3
            result.figures["end to end p50 round trips"] = (
                result.figures["end to end p50 ms"] / 1e3 / rtt
            )
        with workers(topology, relay, tp_log) as procs:
            time.sleep(0.3)
            before = topology.link.requests() if topology.link is not None else 0
            took = submit(topology, "tp", tp_log, throughput_n, plan.concurrency)
            result.figures["orders/s"] = throughput_n / took
            if topology.link is not None:
                requests = topology.link.requests() - before
                result.figures["requests an order"] = requests / throughput_n
            time.sleep(1.5)  # the last reminders fire; then idle
            pids = [p.pid for p in procs]
            server = topology.server.pid if topology.server is not None else None
            start = {pid: cpu_seconds(pid) for pid in [*pids, *([server] if server else [])]}
            began = time.monotonic()
            time.sleep(plan.idle_s)
            spent = time.monotonic() - began
            used = {pid: cpu_seconds(pid) - at for pid, at in start.items()}
            result.figures["idle CPU of the workers %"] = sum(used[p] for p in pids) / spent * 100
            if server is not None:
                result.figures["idle CPU of sqld %"] = used[server] / spent * 100
    return result


def archive(revision: str, into: Path) -> Path:
    """That revision's tree, extracted."""
    into.mkdir()
    tar = subprocess.run(["git", "archive", revision], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return into


def met(run: str, figure: str, value: float) -> str:
    target = TARGETS.get((run, figure))
    if target is None:
        return ""
    op, bound = target
    ok = value <= bound if op == "<=" else value >= bound
    return f"target {op} {bound:g}  {'ok' if ok else 'MISSED'}"


def report(results: list[Result], against: str | None) -> None:
    for run in dict.fromkeys(r.run for r in results):
        mine = next(r for r in results if r.run == run and r.code == "this tree")
        old = next((r for r in results if r.run == run and r.code != "this tree"), None)
        print(f"\n{run}" + (f"   (this tree | {against})" if old else ""))
        for figure, value in mine.figures.items():
            line = f"  {figure:<34} {value:>9.2f}"
            if old is not None and figure in old.figures:
                before = old.figures[figure]
                line += f" | {before:>9.2f}"
                if before:
                    line += f"  ({value / before:.2f}x)"
            print(f"{line}  {met(run, figure, value)}".rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer orders")
    parser.add_argument("--smoke", action="store_true", help="tiny, every part once (no JSON)")
    parser.add_argument("--against", metavar="REV", help="also run that revision's code")
    parser.add_argument("--only", choices=[f"{t}/{r}" for t, r in RUNS], help="one run")
    args = parser.parse_args()
    plan = SMOKE if args.smoke else QUICK if args.quick else FULL
    started = time.time()
    results: list[Result] = []
    failed: BaseException | None = None
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        codes = [("this tree", ROOT)]
        if args.against:
            codes.append((args.against, archive(args.against, tmp / "against")))
        try:
            for topology, relay in RUNS:
                if args.only and args.only != f"{topology}/{relay}":
                    continue
                for label, code in codes:
                    print(f"{topology}/{relay}: {label}", flush=True)
                    where = tmp / f"{topology}-{relay}-{len(results)}"
                    where.mkdir()
                    results.append(measure(topology, relay, code, plan, where, label))
        except BaseException as exc:  # what was measured is still printed and written
            failed = exc
    report(results, args.against)
    meta = {
        "plan": asdict(plan),
        "against": args.against,
        "seconds": round(time.time() - started, 1),
        "error": None if failed is None else repr(failed),
        "sqld": SQLD_VERSION,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
    }
    if args.smoke:
        print(f"\nsmoke run, JSON not written ({meta['seconds']} s)")
    else:
        out = ROOT / "benchmarks" / "results" / f"engine-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.parent.mkdir(exist_ok=True)
        rows = [asdict(r) for r in results]
        out.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")
        print(f"\n{out.relative_to(ROOT)} ({meta['seconds']} s)")
    if failed is not None:
        raise failed


if __name__ == "__main__":
    main()
