"""A relay worker: claim outbox entries, spawns and due timers, deliver them, ack them.

``python -m tests.workers.relay DRIVER DB_OR_URL WORKER_ID OUT_FILE [GO_FILE] [options]``

DB_OR_URL is a file (DRIVER ``libsql`` or ``sqlite``) or a server's URL (DRIVER ``libsql``;
the token in the environment variable named by ``--token-env``, never on the command line).
With GO_FILE it prints ``ready`` once the store is open and waits for GO_FILE to exist.

Each round claims up to ``--limit`` outbox entries, spawns and timers due at ``--now`` (in
that order) under a lease of ``--lease`` seconds and prints ``claimed N ITEMS`` (ITEMS: a
JSON list). Then, for each item, it "delivers" it by appending one line to OUT_FILE
(``outbox SEQ``, ``spawn SEQ``, ``timer EXECUTION_ID PATH``; flushed and fsynced), prints
``delivered ITEM``, sleeps ``--slow`` seconds and acks it (ack_outbox, ack_spawn,
delete_timer). So OUT_FILE lists at least every item whose ack was sent. With
``--hang-after N`` it waits to be killed after its Nth delivery, before that item's ack:
it then holds claims it never delivered and one item delivered but not acked.

It stops after three rounds in a row that claimed nothing with nothing pending (a round
that finds items pending under another worker's lease waits for them), printing ``done
REPORT`` (exit 0), or at ``--deadline`` seconds (exit 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import IO

from harel_store import LibsqlStore
from harel_store.connection import is_remote
from harel_store.store import Store
from tests.workers.common import open_store

IDLE_ROUNDS = 3
IDLE_PAUSE = 0.02  # seconds between rounds that claimed nothing
FAR_FUTURE = 1e11  # epoch seconds (year 5138): every timer is due


def parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tests.workers.relay")
    parser.add_argument("driver", choices=["libsql", "sqlite"])
    parser.add_argument("db", help="a file, or a server's URL (driver libsql)")
    parser.add_argument("worker", help="the worker id its claims carry")
    parser.add_argument("out", help="the delivery log, appended to")
    parser.add_argument("go", nargs="?", help="print ready, then wait for this file")
    parser.add_argument("--lease", type=float, default=30.0, help="seconds (default 30)")
    parser.add_argument("--limit", type=int, default=10, help="items per claim (default 10)")
    parser.add_argument("--now", type=float, default=FAR_FUTURE, help="the timer sweep's now")
    parser.add_argument("--slow", type=float, default=0.0, help="seconds between deliver, ack")
    parser.add_argument("--hang-after", type=int, help="hang after this many deliveries")
    parser.add_argument("--deadline", type=float, default=90.0, help="give up after (seconds)")
    parser.add_argument("--token-env", default="HAREL_AUTH_TOKEN", help="a remote store's token")
    # Intermixed: GO_FILE may follow the options (tests.workers.common.race appends it).
    return parser.parse_intermixed_args(argv)


def open_relay_store(args: argparse.Namespace) -> Store:
    if is_remote(args.db):
        if args.driver != "libsql":
            raise SystemExit(f"a server's URL needs the libsql driver, not {args.driver}")
        return LibsqlStore(args.db, auth_token=os.environ[args.token_env])
    return open_store(args.driver, args.db)


class Relay:
    """Delivers items to OUT_FILE: one line each, on disk before the ack is sent."""

    def __init__(self, out: IO[str], args: argparse.Namespace) -> None:
        self.out = out
        self.slow: float = args.slow
        self.hang_after: int | None = args.hang_after
        self.delivered = 0

    def deliver(self, item: str) -> None:
        self.out.write(item + "\n")
        self.out.flush()
        os.fsync(self.out.fileno())
        self.delivered += 1
        print("delivered", item, flush=True)
        if self.delivered == self.hang_after:
            while True:  # until the test's SIGKILL
                time.sleep(60)
        time.sleep(self.slow)


def main() -> None:
    args = parse(sys.argv[1:])
    store = open_relay_store(args)
    if args.go is not None:
        print("ready", flush=True)
        while not os.path.exists(args.go):
            time.sleep(0.001)
    deadline = time.monotonic() + args.deadline
    rounds = waited = idle = 0
    with open(args.out, "a", encoding="utf-8") as out:
        relay = Relay(out, args)
        while idle < IDLE_ROUNDS:
            if time.monotonic() > deadline:
                print(f"{args.worker}: deadline passed after {rounds} rounds", file=sys.stderr)
                raise SystemExit(3)
            rounds += 1
            worker, limit, lease = args.worker, args.limit, args.lease
            outbox = store.claim_outbox(worker, limit=limit, lease=lease)
            spawns = store.claim_spawns(worker, limit=limit, lease=lease)
            timers = store.claim_due_timers(worker, args.now, limit=limit, lease=lease)
            items = [f"outbox {e.seq}" for e in outbox] + [f"spawn {s.seq}" for s in spawns]
            items += [f"timer {eid} {path}" for eid, path, _ in timers]
            if not items:
                if (
                    store.pending_outbox(limit=1)
                    or store.pending_spawns(limit=1)
                    or store.due_timers(args.now, limit=1)
                ):
                    idle = 0  # held by another worker's lease: wait for its ack or expiry
                    waited += 1
                else:
                    idle += 1
                time.sleep(IDLE_PAUSE)
                continue
            idle = 0
            print("claimed", len(items), json.dumps(items), flush=True)
            for entry in outbox:
                relay.deliver(f"outbox {entry.seq}")
                store.ack_outbox(entry.seq)
            for spawn in spawns:
                relay.deliver(f"spawn {spawn.seq}")
                store.ack_spawn(spawn.seq)
            for eid, path, fire_at in timers:
                relay.deliver(f"timer {eid} {path}")
                store.delete_timer(eid, path, fire_at)
    store.close()
    report = {"delivered": relay.delivered, "rounds": rounds, "waited": waited}
    print("done", json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
