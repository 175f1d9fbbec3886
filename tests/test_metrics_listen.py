"""``harel-store metrics --listen`` as a real process: the schema checked at every scrape
(503 with one line while it is not at head, 200 once it is, 503 again after a downgrade),
and idle connections closed after a few seconds, never more than a cap held at once
(issue 48, classes 10 and 18)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harel_store import HEAD, Execution, LibsqlStore
from harel_store.cli.metrics import IDLE_TIMEOUT, MAX_CONNECTIONS
from harel_store.sql import MIGRATIONS
from tests.helpers import alembic_steps
from tests.test_cli import CLI, cli, ok

OLD = MIGRATIONS[-2].revision


@contextmanager
def listening(db: str) -> Iterator[tuple[subprocess.Popen[str], str]]:
    """``metrics --listen`` on ``db``: the process and its /metrics URL; SIGTERM at the end,
    after which it must exit 0 with no traceback."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("HAREL_")}
    proc = subprocess.Popen(
        [str(CLI), "metrics", "--url", db, "--listen", "127.0.0.1:0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert line.startswith("harel-store: serving the gauges of "), (line, proc.wait())
        yield proc, line.split(" at ")[1].strip()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        _, err = proc.communicate()
    assert "Traceback" not in err, err


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return int(reply.status), str(reply.read().decode())
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read().decode()


def test_a_schema_behind_head_answers_503_until_migrated_and_again_after_a_downgrade(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "m.db")
    LibsqlStore(db).close()
    alembic_steps((Path(db), "downgrade", OLD))
    with listening(db) as (_, url):  # it starts, behind head
        status, body = get(url)
        assert status == 503, body
        assert body.count("\n") == 1 and f"behind head {HEAD!r}" in body, body
        assert "harel-store migrate" in body, body
        ok(cli("migrate", "--url", db))
        status, body = get(url)
        assert status == 200 and "harel_store_executions" in body, body
        with LibsqlStore(db) as store:
            store.save(Execution(id="exe-1", definition_id="d"))
        assert 'status="running"} 1.0' in get(url)[1]
        alembic_steps((Path(db), "downgrade", OLD))
        status, body = get(url)
        assert status == 503 and f"is at {OLD!r}" in body, body


def threads(proc: subprocess.Popen[str]) -> int:
    return len(os.listdir(f"/proc/{proc.pid}/task"))


def closed_by_peer(sock: socket.socket, deadline: float) -> bool:
    """Whether the server closes ``sock`` before ``deadline`` (monotonic)."""
    sock.settimeout(max(deadline - time.monotonic(), 0.01))
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def until(check: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.mark.slow
def test_idle_connections_are_closed_and_capped_and_their_threads_reclaimed(
    tmp_path: Path,
) -> None:
    db = str(tmp_path / "m.db")
    LibsqlStore(db).close()
    idle = 25
    assert idle > MAX_CONNECTIONS
    with listening(db) as (proc, url):
        assert get(url)[0] == 200
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        before = threads(proc)
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(idle)]
        try:
            time.sleep(0.5)
            assert threads(proc) <= before + MAX_CONNECTIONS, threads(proc)
            deadline = time.monotonic() + IDLE_TIMEOUT + 10
            assert all(closed_by_peer(s, deadline) for s in socks)
        finally:
            for s in socks:
                s.close()
        assert until(lambda: threads(proc) <= before, 10), (threads(proc), before)
        status, body = get(url)  # it still serves
        assert status == 200 and "harel_store_executions" in body


def test_an_interrupt_as_a_connections_thread_starts_stops_the_server(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SIGTERM while the accepting thread waits for a connection's thread to start (on a busy
    machine that thread may already have served and ended): the interrupt ends the server.
    Before, the slot was freed twice, and the ValueError that raised hid the interrupt: the
    server served on after SIGTERM."""
    import threading
    from http.server import BaseHTTPRequestHandler

    from harel_store.cli.metrics import _Server

    def start_served_then_interrupted(thread: threading.Thread) -> None:
        thread.run()  # the connection's thread has run to its end...
        raise KeyboardInterrupt  # ...as the signal comes in Thread.start's wait

    server = _Server(("127.0.0.1", 0), BaseHTTPRequestHandler)
    try:
        with socket.create_connection(server.server_address) as client:
            client.close()
            request, address = server.get_request()
            monkeypatch.setattr(threading.Thread, "start", start_served_then_interrupted)
            with pytest.raises(KeyboardInterrupt):
                server.process_request(request, address)
            monkeypatch.undo()
        for _ in range(MAX_CONNECTIONS):  # every slot is free again, and no more than that
            assert server._slots.acquire(blocking=False)
        assert not server._slots.acquire(blocking=False)
    finally:
        server.server_close()


@pytest.mark.slow
def test_clients_that_dribble_their_request_hold_no_slot_past_the_deadline(
    tmp_path: Path,
) -> None:
    """Each of MAX_CONNECTIONS clients sends a byte of its request every second (no read
    waits IDLE_TIMEOUT): past IDLE_TIMEOUT from their accept they are cut, and a scrape is
    served. Before, the timeout was a read's: they held every slot for as long as they
    liked, and every scrape was refused."""
    db = str(tmp_path / "m.db")
    LibsqlStore(db).close()
    with listening(db) as (_, url):
        host, port = url.split("//")[1].split("/")[0].rsplit(":", 1)
        socks = [
            socket.create_connection((host, int(port)), timeout=10) for _ in range(MAX_CONNECTIONS)
        ]
        try:
            began = time.monotonic()
            cut = 0
            while time.monotonic() - began < IDLE_TIMEOUT + 3 and cut < len(socks):
                cut = 0
                for sock in socks:
                    try:
                        sock.sendall(b"G")
                    except OSError:
                        cut += 1
                time.sleep(1)
            assert cut == len(socks), f"{len(socks) - cut} dribbling clients still connected"
            assert get(url)[0] == 200
        finally:
            for sock in socks:
                sock.close()
