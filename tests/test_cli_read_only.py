"""The CLI on a database it may not write (read-only media): the read commands open the file
for reading only and work; the others, and the library, say precisely what stops them.

A 0444 file in a 0555 directory stands in for read-only media. These sessions run as root,
whom modes do not stop, and the interpreter lives where user nobody may not read it; so the
CLI runs as this user without the capabilities that bypass file modes (CAP_DAC_OVERRIDE,
CAP_DAC_READ_SEARCH: dropped from its bounding set before it starts). Where a private mount
namespace can be had, a real read-only file system too (a read-only bind mount)."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore, TimerOp

CLI = Path(sys.executable).with_name("harel-store")

# Runs argv[1:] with the capabilities that bypass file modes gone (a no-op for a user other
# than root, whom the modes stop anyway).
UNPRIVILEGED = """
import ctypes, os, sys
if os.geteuid() == 0:
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):  # CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            sys.exit(f"cannot drop capability {cap}: errno {ctypes.get_errno()}")
os.execv(sys.argv[1], sys.argv[1:])
"""


def unprivileged(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    return subprocess.run(
        [sys.executable, "-c", UNPRIVILEGED, *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


def seed(path: Path) -> LibsqlStore:
    """A store on ``path`` holding one execution with a trace, an outbox entry and a timer;
    left open (its commits still in the -wal file)."""
    store = LibsqlStore(path)
    exe = Execution(id="order-1", definition_id="order")
    store.save(exe)
    store.commit(
        exe,
        [("order-2", Event(name="ping"))],
        timers=(TimerOp.schedule("main.remind", 4_000_000_000.0),),
        trace={"event": "go"},
    )
    return store


def read_only(directory: Path) -> None:
    for file in directory.iterdir():
        file.chmod(0o444)
    directory.chmod(0o555)


@pytest.fixture
def media(tmp_path: Path) -> Iterator[Path]:
    """A directory made read-only by the test; writable again afterwards, to be removed."""
    directory = tmp_path / "media"
    directory.mkdir()
    yield directory
    directory.chmod(0o755)


@pytest.fixture(scope="module", autouse=True)
def modes_hold(tmp_path_factory: pytest.TempPathFactory) -> None:
    probe = tmp_path_factory.mktemp("probe") / "file"
    probe.write_text("")
    probe.chmod(0o444)
    result = unprivileged(sys.executable, "-c", f"open({str(probe)!r}, 'a')")
    if "PermissionError" not in result.stderr:
        pytest.skip(f"file modes cannot be made to hold here: {result.stderr.strip()[:200]}")


READS = [
    ("status",),
    ("ls",),
    ("show", "order-1"),
    ("trace", "order-1"),
    ("outbox",),
    ("timers",),
    ("spawns",),
    ("dead",),
    ("schema", "--check"),
    ("migrate", "--sql"),
]


def digest(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in directory.iterdir()}


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["closed", "snapshot"])
def test_read_commands_work_on_read_only_media(media: Path, layout: str) -> None:
    """``closed``: the store closed cleanly (the file alone: SQLite cannot create its -shm
    there, so it is opened immutable); ``snapshot``: the files copied while the store had
    them open, its commits still in the -wal file (read through the -shm beside it)."""
    db = media / "state.db"
    store = seed(db)
    if layout == "snapshot":
        copy = media.parent / "copy"
        copy.mkdir()
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            shutil.copyfile(media / name, copy / name)
        store.close()
        for name in ("state.db", "state.db-wal", "state.db-shm"):
            os.replace(copy / name, media / name)
        assert (media / "state.db-wal").stat().st_size > 0
    else:
        store.close()
        assert sorted(os.listdir(media)) == ["state.db"]
    read_only(media)
    before = digest(media)
    for args in READS:
        result = unprivileged(str(CLI), *args, "--url", str(db))
        assert result.returncode == 0, (args, result.stderr)
        if args[0] in ("ls", "show", "status"):
            assert "order-1" in result.stdout or "1 total" in result.stdout, result.stdout
    shown = unprivileged(str(CLI), "show", "order-1", "--json", "--url", str(db))
    assert '"version": 2' in shown.stdout, shown.stdout
    assert digest(media) == before  # nothing written, nothing created


def test_a_wal_that_cannot_be_read_there_is_one_precise_line(media: Path) -> None:
    db = media / "state.db"
    store = seed(db)
    copy = media.parent / "copy"
    copy.mkdir()
    for name in ("state.db", "state.db-wal"):
        shutil.copyfile(media / name, copy / name)
    store.close()
    for name in ("state.db", "state.db-wal"):
        os.replace(copy / name, media / name)
    read_only(media)
    for args in [("status",), ("ls",), ("schema", "--check"), ("migrate", "--sql")]:
        result = unprivileged(str(CLI), *args, "--url", str(db))
        assert result.returncode == 1, (args, result.stdout)
        assert result.stderr.splitlines() == [
            f"harel-store: error: cannot read {db}: its directory is not writable by this user,"
            " so SQLite cannot create state.db-shm there, without which it cannot read the"
            " commits in state.db-wal: copy state.db and state.db-wal to a writable directory"
            " and read the copy"
        ], args


@pytest.mark.parametrize(
    ("file_mode", "dir_mode", "reason"),
    [
        (
            0o444,
            0o555,
            "cannot open {db}: its directory is not writable by this user (SQLite keeps the"
            " -wal and -shm files beside the database)",
        ),
        (
            0o644,
            0o555,
            "cannot open {db}: its directory is not writable by this user (SQLite keeps the"
            " -wal and -shm files beside the database)",
        ),
        (0o444, 0o755, "cannot write {db}: the file is not writable by this user"),
    ],
    ids=["file-0444-dir-0555", "file-0644-dir-0555", "file-0444-dir-0755"],
)
def test_writing_where_it_cannot_says_why(
    media: Path, file_mode: int, dir_mode: int, reason: str
) -> None:
    """purge (a CLI write) and the library say what stops them, and write nothing."""
    db = media / "state.db"
    seed(db).close()
    db.chmod(file_mode)
    media.chmod(dir_mode)
    before = digest(media)
    expected = reason.format(db=db)
    result = unprivileged(str(CLI), "purge", "order-1", "--version", "2", "--url", str(db))
    assert (result.returncode, result.stderr) == (1, f"harel-store: error: {expected}\n")
    if dir_mode == 0o555:  # (at head already, migrate has nothing to write otherwise)
        result = unprivileged(str(CLI), "migrate", "--url", str(db))
        assert (result.returncode, result.stderr) == (1, f"harel-store: error: {expected}\n")
    code = (
        "from harel_store import LibsqlStore, Execution, StoreError\n"
        "try:\n"
        f"    s = LibsqlStore({str(db)!r})\n"
        "    s.save(Execution(id='x', definition_id='d'))\n"
        "except StoreError as exc:\n"
        "    print(exc)\n"
    )
    result = unprivileged(sys.executable, "-c", code)
    assert (result.returncode, result.stdout, result.stderr) == (0, f"{expected}\n", "")
    assert digest(media)["state.db"] == before["state.db"]  # (SQLite may add its -shm)


def on_read_only_mount(source: Path, mount: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    """``argv`` run in a mount namespace of its own where ``mount`` is ``source`` mounted
    read-only (a real read-only file system, seen by that process alone)."""
    script = 'mount --bind "$1" "$2" && mount -o remount,ro,bind "$2" && shift 2 && exec "$@"'
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    command = ["unshare", "-m", "--propagation", "private", "sh", "-c", script, "sh"]
    return subprocess.run(
        [*command, str(source), str(mount), *argv],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )


@pytest.mark.slow
def test_a_read_only_file_system(tmp_path: Path) -> None:
    source, mount = tmp_path / "source", tmp_path / "mount"
    source.mkdir()
    mount.mkdir()
    if shutil.which("unshare") is None or on_read_only_mount(source, mount, "true").returncode:
        pytest.skip("no private read-only mount here (unshare -m and mount need privileges)")
    seed(source / "state.db").close()
    db = str(mount / "state.db")
    for args in READS:
        result = on_read_only_mount(source, mount, str(CLI), *args, "--url", db)
        assert result.returncode == 0, (args, result.stderr)
    shown = on_read_only_mount(source, mount, str(CLI), "show", "order-1", "--url", db)
    assert "order-1" in shown.stdout
    result = on_read_only_mount(source, mount, str(CLI), "purge", "order-1", "--url", db)
    assert (result.returncode, result.stderr) == (
        1,
        f"harel-store: error: cannot open {db}: it is on a read-only file system\n",
    )
    assert sorted(os.listdir(source)) == ["state.db"]
