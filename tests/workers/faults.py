"""Commit until the disk "fills up" (RLIMIT_FSIZE), or write to a read-only file.

``python -m tests.workers.faults full DRIVER DB``: commits a few small steps, then caps the
size of any file this process may write a little above the database's size and commits
large steps until one fails; then lifts the cap and commits again.
``python -m tests.workers.faults readonly DRIVER DB``: (as an unprivileged user if run as
root) opens a read-only file, reads, tries a commit, reads again.
Prints one JSON report on stdout; an unexpected exception ends it with a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import sys
from pathlib import Path
from typing import Any

from harel_store import Execution, StoreError
from tests.workers.common import open_store

NOBODY = 65534


def size(db: Path) -> int:
    return sum(p.stat().st_size for p in db.parent.glob(db.name + "*"))


def full(driver: str, db: Path) -> dict[str, Any]:
    store = open_store(driver, db)
    done: dict[str, int] = {}
    for i in range(5):
        store.commit(Execution(id=f"small-{i}", definition_id="f", context={"i": i}), [])
        done[f"small-{i}"] = 1
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the cap fails with EFBIG
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (size(db) + 256 * 1024, hard))
    report: dict[str, Any] = {}
    blob = "x" * 50_000
    for i in range(1000):
        exe = Execution(id=f"big-{i}", definition_id="f", context={"blob": blob})
        try:
            store.commit(exe, [])
        except StoreError as exc:
            report["error"] = type(exc).__name__
            report["message"] = str(exc)
            report["failed"] = exe.id
            report["version_after_failure"] = exe.version
            break
        done[exe.id] = 1
    # Still usable while full: what was committed reads back.
    report["reads_while_full"] = all(store.load(e) is not None for e in done)
    resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    store.commit(Execution(id="after", definition_id="f"), [])
    done["after"] = 1
    store.close()
    report["committed"] = done
    return report


def readonly(driver: str, db: Path) -> dict[str, Any]:
    if os.geteuid() == 0:  # root writes through file modes: drop to an ordinary user
        # That user may not read this checkout, its venv or the interpreter's library (a
        # clone in a private folder): load now, while root, every module the store imports
        # as it opens, writes and fails, by doing so once on a throwaway store.
        with open_store(driver, ":memory:") as warm:
            warm.commit(Execution(id="warm", definition_id="f"), [])
            with contextlib.suppress(StoreError):
                warm.commit(Execution(id="warm", definition_id="f"), [])  # a stale version
        os.setgroups([])  # root's supplementary groups stay with a process that keeps them
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    report: dict[str, Any] = {}
    store = open_store(driver, db)
    exe = store.load("kept")
    assert exe is not None
    try:
        store.commit(exe, [])
    except StoreError as exc:
        report["error"] = type(exc).__name__
        report["message"] = str(exc)
        report["version_after_failure"] = exe.version
    after = store.load("kept")
    report["reads_after"] = None if after is None else after.version
    store.close()
    return report


def main() -> None:
    mode, driver, db = sys.argv[1:4]
    report = (full if mode == "full" else readonly)(driver, Path(db))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
