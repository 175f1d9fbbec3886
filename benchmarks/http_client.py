"""Client CPU per request of `harel_store.connection.http` against httpx, on a real sqld on
loopback. Not a test: the figures depend on the machine.

    python -m benchmarks.http_client            # ~30 s
    python -m benchmarks.http_client -n 500     # fewer requests per run
    python -m benchmarks.http_client --smoke    # every run once, tiny: that it works (~2 s)

Each run posts ``SELECT 1`` as one Hrana pipeline, ``-n`` times after a warm-up of 100:
sequentially (sync and async), then from 16 tasks at once (async). CPU is this process's
(``time.process_time``), so sqld's own work is not counted; wall time includes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from benchmarks.harness import TIMEOUT, parser
from harel_store.connection.http import AsyncClient, Client, Response
from tests.sqld import SqldServer

PATH = "/v3/pipeline"
SELECT = {"type": "execute", "stmt": {"sql": "SELECT 1", "args": [], "want_rows": True}}
BODY = json.dumps({"baton": None, "requests": [SELECT, {"type": "close"}]}).encode()
HEADERS = {"Content-Type": "application/json"}
WARMUP = 100
TASKS = 16
SMOKE = 2 * TASKS  # requests a run in --smoke: each of the 16 tasks sends some


def check(r: httpx.Response | Response) -> None:
    status, body = (
        (r.status_code, r.content) if isinstance(r, httpx.Response) else (r.status, r.body)
    )
    if status != 200 or b'"type":"ok"' not in body:
        raise SystemExit(f"unexpected answer: {status} {body[:200]!r}")


def measure_sync(post: Callable[[], httpx.Response | Response], n: int) -> tuple[float, float]:
    for _ in range(WARMUP):
        check(post())
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        check(post())
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


async def measure_async(
    post: Callable[[], Awaitable[httpx.Response | Response]], n: int, tasks: int
) -> tuple[float, float]:
    async def worker(count: int) -> None:
        for _ in range(count):
            check(await post())

    await asyncio.gather(*(worker(WARMUP // tasks + 1) for _ in range(tasks)))
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(n // tasks) for _ in range(tasks)))
    done = n // tasks * tasks
    return (time.process_time() - cpu) / done, (time.perf_counter() - wall) / done


def run(url: str, n: int) -> dict[str, tuple[float, float]]:
    """(CPU, wall) seconds a request of each run, by label."""
    results: dict[str, tuple[float, float]] = {}
    options: dict[str, Any] = {"headers": HEADERS, "timeout": TIMEOUT}
    with httpx.Client(**options) as hx:
        results["httpx sync"] = measure_sync(lambda: hx.post(url + PATH, content=BODY), n)
    with contextlib.closing(Client(url, ssl_context=None, **options)) as ours:
        results["ours sync"] = measure_sync(lambda: ours.post(PATH, BODY), n)
    runs = (("async", 1), (f"async x{TASKS}", TASKS))

    async def in_loop() -> None:
        async with httpx.AsyncClient(**options) as ahx:
            hx_post = functools.partial(ahx.post, url + PATH, content=BODY)
            for label, tasks in runs:
                results[f"httpx {label}"] = await measure_async(hx_post, n, tasks)
        aours = AsyncClient(url, ssl_context=None, **options)
        our_post = functools.partial(aours.post, PATH, BODY)
        for label, tasks in runs:
            results[f"ours {label}"] = await measure_async(our_post, n, tasks)
        await aours.aclose()

    asyncio.run(in_loop())
    return results


def main() -> None:
    args = parser(__doc__, quick=None)
    args.add_argument("-n", type=int, default=2000, help="requests per run (default 2000)")
    ns = args.parse_args()
    n = SMOKE if ns.smoke else ns.n
    if n < TASKS:
        args.error(f"-n must be at least {TASKS} (the tasks of the concurrent runs)")
    with SqldServer() as server:  # started on entry
        results = run(server.url, n)
    print(f"{n} requests of SELECT 1 per run; per request:\n")
    print(f"{'client':<20} {'CPU ms':>8} {'wall ms':>8}")
    for name, (cpu, wall) in results.items():
        print(f"{name:<20} {cpu * 1e3:>8.3f} {wall * 1e3:>8.3f}")
    print("\nours / httpx:")
    for kind in ("sync", "async", f"async x{TASKS}"):
        (oc, ow), (hc, hw) = results[f"ours {kind}"], results[f"httpx {kind}"]
        print(f"  {kind:<12} CPU {oc / hc:.2f}   wall {ow / hw:.2f}")


if __name__ == "__main__":
    main()
