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

On each of: a local file; sqld on loopback; sqld behind the 20 ms link of `benchmarks.harness`
(each request held 20 ms, each change notification 10 ms), with `Relay` and with
`AsyncRelay`:

1. latency: orders one at a time (a few ms apart): end to end (placed to `wait_for`
   returning) p50 and p99; a hop (the commit that wrote an item returned, to its handler
   starting), in the same process and in another; a timer's lateness (its fire_at to its
   handler starting). On the link, end to end also in round trips (one bare request through
   the link: its median).
2. throughput: orders 32 at a time: orders/s, and (on the link) HTTP requests an order; on
   the file, with this tree's code only, write transactions an order, counted by each
   process as they commit, and the batches that landed in them by what each does (commit,
   claim, ack, ...).
3. idle: the workers waiting with nothing to do, for a few seconds: their CPU, and sqld's,
   as a share of one core.

With ``--against REV`` each topology runs again on that revision's code (`git archive`),
the figures side by side. Prints a table (targets of the issue beside the figures) and
writes JSON to ``benchmarks/results/engine-<timestamp>.json`` (not in a smoke run).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import (
    ROOT,
    Child,
    Report,
    Served,
    archive,
    bare_request,
    client,
    cpu_spent,
    medians,
    meets,
    mode,
    parser,
    quantile,
    served,
)

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


PLANS = {
    "full": Plan(300, 1000, 60, 400, concurrency=32, idle_s=10.0),
    "quick": Plan(100, 300, 30, 150, concurrency=32, idle_s=4.0),
    "smoke": Plan(4, 8, 2, 4, concurrency=4, idle_s=0.3),
}
# (topology, relay): the runs, each on this tree (and on --against's)
RUNS = (("file", "sync"), ("sqld", "sync"), ("link", "sync"), ("link", "async"))
# The targets (ms, orders/s, % of a core), by run and figure: the orders/s and the file's
# p50 are issue 51's ("The server's pace"), the rest the push issue's.
TARGETS = {
    "file/sync": {
        "end to end p50 ms": "<= 10",
        "end to end p99 ms": "<= 60",
        "hop to another process p99 ms": "<= 15",
        "timer lateness p99 ms": "<= 15",
        "idle CPU of the workers %": "<= 1",
        "orders/s": ">= 300",
    },
    "sqld/sync": {
        "end to end p50 ms": "<= 30",
        "end to end p99 ms": "<= 100",
        "timer lateness p99 ms": "<= 30",
        "idle CPU of sqld %": "<= 1",
    },
    "link/async": {
        "orders/s": ">= 120",
        "end to end p50 round trips": "<= 12",
    },
}


@dataclass
class Topology:
    """A database for one run: a fresh file, or a fresh sqld (and the link in front of it)."""

    url: str
    env: dict[str, str]
    cwd: Path
    served: Served | None = None


@contextlib.contextmanager
def topology(name: str, tmp: Path, code: Path) -> Iterator[Topology]:
    env = {**os.environ, "PYTHONPATH": str(code), "RUST_LOG": "off"}

    def migrate(url: str, token: str = "") -> None:
        """Migrated by the code under test (another revision's head may be behind ours), in
        a process of its own: this one never opens the database. The token goes in the
        environment, not the command line (which `ps` shows)."""
        script = "import os, sys; from harel_store import LibsqlStore as S\n"
        script += "S(sys.argv[1], auth_token=os.environ['HAREL_AUTH_TOKEN'], migrate=True).close()"
        subprocess.run([sys.executable, "-c", script, url],
                       env={**env, "HAREL_AUTH_TOKEN": token}, cwd=tmp, check=True)  # fmt: skip

    if name == "file":
        url = str(tmp / "engine.db")
        migrate(url)  # and closed: this process never opens it
        yield Topology(url, env, tmp)
        return
    with served(tmp, DELAY_MS, migrate) as on:
        env["HAREL_AUTH_TOKEN"] = on.srv.token
        yield Topology(on.link.url if name == "link" else on.srv.url, env, tmp, on)


@contextlib.contextmanager
def workers(where: Topology, relay: str, log: Path, count: bool = False) -> Iterator[list[Child]]:
    """The worker processes, ready; stopped (stdin closed) and their logs written at the end
    (what they log, a relay's failures, beside it: ``*.stderr``); with ``count``, their
    write transactions logged too."""
    args = (["--async"] if relay == "async" else []) + (["--count"] if count else [])
    with log.with_suffix(".stderr").open("a") as errors:
        command = [sys.executable, str(WORKER), "worker", where.url]
        procs = [
            Child([*command, f"w{i}", str(log), *args], stderr=errors, env=where.env, cwd=where.cwd)
            for i in range(WORKERS)
        ]
        try:
            for proc in procs:
                if (line := proc.line()) != "ready":
                    raise RuntimeError(f"a worker did not start: {line!r}")
            yield procs
        finally:
            for proc in procs:
                proc.close()


def submit(
    where: Topology, prefix: str, log: Path, orders: int, concurrency: int, count: bool = False
) -> tuple[float, float]:
    """Run the submitter; the seconds its orders took, and its CPU seconds meanwhile."""
    options = ["--orders", str(orders), "--concurrency", str(concurrency)]
    options += ["--count"] if count else []
    if concurrency == 1:
        options += ["--gap", "0.01"]
    done = subprocess.run(
        [sys.executable, str(WORKER), "submit", where.url, prefix, str(log), *options],
        env=where.env,
        cwd=where.cwd,
        capture_output=True,
        text=True,
        timeout=1800,
        check=False,
    )
    if done.returncode:
        raise RuntimeError(f"the submitter failed:\n{done.stderr[-3000:]}")
    took, cpu = done.stdout.split()[-2:]
    return float(took), float(cpu)


def latency_figures(log: Path, figures: dict[str, float]) -> None:
    """End to end, hops and timers from one latency run's records."""
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
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
    late = [r[1] * 1e3 for r in records if r[0] == "late"]
    for label, values in (
        ("hop in the same process", hops[True]),
        ("hop to another process", hops[False]),
        ("timer lateness", late),
    ):
        if values:
            figures[f"{label} p50 ms"] = quantile(values, 0.5)
            figures[f"{label} p99 ms"] = quantile(values, 0.99)


def measure(name: str, relay: str, code: Path, plan: Plan, tmp: Path) -> dict[str, float]:
    figures: dict[str, float] = {}
    link = name == "link"
    latency_n = plan.link_latency if link else plan.latency
    throughput_n = plan.link_throughput if link else plan.throughput
    with topology(name, tmp, code) as where:
        lat_log, tp_log = tmp / "latency.jsonl", tmp / "throughput.jsonl"
        with workers(where, relay, lat_log):
            time.sleep(0.3)  # the workers' first look is done: they wait
            submit(where, "lat", lat_log, latency_n, 1)
            time.sleep(0.3)  # the last reminders fire
        latency_figures(lat_log, figures)
        on = where.served
        if link and on is not None:
            with contextlib.closing(client(on.link.url, on.srv.token)) as http:
                rtt = medians({"bare": (bare_request(http), 10)})["bare"]
            figures["round trip ms"] = rtt * 1e3
            figures["end to end p50 round trips"] = figures["end to end p50 ms"] / 1e3 / rtt
        count = name == "file" and code == ROOT  # this tree's insides only
        with workers(where, relay, tp_log, count) as procs:
            time.sleep(0.3)
            before = on.link.requests() if link and on else 0
            pid_of = {f"worker {i}": p.proc.pid for i, p in enumerate(procs)}
            if on is not None and on.srv.pid is not None:
                pid_of["sqld"] = on.srv.pid
            if link and on is not None:
                pid_of["link proxy"] = on.link.proc.pid
            with cpu_spent(pid_of) as cpu:
                took, submitter = submit(where, "tp", tp_log, throughput_n, plan.concurrency, count)
            figures["orders/s"] = throughput_n / took
            if link and on is not None:
                figures["requests an order"] = (on.link.requests() - before) / throughput_n
            cpu_figures({"submitter": submitter} | cpu, throughput_n, figures)
            time.sleep(1.5)  # the last reminders fire; then idle
            began = time.monotonic()
            with cpu_spent(pid_of) as idle:
                time.sleep(plan.idle_s)
            spent = time.monotonic() - began
            workers_cpu = sum(s for process, s in idle.items() if process.startswith("worker"))
            figures["idle CPU of the workers %"] = workers_cpu / spent * 100
            if "sqld" in idle:
                figures["idle CPU of sqld %"] = idle["sqld"] / spent * 100
        if count:
            transaction_figures(tp_log, throughput_n, figures)
    return figures


def cpu_figures(used: dict[str, float], orders: int, figures: dict[str, float]) -> None:
    """The CPU an order of each process of a throughput run (the submitter's while its
    orders ran; the workers', a server's and a link's from the submitter's start to its end,
    idle while it starts), and the orders/s of every core of the machine busy at that CPU an
    order: the ceiling of this run's CPU an order (with the machine's speed that day), under
    which waits or a lock keep the rate. Not a target: no verdict."""
    total = 0.0
    for name, seconds in used.items():
        figures[f"CPU an order: {name} ms"] = seconds / orders * 1e3
        total += seconds
    figures["ceiling, all cores / CPU an order: orders/s"] = (
        len(os.sched_getaffinity(0)) / (total / orders) if total else 0.0
    )


def transaction_figures(log: Path, orders: int, figures: dict[str, float]) -> None:
    """Write transactions an order on a file (the processes' own counts, this tree's code
    only: every transaction of the run, the workers' start and stop too), and the batches
    that landed in them by what each does (a transaction of a group carries several)."""
    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    if failed := [r[1] for r in records if r[0] == "tx-uncounted"]:
        raise RuntimeError(f"write transactions not counted: {failed[:3]}")
    carried = [r[1] for r in records if r[0] == "tx"]
    if not carried:
        raise RuntimeError("no write transaction counted: the hook of engine_worker is broken")
    figures["write transactions an order"] = len(carried) / orders
    kinds = Counter(kind for batches in carried for kind in batches)
    for kind, n in sorted(kinds.items(), key=lambda item: -item[1]):
        figures[f"batches an order: {kind}"] = n / orders


def report_run(report: Report, run: str, mine: dict[str, float], old: Any, against: str) -> None:
    """The figures of a run, and those of --against's code beside them."""
    report.section(run + (f"   (this tree | {against})" if old is not None else ""))
    for figure, value in mine.items():
        shown = f"{value:>9.2f}"
        before = old.get(figure) if old is not None else None
        if before is not None:
            shown += f" | {before:>9.2f}" + (f"  ({value / before:.2f}x)" if before else "")
        target = TARGETS.get(run, {}).get(figure, "")
        report.add(figure, shown, target, meets(value, target), this_tree=value, before=before)


def main() -> None:
    args = parser(__doc__, quick="fewer orders")
    args.add_argument("--against", metavar="REV", help="also run that revision's code")
    args.add_argument("--only", choices=[f"{t}/{r}" for t, r in RUNS], help="one run")
    ns = args.parse_args()
    plan = PLANS[mode(ns)]
    with (
        tempfile.TemporaryDirectory() as name,
        Report("engine", mode(ns), plan=asdict(plan), against=ns.against) as report,
    ):
        tmp = Path(name)
        codes = [("this tree", ROOT)]
        if ns.against:
            codes.append((ns.against, archive(ns.against, tmp / "against")))
        for where, relay in RUNS:
            run = f"{where}/{relay}"
            if ns.only and ns.only != run:
                continue
            figures: list[dict[str, float]] = []
            for label, code in codes:
                print(f"{run}: {label}", flush=True)
                at = tmp / f"{where}-{relay}-{len(figures)}"
                at.mkdir()
                figures.append(measure(where, relay, code, plan, at))
            report_run(report, run, figures[0], figures[1] if ns.against else None, ns.against)


if __name__ == "__main__":
    main()
