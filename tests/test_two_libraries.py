"""Two SQLite libraries on one file in one process (issue 25, class 22).

Each library is its own copy of SQLite, and POSIX locks are the process's: when a
connection of one closes, it takes itself for the file's last user and deletes the -wal and
-shm files from under the other's, whose commits then go to an unlinked WAL that no other
process sees. The store refuses to open a file with one library while this process has it
open with the other, and its own paths (the CLI, `harel-store migrate`, Alembic's env) go
through the library the process already uses on the file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore, StoreError
from harel_store.connection.local import holder
from tests.helpers import ROOT

STORES = {"libsql": LibsqlStore, "sqlite": SqliteStore}
OTHER = {"libsql": "sqlite", "sqlite": "libsql"}

# Another process reads the file (stdlib sqlite3, read-only): what every other process sees.
READER = """
import json, sqlite3, sys
conn = sqlite3.connect(f"file:{sys.argv[1]}?mode=ro", uri=True)
rows = conn.execute("SELECT id, version FROM harel_executions ORDER BY id").fetchall()
outbox = conn.execute("SELECT count(*) FROM harel_outbox").fetchone()[0]
print(json.dumps({"executions": dict(rows), "outbox": outbox}))
"""


def seen_elsewhere(path: Path) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", READER, str(path)],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return json.loads(out.stdout)  # type: ignore[no-any-return]


def commit(store: LibsqlStore | SqliteStore, exe_id: str) -> None:
    exe = store.load(exe_id) or Execution(id=exe_id, definition_id="d")
    if exe.version == 0:
        store.save(exe)
    store.commit(exe, [(exe_id, Event(name="e"))], processed_event_id=f"{exe_id}-{exe.version}")


def snapshot(path: Path) -> dict[str, tuple[int, bytes]]:
    """Each of the file's parts there is: its inode and its bytes."""
    parts = {}
    for suffix in ("", "-wal", "-shm"):
        part = Path(f"{path}{suffix}")
        if part.exists():
            parts[suffix] = (part.stat().st_ino, part.read_bytes())
    return parts


@pytest.mark.parametrize("first", ["libsql", "sqlite"])
def test_the_other_library_is_refused_and_nothing_is_written(tmp_path: Path, first: str) -> None:
    path = tmp_path / "state.db"
    store = STORES[first](path)
    try:
        commit(store, "a")
        before = snapshot(path)
        assert "-wal" in before
        with pytest.raises(StoreError) as caught:
            STORES[OTHER[first]](path)
        text = str(caught.value)
        assert str(path) in text and "WAL" in text and "close the other first" in text
        assert snapshot(path) == before  # not a byte, and the WAL is the same file
        assert holder(path) == first
        commit(store, "b")  # the store goes on, on a WAL other processes read
        assert seen_elsewhere(path)["executions"] == {"a": 2, "b": 2}
    finally:
        store.close()
    assert holder(path) is None


@pytest.mark.parametrize("first", ["libsql", "sqlite"])
def test_a_symlink_or_a_hard_link_is_the_same_file(tmp_path: Path, first: str) -> None:
    path = tmp_path / "state.db"
    (tmp_path / "link.db").symlink_to(path.name)
    with STORES[first](path) as store:
        commit(store, "a")
        os.link(path, tmp_path / "hard.db")
        for other in ("link.db", "hard.db"):
            with pytest.raises(StoreError, match="Two SQLite libraries on one file"):
                STORES[OTHER[first]](tmp_path / other)
        commit(store, "b")
        assert seen_elsewhere(path)["executions"] == {"a": 2, "b": 2}


@pytest.mark.parametrize("first", ["libsql", "sqlite"])
def test_one_after_the_other_closed_first(tmp_path: Path, first: str) -> None:
    path = tmp_path / "state.db"
    with STORES[first](path) as store:
        commit(store, "a")
    with STORES[OTHER[first]](path) as other:  # the first one closed: allowed
        exe = other.load("a")
        assert exe is not None and exe.version == 2
        commit(other, "a")
        commit(other, "b")
    with STORES[first](path) as again:
        assert {s.id: s.version for s in again.list_executions().items} == {"a": 3, "b": 2}
    assert seen_elsewhere(path)["executions"] == {"a": 3, "b": 2}


@pytest.mark.parametrize("library", ["libsql", "sqlite"])
def test_stores_of_one_library_share_a_file_and_the_last_close_frees_it(
    tmp_path: Path, library: str
) -> None:
    path = tmp_path / "state.db"
    one, two = STORES[library](path), STORES[library](path)
    commit(one, "a")
    commit(two, "b")
    one.close()
    with pytest.raises(StoreError):  # `two` still has it open
        STORES[OTHER[library]](path)
    two.close()
    two.close()  # a second close gives nothing back twice
    with STORES[OTHER[library]](path) as other:
        assert {s.id for s in other.list_executions().items} == {"a", "b"}
    assert holder(path) is None


def test_a_store_that_failed_to_open_or_was_never_closed_holds_nothing(tmp_path: Path) -> None:
    junk = tmp_path / "junk.db"
    junk.write_bytes(b"not a database, " * 100)
    with pytest.raises(StoreError, match="not a SQLite database"):
        LibsqlStore(junk)
    with pytest.raises(StoreError, match="not a SQLite database"):  # not "open with libsql"
        SqliteStore(junk)
    path = tmp_path / "state.db"
    commit(LibsqlStore(path), "a")  # never closed: collected at once (no other reference)
    with SqliteStore(path) as store:
        assert store.load("a") is not None


# The process P of the last test: a LibsqlStore commits, the CLI and Alembic run in P (the
# CLI's status, ls and schema --check; `harel-store migrate` down a revision and back to
# head; `alembic upgrade head` through the repository's alembic.ini), P commits again, and
# says whether the WAL it writes to is still the file others read.
PROCESS = """
import argparse, contextlib, io, json, os, sys
from pathlib import Path
from alembic import command
from alembic.config import Config
from harel_store import Event, Execution, LibsqlStore
from harel_store.cli import main

root, path = Path(sys.argv[1]), sys.argv[2]
wal = path + "-wal"

def deleted_wal():
    links = []
    for fd in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        with contextlib.suppress(OSError):  # the listing's own descriptor, closed by now
            links.append(os.readlink("/proc/self/fd/" + fd))
    return [link for link in links if link.endswith("-wal (deleted)")]

def commit(store, exe_id):
    exe = store.load(exe_id) or Execution(id=exe_id, definition_id="d")
    if exe.version == 0:
        store.save(exe)
    store.commit(exe, [(exe_id, Event(name="e"))], processed_event_id=exe_id + str(exe.version))

store = LibsqlStore(path)
commit(store, "before")
inode = os.stat(wal).st_ino
codes = []
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    for args in (["status"], ["ls"], ["schema", "--check"], ["migrate", "--to", "0006"],
                 ["migrate"]):
        codes.append(main([*args, "--url", path]))
    config = Config(str(root / "alembic.ini"))
    config.cmd_opts = argparse.Namespace(x=["url=" + path])
    config.attributes["configure_logger"] = False
    command.upgrade(config, "head")
commit(store, "after")
commit(store, "before")
report = {
    "codes": codes,
    "wal_exists": os.path.exists(wal),
    "same_wal": os.path.exists(wal) and os.stat(wal).st_ino == inode,
    "deleted_wal": deleted_wal(),
}
print(json.dumps(report))
sys.stdout.flush()
os._exit(0)  # P ends without closing its store: what it committed must be in the file
"""


def test_commits_stay_visible_after_the_cli_and_alembic_ran_in_process(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROCESS), str(ROOT), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["codes"] == [0, 0, 0, 0, 0], report
    assert report["wal_exists"] and report["same_wal"], report
    assert report["deleted_wal"] == [], report
    assert seen_elsewhere(path) == {"executions": {"after": 2, "before": 3}, "outbox": 3}
