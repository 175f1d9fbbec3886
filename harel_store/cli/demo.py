"""``harel-store demo``: the quick start's workflow, into a local file by default."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
from pathlib import Path

from harel_store.cli.common import Command
from harel_store.cli.output import PROG
from harel_store.connection import show
from harel_store.connection.url import token_from_env
from harel_store.store import LibsqlStore

DEMO_DATABASE = "harel-demo.db"


def invocation() -> str:
    """The command that runs this program again, as the user can type it where they are.

    ``harel-store`` when that is this program on the PATH; else the script as it was typed
    (``.venv/bin/harel-store``, the quick start's: relative to the working directory, as
    the demo's database is); else, run as ``python -m harel_store``, this interpreter with
    ``-m harel_store``.
    """
    script = sys.argv[0] if sys.argv else ""
    if Path(script).name == PROG:
        found = shutil.which(PROG)
        if found and os.path.exists(script) and os.path.samefile(found, script):
            return PROG
        return shlex.quote(script)
    python = Path(sys.executable).name
    found = shutil.which(python)  # a venv's python is a link to the base one: compare paths
    same = found is not None and os.path.abspath(found) == os.path.abspath(sys.executable)
    return f"{shlex.quote(python if same else sys.executable)} -m harel_store"


def run(args: argparse.Namespace) -> int:
    database = args.url or DEMO_DATABASE
    from harel_store import demo  # and its relay: imported by this command alone

    with LibsqlStore(database, auth_token=token_from_env(), sync_url=args.sync_url) as store:
        order = demo.run(store, sys.stdout)
    # The other commands default to harel.db: name the demo's database in every suggestion,
    # and the program as it can be run from here (the quick start's venv is not on the PATH).
    where = shlex.quote(show(database))
    program = invocation()
    print(f"\nthe demo's database is {where}; look at it with:")
    for command in (
        "status",
        "ls --newest",
        f"show {shlex.quote(order)}",
        f"trace {shlex.quote(order)}",
        "outbox",
        "timers",
    ):
        print(f"  {program} {command} --url {where}")
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
