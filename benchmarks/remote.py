"""What a commit costs against a libSQL server (sqld), remote and as an embedded replica.

    python -m benchmarks.remote            # ~20 s
    python -m benchmarks.remote --quick    # fewer repetitions

Starts its own sqld on 127.0.0.1 (``tests.sqld``, token auth on) and reports:

- HTTP requests per operation, counted by a loopback TCP proxy run as a separate process
  (libsql holds the GIL through every network call, so a proxy thread in this process
  would never run);
- latency as a ratio against one ``SELECT 1`` round trip to the same server on a bare
  connection, measured directly (not through the proxy), median of many runs;
- the event-loop lag of ``AsyncLibsqlStore``: how late a task that sleeps 1 ms in a loop
  wakes while commits are awaited through the twin, remote and replica, against the same
  ticker idle; for comparison the same on a local file, through the twin over
  ``LibsqlStore`` and over ``SqliteStore`` (stdlib ``sqlite3``, which releases the GIL).

A typical commit: the CAS update, one emit, the dedupe marker, one timer schedule and one
trace step. Not a test: the figures depend on the machine; compare the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/remote.py` as well as `-m benchmarks.remote`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet
import libsql

from harel_store import AsyncLibsqlStore, Event, Execution, LibsqlStore, SqliteStore, TimerOp
from tests.sqld import SqldServer

REQUEST_LINE = re.compile(rb"(?:^|\r\n)(?:GET|POST|PUT|DELETE) \S+ HTTP/1\.[01]\r\n")


# --- the counting proxy (its own process: `python -m benchmarks.remote --proxy PORT FILE`) ---


def _pipe(src: socket.socket, dst: socket.socket, count: Callable[[int], None] | None) -> None:
    try:
        while data := src.recv(65536):
            if count is not None:
                count(len(REQUEST_LINE.findall(data)))  # before forwarding: exact on return
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


def run_proxy(target_port: int, counter: Path) -> None:
    lock = threading.Lock()
    total = 0

    def count(n: int) -> None:
        nonlocal total
        if n:
            with lock:
                total += n
                counter.write_text(str(total))

    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:
        client, _ = listener.accept()
        server = socket.create_connection(("127.0.0.1", target_port))
        threading.Thread(target=_pipe, args=(client, server, count), daemon=True).start()
        threading.Thread(target=_pipe, args=(server, client, None), daemon=True).start()


class Proxy:
    def __init__(self, target_port: int, workdir: Path) -> None:
        self.counter = workdir / "requests"
        self.counter.write_text("0")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.remote",
                "--proxy",
                str(target_port),
                str(self.counter),
            ],
            cwd=Path(__file__).resolve().parent.parent,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self.proc.stdout is not None
        self.url = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"

    def requests(self) -> int:
        return int(self.counter.read_text() or 0)

    def per_call(self, fn: Callable[[], Any], calls: int) -> float:
        before = self.requests()
        for _ in range(calls):
            fn()
        return (self.requests() - before) / calls

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


# --- the workload ---


def committer(store: LibsqlStore, eid: str) -> Callable[[], Any]:
    exe = store.load(eid) or Execution(id=eid, definition_id="bench")
    n = 0

    def commit() -> None:
        nonlocal n
        n += 1
        store.commit(
            exe,
            [(None, Event(name="tick", id=f"{eid}-out-{n}"))],
            processed_event_id=f"{eid}-in-{n}",
            timers=[TimerOp.schedule("t", float(n))],
            trace={"n": n},
        )

    return commit


def median_ms(fn: Callable[[], Any], calls: int) -> float:
    fn()  # warm
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1000


# --- event-loop lag of the async twin ---

TICK = 0.001


async def ticked(work: Callable[[], Awaitable[Any]]) -> tuple[list[float], float]:
    """Await work() while a task sleeps TICK in a loop: how late each wake-up was, and the
    seconds work() took."""
    delays: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(TICK)
            delays.append(time.perf_counter() - start - TICK)

    task = asyncio.create_task(ticker())
    await asyncio.sleep(0.01)
    start = time.perf_counter()
    await work()
    took = time.perf_counter() - start
    done.set()
    await task
    return delays, took


def spread(delays: list[float]) -> tuple[float, float, float]:
    """p50, p99 and max, in ms."""
    cuts = statistics.quantiles(delays, n=100, method="inclusive")
    return cuts[49] * 1e3, cuts[98] * 1e3, max(delays) * 1e3


async def async_commits(
    store: AsyncLibsqlStore, eid: str, calls: int
) -> tuple[tuple[float, float, float], float]:
    """The ticker's delays (p50, p99, max ms) while `calls` commits are awaited through the
    twin, one after another, and the mean ms of one awaited commit."""
    exe = await store.load(eid) or Execution(id=eid, definition_id="bench")

    async def commits() -> None:
        for n in range(1, calls + 1):
            await store.commit(
                exe,
                [(None, Event(name="tick", id=f"{eid}-out-{n}"))],
                processed_event_id=f"{eid}-in-{n}",
                timers=[TimerOp.schedule("t", float(n))],
                trace={"n": n},
            )

    await store.commit(exe, [], processed_event_id=f"{eid}-warm")
    delays, took = await ticked(commits)
    await store.close()
    return spread(delays), took / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--proxy", nargs=2, metavar=("PORT", "COUNTER"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.proxy:
        run_proxy(int(args.proxy[0]), Path(args.proxy[1]))
        return
    calls = 50 if args.quick else 200
    with tempfile.TemporaryDirectory() as tmp, SqldServer(Path(tmp) / "sqld", auth=True) as srv:
        token = srv.token
        LibsqlStore(srv.url, auth_token=token, migrate=True).close()
        proxy = Proxy(srv.port or 0, Path(tmp))
        try:
            rows: list[tuple[str, str]] = []
            # Round trips, through the proxy.
            bare = libsql.connect(proxy.url, auth_token=token)
            remote = LibsqlStore(proxy.url, auth_token=token)
            rep = LibsqlStore(Path(tmp) / "counted.db", sync_url=proxy.url, auth_token=token)
            committer(remote, "warm")()
            committer(rep, "warm-r")()
            counted = {
                "SELECT 1 on a bare connection": lambda: bare.execute("SELECT 1").fetchall(),
                "commit, remote": committer(remote, "count-r"),
                "commit, replica": committer(rep, "count-p"),
                "load, remote": lambda: remote.load("count-r"),
                "load_for_event, remote": lambda: remote.load_for_event("count-r", "x"),
                "load, replica": lambda: rep.load("count-p"),
                "replica sync() with nothing new": rep.sync,
            }
            for label, fn in counted.items():
                fn()
                rows.append((f"HTTP requests: {label}", f"{proxy.per_call(fn, 10):.1f}"))
            for closable in (bare, remote, rep):
                closable.close()

            # Latency, directly.
            bare = libsql.connect(srv.url, auth_token=token)
            remote = LibsqlStore(srv.url, auth_token=token)
            rep = LibsqlStore(Path(tmp) / "timed.db", sync_url=srv.url, auth_token=token)
            select1 = median_ms(lambda: bare.execute("SELECT 1").fetchall(), calls)
            timed = {
                "commit, remote": median_ms(committer(remote, "time-r"), calls),
                "commit, replica": median_ms(committer(rep, "time-p"), calls),
                "load, remote (primary)": median_ms(lambda: remote.load("time-r"), calls),
                "load, replica (local)": median_ms(lambda: rep.load("time-p"), calls),
            }
            rows.append(("SELECT 1 round trip (ms)", f"{select1:.3f}"))
            for label, ms in timed.items():
                rows.append((f"{label} (ms) / SELECT 1", f"{ms:.3f} / {ms / select1:.2f}x"))
            rows.append(
                (
                    "load: replica / primary",
                    f"{timed['load, replica (local)'] / timed['load, remote (primary)']:.3f}",
                )
            )
            for closable in (bare, remote, rep):
                closable.close()

            # Event-loop lag while commits are awaited through the async twin (more commits
            # on a local file, where one takes ~1 ms, so that each run gets enough ticks).
            async def lag_runs() -> tuple[
                list[float], dict[str, tuple[tuple[float, float, float], float]]
            ]:
                idle, _ = await ticked(lambda: asyncio.sleep(0.5))
                runs = {
                    "remote": await async_commits(
                        await AsyncLibsqlStore.create(srv.url, auth_token=token), "lag-r", calls
                    ),
                    "replica": await async_commits(
                        await AsyncLibsqlStore.create(
                            Path(tmp) / "lag.db", sync_url=srv.url, auth_token=token
                        ),
                        "lag-p",
                        calls,
                    ),
                    "file, libsql": await async_commits(
                        await AsyncLibsqlStore.create(Path(tmp) / "lag-libsql.db"),
                        "lag-f",
                        calls * 5,
                    ),
                    # The twin's own wrapper (a lock and asyncio.to_thread) around sqlite3.
                    "file, sqlite3": await async_commits(
                        AsyncLibsqlStore(SqliteStore(Path(tmp) / "lag-sqlite.db")),  # type: ignore[arg-type]
                        "lag-s",
                        calls * 5,
                    ),
                }
                more, _ = await ticked(lambda: asyncio.sleep(0.5))
                return idle + more, runs

            idle_delays, runs = asyncio.run(lag_runs())
            idle = spread(idle_delays)
            rows.append(
                (
                    "loop lag idle: 1 ms ticker delay p50 / p99 / max (ms)",
                    " / ".join(f"{ms:.3f}" for ms in idle),
                )
            )
            for label, (lag, commit_ms) in runs.items():
                rows.append(
                    (
                        f"loop lag, {label}: p50 / p99 / max (ms), x idle",
                        " / ".join(f"{ms:.3f}" for ms in lag)
                        + ", "
                        + " / ".join(
                            f"{ms / base:.1f}x" for ms, base in zip(lag, idle, strict=True)
                        ),
                    )
                )
                rows.append(
                    (
                        f"loop lag, {label}: max / mean awaited commit (ms)",
                        f"{lag[2]:.3f} / {commit_ms:.3f} = {lag[2] / commit_ms:.2f}",
                    )
                )
            rows.append(("GIL switch interval (ms)", f"{sys.getswitchinterval() * 1e3:.1f}"))
        finally:
            proxy.close()
    width = max(len(label) for label, _ in rows)
    for label, value in rows:
        print(f"{label:<{width}}  {value}")


if __name__ == "__main__":
    main()
