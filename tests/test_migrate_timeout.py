"""A migration against a server that stops answering ends at its timeout with one line and a
plain failure status, not a SIGKILL of its own process (exit 137 to a shell, the status of an
OOM kill): the migration runs in a child process that the waiting one stops, and no process
of it is left running. A real sqld of the test's own, stopped with SIGSTOP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers import ALEMBIC
from tests.proxy import Proxy
from tests.sqld import SqldServer

HARELSTORE = Path(sys.executable).with_name("harel-store")
TIMEOUT = 2.0
MARGIN = 8.0  # two Python starts and the kill, on a loaded machine
LINE = (
    "{url} did not answer within 2 s: the migration was stopped, nothing of it committed"
    " (a longer bound: HAREL_TIMEOUT=SECONDS)"
)


@pytest.fixture
def frozen() -> Iterator[SqldServer]:
    """A sqld of this test's own with a token, frozen by SIGSTOP: it accepts connections and
    never answers. Resumed before it is stopped."""
    server = SqldServer(auth=True).start()
    assert server.pid is not None
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.kill()
        server.close()


def tagged(tag: str) -> list[int]:
    """The processes whose environment carries ``tag``: the command's and its children's."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if tag.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run(command: list[str], server: SqldServer) -> tuple[subprocess.CompletedProcess[str], float]:
    """``command`` with the server's token in the environment; its outcome and how long."""
    tag = f"HAREL_TEST_TAG={uuid.uuid4().hex}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    env.update(HAREL_AUTH_TOKEN=server.token, HAREL_TEST_TAG=tag.partition("=")[2])
    started = time.monotonic()
    result = subprocess.run(
        command, capture_output=True, text=True, env=env, timeout=TIMEOUT + 60, check=False
    )
    took = time.monotonic() - started
    assert tagged(tag) == [], "a process of the migration is left running"
    return result, took


@pytest.mark.sqld
@pytest.mark.slow
def test_harel_store_migrate_at_its_timeout_exits_1_with_one_line(frozen: SqldServer) -> None:
    command = [str(HARELSTORE), "migrate", "--url", frozen.url, "--timeout", "2"]
    result, took = run(command, frozen)
    assert took < TIMEOUT + MARGIN, took
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.splitlines() == [f"harel-store: error: {LINE.format(url=frozen.url)}"]
    assert result.stdout == ""
    assert frozen.token not in result.stderr


@pytest.mark.sqld
@pytest.mark.slow
def test_a_run_stuck_in_the_driver_is_stopped_not_killed() -> None:
    """The store's own revision check is answered; then the libsql driver's requests never
    are (it holds the GIL while it waits): the run was once killed with its process (exit
    137). Now its child is stopped, and the command says so and exits 1."""
    with SqldServer(auth=True) as server, Proxy(server.port or 0) as proxy:
        proxy.hang_on = b"x-libsql-client-version"  # the driver's requests, not the store's
        command = [str(HARELSTORE), "migrate", "--url", proxy.url(), "--timeout", "2"]
        result, took = run(command, server)
        server.kill()  # a request it never answered holds it up on SIGTERM
    assert took < TIMEOUT + MARGIN, took
    assert result.returncode == 1, (result.returncode, result.stderr)
    assert result.stderr.splitlines() == [f"harel-store: error: {LINE.format(url=proxy.url())}"]
    assert server.token not in result.stderr


@pytest.mark.sqld
@pytest.mark.slow
def test_alembic_upgrade_at_its_timeout_fails_as_alembic_does(frozen: SqldServer) -> None:
    """Alembic's own failure: ``FAILED: <the line>``, exit status 255, as for any other
    failure of the run; never a kill."""
    command = [*ALEMBIC, "-x", f"url={frozen.url}", "-x", "timeout=2", "upgrade", "head"]
    result, took = run(command, frozen)
    assert took < TIMEOUT + MARGIN, took
    assert result.returncode == 255, (result.returncode, result.stdout, result.stderr)
    assert f"FAILED: {LINE.format(url=frozen.url)}" in result.stdout.splitlines()
    assert frozen.token not in result.stdout + result.stderr


PROGRAM = """
import sys
from alembic import command
from harel_store.migrate import alembic_config
config = alembic_config(sys.argv[1])
config.attributes["timeout"] = 2
try:
    command.upgrade(config, "head")
except Exception as exc:
    print(type(exc).__name__, exc)
    sys.exit(3)
"""


@pytest.mark.sqld
@pytest.mark.slow
def test_a_programs_own_upgrade_at_its_timeout_raises_and_the_program_lives_on(
    frozen: SqldServer,
) -> None:
    """A program that runs Alembic's ``command.upgrade`` itself (the timeout attribute) gets
    the failure as an exception it can handle: its process is not killed."""
    result, took = run([sys.executable, "-c", PROGRAM, frozen.url], frozen)
    assert took < TIMEOUT + MARGIN, took
    assert result.returncode == 3, (result.returncode, result.stdout, result.stderr)
    assert result.stdout.splitlines() == [f"MigrationFailed {LINE.format(url=frozen.url)}"]
    assert frozen.token not in result.stdout + result.stderr
