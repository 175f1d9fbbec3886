"""What every benchmark stands on, in the image of pyperf's ``Runner``: the plans (``--smoke``,
``--quick``, full), timing (best of rounds, medians of interleaved calls, quantiles, an
event-loop ticker), one report (rows by section, printed as they come, a table at the end and
JSON in ``benchmarks/results/<module>-<timestamp>.json``, not written by ``--smoke``), sqld
with a link proxy in front of it, and another revision's code to measure beside this tree's.

``python -m benchmarks.harness PORT DELAY_MS`` is the proxy process (see :class:`Proxy`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import json
import os
import platform
import re
import select
import sqlite3
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

os.environ.setdefault("RUST_LOG", "off")  # read once, at import: keep libsql's log quiet

from harel_store import LibsqlStore
from harel_store.connection import http
from tests.sqld import SQLD_VERSION, SqldServer

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
TIMEOUT = 10.0  # seconds a request may take
TICK = 0.001  # the ticker's sleep


# --- the plans ---


def parser(doc: str | None, quick: str | None = "fewer repetitions") -> argparse.ArgumentParser:
    """The module's arguments: ``--quick`` (unless None) and ``--smoke`` (the full plan
    without either)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument(
        "--smoke", action="store_true", help="every section once, tiny (no JSON written)"
    )
    return parser


def mode(args: argparse.Namespace) -> str:
    return "smoke" if args.smoke else "quick" if getattr(args, "quick", False) else "full"


# --- timing ---


def best(samples: list[float]) -> float:
    """The least of repeated timings: the run least disturbed by the rest of the machine."""
    return min(samples)


def alternate(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """What each run returns (its time), over ``rounds`` rounds: the runs take turns, in
    reverse order every other round, so that neither always goes first."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            times[name].append(runs[name]())
    return times


def median_call(fn: Callable[[], object], calls: int, warm: int = 20) -> float:
    """The median seconds of ``calls`` calls of ``fn``, after ``warm`` (at most ``calls``)."""
    for _ in range(min(warm, calls)):
        fn()
    samples = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def medians(ops: dict[str, tuple[Callable[[], object], int]], rounds: int = 5) -> dict[str, float]:
    """The median seconds of a call of each op (fn, calls), the ops interleaved in rounds so
    that a drift of the machine weighs on all of them alike."""
    samples: dict[str, list[float]] = {label: [] for label in ops}
    for fn, _ in ops.values():
        fn()  # warm
    for _ in range(rounds):
        for label, (fn, calls) in ops.items():
            for _ in range(max(1, calls // rounds)):
                start = time.perf_counter()
                fn()
                samples[label].append(time.perf_counter() - start)
    return {label: statistics.median(times) for label, times in samples.items()}


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (inclusive; 1: the largest)."""
    if q >= 1 or len(values) == 1:
        return max(values)
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1]


async def ticked(work: Awaitable[object]) -> list[float]:
    """Await work while a task sleeps TICK in a loop: how late each of its wake-ups was."""
    delays: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        while not done.is_set():
            start = time.perf_counter()
            await asyncio.sleep(TICK)
            delays.append(time.perf_counter() - start - TICK)

    task = asyncio.create_task(ticker())
    try:
        await work
    finally:
        done.set()
        await task
    return delays


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_spent(pids: dict[str, int]) -> Iterator[dict[str, float]]:
    """The CPU seconds each process of ``pids`` (by name) spent within the block: the dict
    yielded, filled as the block ends."""
    began = {name: cpu_seconds(pid) for name, pid in pids.items()}
    spent: dict[str, float] = {}
    yield spent
    spent.update({name: cpu_seconds(pids[name]) - at for name, at in began.items()})


# --- the report ---


def meets(value: float, target: str) -> bool | None:
    """Whether ``value`` meets a target such as ">= 8" or "<= 2" (None: no such target)."""
    op, _, bound = target.partition(" ")
    if op not in ("<=", ">="):
        return None
    return value >= float(bound) if op == ">=" else value <= float(bound)


def _line(row: dict[str, Any], width: int, shown: int = 0) -> str:
    line = f"  {row['label']:<{width}}  {row['shown']:<{shown}}"
    if row["target"]:
        line += f"  target {row['target']}"
        line += "" if row["met"] is None else "  ok" if row["met"] else "  MISSED"
    return line.rstrip()


class Report:
    """The rows of a run by section, each printed as it comes; at the end (``with``) a table
    by section, the JSON (``{"meta": ..., "rows": [...]}``; not for a smoke run) and a line
    saying where it went. An error still prints and writes what was measured, then goes on."""

    def __init__(self, name: str, mode: str, detail: str = "", **meta: Any) -> None:
        self.name, self.mode, self.detail = name, mode, detail
        self.meta: dict[str, Any] = meta
        self.rows: list[dict[str, Any]] = []
        self.title = ""
        self.started = time.time()

    def section(self, title: str) -> None:
        self.title = title
        print(title, flush=True)

    def add(
        self,
        label: str,
        value: float | str,
        target: str = "",
        met: bool | None = None,
        unit: str = "",
        **raw: Any,
    ) -> None:
        """A row: ``value`` shown as is (a string) or to 3 places with its ``unit``; ``met``
        is worked out from a numeric value and a target ">= X" or "<= X" if not given."""
        shown = value if isinstance(value, str) else f"{value:10.3f} {unit}".rstrip()
        if met is None and not isinstance(value, str):
            met = meets(value, target)
        number = {} if isinstance(value, str) else {"value": round(value, 6)}
        row = {"section": self.title, "label": label, "shown": shown, "target": target}
        self.rows.append(row | {"met": met} | number | raw)
        print(_line(self.rows[-1], 60), flush=True)

    def __enter__(self) -> Report:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for title in dict.fromkeys(row["section"] for row in self.rows):
            rows = [row for row in self.rows if row["section"] == title]
            width = max(len(row["label"]) for row in rows)
            shown = max(len(row["shown"]) for row in rows)
            print(f"\n{title}")
            for row in rows:
                print(_line(row, width, shown))
        seconds = round(time.time() - self.started, 1)
        meta = {
            "module": self.name,
            "mode": self.mode,
            "seconds": seconds,
            "error": None if exc is None else repr(exc),
            **self.meta,
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "libsql": importlib.metadata.version("libsql"),
            "sqld": SQLD_VERSION,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        }
        text = json.dumps({"meta": meta, "rows": self.rows}, indent=2) + "\n"  # a smoke run too
        written = "JSON not written"
        if self.mode != "smoke":
            out = RESULTS / f"{self.name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
            RESULTS.mkdir(exist_ok=True)
            out.write_text(text)
            written = str(out.relative_to(ROOT))
        print(f"\n{self.mode} run{self.detail}, {written} ({seconds} s)")


# --- sqld, and a link in front of it ---

# Unanchored: a request pipelined behind another one follows that one's body at once.
REQUEST_LINE = re.compile(rb"[A-Z]+ /\S* HTTP/1\.[01]\r\n")


def run_proxy(target_port: int, delay_ms: float) -> None:
    """The proxy process: print its port, then its request count for each line read on
    stdin; exit when stdin closes (the benchmark is done, or died)."""
    requests = [0]

    async def pump(
        src: asyncio.StreamReader, dst: asyncio.StreamWriter, client: bool, stream: list[bool]
    ) -> None:
        # Each chunk is forwarded at its own time (when it came, plus its delay), in order:
        # the link adds latency, and a request sent while another is on the link (HTTP/1.1
        # pipelining) crosses it beside that one, not behind it.
        held: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()
        forward = asyncio.create_task(release(held, dst))
        due = 0.0
        try:
            with contextlib.suppress(OSError):  # a reset ends the connection, as EOF does
                while data := await src.read(65536):
                    delay = 0.0
                    if client and (n := len(REQUEST_LINE.findall(data))):
                        requests[0] += n  # before it is forwarded: exact once the answer is back
                        stream[0] = data.startswith(b"GET ")  # change notifications: a stream
                        delay = delay_ms / 1e3
                    elif stream[0]:  # a stream's event crosses the link one way: half a trip
                        delay = delay_ms / 2e3
                    due = max(due, time.monotonic() + delay)  # what follows stays behind it
                    held.put_nowait((due, data))
            held.put_nowait((0.0, b""))
            await forward
        finally:
            forward.cancel()

    async def release(held: asyncio.Queue[tuple[float, bytes]], dst: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError):
            while True:
                due, data = await held.get()
                if not data:
                    return
                if (wait := due - time.monotonic()) > 0:
                    await asyncio.sleep(wait)
                dst.write(data)
                await dst.drain()

    async def serve(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", target_port)
        except OSError:  # sqld is down: say so at once
            client_w.close()
            return
        stream = [False]
        pumps = {
            asyncio.create_task(pump(client_r, server_w, True, stream)),
            asyncio.create_task(pump(server_r, client_w, False, stream)),
        }
        await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)  # HTTP: no half-close
        client_w.close()
        server_w.close()
        for task in pumps:
            task.cancel()

    def answer() -> None:
        for _ in sys.stdin:
            print(requests[0], flush=True)
        os._exit(0)

    async def main() -> None:
        server = await asyncio.start_server(serve, "127.0.0.1", 0, backlog=512)
        print(server.sockets[0].getsockname()[1], flush=True)
        threading.Thread(target=answer, daemon=True).start()
        await server.serve_forever()

    asyncio.run(main())


class Proxy:
    """A proxy process in front of a local port (its own process: libsql holds the GIL
    through its network calls). It forwards bytes untouched and counts the HTTP/1.x requests
    sent; with a delay, it holds each chunk that starts a request ``delay_ms`` (a round trip
    on a slow network) and each event of a change notifications stream (a ``GET``) half that,
    each from when it came (a request pipelined behind another one is not held behind it)."""

    def __init__(self, target_port: int, delay_ms: float) -> None:
        self.delay_ms = delay_ms
        args = [sys.executable, "-m", "benchmarks.harness", str(target_port), str(delay_ms)]
        pipe = subprocess.PIPE
        self.proc = subprocess.Popen(args, cwd=ROOT, stdin=pipe, stdout=pipe)
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in, self._out = self.proc.stdin, self.proc.stdout
        self.url = f"http://127.0.0.1:{int(self._out.readline())}"

    def requests(self) -> int:
        self._in.write(b"\n")
        self._in.flush()
        return int(self._out.readline())

    def close(self) -> None:
        self._in.close()  # the proxy exits
        self.proc.wait(timeout=5)
        self._out.close()


@dataclass
class Served:
    srv: SqldServer
    link: Proxy  # the delay a request
    count: Proxy  # no delay: counts the requests


@contextlib.contextmanager
def served(
    tmp: Path, delay_ms: float, migrate: Callable[[str, str], None] | None = None
) -> Iterator[Served]:
    """A fresh sqld (token auth, on loopback) with a link and a counting proxy, migrated by
    ``migrate(url, token)`` (default: this tree's store)."""
    with contextlib.ExitStack() as stack:
        srv = stack.enter_context(SqldServer(tmp / "sqld", auth=True))
        stack.callback(srv.kill)  # SIGTERM would wait 30 s for open notification streams
        if migrate is None:
            LibsqlStore(srv.url, auth_token=srv.token, migrate=True).close()
        else:
            migrate(srv.url, srv.token)
        link = stack.enter_context(contextlib.closing(Proxy(srv.port or 0, delay_ms)))
        count = stack.enter_context(contextlib.closing(Proxy(srv.port or 0, 0.0)))
        yield Served(srv, link, count)


def client(url: str, token: str = "") -> http.Client:
    """Our HTTP client on ``url`` (a token: its bearer)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return http.Client(url, headers=headers, timeout=TIMEOUT, ssl_context=None)


def bare_request(client: http.Client) -> Callable[[], None]:
    """One ``POST /v3/pipeline`` of ``SELECT 1`` (and the stream's close): one round trip."""
    select = {"type": "execute", "stmt": {"sql": "SELECT 1", "want_rows": True}}
    body = json.dumps({"baton": None, "requests": [select, {"type": "close"}]}).encode()

    def request() -> None:
        if (status := client.post("/v3/pipeline", body).status) != 200:
            raise RuntimeError(f"a bare request got HTTP {status}")

    return request


# --- another revision's code, measured beside this tree's ---


def archive(revision: str, into: Path) -> Path:
    """That revision's tree (``git archive``), extracted into ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    tar = subprocess.run(["git", "archive", revision], cwd=ROOT, check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(into)], input=tar.stdout, check=True)
    return into


def module(name: str, *args: str) -> list[str]:
    """The command of ``python -m benchmarks.<name> ARGS``."""
    return [sys.executable, "-m", f"benchmarks.{name}", *args]


class Child:
    """A helper process (from the repository root, unless ``cwd`` says otherwise) that talks
    in lines over its stdin and stdout."""

    def __init__(self, command: list[str], **popen: Any) -> None:
        pipe = subprocess.PIPE
        popen = {"cwd": ROOT} | popen
        self.proc = subprocess.Popen(command, stdin=pipe, stdout=pipe, text=True, **popen)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def line(self, timeout: float = 60.0) -> str:
        """Its next line (without the newline); an error if none comes within ``timeout``."""
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not (line := self.proc.stdout.readline() if ready else ""):
            raise RuntimeError(f"{self.proc.args!r} said nothing in {timeout:g} s")
        return line.rstrip("\n")

    def close(self, timeout: float = 60.0) -> str:
        """Close its stdin (it exits then), wait for it (killed after ``timeout`` seconds): what
        it wrote meanwhile; an error if it failed."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, _ = self.proc.communicate()
        if self.proc.returncode > 0:
            raise RuntimeError(f"{self.proc.args!r} failed (exit {self.proc.returncode})")
        return out or ""


if __name__ == "__main__":
    run_proxy(int(sys.argv[1]), float(sys.argv[2]))
