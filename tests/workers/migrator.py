"""Bring a database to the head schema, the store's way or Alembic's, with a hook to hold.

``python -m tests.workers.migrator {store|alembic} DB [--driver D] [--go FILE]
[--hold REV --hold-for SECONDS] [--target REV]``

Prints ``applying REV`` inside the transaction of each migration it really applies (after
its statements ran, before COMMIT). With ``--hold REV`` it then prints ``holding`` and
sleeps there, the write lock held, so a test can make others wait or SIGKILL it mid-way.
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

from harel_store import migrate
from harel_store.connection import LocalConnection
from harel_store.connection.local import LibsqlConnection
from harel_store.sql import Query
from tests.workers.common import REPO, open_store


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["store", "alembic"])
    parser.add_argument("db")
    parser.add_argument("--driver", default="libsql")
    parser.add_argument("--go")
    parser.add_argument("--hold")
    parser.add_argument("--hold-for", type=float, default=3600.0)
    parser.add_argument("--target", default="head")
    parser.add_argument("--pause-between", type=float, default=0.0)
    args = parser.parse_args()

    def applied(rev: str) -> None:
        print(f"applying {rev}", flush=True)
        if rev == args.hold:
            print("holding", flush=True)
            time.sleep(args.hold_for)

    if args.mode == "store":
        # A migration is one batch: its revision guard, then its statements, then COMMIT.
        claimed: list[str] = []
        commit = LocalConnection._commit

        def hooked_commit(self: LocalConnection) -> None:
            if claimed:
                applied(claimed.pop())
            commit(self)

        LocalConnection._commit = hooked_commit  # type: ignore[method-assign]
        for cls in (LocalConnection, LibsqlConnection):  # sqlite3's statements, libsql's
            execute = cls._execute

            def hooked_execute(
                self: LocalConnection, query: Query, params: Any, execute: Any = execute
            ) -> Any:
                if query.name == "begin":
                    claimed.clear()
                elif query.name in ("claim_revision", "update_revision"):
                    claimed.append(params[0])
                return execute(self, query, params)

            cls._execute = hooked_execute  # type: ignore[method-assign]
    else:
        run_sql = migrate.run_sql

        def hooked_run_sql(filename: str) -> None:
            run_sql(filename)
            if filename.endswith(".up.sql"):
                applied(filename[:4])

        migrate.run_sql = hooked_run_sql  # the revisions import it when Alembic loads them
        if args.pause_between:
            # A slow process (scheduling, GC) between two migrations of one upgrade.
            from alembic.runtime.migration import MigrationContext

            begin = MigrationContext.begin_transaction
            calls = []

            def paused(self: MigrationContext, _per_migration: bool = False) -> Any:
                if _per_migration:
                    if calls:
                        time.sleep(args.pause_between)
                    calls.append(1)
                return begin(self, _per_migration)

            MigrationContext.begin_transaction = paused  # type: ignore[method-assign]

    print("ready", flush=True)
    while args.go and not os.path.exists(args.go):
        time.sleep(0.001)
    if args.mode == "store":
        open_store(args.driver, args.db).close()
    else:
        from alembic.config import main as alembic

        ini = str(REPO / "alembic.ini")
        alembic(argv=["-c", ini, "-x", f"url={args.db}", "upgrade", args.target])
    print("done", flush=True)


if __name__ == "__main__":
    main()
