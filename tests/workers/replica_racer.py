"""Commit to shared executions through an embedded replica of its own, reloading on conflict.

``python -m tests.workers.replica_racer URL REPLICA_DB NAME COMMITS GO_FILE`` (the token in
$HAREL_AUTH_TOKEN, never on the command line): prints ``ready``, waits for GO_FILE, then makes
COMMITS successful commits to executions picked at random. Every attempt carries a batch
named after it (emit, dedupe marker, timer, spawn, trace), so the test can tell a loser's
rows from a winner's. After each StoreConflict it reloads, never syncing itself, and counts
a reload older than the version that won. Prints a JSON report; any other exception ends
the process with a traceback and a non-zero status.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from harel_store import Event, Execution, LibsqlStore, StoreConflict, TimerOp

EXECUTIONS = ("shared-a", "shared-b")


def main() -> None:
    url, db, name, commits, go = sys.argv[1:6]
    rng = random.Random(name)
    store = LibsqlStore(db, sync_url=url, auth_token=os.environ["HAREL_AUTH_TOKEN"], trace_max=None)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    landed: dict[str, list[str]] = {eid: [] for eid in EXECUTIONS}
    lost: list[str] = []
    stale = 0
    attempt = 0
    for _ in range(int(commits)):
        eid = rng.choice(EXECUTIONS)
        exe = store.load(eid) or Execution(id=eid, definition_id="race")
        while True:
            attempt += 1
            tag = f"{name}-{attempt}"
            try:
                store.commit(
                    exe,
                    [(eid, Event(name="hit", id=tag))],
                    processed_event_id=f"in-{tag}",
                    timers=[TimerOp.schedule(tag, float(attempt))],
                    spawns=[(f"child-{tag}", "root", {})],
                    trace={"tag": tag},
                )
            except StoreConflict as exc:
                lost.append(tag)
                exe = store.load(eid) or Execution(id=eid, definition_id="race")
                if exc.found is not None and exe.version < exc.found:
                    stale += 1
                continue
            landed[eid].append(tag)
            break
    store.close()
    print(json.dumps({"landed": landed, "lost": lost, "stale": stale}), flush=True)


if __name__ == "__main__":
    main()
