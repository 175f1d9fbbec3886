"""``harel-store demo``: the quick start's workflow, into a local file by default."""

from __future__ import annotations

import argparse
import sys

from harel_store import demo
from harel_store.cli.common import Command
from harel_store.cli.output import PROG, token
from harel_store.store import LibsqlStore

DEMO_DATABASE = "harel-demo.db"


def run(args: argparse.Namespace) -> int:
    database = args.url or DEMO_DATABASE
    with LibsqlStore(database, auth_token=token(), sync_url=args.sync_url) as store:
        demo.run(store, sys.stdout)
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
