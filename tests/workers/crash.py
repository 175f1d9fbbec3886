"""Commit a steady stream of deterministic steps until killed.

``python -m workers.crash DRIVER DB LOG SEED``: resumes every execution from its stored
version; after each commit RETURNS it appends ``commit EID N`` to LOG (flushed, fsynced),
so LOG lists only commits that reported success. Before acking an outbox entry it logs
``acking EVENT_ID`` (the ack may land or not if killed right there).
"""

from __future__ import annotations

import os
import random
import sys

from harel_store import Execution
from tests.workers.common import EXECUTIONS, TRACE_MAX, open_store, step


def main() -> None:
    driver, db, log_path, seed = sys.argv[1:5]
    rng = random.Random(int(seed))
    store = open_store(driver, db, trace_max=TRACE_MAX)
    exes = {eid: store.load(eid) or Execution(id=eid, definition_id="crash") for eid in EXECUTIONS}
    with open(log_path, "a", encoding="utf-8") as log:

        def note(line: str) -> None:
            log.write(line + "\n")
            log.flush()
            os.fsync(log.fileno())

        print("ready", flush=True)
        while True:
            eid = rng.choice(EXECUTIONS)
            exe = exes[eid]
            n = exe.version + 1
            exe.context = {"n": n}
            store.commit(exe, **step(eid, n))
            note(f"commit {eid} {n}")
            if rng.random() < 0.3:
                pending = store.pending_outbox()
                if pending:
                    entry = rng.choice(pending)
                    note(f"acking {entry.event.id}")
                    store.ack_outbox(entry.seq)


if __name__ == "__main__":
    main()
