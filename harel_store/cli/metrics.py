"""``metrics``: the database's gauges in the Prometheus text format, printed once (a
textfile collector, a cron) or served at ``/metrics`` with ``--listen`` (each scrape reads
them anew). Every gauge of a scrape comes from one statement (``metrics`` in
sql/queries.sql): one consistent read. Needs the ``prometheus`` extra (prometheus-client)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

from harel_store.batch import Plan, statement
from harel_store.cli.common import Command, database, open_store
from harel_store.cli.output import PROG, Failure, scrub
from harel_store.connection import show
from harel_store.connection.revision import ensure_schema
from harel_store.errors import StoreError
from harel_store.models import STATUSES
from harel_store.store import Store

KINDS = ("outbox", "spawn", "timer")
IDLE_TIMEOUT = 5.0  # seconds a --listen connection may stay silent before it is closed
MAX_CONNECTIONS = 16  # --listen connections at once; one more is closed as it comes

# name, help, the query's rows it is made of, its label (None: no label)
GAUGES = (
    ("executions", "Executions by status.", "executions", "status"),
    (
        "pending_items",
        "Relay items waiting: outbox entries, spawns, due timers.",
        "pending",
        "kind",
    ),
    ("claimed_items", "Relay items a worker holds under a live lease.", "claimed", "kind"),
    ("dead_items", "Dead letters: items that reached max_attempts.", "dead", "kind"),
    ("timers_scheduled", "Live timers not yet due.", "scheduled", None),
)


def snapshot(where: str, now: float) -> Plan[dict[tuple[str, str | None], float | None]]:
    """The ``metrics`` statement's rows by (name, label), once the schema is found at head
    (SchemaError if not: a server at ``--listen`` may be migrated or downgraded under it)."""
    yield from ensure_schema(where, False)
    rows = yield statement("metrics", now)
    return {(name, label): value for name, label, value in rows}


def families(store: Store, where: str) -> Iterator[Any]:
    """The gauges of one consistent read, as prometheus-client metric families."""
    from prometheus_client.core import GaugeMetricFamily

    now = time.time()
    read = store._run(snapshot(where, now))

    def family(name: str, text: str, label: str | None = None) -> Any:
        labels = ["database", label] if label else ["database"]
        return GaugeMetricFamily(f"harel_store_{name}", text, labels=labels)

    for name, text, row, label in GAUGES:
        gauge = family(name, text, label)
        if label is None:
            gauge.add_metric([where], read.get((row, "timer")) or 0.0)
        else:
            keys = STATUSES if row == "executions" else KINDS
            more = sorted(k for r, k in read if r == row and k is not None and k not in keys)
            for key in (*keys, *more):  # a status the store does not know: "unknown"
                gauge.add_metric([where, key], read.get((row, key)) or 0.0)
        yield gauge
    clock = read.get(("now", None)) or now
    oldest = family(
        "oldest_pending_age_seconds",
        "Age of the oldest pending outbox entry and spawn (0: none), on the database's clock.",
        "kind",
    )
    for kind in KINDS[:2]:
        at = read.get(("oldest_at", kind))
        pending = read.get(("pending", kind)) or 0
        oldest.add_metric([where, kind], max(clock - at, 0.0) if at is not None and pending else 0)
    yield oldest
    lag = family("timer_lag_seconds", "How late the most overdue timer is (0: none due).")
    soonest = read.get(("soonest_at", "timer"))
    lag.add_metric([where], max(now - soonest, 0.0) if soonest is not None else 0.0)
    yield lag


def exposition(store: Store, where: str) -> bytes:
    """The Prometheus text of one read."""
    from prometheus_client import CollectorRegistry, generate_latest

    class Collector:
        def collect(self) -> Iterator[Any]:
            return families(store, where)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Collector())
    return generate_latest(registry)


def _require_client() -> None:
    try:
        import prometheus_client  # noqa: F401
    except ImportError:
        raise Failure(
            "metrics needs prometheus-client: pip install 'prometheus-client>=0.20' "
            "(or, from a harel-store checkout, pip install -e '.[prometheus]')"
        ) from None


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, not {text!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def metrics(args: argparse.Namespace) -> int:
    _require_client()
    where = show(database(args))
    if args.listen is None:
        with open_store(args, read_only=True) as store:
            sys.stdout.buffer.write(exposition(store, where))
            sys.stdout.flush()
            return 0
    # Served: the schema is checked at each scrape, not once here (503 until it is at head).
    with open_store(args, read_only=True, check=False) as store:
        return _serve(store, where, args.listen)


class _Server(ThreadingHTTPServer):
    """At most MAX_CONNECTIONS connections at once, each in a thread of its own; one more
    is closed as it comes (a flood of idle sockets holds no more threads or descriptors)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]) -> None:
        super().__init__(address, handler)
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self._lock = threading.Lock()
        self._reading: dict[socket.socket, float] = {}  # requests not yet in: since when

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        with self._lock:
            self._reading[request] = time.monotonic()
        try:
            super().process_request(request, client_address)
        except Exception:  # the thread did not start ("can't start new thread"): slot free
            self.request_read(request)
            self._slots.release()
            raise
        # An interrupt (SIGTERM) here came while the thread started, which frees its slot
        # itself: releasing it here too failed, and that error hid the interrupt (served on).

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.request_read(request)
            self._slots.release()

    def request_read(self, request: socket.socket) -> None:
        """``request``'s request is in (or its connection over): no deadline cuts it now."""
        with self._lock:
            self._reading.pop(request, None)

    def service_actions(self) -> None:
        """Twice a second: a connection whose request is not in within IDLE_TIMEOUT of its
        accept is cut, however it dribbles its bytes (a slow client holds a slot no longer)."""
        late = time.monotonic() - IDLE_TIMEOUT
        with self._lock:
            cut = [request for request, since in self._reading.items() if since <= late]
        for request in cut:
            with contextlib.suppress(OSError):  # closed meanwhile
                request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away is no news; anything else is one line, no traceback."""
        exc = sys.exc_info()[1]
        if not isinstance(exc, OSError):
            line = scrub(f"{PROG}: a request to /metrics failed: {type(exc).__name__}: {exc}")
            print(line, file=sys.stderr, flush=True)


def _serve(store: Store, where: str, address: tuple[str, int]) -> int:
    class Handler(BaseHTTPRequestHandler):
        timeout = IDLE_TIMEOUT  # a silent client's connection is closed, its thread freed

        def do_GET(self) -> None:
            server.request_read(self.connection)
            if self.path.split("?")[0] != "/metrics":
                self._send(404, b"not found: the gauges are at /metrics\n", "text/plain")
                return
            try:
                body = exposition(store, where)
            except StoreError as exc:  # one line (the store's words, scrubbed of secrets)
                self._send(503, f"{scrub(str(exc))}\n".encode(), "text/plain")
                return
            self._send(200, body, "text/plain; version=0.0.4; charset=utf-8")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            """Quiet: a scrape every few seconds is no news."""

    server = _Server(address, Handler)
    host, port = str(server.server_address[0]), int(server.server_address[1])

    def stop(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(f"{PROG}: serving the gauges of {where} at http://{host}:{port}/metrics", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--listen",
        type=_address,
        metavar="HOST:PORT",
        help="serve the gauges at http://HOST:PORT/metrics, read anew at each scrape, "
        "until SIGTERM or Ctrl-C (port 0: any free port, printed)",
    )


COMMANDS = [
    Command(
        "metrics",
        "the database's gauges in the Prometheus text format; --listen to serve /metrics",
        f"""Gauges (every one labelled with the database, never its token): executions by
status, relay items pending, claimed and dead by kind, timers scheduled, the oldest pending
outbox entry's and spawn's age, the most overdue timer's lag. One consistent read each time.

--listen HOST:PORT serves them at http://HOST:PORT/metrics until SIGTERM (port 0: a free
port, printed), each scrape one read; a read that fails, or a schema not at head (checked
at every scrape), answers 503 with the store's one-line error. A connection whose request is
not in {IDLE_TIMEOUT:g} s after it opened is closed; beyond {MAX_CONNECTIONS} at once, a new one is
closed at once.

examples:
  {PROG} metrics
  {PROG} metrics > harel_store.prom   # node_exporter's textfile collector reads *.prom""",
        metrics,
        configure,
    )
]
