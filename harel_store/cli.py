"""The ``harel-store`` command."""

from __future__ import annotations

import argparse
import sys

from harel_store import demo
from harel_store.errors import StoreError
from harel_store.store import LibsqlStore


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="harel-store")
    sub = parser.add_subparsers(dest="command", required=True)
    run_demo = sub.add_parser("demo", help="drive a small order workflow through the store")
    run_demo.add_argument("--url", default="harel-demo.db", help="database (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        with LibsqlStore(args.url) as store:
            demo.run(store, sys.stdout)
    except StoreError as exc:
        print(f"harel-store: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
