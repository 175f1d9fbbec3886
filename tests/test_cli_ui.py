"""``harel-store ui``: served by a real process, its one line, its exit on SIGTERM and SIGINT
(with a live stream open), the token it requires off loopback, --fleet."""

from __future__ import annotations

import http.client
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from harel_store import Execution, LibsqlStore

WAIT = 30.0


def line_of(proc: subprocess.Popen[bytes], timeout: float = WAIT) -> str:
    """The process's first stdout line, within ``timeout`` (never a read that blocks forever)."""
    assert proc.stdout is not None
    fd, got, end = proc.stdout.fileno(), b"", time.monotonic() + timeout
    while not got.endswith(b"\n"):
        left = end - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            pytest.fail(f"no line within {timeout} s (so far {got!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            pytest.fail(
                f"stdout ended: {got!r}; stderr: {proc.stderr.read() if proc.stderr else ''}"
            )
        got += chunk
    return got.decode()


@contextmanager
def console(*args: str, env: dict[str, str] | None = None) -> Iterator[subprocess.Popen[bytes]]:
    command = [sys.executable, "-m", "harel_store", *args]
    proc = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT)


def get(port: int, path: str, host: str = "127.0.0.1", **headers: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection(host, port, timeout=WAIT)
    try:
        conn.request("GET", path, headers=headers)
        answer = conn.getresponse()
        return answer.status, answer.read().decode()
    finally:
        conn.close()


@pytest.fixture
def db(tmp_path: Path) -> Path:
    path = tmp_path / "ui.db"
    with LibsqlStore(path) as store:
        store.commit(Execution(id="order-1", definition_id="order"), [])
    return path


@pytest.mark.slow
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_it_serves_says_where_and_stops_cleanly_with_a_stream_open(
    db: Path, stop: signal.Signals
) -> None:
    with console("ui", "--url", str(db), "--listen", "127.0.0.1:0") as proc:
        line = line_of(proc)
        assert line.startswith("serving http://127.0.0.1:") and line.endswith("/\n")
        port = int(line.rsplit(":", 1)[1].rstrip("/\n"))
        status, page = get(port, "/executions")
        assert status == 200 and "order-1" in page
        stream = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT)
        stream.request("GET", "/live")
        answer = stream.getresponse()
        assert answer.status == 200 and answer.getheader("content-type", "").startswith(
            "text/event-stream"
        )
        assert answer.readline() == b"retry: 1000\n"
        started = time.monotonic()
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=WAIT)
        stream.close()
        assert proc.returncode == 0, err
        assert err == b"", err
        assert time.monotonic() - started < 10
        assert proc.stdout is not None


@pytest.mark.slow
def test_off_loopback_it_needs_a_token_and_then_every_request_does(db: Path) -> None:
    with console("ui", "--url", str(db), "--listen", "0.0.0.0:0") as proc:
        _, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 2
    lines = err.decode().splitlines()
    assert len(lines) == 1 and "HAREL_UI_TOKEN" in lines[0], lines
    env = {"HAREL_UI_TOKEN": "tok-123456"}
    with console("ui", "--url", str(db), "--listen", "0.0.0.0:0", env=env) as proc:
        port = int(line_of(proc).rsplit(":", 1)[1].rstrip("/\n"))
        status, page = get(port, "/")
        assert status == 401 and "tok-123456" not in page
        assert get(port, "/", Authorization="Bearer tok-123456")[0] == 200
        assert get(port, "/", Host="rebound.example", Authorization="Bearer tok-123456")[0] == 400


@pytest.mark.slow
def test_a_fleet_file_serves_every_database(tmp_path: Path, db: Path) -> None:
    other = tmp_path / "other.db"
    with LibsqlStore(other) as store:
        store.commit(Execution(id="refund-9", definition_id="refund"), [])
    fleet = tmp_path / "fleet.txt"
    fleet.write_text(f"# two\nmain {db}\nother {other}\n")
    with console("--fleet", str(fleet), "ui", "--listen", "127.0.0.1:0") as proc:
        port = int(line_of(proc).rsplit(":", 1)[1].rstrip("/\n"))
        status, page = get(port, "/executions")
        assert status == 200 and "order-1" in page and "refund-9" in page
        status, page = get(port, "/")
        assert 'data-database="main"' in page and 'data-database="other"' in page


def test_a_missing_database_is_one_line_and_no_file_is_made(tmp_path: Path) -> None:
    missing = tmp_path / "missing.db"
    with console("ui", "--url", str(missing), "--listen", "127.0.0.1:0") as proc:
        out, err = proc.communicate(timeout=WAIT)
    assert proc.returncode == 2 and out == b""
    assert len(err.decode().splitlines()) == 1 and "no database" in err.decode()
    assert not missing.exists()
