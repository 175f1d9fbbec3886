"""A migration against a server that stops answering ends at its timeout with one line and a
plain failure status, not a SIGKILL of its own process (exit 137 to a shell, the status of an
OOM kill): the migration runs in a child process that the waiting one stops, and no process
of it is left running. A real sqld of the test's own, stopped with SIGSTOP."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from harel_store.migrate import python_child, run_bounded
from tests.helpers import ALEMBIC, ROOT
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


# -- the migration's child killed, the current directory, the token's way to the child ------

KILLED = (
    "{url}: the process of the migration was killed by SIGKILL; where it got to is unknown:"
    " `harel-store status` shows the revision"
)
ALEMBIC_SCRIPT = Path(sys.executable).with_name("alembic")


def clean_env(server: SqldServer, tag: str, *, token: bool = True) -> dict[str, str]:
    """The environment of a command under test: no HAREL_/TURSO_ of the caller's, the
    server's token (unless not ``token``), and ``tag`` to find its processes by."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    env["HAREL_TEST_TAG"] = tag
    if token:
        env["HAREL_AUTH_TOKEN"] = server.token
    return env


def children(pid: int) -> list[int]:
    """``pid``'s children, whichever of its threads started them."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def descendant(pid: int, depth: int, within: float = 30.0) -> int:
    """The first process ``depth`` generations below ``pid`` (1: a child), once it is there."""
    end = time.monotonic() + within
    while time.monotonic() < end:
        found = [pid]
        for _ in range(depth):
            found = [kid for p in found for kid in children(p)]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no process {depth} below {pid} within {within} s")


def kill_tagged(tag: str) -> None:
    for pid in tagged(tag):
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.sqld
@pytest.mark.slow
@pytest.mark.parametrize("how", ["harel-store", "alembic"])
def test_a_migration_child_killed_by_a_signal_is_one_line_and_a_plain_failure(
    frozen: SqldServer, how: str
) -> None:
    """The child killed as an OOM kill would (SIGKILL): the command says so in one line and
    fails as any failure does (exit 1; Alembic's FAILED:, 255), not with the signal's
    negative status passed on (247) and nothing said."""
    tag = uuid.uuid4().hex
    if how == "harel-store":
        command = [str(HARELSTORE), "migrate", "--url", frozen.url, "--timeout", "60"]
    else:
        command = [*ALEMBIC, "-x", f"url={frozen.url}", "-x", "timeout=60", "upgrade", "head"]
    proc = subprocess.Popen(
        command,
        env=clean_env(frozen, tag),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        child = descendant(proc.pid, 1)
        time.sleep(0.5)
        os.kill(child, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.communicate()
        kill_tagged(tag)
    line = KILLED.format(url=frozen.url)
    if how == "harel-store":
        assert proc.returncode == 1, (proc.returncode, err)
        assert err.splitlines() == [f"harel-store: error: {line}"]
        assert out == ""
    else:
        assert proc.returncode == 255, (proc.returncode, out, err)
        assert f"FAILED: {line}" in out.splitlines()
    shown = frozen.token in out + err
    assert not shown
    assert tagged(tag) == []


IMPOSTOR = """
from pathlib import Path
Path(__file__).resolve().parent.parent.joinpath("IMPOSTOR").write_text("imported")
"""


@pytest.mark.sqld
@pytest.mark.slow
def test_no_child_imports_from_the_current_directory(tmp_path: Path) -> None:
    """A folder holding a ``harel_store`` package of its own (a checkout of another version,
    a stray copy): the commands run from there use the installed package, in every child
    process they start too (the migration's, the fleet's workers)."""
    fake = tmp_path / "harel_store"
    fake.mkdir()
    (fake / "__init__.py").write_text(IMPOSTOR)
    (fake / "__main__.py").write_text("import sys\nsys.exit(0)\n")
    (fake / "cli").mkdir()
    (fake / "cli" / "__init__.py").write_text("def main(argv=None):\n    return 0\n")
    (fake / "cli" / "fleet.py").write_text("def serve(main):\n    pass\n")
    marker = tmp_path / "IMPOSTOR"
    tag = uuid.uuid4().hex
    with SqldServer(auth=True) as server:
        env = clean_env(server, tag)
        migrated = subprocess.run(
            [str(HARELSTORE), "migrate", "--url", server.url],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert not marker.exists(), "harel-store migrate ran the current directory's package"
        assert migrated.returncode == 0, migrated.stderr
        assert migrated.stdout.startswith(f"{server.url}: schema at revision")
        upgraded = subprocess.run(
            [str(ALEMBIC_SCRIPT), "-c", str(ROOT / "alembic.ini"), "-x", f"url={server.url}",
             "upgrade", "head"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert not marker.exists(), "alembic upgrade ran the current directory's package"
        assert upgraded.returncode == 0, upgraded.stdout + upgraded.stderr
        fleet = tmp_path / "fleet.txt"
        fleet.write_text(f"a {server.url}\n")
        over = subprocess.run(
            [str(HARELSTORE), "--fleet", str(fleet), "migrate"],
            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
        )  # fmt: skip
        assert not marker.exists(), "a fleet's worker ran the current directory's package"
        assert over.returncode == 0, over.stderr
        assert over.stdout.startswith(f"a: {server.url}: schema at revision"), over.stdout
    assert tagged(tag) == []


@pytest.mark.sqld
@pytest.mark.slow
@pytest.mark.parametrize("fleet", [False, True])
def test_a_token_only_in_the_url_is_in_no_childs_environment_or_command_line(
    frozen: SqldServer, tmp_path: Path, fleet: bool
) -> None:
    """The database's URL goes to the migration's child on its stdin: a token in it
    (``?authToken=``, as a fleet file's line holds it) is neither in /proc/PID/environ (which
    anything the child starts would inherit) nor in /proc/PID/cmdline of the child, nor of a
    fleet's worker."""
    tag = uuid.uuid4().hex
    url = f"{frozen.url}?authToken={frozen.token}"
    if fleet:
        fleet_file = tmp_path / "fleet.txt"
        fleet_file.write_text(f"b {url}\n")
        command = [str(HARELSTORE), "--fleet", str(fleet_file), "migrate", "--timeout", "60"]
    else:
        command = [str(HARELSTORE), "migrate", "--url", url, "--timeout", "60"]
    proc = subprocess.Popen(
        command,
        env=clean_env(frozen, tag, token=False),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        child = descendant(proc.pid, 2 if fleet else 1)
        time.sleep(1.0)  # it waits on the server now
        watched = [child, *([descendant(proc.pid, 1)] if fleet else [])]
        token = frozen.token.encode()
        in_environ, in_cmdline = [], []  # pids, never the token (pytest would print it)
        for pid in watched:
            environ = Path(f"/proc/{pid}/environ").read_bytes()
            assert tag.encode() in environ  # the right process
            if token in environ:
                in_environ.append(pid)
            if token in Path(f"/proc/{pid}/cmdline").read_bytes():
                in_cmdline.append(pid)
        assert in_environ == [], "the token is in the environment of these processes"
        assert in_cmdline == [], "the token is on the command line of these processes"
    finally:
        proc.kill()
        proc.communicate()
        kill_tagged(tag)


# A process that bounds a child whose program only waits once it started (as a child still
# importing harel_store and Alembic on a loaded machine does, seconds before it reaches
# `bounded_elsewhere`): ours (`python_child`'s prelude), or any program that asks
# `bounded_elsewhere` first. It prints an empty line when the child's program runs.
BOUNDING = """
import sys
from harel_store.migrate import python_child, run_bounded
wait = "import time; print(flush=True); time.sleep(60)"
asks = "from harel_store.migrate import bounded_elsewhere; assert bounded_elsewhere(); "
argv = python_child(wait) if sys.argv[1] == "ours" else [sys.executable, "-c", asks + wait]
run_bounded(argv, 120)
"""


@pytest.mark.slow
@pytest.mark.parametrize("program", ["ours", "any"])
def test_a_run_child_dies_with_its_parent(program: str) -> None:
    """The parent of a run's child (the command, a fleet's worker) killed while the child's
    program waits: the child dies with it at once, linked from its first lines (ours:
    `python_child`'s prelude, before its imports, which take seconds on a loaded machine)
    or when it asks `bounded_elsewhere` (any program)."""
    tag = uuid.uuid4().hex
    env = {**os.environ, "HAREL_TEST_TAG": tag}
    with subprocess.Popen(
        [sys.executable, "-c", BOUNDING, program], env=env, stdout=subprocess.PIPE, text=True
    ) as proc:
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "\n"  # the child's program runs
            assert len(tagged(tag)) == 2
            proc.kill()
            proc.wait()
            end = time.monotonic() + 5.0
            while tagged(tag) and time.monotonic() < end:
                time.sleep(0.05)
            assert tagged(tag) == [], "the child outlived the process that bounds it"
        finally:
            proc.kill()
            kill_tagged(tag)


# A run's child that reads whether it is bounded (twice: the command's main and Alembic's env
# both ask), then starts a process of its own that prints what it inherited.
GRANDCHILD = """
import subprocess
from harel_store.migrate import bounded_elsewhere
print(bounded_elsewhere(), bounded_elsewhere(), flush=True)
probe = "import os; print(os.environ.get('HAREL_MIGRATE_PARENT'), os.environ.get('HAREL_DIE_WITH'))"
subprocess.run([sys.executable, "-c", probe], check=True)
"""


@pytest.mark.slow
def test_a_run_childs_own_processes_inherit_neither_pid() -> None:
    """A run's child is bounded by its parent, however often it asks; a process it starts
    inherits neither the pid it is bounded by nor the one it dies with: a migration that
    process ran would otherwise be refused (the pid names no parent of it)."""
    done = run_bounded(python_child(GRANDCHILD), 60, capture=True)
    assert done is not None
    assert done == (0, b"True True\nNone None\n")


# A program (a long-lived one, calling Alembic's `command` itself) whose environment kept a
# $HAREL_MIGRATE_PARENT: refused once, then left linked to no parent's death, and asked
# again (the variable gone) not a run's child.
REFUSED = """
import ctypes, os, sys
os.environ["HAREL_MIGRATE_PARENT"] = sys.argv[1]
from harel_store.migrate import bounded_elsewhere
try:
    bounded_elsewhere()
except ValueError as exc:
    print("refused" if str(exc).startswith("$HAREL_MIGRATE_PARENT (") else exc)
signal = ctypes.c_int()
ctypes.CDLL(None).prctl(2, ctypes.byref(signal))  # PR_GET_PDEATHSIG
print(signal.value, bounded_elsewhere(), "HAREL_MIGRATE_PARENT" in os.environ)
"""


@pytest.mark.parametrize("value", ["0", "4" * 5000])
def test_a_refused_migrate_parent_leaves_the_process_as_it_was(value: str) -> None:
    """Refused in our words whatever the value (5,000 digits: past what `int` reads)."""
    run = subprocess.run(
        [sys.executable, "-c", REFUSED, value],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert run.stdout == "refused\n0 False False\n", run.stderr
