"""Commit a steady stream of deterministic steps until killed.

``python -m workers.crash DRIVER DB LOG SEED [MODE]``: resumes every execution from its
stored version; after each commit RETURNS it appends ``commit EID N`` to LOG (flushed,
fsynced), so LOG lists only commits that reported success. Before acking an outbox entry it
logs ``acking EVENT_ID`` (the ack may land or not if killed right there).

MODE ``serial`` (the default) commits one execution after another from one thread;
``threads`` commits each execution from its own thread and ``tasks`` from its own task of an
`AsyncLibsqlStore`, so that the commits go in groups (one transaction for several).
"""

from __future__ import annotations

import asyncio
import os
import random
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

from harel_store import AsyncLibsqlStore, Execution
from harel_store.store import Store
from tests.workers.common import EXECUTIONS, TRACE_MAX, open_store, step


def stream(
    store: Store, rng: random.Random, eids: tuple[str, ...], note: Callable[[str], None]
) -> Iterator[tuple[str, Any, Any]]:
    """The steps of ``eids``, each commit a step (a generator: the caller runs each)."""
    exes = {eid: store.load(eid) or Execution(id=eid, definition_id="crash") for eid in eids}
    while True:
        eid = rng.choice(eids)
        exe = exes[eid]
        n = exe.version + 1
        exe.context = {"n": n}
        yield "commit", exe, step(eid, n)
        note(f"commit {eid} {n}")
        if rng.random() < 0.3:
            pending = store.pending_outbox()
            if pending:
                entry = rng.choice(pending)
                note(f"acking {entry.event.id}")
                yield "ack", entry.seq, None


def main() -> None:
    driver, db, log_path, seed = sys.argv[1:5]
    mode = sys.argv[5] if len(sys.argv) > 5 else "serial"
    store = open_store(driver, db, trace_max=TRACE_MAX)
    lock = threading.Lock()
    with open(log_path, "a", encoding="utf-8") as log:

        def note(line: str) -> None:
            with lock:
                log.write(line + "\n")
                log.flush()
                os.fsync(log.fileno())

        def run(eids: tuple[str, ...], rng: random.Random) -> None:
            for kind, what, args in stream(store, rng, eids, note):
                if kind == "commit":
                    store.commit(what, **args)
                else:
                    store.ack_outbox(what)

        async def run_async(a: AsyncLibsqlStore, eid: str, rng: random.Random) -> None:
            for kind, what, args in stream(store, rng, (eid,), note):
                if kind == "commit":
                    await a.commit(what, **args)
                else:
                    await a.ack_outbox(what)

        async def tasks() -> None:
            a = AsyncLibsqlStore(store)
            await asyncio.gather(
                *(run_async(a, eid, random.Random(f"{seed}-{eid}")) for eid in EXECUTIONS)
            )

        print("ready", flush=True)
        if mode == "serial":
            run(EXECUTIONS, random.Random(int(seed)))
        elif mode == "threads":
            threads = [
                threading.Thread(target=run, args=((eid,), random.Random(f"{seed}-{eid}")))
                for eid in EXECUTIONS
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        else:
            asyncio.run(tasks())


if __name__ == "__main__":
    main()
