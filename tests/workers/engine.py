"""An engine-like outbox relay: each claimed event is delivered to its target execution and
consumed in the target's own commit, with the event's id as the dedupe marker.

``python -m tests.workers.engine DRIVER DB_OR_URL WORKER_ID [options]``

DB_OR_URL is a file (DRIVER ``libsql`` or ``sqlite``) or a server's URL (DRIVER ``libsql``;
the token in ``$HAREL_AUTH_TOKEN``). The effect of an event is its id appended to the
target's ``context["applied"]``; the commit that appends it also marks the event processed
and consumes the outbox entry (``acks=``), so a delivery repeated after a lost lease finds
the marker and only acks. A conflicting commit (another worker moved the target) reloads
and tries again.

Each round claims up to ``--limit`` entries (``--lease``, ``--max-attempts``) and prints
``claimed SEQ,SEQ,...``; each delivery prints ``applied SEQ`` or ``seen SEQ``. An event named
``poison`` makes the handler end the process at once (``os._exit(3)``, after printing
``poisoned SEQ``), as a handler that crashes its process would. With ``--hang-after N`` it
waits to be killed after its Nth delivery. It stops after three rounds in a row that found
nothing pending (exit 0; entries under another worker's lease are waited for), or at
``--deadline`` seconds (exit 4).

With ``--relay`` the rounds are `harel_store.Relay.run_once` calls, the same handler its
``on_outbox`` (claims, acks, backoff and releases are then the relay's own; its backoff is
none, so a failed entry is retried at once).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from harel_store import LibsqlStore, OutboxEntry, Relay, StoreConflict
from harel_store.connection import is_remote
from harel_store.store import Store
from tests.workers.common import open_store

IDLE_ROUNDS = 3
IDLE_PAUSE = 0.02


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.workers.engine")
    parser.add_argument("driver", choices=["libsql", "sqlite"])
    parser.add_argument("db")
    parser.add_argument("worker")
    parser.add_argument("--limit", type=int, default=10)
    parser.add_argument("--lease", type=float, default=30.0)
    parser.add_argument("--max-attempts", type=int)
    parser.add_argument("--hang-after", type=int)
    parser.add_argument("--deadline", type=float, default=90.0)
    parser.add_argument("--relay", action="store_true", help="rounds of harel_store.Relay")
    return parser.parse_args(argv)


def deliver(store: Store, entry: OutboxEntry) -> str:
    """Apply the event to its target once; consume the entry in the same commit."""
    assert entry.target_id is not None
    while True:
        exe, seen = store.load_for_event(entry.target_id, entry.event.id)
        if exe is None or seen:
            store.ack([entry])
            return "seen"
        exe.context["applied"].append(entry.event.id)
        try:
            store.commit(exe, [], processed_event_id=entry.event.id, acks=(entry,))
        except StoreConflict:
            continue
        return "applied"


def main() -> None:
    args = parse(sys.argv[1:])
    if is_remote(args.db):
        store: Store = LibsqlStore(args.db, auth_token=os.environ["HAREL_AUTH_TOKEN"])
    else:
        store = open_store(args.driver, args.db)
    deadline = time.monotonic() + args.deadline
    delivered = 0

    def handle(entry: OutboxEntry) -> None:
        nonlocal delivered
        if entry.event.name == "poison":
            print("poisoned", entry.seq, flush=True)
            os._exit(3)
        print(deliver(store, entry), entry.seq, flush=True)
        delivered += 1
        if delivered == args.hang_after:
            while True:  # until the test's SIGKILL
                time.sleep(60)

    def by_hand() -> int:
        entries = store.claim_outbox(
            args.worker, limit=args.limit, lease=args.lease, max_attempts=args.max_attempts
        )
        if entries:
            print("claimed", ",".join(str(e.seq) for e in entries), flush=True)
        for entry in entries:
            handle(entry)
        return len(entries)

    relay = Relay(
        store,
        args.worker,
        on_outbox=handle,
        batch=args.limit,
        lease=args.lease,
        max_attempts=args.max_attempts,
        backoff=(0.0, 0.0),
    )
    round_ = relay.run_once if args.relay else by_hand
    idle = 0
    while idle < IDLE_ROUNDS:
        if time.monotonic() > deadline:
            print(f"{args.worker}: deadline passed", file=sys.stderr)
            raise SystemExit(4)
        if round_():
            idle = 0
            continue
        idle = 0 if store.pending_outbox(limit=1) else idle + 1
        time.sleep(IDLE_PAUSE)
    store.close()
    print("done", delivered, flush=True)


if __name__ == "__main__":
    main()
