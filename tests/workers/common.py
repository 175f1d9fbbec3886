"""What the worker processes and the tests that check them agree on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from harel_store import Event, LibsqlStore, SqliteStore, TimerOp
from harel_store.store import Store

REPO = Path(__file__).resolve().parents[2]
DRIVERS: dict[str, type[Store]] = {"libsql": LibsqlStore, "sqlite": SqliteStore}


def open_store(driver: str, path: str | Path, **kwargs: Any) -> Store:
    return DRIVERS[driver](path, **kwargs)


def spawn(module: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """Start ``python -m tests.workers.<module> args...`` from the repository root."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", f"tests.workers.{module}", *args],
        env=env,
        text=True,
        **kwargs,
    )


def race(go: Path, workers: list[tuple[str, ...]]) -> list[tuple[int, str, str]]:
    """Start ``python -m tests.workers.<module> args... <go>`` for each (module, *args), wait
    until each says "ready", create ``go`` so they start together, and return each one's
    (returncode, stdout, stderr)."""
    procs = [
        spawn(module, *args, str(go), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for module, *args in workers
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            assert p.stdout.readline() == "ready\n"
        go.touch()
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs, strict=True)]


def run(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run a worker to the end, capturing its output."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", f"tests.workers.{module}", *args],
        env=env,
        text=True,
        capture_output=True,
        timeout=timeout,
        check=False,
    )


# --- the crash stream: every commit is a pure function of (execution, step) ---

EXECUTIONS = ("exe-a", "exe-b", "exe-c")
TRACE_MAX = 4
PATHS = ("p0", "p1", "p2")


def emit_ids(eid: str, n: int) -> list[str]:
    return [f"ev-{eid}-{n}-{k}" for k in range(1 + n % 2)]


def step(eid: str, n: int) -> dict[str, Any]:
    """The arguments of commit number ``n`` (1-based; the version it produces) of ``eid``."""
    return {
        "emits": [
            (f"to-{eid}", Event(name="tick", id=i, payload={"n": n})) for i in emit_ids(eid, n)
        ],
        "processed_event_id": f"in-{eid}-{n}",
        "timers": [TimerOp.schedule(PATHS[n % 3], float(n)), TimerOp.cancel(PATHS[(n + 1) % 3])],
        "spawns": [(f"child-{eid}-{n}", "root", {"n": n})] if n % 3 == 0 else [],
        "trace": {"eid": eid, "n": n},
    }


def timers_after(n: int) -> dict[str, float]:
    """The armed timers of an execution after its first ``n`` commits."""
    armed: dict[str, float] = {}
    for k in range(1, n + 1):
        armed[PATHS[k % 3]] = float(k)
        armed.pop(PATHS[(k + 1) % 3], None)
    return armed
