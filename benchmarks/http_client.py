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
import json
import time
from collections.abc import Awaitable, Callable

import httpx

from benchmarks.harness import TIMEOUT, parser
from harel_store.connection.http import AsyncClient, Client
from tests.sqld import SqldServer

PATH = "/v3/pipeline"
SELECT = {"type": "execute", "stmt": {"sql": "SELECT 1", "args": [], "want_rows": True}}
BODY = json.dumps({"baton": None, "requests": [SELECT, {"type": "close"}]}).encode()
HEADERS = {"Content-Type": "application/json"}
WARMUP = 100
TASKS = 16
SMOKE = 2 * TASKS  # requests a run in --smoke: each of the 16 tasks sends some


def check(status: int, body: bytes) -> None:
    if status != 200 or b'"type":"ok"' not in body:
        raise SystemExit(f"unexpected answer: {status} {body[:200]!r}")


def measure_sync(post: Callable[[], tuple[int, bytes]], n: int) -> tuple[float, float]:
    for _ in range(WARMUP):
        check(*post())
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(n):
        check(*post())
    return (time.process_time() - cpu) / n, (time.perf_counter() - wall) / n


async def measure_async(
    post: Callable[[], Awaitable[tuple[int, bytes]]], n: int, tasks: int
) -> tuple[float, float]:
    async def worker(count: int) -> None:
        for _ in range(count):
            check(*await post())

    await asyncio.gather(*(worker(WARMUP // tasks + 1) for _ in range(tasks)))
    cpu, wall = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(n // tasks) for _ in range(tasks)))
    done = n // tasks * tasks
    return (time.process_time() - cpu) / done, (time.perf_counter() - wall) / done


def run(url: str, n: int) -> dict[str, tuple[float, float]]:
    results: dict[str, tuple[float, float]] = {}
    with httpx.Client(headers=HEADERS, timeout=TIMEOUT) as hx:

        def hx_post() -> tuple[int, bytes]:
            r = hx.post(url + PATH, content=BODY)
            return r.status_code, r.content

        results["httpx sync"] = measure_sync(hx_post, n)
    ours = Client(url, headers=HEADERS, timeout=TIMEOUT, ssl_context=None)

    def our_post() -> tuple[int, bytes]:
        r = ours.post(PATH, BODY)
        return r.status, r.body

    results["ours sync"] = measure_sync(our_post, n)
    ours.close()

    async def in_loop() -> None:
        async with httpx.AsyncClient(headers=HEADERS, timeout=TIMEOUT) as ahx:

            async def ahx_post() -> tuple[int, bytes]:
                r = await ahx.post(url + PATH, content=BODY)
                return r.status_code, r.content

            results["httpx async"] = await measure_async(ahx_post, n, 1)
            results[f"httpx async x{TASKS}"] = await measure_async(ahx_post, n, TASKS)
        aours = AsyncClient(url, headers=HEADERS, timeout=TIMEOUT, ssl_context=None)

        async def aour_post() -> tuple[int, bytes]:
            r = await aours.post(PATH, BODY)
            return r.status, r.body

        results["ours async"] = await measure_async(aour_post, n, 1)
        results[f"ours async x{TASKS}"] = await measure_async(aour_post, n, TASKS)
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
