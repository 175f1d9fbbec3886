"""What commits and reads cost against a libSQL server (sqld), remote and as an embedded
replica, on a link with a round-trip delay. Not a test: the figures depend on the machine.

    python -m benchmarks.remote                  # ~3 minutes
    python -m benchmarks.remote --quick          # fewer repetitions (~40 s)
    python -m benchmarks.remote --smoke          # every section once, tiny: that it works
    python -m benchmarks.remote --delay-ms 50    # another link (default: 20 ms a request)

It starts its own sqld (token auth) behind the harness's *link* proxy (each request held
``--delay-ms``) and *counting* proxy; replicas sync through them too. Measured (a commit: the
CAS update, one emit, the dedupe marker, one timer, one trace step):

1. requests per operation, of the store remote and as a replica, and of a bare ``libsql``
   connection (the driver the store used before); 1b. the statements the server runs a
   typical commit (one emit, the marker, one timer), of 1 task and of 32 tasks (grouped);
2. each operation's median latency on the link, as a ratio to one bare ``POST /v3/pipeline``
   of ``SELECT 1``; a replica's commit + next read, and its opening, also as before;
3. group commit over the link: commits/s (and commits a request) of 1, 8, 32 and 128 tasks of
   one ``AsyncLibsqlStore``, each on its own execution, then that every execution's version,
   commits returned, markers and trace steps agree; commits/s of 1, 8 and 32 threads sharing
   one ``LibsqlStore``; reads/s of 32 tasks against 32 bare keep-alive connections;
4. event-loop lag (a task sleeping 1 ms in a loop: p99, max, against idle) during section 3's
   runs, one task's commits to the primary, to a replica, to a local file (libsql) and through
   the twin's thread wrapper over ``SqliteStore``, and a replica's commit + ``sync()`` against
   before (libsql's sync on a thread); 4b. the targeted ones again on a ``select()`` loop;
5. client CPU a ``load`` on loopback, of the sync store and of the async twin;
6. whether sqld wedges: 100k commits (``--quick``: 5k; ``--wedge N``) from 32 tasks of one
   store on loopback (a wedge shows as a write that times out).

Prints a table and writes JSON to ``benchmarks/results/remote-<timestamp>.json`` (not in a
smoke run). A store error ends the run, naming the section (a request times out after 10 s).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import re
import selectors
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import libsql

from benchmarks.harness import (
    TIMEOUT,
    Proxy,
    Report,
    Served,
    bare_request,
    client,
    cpu_spent,
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
from harel_store.connection import hrana
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


def plural(n: int, word: str) -> str:
    return f"{n} {word}" + "s" * (n > 1)


def commit_args(exe: Execution) -> dict[str, Any]:
    """The arguments of the execution's next commit."""
    n = exe.version + 1
    return {
        "emits": [(None, Event(name="tick", id=f"{exe.id}-out-{n}"))],
        "processed_event_id": f"{exe.id}-in-{n}",
        "timers": [TimerOp.schedule("t", float(n))],
        "trace": {"n": n},
    }


def committer(
    store: Store, eid: str, seen: Callable[[str, str], bool] | None = None
) -> Callable[[], None]:
    """The store's commit on one execution; with `seen`, the next read, which must see it."""
    exe = store.load(eid) or Execution(id=eid, definition_id="bench")

    def commit() -> None:
        store.commit(exe, **commit_args(exe))
        if seen and not seen(eid, f"{eid}-in-{exe.version}"):
            raise AssertionError(f"the read after commit {exe.version} of {eid} did not see it")

    return commit


def bare(conn: Any, name: str, *params: Any) -> Any:
    """One statement of queries.sql on a bare libsql connection."""
    return conn.execute(QUERIES[name].sql, QUERIES[name].bind(params))


def bare_seen(conn: Any, eid: str, event_id: str, sync: bool = False) -> bool:
    """Whether a bare connection finds the marker (after libsql's sync, with `sync`)."""
    if sync:
        conn.sync()
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
        elif (changed := bare(conn, "update_execution", eid, data, n, old, *summary).rowcount) != 1:
            # Under a loaded machine the libsql driver was seen to report 0 rows for an update
            # that landed (a request sent again?): only a row not at the new version is a
            # failed CAS.
            found = bare(conn, "execution_version", eid).fetchall()
            if found != [(n,)]:
                raise AssertionError(f"the CAS of {eid} failed: {changed} rows, found {found}")
        event = Event(name="tick", id=f"{eid}-out-{n}").model_dump_json()
        # target .. context, flow key; its RETURNING row fetched: libsql 0.1.8's remote
        # connection left one unread silently loses the commit (its later COMMIT lands
        # nothing, every later CAS then fails)
        bare(conn, "insert_outbox", None, eid, event, None, "").fetchone()
        bare(conn, "mark_processed", eid, f"{eid}-in-{n}")
        bare(conn, "schedule_timer", eid, "t", float(n), None, eid)  # its flow key: the root
        (idx,) = bare(conn, "append_trace", eid, json.dumps({"n": n})).fetchone()
        if idx >= DEFAULT_TRACE_MAX:
            bare(conn, "trim_trace", eid, DEFAULT_TRACE_MAX)
        conn.commit()
        if read and not bare_seen(conn, eid, f"{eid}-in-{n}"):
            raise AssertionError(f"the read after commit {n} of {eid} did not see it")

    return commit


def bare_replica(path: Path, url: str, token: str) -> Any:
    """A libsql embedded replica's connection (as the store had before), synced."""
    conn = libsql.connect(str(path), sync_url=url, auth_token=token)
    conn.sync()
    return conn


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
    server_cpu: float = 0.0  # of sqld, meanwhile (a run on the link)
    link_cpu: float = 0.0  # of the link's proxy, meanwhile


async def in_tasks(
    tasks: int, step: Callable[[int], Awaitable[object]], seconds: float = 0.0, calls: int = 0
) -> tuple[int, float]:
    """Task i awaits step(i) again and again, for `seconds` (or until `calls` steps in all),
    beside the other tasks: (steps, seconds)."""
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        while (done < calls) if calls else (time.perf_counter() < deadline):
            done += 1
            await step(i)

    start = time.perf_counter()
    deadline = start + seconds
    await asyncio.gather(*(one(i) for i in range(tasks)))
    return done, time.perf_counter() - start


async def commit_run(
    store: AsyncLibsqlStore,
    prefix: str,
    tasks: int,
    seconds: float,
    sync: Callable[[], Awaitable[object]] | None = None,
    link: Proxy | None = None,
    server: int | None = None,
) -> Run:
    """`tasks` tasks, each committing to an execution of its own (then `sync`), one commit
    after another, for `seconds`, with the ticker on; with ``link``, the requests it counted
    and its CPU, and with ``server`` (sqld's pid), the server's CPU. A failed commit ends the
    run."""
    exes = [Execution(id=f"{prefix}-{i}", definition_id="bench") for i in range(tasks)]
    returned: Counter[str] = Counter()
    slowest = 0.0

    async def commit(i: int) -> None:
        nonlocal slowest
        start = time.perf_counter()
        await store.commit(exes[i], **commit_args(exes[i]))
        if sync:
            await sync()
        slowest = max(slowest, time.perf_counter() - start)
        returned[exes[i].id] += 1

    await asyncio.gather(*(commit(i) for i in range(tasks)))  # warm: the rows, the connections
    slowest = 0.0
    before = await asyncio.to_thread(link.requests) if link else 0
    pids = {"server": server, "link": link.proc.pid if link else None}
    with cpu_spent({name: pid for name, pid in pids.items() if pid is not None}) as used:
        cpu = time.process_time()
        timed = asyncio.ensure_future(in_tasks(tasks, commit, seconds))
        delays = await ticked(timed)
        (commits, took), cpu = timed.result(), time.process_time() - cpu
    requests = await asyncio.to_thread(link.requests) - before if link else 0
    run = Run(tasks, returned, commits, took, cpu, slowest, requests, delays)
    run.server_cpu, run.link_cpu = used.get("server", 0.0), used.get("link", 0.0)
    return run


@dataclass
class Plan:
    counts: int  # calls of each operation counted
    calls: int  # timed calls of each operation of section 2 (a fifth of the slow ones)
    run_s: float  # seconds of each run of section 3 (half that of the other runs of section 4)
    cpu_calls: int  # loads timed in section 5
    wedge: int  # commits of section 6


PLANS = {
    "quick": Plan(counts=10, calls=40, run_s=1.5, cpu_calls=500, wedge=5_000),
    "full": Plan(counts=20, calls=120, run_s=4.0, cpu_calls=2_000, wedge=100_000),
    "smoke": Plan(counts=1, calls=5, run_s=0.4, cpu_calls=20, wedge=200),
}
BARE = "one bare request (POST /v3/pipeline, SELECT 1)"
BEFORE = "before (libsql's sync in this process): commit + next read"
MOST = {BARE: 1, "remote: commit": 1, "remote: load": 1, "remote: load_for_event": 1}
MOST |= {"replica: commit + next load_for_event": 3, "replica: load": 0}
# the operations timed in section 2, and the share of plan.calls each gets
TIMED = {BARE: 1, "remote: commit": 1, "remote: load_for_event": 1}
TIMED |= {"replica: commit + next load_for_event": 1, BEFORE: 1}
TIMED |= {"libsql driver, remote: commit": 5, "replica: open + close": 5}
TIMED |= {"before: libsql replica open + sync + close": 5}
SYNCING = "replica, direct: commit, then sync()"
BEFORE_SYNC = "before: commit, then libsql's sync() on a thread"


def operations(
    stack: contextlib.ExitStack, url: str, tmp: Path, token: str, ids: str
) -> dict[str, Callable[[], object]]:
    """Each operation of sections 1 and 2 through the proxy at url, by label; the names of
    the executions and files they write start with `ids`."""
    replica: dict[str, Any] = {"sync_url": url, "auth_token": token}
    remote = stack.enter_context(LibsqlStore(url, auth_token=token))
    rep = stack.enter_context(LibsqlStore(tmp / f"{ids}.db", **replica))
    conn = libsql.connect(url, auth_token=token)
    conn_rep = bare_replica(tmp / f"{ids}-bare.db", url, token)
    before = bare_replica(tmp / f"{ids}-before.db", url, token)
    for closed in (conn, conn_rep, before):
        stack.callback(closed.close)
    http = stack.enter_context(contextlib.closing(client(url, token)))
    committer(remote, f"{ids}r")()  # the row the reads find
    return {
        BARE: bare_request(http),
        "remote: commit": committer(remote, f"{ids}r"),
        "remote: load": lambda: remote.load(f"{ids}r"),
        "remote: load_for_event": lambda: remote.load_for_event(f"{ids}r", "x"),
        "replica: commit + next load_for_event": committer(
            rep, f"{ids}p", lambda eid, event_id: rep.load_for_event(eid, event_id)[1]
        ),
        "replica: load": lambda: rep.load(f"{ids}p"),
        "replica: sync() with nothing new": rep.sync,
        "replica: open + close": lambda: LibsqlStore(tmp / f"{ids}-open.db", **replica).close(),
        BEFORE: committer(remote, f"{ids}o", functools.partial(bare_seen, before, sync=True)),
        "before: libsql replica open + sync + close": lambda: bare_replica(
            tmp / f"{ids}-before.db", url, token
        ).close(),
        "libsql driver, remote: SELECT 1": lambda: conn.execute("SELECT 1").fetchall(),
        "libsql driver, remote: commit": bare_committer(conn, f"{ids}b"),
        "libsql driver, remote: load_for_event": lambda: bare_seen(conn, f"{ids}b", "x"),
        "libsql driver, replica: commit + next read": bare_committer(conn_rep, f"{ids}bp", True),
    }


def operation_parts(report: Report, plan: Plan, on: Served, tmp: Path) -> None:
    """Sections 1 (requests, through the counting proxy) and 2 (latency, on the link)."""
    title = "1. HTTP requests per operation (counting proxy, no delay)"
    with section(report, title, on.srv), contextlib.ExitStack() as stack:
        for label, fn in operations(stack, on.count.url, tmp, on.srv.token, "c").items():
            fn()  # warm: a first connection, a first sync
            before = on.count.requests()
            for _ in range(plan.counts):
                fn()
            n = (on.count.requests() - before) / plan.counts
            most = MOST.get(label)
            target = "" if most is None else f"<= {most}"
            report.add(label, f"{n:.1f}", target, most is not None and n <= most, requests=n)
    title = f"2. Latency on the {on.link.delay_ms:g} ms link, median / one bare request"
    with section(report, title, on.srv):
        with contextlib.ExitStack() as stack:
            fns = operations(stack, on.link.url, tmp, on.srv.token, "l")
            results = medians({label: (fns[label], plan.calls // n) for label, n in TIMED.items()})
        limit = {"remote: commit": 1.2, "replica: commit + next load_for_event": 2.5}
        for label, seconds in results.items():
            ratio = seconds / results[BARE]
            target = f"<= {limit[label]}x" if label in limit else ""
            shown = f"{seconds * 1e3:7.2f} ms {ratio:6.2f}x"
            report.add(label, shown, target, ratio <= limit.get(label, 0), ms=seconds * 1e3)


@contextlib.contextmanager
def steps_counted() -> Iterator[Counter[str]]:
    """The statements the server ran for the write requests this process sent meanwhile
    ("steps"), and those requests' batches ("batches"): counted from each batch's result,
    where a step that ran has a result or an error and one its condition skipped has
    neither."""
    counted: Counter[str] = Counter()
    original = hrana.HranaConnection._settle

    def settle(self: Any, todo: Any, answer: Any, started: float, tries: int) -> Any:
        body = getattr(answer, "body", None)
        if body and todo and todo[0].wire.write:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                for result in json.loads(body)["results"]:
                    if result["type"] == "ok" and result["response"]["type"] == "batch":
                        ran = result["response"]["result"]
                        pairs = zip(ran["step_results"], ran["step_errors"], strict=True)
                        counted["steps"] += sum(r is not None or e is not None for r, e in pairs)
                        counted["batches"] += 1
        return (yield from original(self, todo, answer, started, tries))

    hrana.HranaConnection._settle = settle  # type: ignore[method-assign]
    try:
        yield counted
    finally:
        hrana.HranaConnection._settle = original  # type: ignore[method-assign]


STEPS_MOST = 6  # server steps a typical commit, in a group (issue "The server's pace")


async def steps_part(report: Report, plan: Plan, on: Served) -> None:
    """Section 1b: server steps a typical commit (one emit, the dedupe marker, one timer; no
    trace step), of 1 task (each commit a transaction of its own) and of 32 tasks (grouped),
    on the counting proxy."""
    with section(report, "1b. Server steps a typical commit (emit, marker, timer)", on.srv):
        for tasks in (1, 32):
            async with await AsyncLibsqlStore.create(
                on.count.url, auth_token=on.srv.token, timeout=TIMEOUT
            ) as store:
                exes = [Execution(id=f"st{tasks}-{i}", definition_id="bench") for i in range(tasks)]
                for exe in exes:
                    await store.save(exe)

                async def commit(exe: Execution) -> None:
                    args = commit_args(exe)
                    del args["trace"]
                    await store.commit(exe, **args)

                with steps_counted() as counted:
                    for _ in range(plan.counts):
                        await asyncio.gather(*(commit(exe) for exe in exes))
            commits = plan.counts * tasks
            steps = counted["steps"] / commits
            shown = f"{steps:.2f} ({counted['batches']} requests, {commits} commits)"
            grouped = tasks > 1  # the target is a group's member's
            target, met = (f"<= {STEPS_MOST}", steps <= STEPS_MOST) if grouped else ("", None)
            report.add(f"steps a commit, {plural(tasks, 'task')}", shown, target, met, steps=steps)


INTEGRITY = """
SELECT e.id, e.version,
    (SELECT COUNT(*) FROM harel_processed_events AS p WHERE p.execution_id = e.id),
    (SELECT COUNT(*) FROM harel_trace AS t WHERE t.execution_id = e.id)
FROM harel_executions AS e WHERE e.id LIKE 'tp%'
"""


async def bare_reads(url: str, token: str, connections: int, seconds: float) -> tuple[int, float]:
    """`connections` kept-alive connections, each sending one bare ``SELECT 1`` pipeline
    after another for `seconds` on raw asyncio streams (the least a client can do)."""
    select = {"type": "execute", "stmt": {"sql": "SELECT 1", "want_rows": True}}
    body = json.dumps({"baton": None, "requests": [select, {"type": "close"}]}).encode()
    host, port = url.removeprefix("http://").split(":")
    request = (
        f"POST /v3/pipeline HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}"
        f"\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    streams = await asyncio.gather(
        *(asyncio.open_connection(host, int(port)) for _ in range(connections))
    )

    async def read(i: int) -> None:
        reader, writer = streams[i]
        writer.write(request)
        answer = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", answer)
        if not answer.startswith(b"HTTP/1.1 200") or length is None:
            raise RuntimeError(f"a bare read failed: {answer.splitlines()[0]!r}")
        await reader.readexactly(int(length[1]))

    try:
        return await in_tasks(connections, read, seconds)
    finally:
        for _, writer in streams:
            writer.close()


def thread_run(
    url: str, token: str, prefix: str, threads: int, seconds: float
) -> tuple[int, float]:
    """`threads` threads sharing one sync store, each committing to an execution of its own,
    one commit after another, for `seconds`: (commits, seconds)."""
    with LibsqlStore(url, auth_token=token, timeout=TIMEOUT) as store:
        commits = [committer(store, f"{prefix}-{i}") for i in range(threads)]
        for commit in commits:
            commit()  # warm: the rows, the connections

        def work(commit: Callable[[], None]) -> int:
            done = 0
            while time.perf_counter() < deadline:
                commit()
                done += 1
            return done

        start = time.perf_counter()
        deadline = start + seconds
        with ThreadPoolExecutor(threads) as pool:
            done = sum(pool.map(work, commits))
        return done, time.perf_counter() - start


def client_cpu(url: str, token: str, calls: int) -> tuple[float, float]:
    """Client CPU a ``load`` (one request), ms, one call after another on loopback: the sync
    store, then the async twin (process time / calls)."""
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


async def open_retrying(
    report: Report, label: str, database: Path | str, **options: Any
) -> AsyncLibsqlStore:
    """Open a store; a replica refused with "snapshot not found" (sqld 0.24.32 compacting its
    log as the replica asks) is opened again, up to 5 times a second apart, and reported."""
    for attempt in range(6):
        try:
            store = await AsyncLibsqlStore.create(database, **options)
            break
        except StoreError as exc:
            if "snapshot not found" not in str(exc) or attempt == 5:
                raise
            await asyncio.sleep(1.0)
    if attempt:
        report.add(f"{label}: opening refused (snapshot not found)", f"{attempt} times")
    return store


def spread(delays: list[float]) -> tuple[float, float]:
    """p99 and max, in ms."""
    return quantile(delays, 0.99) * 1e3, max(delays) * 1e3


async def lag_part(
    report: Report, plan: Plan, on: Served, tmp: Path, runs: dict[str, Run] | None = None
) -> None:
    """Section 4, with section 3's `runs`; without, 4b, on a select() loop (epoll waits whole
    milliseconds: a wake-up for I/O within the ticker's sleep rounds the rest of it up, which
    reads as lag). A target: p99 at most that many times idle's."""
    srv = on.srv
    options: dict[str, Any] = {"auth_token": srv.token, "timeout": TIMEOUT}
    link = f"remote, {on.link.delay_ms:g} ms link"
    targets = {f"{link}, 1 task": 2, f"{link}, 32 tasks": 3}
    stores: dict[str, tuple[Path | str, dict[str, Any] | None, int]]  # database, options, tasks
    commits = runs is not None  # section 4: the time of a commit too
    if commits:
        title = "4. Event-loop lag: a 1 ms ticker's delay, p99 and max / idle"
        stores = {
            "remote, direct": (srv.url, options, 1),
            "replica, direct": (tmp / "lag-replica.db", {"sync_url": srv.url, **options}, 1),
            "file, libsql": (tmp / "lag-libsql.db", {}, 1),
            "file, sqlite3 (the twin's thread wrapper)": (tmp / "lag-sqlite.db", None, 1),
        }
        targets["remote, direct"] = 2
    else:
        title = "4b. Event-loop lag on a select() loop (timers to the microsecond), p99 / idle"
        stores = {f"{link}, {plural(n, 'task')}": (on.link.url, options, n) for n in (1, 32)}
        targets[SYNCING] = 3
        tmp.mkdir()
    runs, seconds = {} if runs is None else runs, plan.run_s / 2
    with section(report, title, srv):
        idle = spread(await ticked(asyncio.sleep(plan.run_s / 4)))
        report.add("idle", f"p99 {idle[0]:6.3f} ms, max {idle[1]:6.3f} ms", p99_ms=idle[0])
        for n, (label, (database, opts, tasks)) in enumerate(stores.items()):
            if opts is None:
                store = AsyncLibsqlStore(SqliteStore(database))
            else:
                store = await open_retrying(report, label, database, **opts)
            async with store:
                runs[label] = await commit_run(store, f"{tmp.name}-lag{n}", tasks, seconds)
        # while a replica syncs: a commit, then sync(); before: libsql's sync on a thread
        path = tmp / "sync-replica.db"
        replica = await open_retrying(report, SYNCING, path, sync_url=srv.url, **options)
        remote = await AsyncLibsqlStore.create(srv.url, **options)
        conn = bare_replica(tmp / "sync-before.db", srv.url, srv.token)
        before = functools.partial(asyncio.to_thread, conn.sync)
        async with replica, remote:
            try:
                prefix = f"{tmp.name}-sync"
                runs[SYNCING] = await commit_run(replica, f"{prefix}0", 1, seconds, replica.sync)
                runs[BEFORE_SYNC] = await commit_run(remote, f"{prefix}1", 1, seconds, before)
            finally:
                conn.close()
        for label, run in runs.items():
            p99, worst = spread(run.delays)
            shown = f"p99 {p99:6.3f} ms {p99 / idle[0]:4.1f}x, max {worst:6.3f} ms"
            extra: dict[str, Any] = {}
            if commits:
                extra["commit_ms"] = ms = run.tasks * run.seconds / run.commits * 1e3
                shown += f" {worst / idle[1]:4.1f}x; a commit {ms:.2f} ms"
            most = targets.get(label, 0)
            target = f"p99 <= {most}x idle" if most else ""
            met = p99 <= most * idle[0]
            report.add(label, shown, target, met, p99_ms=p99, max_ms=worst, **extra)


# Issue 51's ("The server's pace") commits/s of 32 and 128 tasks on the 20 ms link.
RATE_TARGETS = {32: 1_400, 128: 3_000}


async def ceilings(report: Report, runs: dict[str, Run], on: Served) -> None:
    """Ceilings of this run beside issue 51's rates (no verdict: a ceiling is not a target),
    to say where a rate's time goes:

    - latency: tasks that each wait for their commit make at most one commit a task a
      round trip (Little's law): N / the fastest of 20 bare requests through the link; and,
      an estimate, N x the rate of one task (if a commit carried with others took as long
      as a lone one);
    - CPU: every core busy at what sqld, the client (this process: the store, and the
      benchmark's 1 ms ticker) and the link's proxy spent a commit in the run of N tasks;
      and sqld's CPU alone. These move with the machine's speed on the day and with the
      store's own CPU a commit: not what the machine can ever do."""

    def fastest(http: Any, calls: int) -> float:
        request, times = bare_request(http), []
        request()  # the connection
        for _ in range(calls):
            start = time.perf_counter()
            request()
            times.append(time.perf_counter() - start)
        return min(times)

    with contextlib.closing(client(on.link.url, on.srv.token)) as http:
        rtt = await asyncio.to_thread(fastest, http, 20)
    cores = len(os.sched_getaffinity(0))
    by_tasks = {run.tasks: run for run in runs.values()}  # section 3's: each on the link
    lone = by_tasks[1].commits / by_tasks[1].seconds
    for tasks, target in RATE_TARGETS.items():
        run, goal = by_tasks[tasks], f"issue 51: {target:,}/s"
        server, client_, link = (
            cpu / run.commits for cpu in (run.server_cpu, run.cpu, run.link_cpu)
        )
        cpu = f"sqld {server * 1e3:.2f} + client {client_ * 1e3:.2f} + link {link * 1e3:.2f} ms"
        rows = {
            f"ceiling, {tasks} tasks / the fastest bare round trip ({rtt * 1e3:.1f} ms)": (
                tasks / rtt
            ),
            f"estimate, {tasks} x the rate of 1 task": tasks * lone,
            f"ceiling, {cores} cores / CPU a commit at {tasks} tasks ({cpu})": (
                cores / (server + client_ + link) if server else None
            ),
            f"ceiling, {cores} cores / sqld's CPU a commit alone at {tasks} tasks": (
                cores / server if server else None
            ),
        }
        for label, ceiling in rows.items():
            # None: sqld's CPU not measured (under a clock tick in a tiny run, or no pid)
            shown = "n/a (sqld's CPU not measured)" if ceiling is None else f"{ceiling:,.0f}/s"
            report.add(label, shown, goal, None, ceiling=ceiling)


async def async_part(report: Report, plan: Plan, on: Served, tmp: Path) -> None:
    """Sections 3, 4 and 5."""
    srv, link, on_link = on.srv, on.link, f"{on.link.delay_ms:g} ms link"
    options: dict[str, Any] = {"auth_token": srv.token, "timeout": TIMEOUT}
    runs: dict[str, Run] = {}
    with section(report, f"3. Group commit on the remote primary, {on_link}", srv):
        for tasks in (1, 8, 32, 128):
            async with await AsyncLibsqlStore.create(link.url, **options) as store:
                run = await commit_run(
                    store, f"tp{tasks}", tasks, plan.run_s, link=link, server=srv.pid
                )
            runs[f"remote, {on_link}, {plural(tasks, 'task')}"] = run
            report.add(
                f"async commits/s, {plural(tasks, 'task')}",
                f"{run.commits / run.seconds:.1f}/s ({run.commits} commits in {run.requests}"
                f" requests: {run.commits / max(run.requests, 1):.1f} a request,"
                f" slowest {run.slowest * 1e3:.0f} ms, client CPU {run.cpu / run.seconds:.0%})",
                **{k: v for k, v in asdict(run).items() if k not in ("returned", "delays")},
            )
        rates = {run.tasks: run.commits / run.seconds for run in runs.values()}
        ratio, met = rates[32] / rates[1], rates[32] / rates[1] >= 15 and rates[32] >= 600
        shown = f"{ratio:.1f}x, {rates[32]:.0f}/s"
        report.add("32 tasks / 1 task", shown, ">= 15x and >= 600/s", met, ratio=ratio)
        await ceilings(report, runs, on)
        returned = sum((r.returned for r in runs.values()), Counter[str]())
        want = {eid: (n, n, min(n, DEFAULT_TRACE_MAX)) for eid, n in returned.items()}
        found = {row[0]: tuple(row[1:]) for row in srv.rows(INTEGRITY)}
        bad = sorted(eid for eid in want.keys() | found.keys() if want.get(eid) != found.get(eid))
        shown = f"{len(bad)} of {len(want)} disagree" + (f": {', '.join(bad[:5])}" if bad else "")
        report.add("version = commits returned = markers = steps", shown, "0", not bad, bad=bad)
        threads: dict[int, float] = {}
        for n in (1, 8, 32):
            args = (link.url, srv.token, f"th{n}", n, plan.run_s)
            done, took = await asyncio.to_thread(thread_run, *args)
            threads[n] = done / took
            label = f"sync commits/s, {plural(n, 'thread')} sharing one store"
            report.add(label, f"{done / took:.1f}/s")
        ratio = threads[8] / threads[1]
        report.add("8 threads / 1 thread", f"{ratio:.1f}x", ">= 5x", ratio >= 5, ratio=ratio)
        async with await AsyncLibsqlStore.create(link.url, **options) as store:

            async def load(_: int) -> None:
                if await store.load("tp1-0") is None:
                    raise AssertionError("tp1-0 is gone")

            reads, took = await in_tasks(32, load, plan.run_s)
        bare, bare_took = await bare_reads(link.url, srv.token, 32, plan.run_s)
        ratio = reads / took / (bare / bare_took)
        shown = f"{reads / took:.0f}/s / {bare / bare_took:.0f}/s = {ratio:.2f}"
        label = "reads/s, 32 tasks / 32 bare keep-alive connections"
        report.add(label, shown, ">= 0.7", ratio >= 0.7, ratio=ratio)

    await lag_part(report, plan, on, tmp, runs)

    with section(report, "5. Client CPU a request (load), loopback sqld", srv):
        sync_ms, async_ms = await asyncio.to_thread(client_cpu, srv.url, srv.token, plan.cpu_calls)
        for label, ms in (("sync store", sync_ms), ("async twin", async_ms)):
            report.add(label, f"{ms:.3f} ms", "<= 0.4 ms", ms <= 0.4, ms=ms)


async def wedge_part(report: Report, plan: Plan, srv: SqldServer) -> None:
    """Section 6: a wedged sqld shows as a request timing out (a StoreError)."""
    if not plan.wedge:
        return
    with section(report, f"6. {plan.wedge} commits from 32 tasks of one store, loopback", srv):
        exes = [Execution(id=f"wedge-{i}", definition_id="bench") for i in range(32)]
        try:
            async with await AsyncLibsqlStore.create(
                srv.url, auth_token=srv.token, timeout=TIMEOUT
            ) as store:

                async def commit(i: int) -> None:
                    await store.commit(exes[i], **commit_args(exes[i]))

                done, took = await in_tasks(32, commit, calls=plan.wedge)
            shown, wedged = f"no: {done} commits in {took:.0f} s ({done / took:.0f}/s)", False
        except Exception as exc:  # a request timed out: the server stopped answering writes
            shown, wedged = f"yes: {exc!r}"[:200], True
        report.add("sqld wedged", shown, "never", not wedged)


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
        operation_parts(report, plan, on, Path(name))
        asyncio.run(steps_part(report, plan, on))
        asyncio.run(async_part(report, plan, on, Path(name)))
        select_loop = asyncio.SelectorEventLoop(selectors.SelectSelector())
        try:
            select_loop.run_until_complete(lag_part(report, plan, on, Path(name) / "4b"))
        finally:
            select_loop.close()
        asyncio.run(wedge_part(report, plan, on.srv))


if __name__ == "__main__":
    main()
