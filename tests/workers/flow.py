"""Worker processes for tests/test_flows.py (flow control across processes).

``python -m tests.workers.flow hold DRIVER DB WORKER``: claims every kind of item as
WORKER under a 30 s lease, prints ``held N`` (N items) and waits to be killed.

``python -m tests.workers.flow limit DRIVER DB WORKER KEY LOG GO``: prints ``ready``, waits
for the file GO to exist, then claims (up to 2 items a claim, every kind), handles and acks
items until flow key KEY has none left, pending or held. For each item it appends to LOG
``KIND ID START END``: START (taken once the claim returned) and END (taken before its ack
is sent) on the monotonic clock the processes of one machine share, so each interval lies
within the time the database had the item held. Prints ``done N`` (N items handled).

``python -m tests.workers.flow resume DRIVER DB KEY``: resumes flow key KEY and prints
``resumed`` once the commit returned.

DB is a file, or (DRIVER ``libsql``) a server's URL, its token in $HAREL_FLOW_TOKEN.
"""

from __future__ import annotations

import os
import sys
import time

from harel_store import LibsqlStore
from harel_store.connection import is_remote
from harel_store.store import Store
from tests.workers.common import open_store as open_file

NOW = 1e11  # the timer sweep's now: every timer the tests arm is due
HANDLING = 0.03  # seconds a limit worker holds each item it handles


def open_store(driver: str, db: str) -> Store:
    if is_remote(db):
        return LibsqlStore(db, auth_token=os.environ["HAREL_FLOW_TOKEN"])
    return open_file(driver, db)


def item_id(kind: str, item: object) -> str:
    if kind == "timer":
        return f"{item.execution_id}/{item.path}"  # type: ignore[attr-defined]
    return str(item.seq)  # type: ignore[attr-defined]


def hold(driver: str, db: str, worker: str) -> None:
    store = open_store(driver, db)
    claimed = store.claim_work(worker, NOW, limit=100, lease=30.0)
    print("held", len(claimed.items()), flush=True)
    while True:  # until the test's SIGKILL
        time.sleep(60)


def limit(driver: str, db: str, worker: str, key: str, log_path: str, go: str) -> None:
    store = open_store(driver, db)
    print("ready", flush=True)
    while not os.path.exists(go):
        time.sleep(0.001)
    handled = 0
    deadline = time.monotonic() + 60
    with open(log_path, "a", encoding="utf-8") as log:
        while time.monotonic() < deadline:
            items = store.claim_work(worker, NOW, limit=2, lease=30.0).items()
            start = time.monotonic()
            if not items:
                (flow,) = [f for f in store.flows() if f.key == key]
                if flow.pending == flow.held == 0:
                    break
                time.sleep(0.002)
                continue
            for kind, item in items:
                time.sleep(HANDLING)
                end = time.monotonic()
                log.write(f"{kind} {item_id(kind, item)} {start!r} {end!r}\n")
                log.flush()
                store.ack([item])
                handled += 1
        else:
            raise SystemExit(f"{worker}: items of {key!r} left after 60 s")
    store.close()
    print("done", handled, flush=True)


def resume(driver: str, db: str, key: str) -> None:
    store = open_store(driver, db)
    store.resume_flow(key)
    print("resumed", flush=True)
    store.close()


def main() -> None:
    command, *args = sys.argv[1:]
    {"hold": hold, "limit": limit, "resume": resume}[command](*args)


if __name__ == "__main__":
    main()
