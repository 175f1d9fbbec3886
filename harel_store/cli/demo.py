"""``harel-store demo``: the quick start's workflow, into a local file by default."""

from __future__ import annotations

import argparse
import shlex
import sys

from harel_store import demo
from harel_store.cli.common import Command
from harel_store.cli.output import PROG
from harel_store.connection import show
from harel_store.connection.url import token_from_env
from harel_store.store import LibsqlStore

DEMO_DATABASE = "harel-demo.db"


def run(args: argparse.Namespace) -> int:
    database = args.url or DEMO_DATABASE
    with LibsqlStore(database, auth_token=token_from_env(), sync_url=args.sync_url) as store:
        order = demo.run(store, sys.stdout)
    # The other commands default to harel.db: name the demo's database in every suggestion.
    where = shlex.quote(show(database))
    print(f"\nthe demo's database is {where}; look at it with:")
    for command in (
        "status",
        "ls --newest",
        f"show {shlex.quote(order)}",
        f"trace {shlex.quote(order)}",
        "outbox",
        "timers",
    ):
        print(f"  {PROG} {command} --url {where}")
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    del parser  # --url and --sync-url only


COMMANDS = [
    Command(
        "demo",
        "drive a small order workflow through the store (quick start)",
        f"""examples:
  {PROG} demo                  # into {DEMO_DATABASE}
  {PROG} demo --url other.db""",
        run,
        configure,
    )
]
