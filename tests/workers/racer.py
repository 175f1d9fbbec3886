"""Commit to shared executions from one of several processes, reloading on conflict.

``python -m tests.workers.racer DRIVER DB NAME COMMITS GO_FILE``: prints ``ready``, waits
for GO_FILE to exist, then makes COMMITS successful commits (each emitting one event with
id ``NAME-k``) to executions picked at random, retrying on StoreConflict. Prints a JSON
report; any other exception ends the process with a traceback and a non-zero status.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

from harel_store import Event, Execution, StoreConflict
from tests.workers.common import EXECUTIONS, open_store


def main() -> None:
    driver, db, name, commits, go = sys.argv[1:6]
    rng = random.Random(name)
    store = open_store(driver, db)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    done = dict.fromkeys(EXECUTIONS, 0)
    emits: list[str] = []
    conflicts = 0
    for k in range(int(commits)):
        eid = rng.choice(EXECUTIONS)
        while True:
            exe = store.load(eid) or Execution(id=eid, definition_id="race")
            exe.context = {"last": name}
            event = Event(name="hit", id=f"{name}-{k}")
            time.sleep(rng.random() / 1000)  # an engine works between load and commit
            try:
                store.commit(exe, [(eid, event)], processed_event_id=event.id)
            except StoreConflict:
                conflicts += 1
                continue
            break
        done[eid] += 1
        emits.append(event.id)
    store.close()
    print(json.dumps({"commits": done, "emits": emits, "conflicts": conflicts}), flush=True)


if __name__ == "__main__":
    main()
