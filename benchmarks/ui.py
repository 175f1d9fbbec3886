"""The console (`harel_store.ui`): what its pages cost the server as the database grows, what
open live pages cost a database while nothing changes, how soon they hear another process's
commit, and that the commit path pays nothing for the ``ui`` extra. Not a test: the figures
depend on the machine; the ratios, each against a baseline measured in the same run, carry.

    python -m benchmarks.ui            # full: 1,000 and 1,000,000 executions, 30 s idle,
                                       #   and benchmarks.instructions (~7 minutes on 2 cores)
    python -m benchmarks.ui --smoke    # that it works: 1,000 and 5,000, 2 s idle (~8 s)

Server time is the time inside the ASGI application: each page is requested through
``httpx.ASGITransport`` (the console in this process, as ``harel-store ui`` builds it: from
the database's path, a checked and never migrated store whose calls run in worker threads),
timed by a wrapper from the call of the application to the last chunk of the body it sends:
what a server adds (HTTP parsing, the socket) and the client are not in it. The live streams
need a real server (the transport waits for a response's end): uvicorn in a thread of this
process, the pages' clients on this thread's event loop.

1. Server time of ``/executions`` (the first page, and the page its "Next" link leads to), of
   one execution's page (20 trace steps, 5 children, 3 outbox entries to it, 2 pending
   spawns, 2 timers) and of ``/`` (no target: its counts read every row), over a file of
   1,000 executions and one of 1,000,000 (smoke: 5,000), each with a few trace steps, a
   timer for a tenth of them and some pending and dead items; the two consoles' requests
   interleaved. Median and p95 of each page, and the big file's median over the small's.
   The files are built with the stdlib's sqlite3 in a helper process (the schema made by the
   store, then rows by SQL and items by the store), closed before this process opens them.
2. ``/`` over a fleet of 4 such files (as ``harel-store --fleet FILE ui`` serves it), and
   ``/dead`` and ``/timers`` beside it: median server time.
3. Ten pages of the console on the small file (two each of ``/``, ``/executions``, the
   execution's page, ``/dead`` and ``/timers``), each with its ``/live`` stream open and
   fetching itself again on each ``change`` event as the page's script does. The database
   requests counted: the console's (``Databases.call``, ``Databases.list_executions``), the
   store connections' (``LocalConnection.execute``: a read or a write; the statements under
   it, ``LibsqlConnection._execute``) and the wake-up watch's (``PRAGMA data_version``), each
   wrapped in this process by a counting function that calls it. First one page opened
   alone (the console's first listener starts the watch); then the ten pages, and N seconds
   of nothing changing after a second's settling: requests, change events and the bytes of
   the streams' bodies. Then commits by another process (a helper that loaded the execution
   beforehand), one a second: from ``commit()`` returning there (CLOCK_MONOTONIC, shared by
   the processes) until every stream has its ``change`` event, and until every page has
   fetched itself again.
4. The commit path with the extra installed and no console: in a fresh interpreter, none of
   ``harel_store.ui``, Starlette, Jinja2 and uvicorn is imported by ``import harel_store``,
   by commits to a file, or by building the CLI's parser; the command of
   `benchmarks.instructions` against the revision before the console (the parent of the
   commit that added ``harel_store/ui``), run in the full run when valgrind is here.

Prints a table and writes JSON to ``benchmarks/results/ui-<timestamp>.json`` (not in a smoke
run).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import importlib.util
import json
import logging
import re
import shutil
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import httpx

from benchmarks.harness import ROOT, Child, Report, module, parser, quantile
from harel_store import Event, Execution, Fleet, LibsqlStore, SqliteStore, TimerOp

BASE = "http://127.0.0.1"
FEATURED = "order-featured"  # the execution whose page is measured
STEPS = 20  # its trace steps
CHILDREN = 5
TO_IT = 3  # outbox entries to it
BULK_STEPS = 3  # trace steps of every other execution
PAGES = 10  # live pages open at once
SETTLE = 1.0  # seconds after the pages open before the idle window starts
WATCHED = ("harel_store.ui", "starlette", "jinja2", "uvicorn")  # not imported by a commit


@dataclass(frozen=True)
class Plan:
    sizes: tuple[int, int]  # executions in the small and the big file
    samples: int  # requests of each page at each size
    fleet_rows: int  # executions in each of the fleet's 4 files
    idle: float  # seconds of nothing changing with the live pages open
    commits: int  # commits by another process
    instructions: bool  # run benchmarks.instructions (if valgrind is here)


PLANS = {
    "smoke": Plan((1_000, 5_000), 10, 500, 2.0, 2, False),
    "full": Plan((1_000, 1_000_000), 200, 10_000, 30.0, 5, True),
}


# --- the databases (built in a helper process: stdlib sqlite3, then SqliteStore) ---

EXECUTIONS = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :n),
rows AS (
  SELECT n, printf('exe-%08d', n) AS id, 'def-' || (n % 4) AS def,
         CASE (n / 4) % 10 WHEN 8 THEN 'failed' WHEN 9 THEN 'cancelled'
              ELSE CASE WHEN (n / 4) % 10 < 4 THEN 'running' ELSE 'finished' END END AS st,
         CASE WHEN (n / 40) % 2 = 0 THEN NULL ELSE printf('exe-%08d', n - 40) END AS parent,
         -- update times spread over the ids, one a second, all before the items' commits
         :t0 + (n * 7919) % :n AS at
  FROM seq)
INSERT INTO harel_executions
    (id, definition_id, data, version, status, outcome, active_path, parent_id, finished_at,
     created_at, updated_at)
SELECT id, def,
       json_object('id', id, 'definition_id', def, 'version', 3, 'status', st,
                   'outcome', iif(st = 'running', NULL, 'done'), 'active_path', 'main.wait',
                   'parent_id', parent, 'finished_at', iif(st = 'running', NULL, at),
                   'context', json_object('order', n, 'customer', 'c-' || (n % 977),
                                          'items', json_array(1, 2, 3), 'note', 'typical')),
       3, st, iif(st = 'running', NULL, 'done'), 'main.wait', parent,
       iif(st = 'running', NULL, at), at - 60.0, at
FROM rows
"""
TRACE = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM seq WHERE n + 1 < :n * :steps)
INSERT INTO harel_trace (execution_id, idx, entry, recorded_at)
SELECT printf('exe-%08d', n / :steps), n % :steps,
       json_object('event', 'tick', 'transition', 'main.wait -> main.wait'),
       :t0 + n / :steps + (n % :steps) * 0.5
FROM seq
"""
TIMERS = """
WITH RECURSIVE seq(n) AS (SELECT 0 UNION ALL SELECT n + 10 FROM seq WHERE n + 10 < :n)
INSERT INTO harel_timers (execution_id, path, fire_at)
SELECT printf('exe-%08d', n), 'main.wait', :now + 3600.0 + n FROM seq
"""


def build(path: Path, n: int) -> None:
    """``n`` executions (a tenth of them with a timer, each with `BULK_STEPS` trace steps),
    then items committed by the store (outbox entries, spawns, timers, dead letters) and the
    featured execution."""
    logging.getLogger("harel_store").setLevel(logging.ERROR)  # the dead letters made: no news
    SqliteStore(path).close()  # the schema at head, made by the store
    now = time.time()
    with contextlib.closing(sqlite3.connect(path, isolation_level=None)) as conn:
        conn.execute("PRAGMA synchronous = OFF")
        conn.execute("PRAGMA cache_size = -500000")  # 500 MB: the index inserts in memory
        conn.execute("BEGIN")
        params = {"n": n, "t0": now - n - 3600.0, "now": now, "steps": BULK_STEPS}
        for sql in (EXECUTIONS, TRACE, TIMERS):
            conn.execute(sql, params)
        conn.execute("COMMIT")
    with SqliteStore(path, synchronous="OFF") as store:
        items(store, n, now)
        featured(store, now)


def items(store: SqliteStore, n: int, now: float) -> None:
    """40 sources, each emitting two events to executions of the file; a spawn from every
    fourth, a timer from each (every fifth overdue); 4 entries made dead letters (one
    attempt, failed), 4 more held by a worker."""
    for i in range(40):
        source = Execution(id=f"src-{i:03d}", definition_id="order")
        emits = [(f"exe-{(i * 7919 + k) % n:08d}", Event(name=f"e{k}")) for k in range(2)]
        spawns = [(f"src-{i:03d}.child", "main", {"i": i})] if i % 4 == 0 else []
        at = now - 60.0 + i if i % 5 == 0 else now + 3600.0 + i
        store.commit(source, emits, spawns=spawns, timers=[TimerOp.schedule("main.wait", at)])
    claimed = store.claim_outbox("bench", limit=4, max_attempts=1)
    store.fail("bench", claimed, error="handler raised: boom")
    store.claim_outbox("bench", limit=4, max_attempts=1)  # those 4 die, 4 more are held


def featured(store: SqliteStore, now: float) -> None:
    """`FEATURED`: `STEPS` commits with a trace step (2 spawns and 2 timers among them), its
    `CHILDREN` children, `TO_IT` of them emitting an event to it."""
    context = {"order": 42, "customer": "c-7", "items": [1, 2, 3], "note": "featured"}
    exe = Execution(id=FEATURED, definition_id="order", active_path="main.s0", context=context)
    store.commit(exe, [], trace={"event": "start", "transition": "-> main.s0"})
    for i in range(1, STEPS):
        spawns = [(f"{FEATURED}.s{i}", "main", {"i": i})] if i in (5, 10) else []
        at = now - 30.0 if i == 7 else now + 600.0 * i
        timers = [TimerOp.schedule(f"main.t{i}", at)] if i in (7, 12) else []
        exe.active_path = f"main.s{i}"
        step = {"event": f"e{i}", "transition": f"main.s{i - 1} -> main.s{i}", "data": {"i": i}}
        store.commit(exe, [], f"ev-{i}", timers=timers, spawns=spawns, trace=step)
    for c in range(CHILDREN):
        child = Execution(id=f"{FEATURED}.c{c}", definition_id="item", parent_id=FEATURED)
        emits = [(FEATURED, Event(name="done", payload={"c": c}))] if c < TO_IT else []
        store.commit(child, emits)


def built(path: Path, n: int) -> float:
    """`build` in a helper process; its seconds."""
    path.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    subprocess.run(module("ui", "--build", str(path), str(n)), cwd=ROOT, check=True)
    return time.perf_counter() - start


def committer(path: Path) -> None:
    """The helper that commits from another process: loads `FEATURED`, says "ready", then for
    each line read commits a trace step to it and prints the monotonic times around the
    commit."""
    with LibsqlStore(path) as store:
        exe = store.load(FEATURED)
        assert exe is not None
        print("ready", flush=True)
        for i, _ in enumerate(sys.stdin):
            start = time.monotonic()
            store.commit(exe, [], trace={"event": f"poke{i}", "transition": "main.poke"})
            print(f"{start} {time.monotonic()}", flush=True)


# --- the console in this process ---


class Timed:
    """An ASGI application's server time: from its call to the last chunk of its body."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.last = 0.0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()

        async def timed(message: Any) -> None:
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                self.last = time.perf_counter() - start

        await self.app(scope, receive, timed)


@contextlib.asynccontextmanager
async def lifespan(app: Any) -> AsyncIterator[None]:
    """The application's lifespan, started and then shut down (the transport sends none)."""
    inbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
    task = asyncio.create_task(app(scope, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        await task


class Console:
    """The console over ``source``, called in this process; `get` is a page and its server
    time."""

    def __init__(self, source: Any) -> None:
        from harel_store.ui import app

        self.timed = Timed(app(source))
        transport = httpx.ASGITransport(app=self.timed)
        self.client = httpx.AsyncClient(transport=transport, base_url=BASE)

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[Console]:
        async with lifespan(self.timed), self.client:
            yield self

    async def get(self, url: str) -> tuple[float, str]:
        response = await self.client.get(url)
        assert response.status_code == 200, (url, response.status_code, response.text[:300])
        return self.timed.last, response.text


def next_link(page: str) -> str:
    found = re.search(r'<a class="next" href="([^"]+)">Next</a>', page)
    assert found, "no Next link on the listing"
    return html.unescape(found.group(1))


def check_execution_page(page: str) -> None:
    """The featured execution's page shows what it holds."""
    assert page.count('<g class="step">') == STEPS, page.count('<g class="step">')
    children = re.findall(rf'href="/executions/{FEATURED}\.c\d"', page)
    assert len(set(children)) == CHILDREN, children
    assert page.count('class="event-name">done<') == TO_IT
    assert page.count(f"<td>{FEATURED}.s") == 2 and "overdue" in page


async def sample(
    pages: dict[str, tuple[Console, str]], samples: int, rounds: int = 10
) -> dict[str, list[float]]:
    """``samples`` server times of each page, the pages taking turns in rounds (in reverse
    order every other round), after two warm requests each."""
    times: dict[str, list[float]] = {label: [] for label in pages}
    for console, url in pages.values():
        for _ in range(2):
            await console.get(url)
    per_round = max(1, samples // rounds)
    for r in range(rounds):
        for label in list(pages)[:: 1 if r % 2 == 0 else -1]:
            console, url = pages[label]
            for _ in range(per_round):
                times[label].append((await console.get(url))[0])
    return times


def ms(seconds: float) -> float:
    return seconds * 1000.0


async def bench_pages(report: Report, paths: dict[int, Path], samples: int) -> None:
    small, big = paths
    consoles = {n: Console(str(path)) for n, path in paths.items()}
    async with contextlib.AsyncExitStack() as stack:
        for console in consoles.values():
            await stack.enter_async_context(console.running())
        pages: dict[str, tuple[Console, str]] = {}
        for n, console in consoles.items():
            _, first = await console.get("/executions")
            assert f'href="/executions/{FEATURED}"' in first, "the featured is not listed first"
            _, execution = await console.get(f"/executions/{FEATURED}")
            check_execution_page(execution)
            pages[f"{n}: /executions"] = (console, "/executions")
            pages[f"{n}: /executions next"] = (console, next_link(first))
            pages[f"{n}: /executions/{{id}}"] = (console, f"/executions/{FEATURED}")
            pages[f"{n}: /"] = (console, "/")
        times = await sample(pages, samples)
    names = {
        "/executions": "/executions, first page",
        "/executions next": "/executions, its Next page",
        "/executions/{id}": f"/executions/{{id}}, {STEPS} steps",
        "/": "/ (overview: counts every row)",
    }
    for page, name in names.items():
        target = "" if page == "/" else "<= 50"
        medians = {}
        for n in (small, big):
            values = times[f"{n}: {page}"]
            medians[n] = statistics.median(values)
            report.add(f"{name} @{n:,}: median", ms(medians[n]), target, unit="ms")
            report.add(f"{name} @{n:,}: p95", ms(quantile(values, 0.95)), target, unit="ms")
        ratio = medians[big] / medians[small]
        target = "" if page == "/" else "<= 2"
        report.add(f"{name}: {big:,} / {small:,}", ratio, target, unit="x")


async def bench_fleet(report: Report, paths: list[Path], samples: int) -> None:
    databases = {f"db{i}": str(path) for i, path in enumerate(paths)}
    with Fleet(databases, migrate=False) as fleet:  # as `harel-store --fleet FILE ui` opens it
        console = Console(fleet)
        async with console.running():
            _, overview = await console.get("/")
            assert overview.count("at head") == len(paths), "not every database is shown"
            pages = {url: (console, url) for url in ("/", "/dead", "/timers")}
            times = await sample(pages, samples)
    for url, values in times.items():
        target = "<= 100" if url == "/" else ""
        report.add(f"{url} over 4 files: median", ms(statistics.median(values)), target, unit="ms")
        report.add(f"{url} over 4 files: p95", ms(quantile(values, 0.95)), unit="ms")


# --- live pages, served by uvicorn in a thread ---


class Counts:
    """Calls of the database counted in this process: each method wrapped by a function that
    counts, then calls it."""

    KEYS: ClassVar[dict[str, str]] = {
        "console": "console calls (Databases.call, .list_executions)",
        "requests": "store requests (LocalConnection.execute)",
        "statements": "statements of the stores (LibsqlConnection._execute)",
        "watch": "statements of the watch (PRAGMA data_version)",
    }

    def __init__(self) -> None:
        self.n = dict.fromkeys(self.KEYS, 0)
        self._lock = threading.Lock()

    def bump(self, key: str) -> None:
        with self._lock:
            self.n[key] += 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self.n)

    def install(self) -> None:
        from harel_store.connection import local, watch
        from harel_store.ui.source import Databases

        def counted_async(key: str, fn: Callable[..., Awaitable[Any]]) -> Any:
            async def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.bump(key)
                return await fn(*args, **kwargs)

            return wrapper

        def counted(key: str, fn: Callable[..., Any]) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                self.bump(key)
                return fn(*args, **kwargs)

            return wrapper

        Databases.call = counted_async("console", Databases.call)  # type: ignore[method-assign]
        Databases.list_executions = counted_async(  # type: ignore[method-assign]
            "console", Databases.list_executions
        )
        local.LocalConnection.execute = counted(  # type: ignore[method-assign]
            "requests", local.LocalConnection.execute
        )
        local.LibsqlConnection._execute = counted(  # type: ignore[method-assign]
            "statements", local.LibsqlConnection._execute
        )
        watch._data_version = counted("watch", watch._data_version)


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {key: after[key] - before[key] for key in after}


class Served:
    """uvicorn serving ``app`` on 127.0.0.1 in a thread (its own event loop), as
    ``harel-store ui`` configures it."""

    def __init__(self, app: Any) -> None:
        import uvicorn

        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(128)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="on", timeout_graceful_shutdown=1
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


class Page:
    """A browser's page of the console: fetched, then its ``/live`` stream read; on each
    ``change`` event it fetches itself again (one fetch at a time, one more if a change came
    meanwhile), as console.js does."""

    def __init__(self, base: str, url: str) -> None:
        self.url = url
        self.client = httpx.AsyncClient(base_url=base, trust_env=False, timeout=30.0)
        self.opened = asyncio.Event()
        self.opened_at = 0.0  # monotonic time of its stream's first line
        self.changes: list[float] = []  # monotonic times of the change events
        self.refreshed: list[float] = []  # monotonic times each fetch again ended
        self.bytes = 0  # of the stream's body
        self._busy = self._again = False
        self._tasks: set[asyncio.Task[None]] = set()
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        (await self.client.get(self.url)).raise_for_status()
        async with self.client.stream("GET", "/live") as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            buffer = b""
            async for chunk in response.aiter_raw():
                self.bytes += len(chunk)
                buffer += chunk
                while b"\n\n" in buffer:
                    message, buffer = buffer.split(b"\n\n", 1)
                    if message.startswith(b"retry:"):
                        self.opened_at = time.monotonic()
                        self.opened.set()
                    elif message.startswith(b"event: change"):
                        self.changes.append(time.monotonic())
                        self._refresh()

    def _refresh(self) -> None:
        if self._busy:
            self._again = True
            return
        self._busy = True
        task = asyncio.create_task(self._fetch())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _fetch(self) -> None:
        try:
            while True:
                headers = {"X-Harel-Live": "1"}
                (await self.client.get(self.url, headers=headers)).raise_for_status()
                self.refreshed.append(time.monotonic())
                if not self._again:
                    return
                self._again = False
        finally:
            self._busy = False

    async def close(self) -> None:
        for task in (self.task, *self._tasks):
            task.cancel()
        await asyncio.gather(self.task, *self._tasks, return_exceptions=True)
        if self.task.done() and not self.task.cancelled() and self.task.exception():
            raise self.task.exception()  # type: ignore[misc]
        await self.client.aclose()


async def opened(pages: list[Page], timeout: float = 10.0) -> None:
    """Until every page has its stream's first line; an error if a stream ends first."""
    deadline = time.monotonic() + timeout
    while not all(page.opened.is_set() for page in pages):
        for page in pages:
            if page.task.done():
                page.task.result()  # its error
                raise RuntimeError(f"the stream of {page.url} ended")
        assert time.monotonic() < deadline, "a stream did not open"
        await asyncio.sleep(0.001)


async def until(check: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.002)
    return True


async def last_new(times: list[list[float]], seen: list[int], timeout: float = 5.0) -> float:
    """When the last of the lists ``times`` got an entry past its first ``seen`` (waited for
    up to ``timeout`` seconds)."""
    pairs = list(zip(times, seen, strict=True))
    ok = await until(lambda: all(len(t) > n for t, n in pairs), timeout)
    assert ok, f"a page was not told of the commit (or did not fetch) within {timeout:g} s"
    return max(t[n] for t, n in pairs)


async def bench_live(report: Report, path: Path, plan: Plan, counts: Counts) -> None:
    from harel_store.ui import app

    served = Served(app(str(path)))
    helper = Child(module("ui", "--commit", str(path)))
    try:
        assert helper.line() == "ready"
        await live_pages(report, served.url, plan, counts, helper)
    finally:
        with contextlib.suppress(Exception):
            helper.close(10)
        served.close()


async def live_pages(report: Report, base: str, plan: Plan, counts: Counts, helper: Child) -> None:
    # Cold: no page was open, so the console had no watch on the file; the watch it starts
    # cannot tell what was committed between the page's render and its own start, and says
    # so (one change: the page looks once). Warm (3b): a page opened while the watch runs, or
    # within a minute of the last page leaving, is told of nothing that did not happen.
    report.section(f"3a. a page opened alone on the idle file, cold: its first {SETTLE:g} s")
    before = counts.snapshot()
    lone = Page(base, "/executions")
    await opened([lone])
    await asyncio.sleep(SETTLE)
    moved = delta(counts.snapshot(), before)
    report.add("change events it was told (the watch's start)", len(lone.changes), "<= 1")
    report.add("times it fetched itself again", len(lone.refreshed), "<= 1")
    if lone.changes:
        after = ms(lone.changes[0] - lone.opened_at)
        report.add("its first change event, after its stream opened", after, unit="ms")
    report.add("console calls, its first fetch included (informative)", moved["console"])
    await lone.close()
    await asyncio.sleep(0.5)  # the watch outlives its last page (a minute): 3b opens warm

    report.section(f"3b. {PAGES} live pages on the idle file, {plan.idle:g} s")
    urls = ["/", "/executions", f"/executions/{FEATURED}", "/dead", "/timers"]
    pages = [Page(base, urls[i % len(urls)]) for i in range(PAGES)]
    try:
        before = counts.snapshot()
        await opened(pages)
        await asyncio.sleep(SETTLE)
        at_open = delta(counts.snapshot(), before)
        told = sum(bool(p.changes) for p in pages)
        report.add(f"pages told of a change in their first {SETTLE:g} s", told, "<= 0")
        again = sum(len(p.refreshed) for p in pages)
        report.add(f"fetches again in the first {SETTLE:g} s", again, "<= 0")
        label = f"console calls in the first {SETTLE:g} s, {PAGES} first fetches included"
        report.add(label, at_open["console"])
        before, sent = counts.snapshot(), sum(p.bytes for p in pages)
        told = sum(len(p.changes) for p in pages)
        await asyncio.sleep(plan.idle)
        idle = delta(counts.snapshot(), before)
        for key, label in Counts.KEYS.items():
            report.add(label, idle[key], "<= 0")
        report.add("change events told", sum(len(p.changes) for p in pages) - told, "<= 0")
        streamed = sum(p.bytes for p in pages) - sent
        report.add(f"bytes of the {PAGES} streams", streamed, unit="B")

        report.section(f"3c. a commit by another process, {PAGES} pages listening")
        heard: list[float] = []
        refetched: list[float] = []
        calls: list[int] = []
        for _ in range(plan.commits):
            changes = [p.changes for p in pages]
            fetches = [p.refreshed for p in pages]
            seen, fetched = [len(c) for c in changes], [len(f) for f in fetches]
            before = counts.snapshot()
            helper.send("commit")
            _, committed = map(float, helper.line(10).split())
            heard.append(await last_new(changes, seen) - committed)
            refetched.append(await last_new(fetches, fetched) - committed)
            await asyncio.sleep(1.0)  # past LIVE_GAP: the next commit is a change of its own
            calls.append(delta(counts.snapshot(), before)["console"])
        n = plan.commits
        report.add(
            f"until all {PAGES} streams told, worst of {n}", ms(max(heard)), "<= 1000", unit="ms"
        )
        report.add(
            f"until all {PAGES} streams told, median of {n}",
            ms(statistics.median(heard)),
            unit="ms",
        )
        report.add(f"until all {PAGES} pages fetched again, worst", ms(max(refetched)), unit="ms")
        report.add("console calls a commit (the pages' fetches)", statistics.median(calls))
    finally:
        for page in pages:
            await page.close()


# --- the commit path ---

PROBE = """
import json, os, sys, tempfile
os.environ.setdefault("RUST_LOG", "off")
watched = sys.argv[1:]
def loaded():
    return sorted(m for m in watched if m in sys.modules)
seen = {}
import harel_store
seen["import harel_store"] = loaded()
from harel_store import Event, Execution, LibsqlStore, SqliteStore, TimerOp
with tempfile.TemporaryDirectory() as tmp:
    for kind in (LibsqlStore, SqliteStore):
        with kind(os.path.join(tmp, kind.__name__ + ".db")) as store:
            exe = Execution(id="e", definition_id="d")
            store.commit(exe, [("e", Event(name="go"))], timers=[TimerOp.schedule("p", 1e9)],
                         trace={"state": "a"})
            store.commit(exe, [], processed_event_id="x", trace={"state": "b"})
            store.list_executions()
seen["commits (LibsqlStore, SqliteStore)"] = loaded()
from harel_store.cli import build_parser
build_parser()
seen["the CLI's parser"] = loaded()
print(json.dumps(seen))
"""


def git(*args: str) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def before_console() -> tuple[str, str]:
    """The revision before the console (the parent of the commit that added it), and how it
    was found."""
    added = git("log", "--diff-filter=A", "--format=%H", "--", "harel_store/ui/__init__.py")
    if added:
        return git("rev-parse", "--short", f"{added.splitlines()[-1]}^"), "the console's parent"
    return "HEAD", "the console is not committed yet: HEAD"


def bench_commit_path(report: Report, plan: Plan) -> None:
    installed = [m for m in WATCHED if importlib.util.find_spec(m.split(".")[0]) is not None]
    report.add("the ui extra installed (Starlette, Jinja2, uvicorn)", ", ".join(installed))
    probe = subprocess.run(
        [sys.executable, "-c", PROBE, *WATCHED],
        cwd=ROOT, capture_output=True, text=True, check=True,
    )  # fmt: skip
    for step, modules in json.loads(probe.stdout).items():
        shown = ", ".join(modules) or "none"
        report.add(f"of {', '.join(WATCHED)}: imported by {step}", shown, "none", met=not modules)
    revision, how = before_console()
    command = f"python -m benchmarks.instructions --against {revision}"
    print(f"  the revision before the console: {revision} ({how})")
    print(f"  instructions a commit, this tree / {revision}: {command}", flush=True)
    report.add("instructions a commit: the command", command)
    if not plan.instructions:
        report.add("instructions a commit, this tree / before", "not run (smoke)")
        return
    if shutil.which("valgrind") is None:
        report.add("instructions a commit, this tree / before", "not run (no valgrind)")
        return
    done = subprocess.run(
        module("instructions", "--against", revision), cwd=ROOT, capture_output=True, text=True
    )
    print(done.stdout, end="", flush=True)
    if done.returncode != 0:
        report.add("instructions a commit, this tree / before", f"failed (exit {done.returncode})")
        print(done.stderr[-3000:])
        return
    rows = re.findall(
        r"^  ((?:sqlite|libsql) \S+)\s+([\d,]+) / +([\d,]+) = ([\d.]+)$", done.stdout, re.M
    )
    for label, new, old, _ in rows:
        ratio = int(new.replace(",", "")) / int(old.replace(",", ""))
        report.add(
            f"instructions a commit, {label}: this tree / {revision}", ratio, "<= 1.01", unit="x"
        )


# --- the run ---


async def run_async(report: Report, plan: Plan, tmp: Path) -> None:
    small, big = plan.sizes
    paths = {n: tmp / f"n{n}" / "console.db" for n in plan.sizes}
    for n, path in paths.items():
        print(f"  built {n:,} executions in {built(path, n):.1f} s", flush=True)
    report.section(
        f"1. server time of a page (ASGI, in this process), {small:,} and {big:,} executions"
    )
    await bench_pages(report, paths, plan.samples)

    fleet = [tmp / f"fleet{i}" / "db.db" for i in range(4)]
    for path in fleet:
        built(path, plan.fleet_rows)
    report.section(f"2. pages over a fleet of 4 files, {plan.fleet_rows:,} executions each")
    await bench_fleet(report, fleet, plan.samples)

    counts = Counts()
    counts.install()
    await bench_live(report, paths[small], plan, counts)


def main() -> None:
    args = parser(__doc__, quick=None)
    args.add_argument("--build", nargs=2, metavar=("PATH", "N"), help=argparse.SUPPRESS)
    args.add_argument("--commit", metavar="PATH", help=argparse.SUPPRESS)
    ns = args.parse_args()
    if ns.build:
        build(Path(ns.build[0]), int(ns.build[1]))
        return
    if ns.commit:
        committer(Path(ns.commit))
        return
    run = "smoke" if ns.smoke else "full"
    plan = PLANS[run]
    with (
        tempfile.TemporaryDirectory() as tmp,
        Report("ui", run, sizes=list(plan.sizes), idle=plan.idle, pages=PAGES) as report,
    ):
        asyncio.run(run_async(report, plan, Path(tmp)))
        report.section("4. the commit path, the ui extra installed, no console")
        bench_commit_path(report, plan)


if __name__ == "__main__":
    main()
