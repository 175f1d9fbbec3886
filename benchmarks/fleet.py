"""A fleet of databases (issue 39): what one process gets from several primaries, what an
operator's migration of many databases costs, what a listing across them costs, how many
roots a database that joins takes.

    python -m benchmarks.fleet             # full: 3 s runs, 100 databases migrated
    python -m benchmarks.fleet --quick     # 1.5 s runs
    python -m benchmarks.fleet --smoke     # that it works: tiny sizes

1. commits/s of one process (an `AsyncFleet`, 32 tasks per database, each committing to an
   execution of its own) over 1, 2 and 4 sqld primaries, each behind its own 20 ms link,
   with the process's CPU per commit beside it;
2. ``harel-store --fleet FILE migrate`` of 100 fresh files against 1, wall time;
3. a listing page (100 rows, by id and newest first) of a `Fleet` over 4 files against one
   store's page, the same rows in all: medians of interleaved calls;
4. the share of 10,000 roots that move when a fifth database joins four (rendezvous
   hashing: a fifth of them, ideally).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import ROOT, Report, medians, mode, parser, served
from harel_store import AsyncFleet, AsyncLibsqlStore, Execution, Fleet, LibsqlStore
from harel_store.fleet import rendezvous

PLANS = {  # run seconds, databases migrated, rows listed
    "smoke": (0.3, 4, 400),
    "quick": (1.5, 100, 4_000),
    "full": (3.0, 100, 20_000),
}
LINK_MS = 20.0
TASKS = 32


async def commits(urls: dict[str, str], seconds: float) -> tuple[float, float]:
    """Commits/s of 32 tasks per database for ``seconds``, and the CPU (ms) a commit (each
    run commits to executions of its own: the servers outlive it)."""
    async with AsyncFleet(urls) as fleet:
        exes = [
            (
                await fleet.store(name),
                Execution(id=f"{name}-{len(urls)}-{i}", definition_id="bench"),
            )
            for name in fleet.names
            for i in range(TASKS)
        ]
        for store, exe in exes:
            await store.commit(exe, [])
        done = 0
        ends = time.monotonic() + seconds

        async def one(store: AsyncLibsqlStore, exe: Execution) -> None:
            nonlocal done
            while time.monotonic() < ends:
                await store.commit(exe, [])
                done += 1

        cpu, start = time.process_time(), time.perf_counter()
        await asyncio.gather(*(one(store, exe) for store, exe in exes))
        took, cpu = time.perf_counter() - start, time.process_time() - cpu
    return done / took, cpu / max(done, 1) * 1000


def migrate(tmp: Path, n: int) -> float:
    """Seconds of ``harel-store --fleet FILE migrate --create`` over ``n`` fresh files."""
    where = tmp / f"migrate-{n}"
    where.mkdir()
    fleet = where / "fleet.txt"
    fleet.write_text("".join(f"db{i} {where / f'db{i}.db'}\n" for i in range(n)))
    cli = [sys.executable, "-m", "harel_store", "--fleet", str(fleet), "migrate", "--create"]
    start = time.perf_counter()
    subprocess.run(cli, check=True, capture_output=True, cwd=ROOT)
    return time.perf_counter() - start


def main() -> None:
    ns = parser(__doc__).parse_args()
    run = mode(ns)
    seconds, migrated, rows = PLANS[run]
    with (
        tempfile.TemporaryDirectory() as tmp_name,
        Report("fleet", run, link_ms=LINK_MS, tasks=TASKS) as report,
    ):
        tmp = Path(tmp_name)
        link = f"{LINK_MS:g} ms link"
        report.section(f"1. commits/s of one process, {TASKS} tasks a database, {link}")
        with contextlib.ExitStack() as stack:
            servers = [stack.enter_context(served(tmp / f"s{i}", LINK_MS)) for i in range(4)]
            urls = {
                f"db{i}": f"{on.link.url}?authToken={on.srv.token}" for i, on in enumerate(servers)
            }
            rates = {}
            for n in (1, 2, 4):
                some = dict(list(urls.items())[:n])
                rate, cpu = asyncio.run(commits(some, seconds))
                rates[n] = rate
                report.add(f"{n} primaries: commits/s", rate, unit="/s")
                report.add(f"{n} primaries: client CPU a commit", cpu, unit="ms")
            report.add("4 primaries / 1", rates[4] / rates[1], ">= 2.5", unit="x")
            report.add("2 primaries / 1", rates[2] / rates[1], unit="x")

        report.section("2. harel-store --fleet FILE migrate, wall time")
        one, many = migrate(tmp, 1), migrate(tmp, migrated)
        report.add("1 database", one, unit="s")
        report.add(f"{migrated} databases", many, unit="s")
        report.add(f"{migrated} databases / 1", many / one, "<= 15", unit="x")

        report.section(f"3. a page of 100 of {rows:,} rows: a fleet of 4 files / one store")
        dbs = {f"db{i}": str(tmp / f"list{i}.db") for i in range(4)}
        with Fleet(dbs) as fleet, LibsqlStore(tmp / "single.db") as single:
            for i in range(rows):
                exe = Execution(id=f"order-{i:06d}", definition_id="d")
                fleet.store_for(exe.id).save(exe)
                single.save(Execution(id=exe.id, definition_id="d"))
            for label, newest in (("by id", False), ("newest first", True)):
                pages = {
                    "fleet": functools.partial(
                        fleet.list_executions, limit=100, newest_first=newest
                    ),
                    "single": functools.partial(
                        single.list_executions, limit=100, newest_first=newest
                    ),
                }
                shown = [[s.id for s in page().items] for page in pages.values()]
                assert shown[0] == shown[1], "the fleet's page is not the store's"
                times = medians({name: (page, 50) for name, page in pages.items()})
                report.add(f"{label}: fleet page", times["fleet"] * 1000, unit="ms")
                report.add(f"{label}: one store's page", times["single"] * 1000, unit="ms")
                ratio = times["fleet"] / times["single"]
                report.add(f"{label}: fleet / one store", ratio, "<= 2", unit="x")

        report.section("4. roots moved when a fifth database joins four (10,000 ids)")
        four, five = [f"db{i}" for i in range(4)], [f"db{i}" for i in range(5)]
        ids = [f"order-{i}" for i in range(10_000)]
        moved = sum(rendezvous(four, i) != rendezvous(five, i) for i in ids) / len(ids)
        report.add("share moved", moved * 100, "15 to 25", met=0.15 <= moved <= 0.25, unit="%")


if __name__ == "__main__":
    main()
