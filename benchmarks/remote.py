"""What commits and reads cost against a libSQL server (sqld), remote and as an embedded
replica, on a link with a round-trip delay. Not a test: the figures depend on the machine.

    python -m benchmarks.remote                  # ~3 minutes
    python -m benchmarks.remote --quick          # fewer repetitions (~40 s)
    python -m benchmarks.remote --smoke          # every section once, tiny: that it works
    python -m benchmarks.remote --delay-ms 50    # another link (default: 20 ms a request)

It starts its own sqld (token auth on) and two proxies in front of it (``benchmarks.harness``):
the *link* proxy holds each request ``--delay-ms``, the *counting* proxy does not; both
count the requests. Replicas sync through a proxy too. Measured (a commit: the CAS update, one
emit, the dedupe marker, one timer and one trace step):

1. requests per operation (counting proxy), of the store remote and as a replica, and of a
   bare ``libsql`` connection (the driver the store used before) as the baseline;
2. latency on the link: each operation's median call, interleaved in rounds, as a ratio to one
   bare ``POST /v3/pipeline`` of ``SELECT 1``; a replica's commit and next read, and its
   opening, also as the store did them before (libsql's sync in this process);
3. group commit on the remote primary over the link: commits/s of 1, 8, 32 and 128 tasks of
   one ``AsyncLibsqlStore`` on executions of their own (a store sends one write request at a
   time, carrying every commit that waited for the one before; the commits a request
   shown), then a check that each execution's version, commits returned, markers and trace
   steps agree; commits/s of 1, 8 and 32 threads sharing one sync ``LibsqlStore``; reads/s
   of 32 tasks against 32 bare kept-alive connections (raw asyncio streams) in the same run;
4. event-loop lag (a task sleeping 1 ms in a loop: p99, max, against the same idle) during the
   runs of section 3, and during one task's commits to the primary directly, to a replica, to
   a local file (libsql) and through the twin's thread wrapper over ``SqliteStore`` (sqlite3);
   and while a replica syncs (a commit, then ``sync()``, in a loop) against what the store
   did before (libsql's sync in this process, on a worker thread);
   4b. the targeted ones again on a ``select()`` loop (epoll rounds a wait to milliseconds),
   and the replica's sync against before;
5. client CPU a request: a ``load`` at a time on loopback, the sync store and the async twin;
6. whether sqld wedges: 100k commits (``--quick``: 5k; ``--wedge N``) from 32 tasks of one
   store on loopback (a wedge shows as a write that times out).

Prints a table and writes JSON to ``benchmarks/results/remote-<timestamp>.json`` (not in a
smoke run). A store error ends the run, naming the section (a request times out after 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import selectors
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import libsql

from benchmarks.harness import (
    TIMEOUT,
    Proxy,
    Report,
    bare_request,
    client,
    medians,
    mode,
    parser,
    quantile,
    served,
    ticked,
)
from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    SqliteStore,
    StoreError,
    TimerOp,
)
from harel_store.connection.hrana import GROUP_MAX
from harel_store.sql import QUERIES
from harel_store.store import DEFAULT_TRACE_MAX, Store
from tests.sqld import SqldServer


@contextlib.contextmanager
def section(report: Report, title: str, srv: SqldServer) -> Iterator[None]:
    """Rows added within belong to `title`; an error ends the run, naming the section."""
    report.section(title)
    try:
        yield
    except Exception as exc:
        state = f"running (pid {srv.pid})" if srv.running else "not running"
        raise RuntimeError(f"section {title!r} failed (sqld is {state}): {exc!r}") from exc


def commit_args(eid: str, n: int) -> dict[str, Any]:
    """The arguments of an execution's commit n, after ``exe``."""
    return {
        "emits": [(None, Event(name="tick", id=f"{eid}-out-{n}"))],
        "processed_event_id": f"{eid}-in-{n}",
        "timers": [TimerOp.schedule("t", float(n))],
        "trace": {"n": n},
    }


def committer(store: Store, eid: str, read: bool = False) -> Callable[[], None]:
    """The store's commit on one execution; with `read`, the worker's next read too, which
    must see it (the dedupe marker)."""
    exe = store.load(eid) or Execution(id=eid, definition_id="bench")

    def commit() -> None:
        n = exe.version + 1
        store.commit(exe, **commit_args(eid, n))
        if read and not store.load_for_event(eid, f"{eid}-in-{n}")[1]:
            raise AssertionError(f"the read after commit {n} of {eid} did not see it")

    return commit


def bare(conn: Any, name: str, *params: Any) -> Any:
    """One statement of queries.sql on a bare libsql connection."""
    return conn.execute(QUERIES[name].sql, QUERIES[name].bind(params))


def bare_seen(conn: Any, eid: str, event_id: str) -> bool:
    data, _, seen = bare(conn, "load_for_event", eid, event_id).fetchone()
    return data is not None and bool(seen)


def bare_committer(conn: Any, eid: str, read: bool = False) -> Callable[[], None]:
    """`committer` on a bare libsql connection, a statement at a time, as the store did."""
    exe = Execution(id=eid, definition_id="bench")

    def commit() -> None:
        old = exe.version
        n = exe.version = old + 1
        data = exe.model_dump_json()
        summary = (exe.status, exe.outcome, exe.active_path, exe.parent_id, exe.finished_at)
        bare(conn, "begin")
        if old == 0:
            bare(conn, "insert_execution", eid, exe.definition_id, data, n, *summary)
        elif bare(conn, "update_execution", eid, data, n, old, *summary).rowcount != 1:
            raise AssertionError(f"the CAS of {eid} failed")
        event = Event(name="tick", id=f"{eid}-out-{n}").model_dump_json()
        bare(conn, "insert_outbox", None, eid, event)  # target, source, event
        bare(conn, "mark_processed", eid, f"{eid}-in-{n}")
        bare(conn, "schedule_timer", eid, "t", float(n))
        (idx,) = bare(conn, "append_trace", eid, json.dumps({"n": n})).fetchone()
        if idx >= DEFAULT_TRACE_MAX:
            bare(conn, "trim_trace", eid, DEFAULT_TRACE_MAX)
        conn.commit()
        if read and not bare_seen(conn, eid, f"{eid}-in-{n}"):
            raise AssertionError(f"the read after commit {n} of {eid} did not see it")

    return commit


def before_committer(remote: Store, replica: Any, eid: str) -> Callable[[], None]:
    """What the store's replica did before: the commit to the primary as one request, then
    libsql's sync in this process, then the read from the replica's file."""
    exe = remote.load(eid) or Execution(id=eid, definition_id="bench")

    def commit() -> None:
        n = exe.version + 1
        remote.commit(exe, **commit_args(eid, n))
        replica.sync()
        if not bare_seen(replica, eid, f"{eid}-in-{n}"):
            raise AssertionError(f"the read after commit {n} of {eid} did not see it")

    return commit


def reopen(path: Path, url: str, token: str) -> None:
    conn = libsql.connect(str(path), sync_url=url, auth_token=token)
    conn.sync()
    conn.close()


def spread(delays: list[float]) -> tuple[float, float]:
    """p99 and max, in ms."""
    return quantile(delays, 0.99) * 1e3, max(delays) * 1e3


async def idle_lag(report: Report, seconds: float) -> tuple[float, float]:
    """The ticker's delays on this loop with nothing else to do: p99 and max, in ms."""
    idle = spread(await ticked(asyncio.sleep(seconds)))
    report.add("idle", f"p99 {idle[0]:6.3f} ms, max {idle[1]:6.3f} ms", p99_ms=idle[0])
    return idle


def lag_rows(
    report: Report,
    idle: tuple[float, float],
    runs: dict[str, tuple[Run, int]],
    commits: bool = True,
) -> None:
    """Each run's lag against idle (a target: its p99 at most that many times idle's)."""
    for label, (run, most) in runs.items():
        p99, worst = spread(run.delays)
        shown = f"p99 {p99:6.3f} ms {p99 / idle[0]:4.1f}x, max {worst:6.3f} ms"
        extra: dict[str, Any] = {}
        if commits:
            extra["commit_ms"] = ms = run.tasks * run.seconds / run.commits * 1e3
            shown += f" {worst / idle[1]:4.1f}x; a commit {ms:.2f} ms"
        target = f"p99 <= {most}x idle" if most else ""
        report.add(label, shown, target, p99 <= most * idle[0], p99_ms=p99, max_ms=worst, **extra)


@dataclass
class Run:
    tasks: int
    returned: Counter[str]  # commits that returned, by execution (the first ones too)
    commits: int  # timed ones
    seconds: float
    cpu: float  # of this process, meanwhile
    slowest: float  # seconds of the slowest commit
    requests: int  # that the link counted, meanwhile
    delays: list[float]  # the ticker's


async def commit_run(
    store: AsyncLibsqlStore, prefix: str, tasks: int, seconds: float, link: Proxy | None = None
) -> Run:
    """`tasks` tasks, each committing to an execution of its own, one commit after another,
    for `seconds`, with the ticker on. A failed commit ends the run."""
    exes = [Execution(id=f"{prefix}-{i}", definition_id="bench") for i in range(tasks)]
    returned: Counter[str] = Counter()
    slowest = 0.0

    async def commit(exe: Execution) -> None:
        nonlocal slowest
        start = time.perf_counter()
        await store.commit(exe, **commit_args(exe.id, exe.version + 1))
        slowest = max(slowest, time.perf_counter() - start)
        returned[exe.id] += 1

    async def worker(exe: Execution) -> None:
        while time.perf_counter() < deadline:
            await commit(exe)

    await asyncio.gather(*(commit(exe) for exe in exes))  # warm: the rows, the connections
    first, slowest = returned.total(), 0.0
    before = await asyncio.to_thread(link.requests) if link else 0
    cpu, start = time.process_time(), time.perf_counter()
    deadline = start + seconds
    delays = await ticked(asyncio.gather(*(worker(exe) for exe in exes)))
    took, cpu = time.perf_counter() - start, time.process_time() - cpu
    requests = await asyncio.to_thread(link.requests) - before if link else 0
    return Run(tasks, returned, returned.total() - first, took, cpu, slowest, requests, delays)


@dataclass
class Plan:
    counts: int  # calls of each operation counted
    calls: int  # timed calls of each operation of section 2 (a fifth of the driver's commit)
    run_s: float  # seconds of each run of section 3 (half that of the other runs of section 4)
    cpu_calls: int  # loads timed in section 5
    wedge: int  # commits of section 6


PLANS = {
    "quick": Plan(counts=10, calls=40, run_s=1.5, cpu_calls=500, wedge=5_000),
    "full": Plan(counts=20, calls=120, run_s=4.0, cpu_calls=2_000, wedge=100_000),
    "smoke": Plan(counts=1, calls=5, run_s=0.4, cpu_calls=20, wedge=200),
}
BARE = "one bare request (POST /v3/pipeline, SELECT 1)"
MOST = {BARE: 1, "remote: commit": 1, "remote: load": 1, "remote: load_for_event": 1}
MOST |= {"replica: commit + next load_for_event": 3, "replica: load": 0}
BEFORE = "before (libsql's sync in this process): commit + next read"


def operations(
    stack: contextlib.ExitStack, url: str, tmp: Path, token: str, ids: str
) -> dict[str, Callable[[], object]]:
    """Each operation of sections 1 and 2 through the proxy at url, by label; the names of
    the executions and files they write start with `ids`."""
    remote = stack.enter_context(LibsqlStore(url, auth_token=token))
    rep = stack.enter_context(LibsqlStore(tmp / f"{ids}.db", sync_url=url, auth_token=token))
    conn = libsql.connect(url, auth_token=token)
    stack.callback(conn.close)
    conn_rep = libsql.connect(str(tmp / f"{ids}-bare.db"), sync_url=url, auth_token=token)
    stack.callback(conn_rep.close)
    conn_rep.sync()
    conn_before = libsql.connect(str(tmp / f"{ids}-before.db"), sync_url=url, auth_token=token)
    stack.callback(conn_before.close)
    conn_before.sync()
    http = stack.enter_context(contextlib.closing(client(url, token)))
    committer(remote, f"{ids}r")()  # the row the reads find
    return {
        BARE: bare_request(http),
        "remote: commit": committer(remote, f"{ids}r"),
        "remote: load": lambda: remote.load(f"{ids}r"),
        "remote: load_for_event": lambda: remote.load_for_event(f"{ids}r", "x"),
        "replica: commit + next load_for_event": committer(rep, f"{ids}p", read=True),
        "replica: load": lambda: rep.load(f"{ids}p"),
        "replica: sync() with nothing new": rep.sync,
        "replica: open + close": lambda: LibsqlStore(
            tmp / f"{ids}-open.db", sync_url=url, auth_token=token
        ).close(),
        BEFORE: before_committer(remote, conn_before, f"{ids}o"),
        "before: libsql replica open + sync + close": lambda: reopen(
            tmp / f"{ids}-before.db", url, token
        ),
        "libsql driver, remote: SELECT 1": lambda: conn.execute("SELECT 1").fetchall(),
        "libsql driver, remote: commit": bare_committer(conn, f"{ids}b"),
        "libsql driver, remote: load_for_event": lambda: bare_seen(conn, f"{ids}b", "x"),
        "libsql driver, replica: commit + next read": bare_committer(conn_rep, f"{ids}bp", True),
    }


def count_requests(report: Report, plan: Plan, count: Proxy, tmp: Path, token: str) -> None:
    with contextlib.ExitStack() as stack:
        for label, fn in operations(stack, count.url, tmp, token, "c").items():
            fn()  # warm: a first connection, a first sync
            before = count.requests()
            for _ in range(plan.counts):
                fn()
            n = (count.requests() - before) / plan.counts
            most = MOST.get(label)
            target = "" if most is None else f"<= {most}"
            report.add(label, f"{n:.1f}", target, most is not None and n <= most, requests=n)


def latency(report: Report, plan: Plan, link: Proxy, tmp: Path, token: str) -> None:
    with contextlib.ExitStack() as stack:
        fns = operations(stack, link.url, tmp, token, "l")
        timed = [
            BARE,
            "remote: commit",
            "remote: load_for_event",
            "replica: commit + next load_for_event",
            BEFORE,
        ]
        ops = {label: (fns[label], plan.calls) for label in timed}
        for slow in (
            "libsql driver, remote: commit",
            "replica: open + close",
            "before: libsql replica open + sync + close",
        ):
            ops[slow] = (fns[slow], plan.calls // 5)
        results = medians(ops)
    most = {"remote: commit": 1.2, "replica: commit + next load_for_event": 2.5}
    for label, seconds in results.items():
        ratio = seconds / results[BARE]
        target = f"<= {most[label]}x" if label in most else ""
        shown = f"{seconds * 1e3:7.2f} ms {ratio:6.2f}x"
        report.add(label, shown, target, ratio <= most.get(label, 0), ms=seconds * 1e3)


INTEGRITY = """
SELECT e.id, e.version,
    (SELECT COUNT(*) FROM harel_processed_events AS p WHERE p.execution_id = e.id),
    (SELECT COUNT(*) FROM harel_trace AS t WHERE t.execution_id = e.id)
FROM harel_executions AS e WHERE e.id LIKE 'tp%'
"""


async def bare_reads(url: str, token: str, connections: int, seconds: float) -> tuple[int, float]:
    """``connections`` kept-alive connections, each sending one bare ``SELECT 1`` pipeline
    after another for ``seconds`` on raw asyncio streams (the least a client can do):
    (requests answered, seconds)."""
    select = {"type": "execute", "stmt": {"sql": "SELECT 1", "want_rows": True}}
    body = json.dumps({"baton": None, "requests": [select, {"type": "close"}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    head = (
        f"POST /v3/pipeline HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    request = head.encode() + body
    done = 0

    async def one() -> None:
        nonlocal done
        reader, writer = await asyncio.open_connection(host, int(port))
        try:
            while time.perf_counter() < deadline:
                writer.write(request)
                lines = (await reader.readuntil(b"\r\n\r\n")).split(b"\r\n")
                if not lines[0].startswith(b"HTTP/1.1 200"):
                    raise RuntimeError(f"a bare read failed: {lines[0]!r}")
                length = next(
                    int(line.split(b":")[1])
                    for line in lines
                    if line.lower().startswith(b"content-length:")
                )
                await reader.readexactly(length)
                done += 1
        finally:
            writer.close()

    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(one() for _ in range(connections)))
    return done, time.perf_counter() - start


async def read_run(
    store: AsyncLibsqlStore, eid: str, tasks: int, seconds: float
) -> tuple[int, float]:
    """``tasks`` tasks each loading ``eid`` one after another for ``seconds``."""
    done = 0

    async def one() -> None:
        nonlocal done
        while time.perf_counter() < deadline:
            if await store.load(eid) is None:
                raise AssertionError(f"{eid} is gone")
            done += 1

    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(one() for _ in range(tasks)))
    return done, time.perf_counter() - start


def thread_run(
    url: str, token: str, prefix: str, threads: int, seconds: float
) -> tuple[int, float]:
    """``threads`` threads sharing one sync store, each committing to an execution of its
    own, one commit after another, for ``seconds``: (commits, seconds)."""
    with LibsqlStore(url, auth_token=token, timeout=TIMEOUT) as store:
        commits = [committer(store, f"{prefix}-{i}") for i in range(threads)]
        for commit in commits:
            commit()  # warm: the rows, the connections
        counts = [0] * threads
        errors: list[BaseException] = []

        def work(i: int) -> None:
            try:
                while time.perf_counter() < deadline:
                    commits[i]()
                    counts[i] += 1
            except BaseException as exc:
                errors.append(exc)

        start = time.perf_counter()
        deadline = start + seconds
        workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
        if errors:
            raise errors[0]
        return sum(counts), time.perf_counter() - start


def client_cpu(url: str, token: str, calls: int) -> tuple[float, float]:
    """Client CPU a ``load`` (one request), ms: the sync store and the async twin, one call
    after another on loopback (process time / calls)."""
    with LibsqlStore(url, auth_token=token, timeout=TIMEOUT) as store:
        store.save(Execution(id="cpu", definition_id="bench"))
        store.load("cpu")
        cpu = time.process_time()
        for _ in range(calls):
            store.load("cpu")
        sync_ms = (time.process_time() - cpu) / calls * 1e3

    async def main() -> float:
        async with await AsyncLibsqlStore.create(url, auth_token=token, timeout=TIMEOUT) as store:
            await store.load("cpu")
            cpu = time.process_time()
            for _ in range(calls):
                await store.load("cpu")
            return (time.process_time() - cpu) / calls * 1e3

    return sync_ms, asyncio.run(main())


async def wedge_run(url: str, token: str, commits: int, tasks: int) -> tuple[int, float]:
    """``commits`` commits from ``tasks`` tasks of one store, on loopback: a wedged sqld shows
    as a request timing out (a StoreError). (commits done, seconds)."""
    done = 0
    async with await AsyncLibsqlStore.create(url, auth_token=token, timeout=TIMEOUT) as store:

        async def one(i: int) -> None:
            nonlocal done
            exe = Execution(id=f"wedge-{i}", definition_id="bench")
            while done < commits:
                done += 1
                await store.commit(exe, **commit_args(exe.id, exe.version + 1))

        start = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(tasks)))
        return done, time.perf_counter() - start


async def open_retrying(
    report: Report, label: str, database: Path | str, options: dict[str, Any]
) -> AsyncLibsqlStore:
    """Open a store; a replica refused with "snapshot not found" (sqld 0.24.32 compacting its
    replication log as the replica asks for it) is opened again, up to 5 times a second
    apart, and the refusals are reported."""
    for attempt in range(6):
        try:
            store = await AsyncLibsqlStore.create(database, **options)
        except StoreError as exc:
            if "snapshot not found" not in str(exc) or attempt == 5:
                raise
            await asyncio.sleep(1.0)
            continue
        if attempt:
            report.add(f"{label}: opening refused (snapshot not found)", f"{attempt} times")
        return store
    raise AssertionError("unreachable")


async def async_part(report: Report, plan: Plan, srv: SqldServer, link: Proxy, tmp: Path) -> None:
    on_link = f"{link.delay_ms:g} ms link"
    runs: dict[str, Run] = {}
    with section(report, f"3. Group commit on the remote primary, {on_link}", srv):
        rates: dict[int, float] = {}
        for tasks in (1, 8, 32, 128):
            store = await AsyncLibsqlStore.create(link.url, auth_token=srv.token, timeout=TIMEOUT)
            async with store:
                run = await commit_run(store, f"tp{tasks}", tasks, plan.run_s, link)
            label = f"{tasks} task" + "s" * (tasks > 1)
            runs[f"remote, {on_link}, {label}"] = run
            rate = rates[tasks] = run.commits / run.seconds
            report.add(
                f"async commits/s, {label}",
                f"{rate:.1f}/s ({run.commits} commits in {run.requests} requests:"
                f" {run.commits / max(run.requests, 1):.1f} a request,"
                f" slowest {run.slowest * 1e3:.0f} ms, client CPU {run.cpu / run.seconds:.0%})",
                **{k: v for k, v in asdict(run).items() if k not in ("returned", "delays")},
            )
        ratio = rates[32] / rates[1]
        report.add(
            "32 tasks / 1 task",
            f"{ratio:.1f}x, {rates[32]:.0f}/s",
            ">= 15x and >= 600/s",
            ratio >= 15 and rates[32] >= 600,
            ratio=ratio,
        )
        returned = sum((r.returned for r in runs.values()), Counter[str]())
        want = {eid: (n, n, min(n, DEFAULT_TRACE_MAX)) for eid, n in returned.items()}
        found = {row[0]: tuple(row[1:]) for row in srv.rows(INTEGRITY)}
        bad = sorted(eid for eid in want.keys() | found.keys() if want.get(eid) != found.get(eid))
        shown = f"{len(bad)} of {len(want)} disagree" + (f": {', '.join(bad[:5])}" if bad else "")
        report.add("version = commits returned = markers = steps", shown, "0", not bad, bad=bad)
        threads: dict[int, float] = {}
        for count in (1, 8, 32):
            done, took = await asyncio.to_thread(
                thread_run, link.url, srv.token, f"th{count}", count, plan.run_s
            )
            threads[count] = done / took
            label = f"{count} thread" + "s" * (count > 1)
            report.add(f"sync commits/s, {label} sharing one store", f"{done / took:.1f}/s")
        ratio = threads[8] / threads[1]
        report.add("8 threads / 1 thread", f"{ratio:.1f}x", ">= 5x", ratio >= 5, ratio=ratio)
        store = await AsyncLibsqlStore.create(link.url, auth_token=srv.token, timeout=TIMEOUT)
        async with store:
            reads, took = await read_run(store, "tp1-0", 32, plan.run_s)
        bare, bare_took = await bare_reads(link.url, srv.token, 32, plan.run_s)
        ratio = reads / took / (bare / bare_took)
        report.add(
            "reads/s, 32 tasks / 32 bare keep-alive connections",
            f"{reads / took:.0f}/s / {bare / bare_took:.0f}/s = {ratio:.2f}",
            ">= 0.7",
            ratio >= 0.7,
            ratio=ratio,
        )

    with section(report, "4. Event-loop lag: a 1 ms ticker's delay, p99 and max / idle", srv):
        idle = await idle_lag(report, plan.run_s / 4)
        remote = {"auth_token": srv.token, "timeout": TIMEOUT}
        lag_stores: dict[str, tuple[Path | str, dict[str, Any] | None]] = {
            "remote, direct": (srv.url, remote),
            "replica, direct": (tmp / "lag-replica.db", {"sync_url": srv.url, **remote}),
            "file, libsql": (tmp / "lag-libsql.db", {}),
            "file, sqlite3 (the twin's thread wrapper)": (tmp / "lag-sqlite.db", None),
        }
        for n, (label, (database, options)) in enumerate(lag_stores.items()):
            if options is None:
                store = AsyncLibsqlStore(SqliteStore(database))
            else:
                store = await open_retrying(report, label, database, options)
            async with store:
                runs[label] = await commit_run(store, f"lag{n}", 1, plan.run_s / 2)
        runs |= await replica_syncing(report, srv, tmp, plan.run_s / 2)
        targets = {f"remote, {on_link}, 32 tasks": 3}
        targets |= {f"remote, {on_link}, 1 task": 2, "remote, direct": 2}
        lag_rows(report, idle, {label: (run, targets.get(label, 0)) for label, run in runs.items()})

    with section(report, "5. Client CPU a request (load), loopback sqld", srv):
        sync_ms, async_ms = await asyncio.to_thread(client_cpu, srv.url, srv.token, plan.cpu_calls)
        for label, ms in (("sync store", sync_ms), ("async twin", async_ms)):
            report.add(label, f"{ms:.3f} ms", "<= 0.4 ms", ms <= 0.4, ms=ms)


SYNCING = "replica, direct: commit, then sync()"


async def syncing(
    store: AsyncLibsqlStore,
    sync: Callable[[], Awaitable[None]],
    exe: Execution,
    until: float,
    done: Counter[str],
) -> None:
    while time.perf_counter() < until:
        await store.commit(exe, **commit_args(exe.id, exe.version + 1))
        await sync()
        done[exe.id] += 1


async def replica_syncing(
    report: Report, srv: SqldServer, tmp: Path, seconds: float
) -> dict[str, Run]:
    """Loop lag while a replica syncs: one task commits, then syncs, for `seconds`; and what
    the store did before: libsql's sync in this process, on a worker thread."""
    options: dict[str, Any] = {"auth_token": srv.token, "timeout": TIMEOUT}
    rep = await open_retrying(
        report, SYNCING, tmp / "sync-replica.db", {"sync_url": srv.url, **options}
    )
    remote = await AsyncLibsqlStore.create(srv.url, **options)
    conn = libsql.connect(str(tmp / "sync-before.db"), sync_url=srv.url, auth_token=srv.token)
    conn.sync()

    async def before() -> None:
        await asyncio.to_thread(conn.sync)

    runs: dict[str, Run] = {}
    try:
        for label, store, sync in (
            (SYNCING, rep, rep.sync),
            ("before: commit, then libsql's sync() on a thread", remote, before),
        ):
            exe = Execution(id=f"{tmp.name}-sync-{len(runs)}", definition_id="bench")
            start = time.perf_counter()
            done = Counter[str]()
            delays = await ticked(syncing(store, sync, exe, start + seconds, done))
            took = time.perf_counter() - start
            runs[label] = Run(1, done, done.total(), took, 0.0, 0.0, 0, delays)
    finally:
        conn.close()
        await remote.close()
        await rep.close()
    return runs


async def wedge_part(report: Report, plan: Plan, srv: SqldServer) -> None:
    if plan.wedge:
        with section(report, f"6. {plan.wedge} commits from 32 tasks of one store, loopback", srv):
            try:
                done, took = await wedge_run(srv.url, srv.token, plan.wedge, 32)
                shown, wedged = f"no: {done} commits in {took:.0f} s ({done / took:.0f}/s)", False
            except Exception as exc:  # a request timed out: the server stopped answering writes
                shown, wedged = f"yes: {exc!r}"[:200], True
            report.add("sqld wedged", shown, "never", not wedged)


async def select_lag(report: Report, plan: Plan, srv: SqldServer, link: Proxy, tmp: Path) -> None:
    """Section 4 again on an event loop over ``select()``: epoll waits in whole milliseconds,
    so on the default loop a wake-up for I/O in the middle of the ticker's 1 ms sleep
    rounds the rest of it up to a millisecond, which reads as lag; select() waits to the
    microsecond, so the ticker's delay there is the loop's own work."""
    title = "4b. Event-loop lag on a select() loop (timers to the microsecond), p99 / idle"
    with section(report, title, srv):
        idle = await idle_lag(report, plan.run_s / 4)
        runs: dict[str, tuple[Run, int]] = {}
        for tasks, most in ((1, 2), (32, 3)):
            store = await AsyncLibsqlStore.create(link.url, auth_token=srv.token, timeout=TIMEOUT)
            async with store:
                run = await commit_run(store, f"sel{tasks}", tasks, plan.run_s / 2)
            label = f"remote, {link.delay_ms:g} ms link, {tasks} task" + "s" * (tasks > 1)
            runs[label] = run, most
        tmp.mkdir()
        for label, run in (await replica_syncing(report, srv, tmp, plan.run_s / 2)).items():
            runs[label] = run, 3 if label == SYNCING else 0
        lag_rows(report, idle, runs, commits=False)


def main() -> None:
    args = parser(__doc__)
    args.add_argument("--delay-ms", type=float, default=20.0, help="the link's delay a request")
    args.add_argument("--wedge", type=int, metavar="N", help="commits of section 6 (0: skip)")
    ns = args.parse_args()
    plan = PLANS[mode(ns)]
    if ns.wedge is not None:
        plan = dataclasses.replace(plan, wedge=ns.wedge)
    meta = {"delay_ms": ns.delay_ms, "plan": asdict(plan), "group_max": GROUP_MAX}
    with (
        Report("remote", mode(ns), **meta) as report,
        tempfile.TemporaryDirectory() as name,
        served(Path(name), ns.delay_ms) as on,
    ):
        tmp, srv, link = Path(name), on.srv, on.link
        with section(report, "1. HTTP requests per operation (counting proxy, no delay)", srv):
            count_requests(report, plan, on.count, tmp, srv.token)
        title = f"2. Latency on the {ns.delay_ms:g} ms link, median / one bare request"
        with section(report, title, srv):
            latency(report, plan, link, tmp, srv.token)
        asyncio.run(async_part(report, plan, srv, link, tmp))
        select_loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        try:
            select_loop.run_until_complete(select_lag(report, plan, srv, link, tmp / "4b"))
        finally:
            select_loop.close()
        asyncio.run(wedge_part(report, plan, srv))


if __name__ == "__main__":
    main()
