"""``ui``: the console (`harel_store.ui`) served with uvicorn, over --url's database or, with
--fleet, over every database of the fleet file. Needs the ``ui`` extra."""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import signal
import socket
import sys
import threading
from types import FrameType

from harel_store.cli.common import Command, database
from harel_store.cli.output import PROG, Failure

DEFAULT_LISTEN = "127.0.0.1:8765"
TOKEN_VARIABLE = "HAREL_UI_TOKEN"
STOP_WITHIN = 5.0  # seconds a stopping server has to finish the requests in hand


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    host = host.strip("[]")
    if not host:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a host, not {text!r}")
    return host, int(port)


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def ui(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from harel_store.ui import app
        from harel_store.ui.source import Source
    except ImportError as exc:
        raise Failure(f"ui needs the ui extra: pip install 'harel-store[ui]' ({exc})") from None
    host, port = args.listen
    token = os.environ.get(TOKEN_VARIABLE) or None
    if token is None and not loopback(host):
        print(
            f"{PROG}: ui: {host} is reachable from other machines: set {TOKEN_VARIABLE} "
            "(every request then needs it), or listen on 127.0.0.1",
            file=sys.stderr,
        )
        return 2
    source: Source
    if args.fleet is not None:
        from harel_store.cli.fleet import read_fleet

        if args.url is not None or args.sync_url is not None:
            raise ValueError("--fleet names every database: give no --url or --sync-url")
        source = read_fleet(args.fleet)
    else:
        if args.sync_url is not None:
            raise ValueError("ui reads --url itself (a replica's primary: give its URL)")
        source = database(args)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        console = app(source, actions=args.actions, token=token, hosts=[host])
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise Failure(f"ui: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    shown = f"[{host}]" if family == socket.AF_INET6 else host
    config = uvicorn.Config(
        console,
        log_config=None,  # uvicorn's own writes to stdout, which may be closed
        log_level="warning",
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=1,
        server_header=False,
    )
    server = uvicorn.Server(config)
    # The server runs on a thread of its own; this one waits for SIGTERM or SIGINT, then ends
    # the live streams (a server stopping waits for its responses to end) and stops it.
    stopping = threading.Event()

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="harel-store ui", daemon=True
    )
    thread.start()
    if sys.stdout is not None:
        with contextlib.suppress(OSError):  # nobody reads it (closed, a reader gone)
            print(f"serving http://{shown}:{sock.getsockname()[1]}/", flush=True)
    try:
        while thread.is_alive() and not stopping.wait(1.0):
            pass
        console.close_streams()  # type: ignore[attr-defined]
        server.should_exit = True
        thread.join(STOP_WITHIN)
    finally:
        sock.close()
    return 0 if stopping.is_set() else 1


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=_address,
        default=_address(DEFAULT_LISTEN),
        metavar="HOST:PORT",
        help=f"where to serve it (default {DEFAULT_LISTEN}; port 0: a free one)",
    )
    parser.add_argument(
        "--actions",
        action="store_true",
        help="let it act: revive and discard dead letters (read-only without)",
    )


COMMANDS = [
    Command(
        "ui",
        "serve the console: the database's executions, traces, dead letters and timers, live",
        f"""\
Serves the console in a browser: an overview with health, the executions (filters, pages),
each execution's record, trace timeline and pending work, dead letters and timers; every
open page updates as the database changes. Read-only unless --actions. It never migrates.

Outside loopback it needs ${TOKEN_VARIABLE}: every request must then carry it (the login
form sets a session cookie; or Authorization: Bearer). Prints "serving http://HOST:PORT/"
once it accepts connections; SIGTERM or Ctrl-C stops it.

examples:
  {PROG} ui --url state.db
  {PROG} ui --url http://127.0.0.1:8080 --actions
  {PROG} ui --fleet fleet.txt --listen 127.0.0.1:9000
  {TOKEN_VARIABLE}=$(openssl rand -hex 16) {PROG} ui --listen 0.0.0.0:8765
""",
        ui,
        configure,
        refuses=("--sync-url", "--jobs"),
    )
]
