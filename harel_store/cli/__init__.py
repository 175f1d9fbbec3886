"""The ``harel-store`` command: migrate, inspect, trace and purge a harel-store database.

One module per command group, each command's arguments next to it (`Command.configure`);
what they print goes through `output`. Exit codes: 0 ok, 1 failure, 2 usage. Errors are
one line on stderr; the auth token is never printed.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from typing import NoReturn

from harel_store import __version__
from harel_store.cli import (
    dead,
    demo,
    executions,
    fleet,
    flows,
    gc,
    metrics,
    relays,
    schema,
    status,
    ui,
)
from harel_store.cli.common import Command, limit
from harel_store.cli.output import PROG, Failure, fail
from harel_store.errors import StoreError

__all__ = ["COMMANDS", "Command", "build_parser", "main"]

COMMANDS: list[Command] = [
    *schema.COMMANDS[:1],
    *status.COMMANDS,
    *metrics.COMMANDS,
    *executions.COMMANDS[:3],  # ls, show, trace
    *relays.COMMANDS,
    *dead.COMMANDS,
    *flows.COMMANDS,  # flow, workers, release
    *executions.COMMANDS[3:],  # purge
    *gc.COMMANDS,
    *schema.COMMANDS[1:],
    *ui.COMMANDS,
    *demo.COMMANDS,
]


TOP_HELP = f"""\
Operate a harel-store database: a local file, a remote libSQL URL or an embedded replica.

The database is --url, else $HAREL_DATABASE_URL, else $TURSO_DATABASE_URL, else harel.db
(demo: harel-demo.db): a path, file:, http(s)://, libsql:// (TLS; ?tls=0 for plain HTTP),
ws(s)://, or Alembic's sqlite+libsql:// form. The auth token for a remote database comes
from $HAREL_AUTH_TOKEN, else $TURSO_AUTH_TOKEN (or authToken= in the URL); never printed.

--fleet FILE runs migrate, status, schema --check, gc, ls, flow, workers or release on
every database FILE names (one "NAME DATABASE" per line, # comments), --jobs at once
(default 4): each database's output under its name, then a summary; the exit status is
the worst of them.

--url, --sync-url, --fleet and --jobs go before or after the command (after it wins).

examples:
  {PROG} demo
  {PROG} migrate --url state.db
  HAREL_DATABASE_URL=http://127.0.0.1:8080 {PROG} status
  {PROG} ls --status failed --since 1h --newest
  {PROG} show order-1a2b3c4d
  {PROG} outbox --limit 20
  {PROG} status --check --max-outbox-age 60s
  {PROG} gc --finished-older-than 90d --markers-older-than 30d --dry-run
  {PROG} flow set order-1a2b3c4d --concurrency 4 --rate 100/1m
  {PROG} --fleet fleet.txt status --check
  {PROG} --fleet fleet.txt release --worker relay-1

exit codes: 0 ok, 1 failure, 2 usage error
"""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error is one line too (the usage itself is one ``--help`` away)."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def _global_options(
    parser: argparse.ArgumentParser, default: object, refused: tuple[str, ...] = ()
) -> None:
    """--url, --sync-url, --fleet and --jobs: on the top parser (``default`` None) and on
    each command's (``default`` SUPPRESS, so one given after the command overrides one given
    before it, and one left out after it leaves the one before alone). Those ``refused``
    are still parsed (the command says why it refuses one) but left out of its help."""

    def shown(option: str, text: str) -> str:
        return argparse.SUPPRESS if option in refused else text

    where = parser.add_argument_group("database")
    where.add_argument(
        "--url",
        default=default,
        help="a path, file:, http(s)://, libsql://, ws(s):// or sqlite+libsql:// URL",
    )
    where.add_argument(
        "--sync-url",
        metavar="URL",
        default=default,
        help=shown("--sync-url", "open --url as an embedded replica of this primary"),
    )
    many = parser.add_argument_group("fleet")
    many.add_argument(
        "--fleet",
        metavar="FILE",
        default=default,
        help="run the command on every database of FILE (one NAME DATABASE per line)",
    )
    many.add_argument(
        "--jobs",
        type=limit,
        metavar="N",
        default=default,
        help=shown("--jobs", f"with --fleet: how many databases at once (default {fleet.JOBS})"),
    )


_FLEET_OPTIONS = ("--fleet", "--jobs")


def _without_fleet(argv: list[str]) -> list[str]:
    """``argv`` without --fleet and --jobs (and their values), wherever they stand: what
    each database of the fleet runs. A token that argparse took for one of them is one of
    them, or an unambiguous prefix of one (``--fl``); never a value, which argparse does not
    take from a token that starts with ``--``."""
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            rest += argv[i:]
            break
        name, eq, _ = token.partition("=")
        if (
            len(name) > 2
            and name.startswith("--")
            and any(option.startswith(name) for option in _FLEET_OPTIONS)
        ):
            i += 1 if eq else 2
            continue
        rest.append(token)
        i += 1
    return rest


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = _Parser(prog=PROG, description=TOP_HELP, formatter_class=raw)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    _global_options(parser, None)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        p = sub.add_parser(
            command.name,
            help=command.summary,
            description=command.summary,
            epilog=command.epilog,
            formatter_class=raw,
        )
        _global_options(p, argparse.SUPPRESS, command.refuses)
        p.set_defaults(run=command.run)
        command.configure(p)
        for nested in _actions_of(p):  # `flow set ... --url X` as `flow --url X set ...`
            _global_options(nested, argparse.SUPPRESS, command.refuses)
    return parser


def _actions_of(parser: argparse.ArgumentParser) -> list[argparse.ArgumentParser]:
    """The parsers of a command's own subcommands (``flow ls``, ``flow set``...), if any."""
    return [
        nested
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for nested in action.choices.values()
    ]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)  # usage errors exit 2 here
    # libsql's replica client logs INFO lines (in colour) to stdout unless RUST_LOG is set,
    # which would corrupt piped output; failures reach us as exceptions anyway.
    os.environ.setdefault("RUST_LOG", "off")
    run: Callable[[argparse.Namespace], int] = args.run
    try:
        if args.fleet is not None and args.command != "ui":  # the console shows them all
            return fleet.run(args, _without_fleet(argv))
        if args.jobs is not None:
            raise ValueError(
                "--jobs is for --fleet: how many of its databases at once"
                + (" (ui reads them all at once)" if args.command == "ui" else "")
            )
        return run(args)
    except (Failure, StoreError) as exc:  # SchemaError says to run `harel-store migrate`
        return fail(str(exc), 1)
    except (ValueError, TypeError) as exc:
        return fail(str(exc), 2)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly, with no flush error at exit.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # alembic, SQLAlchemy, the OS: still one line, no traceback
        first = (str(exc).strip().splitlines() or [""])[0]
        return fail(f"{type(exc).__name__}: {first}" if first else type(exc).__name__, 1)


if __name__ == "__main__":
    sys.exit(main())
