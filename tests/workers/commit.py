"""Another process's commits, one a command: what wakes a relay or a waiter elsewhere.

``python -m tests.workers.commit DRIVER DB_OR_URL COMMAND...``

DB_OR_URL is a file (DRIVER ``libsql`` or ``sqlite``) or a server's URL (the token in
``$HAREL_AUTH_TOKEN``). Commands, run in order, each one commit of the execution
``source`` (made at its first):

- ``emit TARGET``: an event to TARGET; prints ``emitted`` and the wall-clock time the
  commit returned at;
- ``timer SECONDS``: arms the timer ``t`` of ``source`` SECONDS from now; prints ``armed``
  and its fire_at;
- ``finish EXECUTION``: loads EXECUTION and commits it finished; prints ``finished`` and
  the time;
- ``sleep SECONDS``.
"""

from __future__ import annotations

import os
import sys
import time

from harel_store import Event, Execution, LibsqlStore, TimerOp
from harel_store.connection import is_remote
from harel_store.store import Store
from tests.workers.common import open_store


def main() -> None:
    driver, database, *commands = sys.argv[1:]
    if is_remote(database):
        store: Store = LibsqlStore(database, auth_token=os.environ["HAREL_AUTH_TOKEN"])
    else:
        store = open_store(driver, database)
    with store:
        source = store.load("source") or Execution(id="source", definition_id="d")
        while commands:
            command, argument, *commands = commands
            if command == "emit":
                store.commit(source, [(argument, Event(name="go"))])
                print("emitted", time.time(), flush=True)
            elif command == "timer":
                fire_at = time.time() + float(argument)
                store.commit(source, [], timers=[TimerOp.schedule("t", fire_at)])
                print("armed", fire_at, flush=True)
            elif command == "finish":
                exe = store.load(argument)
                assert exe is not None, argument
                exe.status, exe.outcome = "finished", "done"
                store.commit(exe, [])
                print("finished", time.time(), flush=True)
            elif command == "sleep":
                time.sleep(float(argument))
            else:
                raise SystemExit(f"unknown command {command!r}")


if __name__ == "__main__":
    main()
