"""Resource faults: a full disk and a read-only file fail one commit, not the store.

The disk "fills up" through RLIMIT_FSIZE in a child process (the cap applies to every file
it writes, the WAL included); the read-only file is a 0444 database opened by a user who
may not write it.
"""

from __future__ import annotations

import json
import os
import sqlite3
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from harel_store import Execution
from tests.workers.common import open_store, run

DRIVERS = ["libsql", "sqlite"]


def integrity(db: Path) -> list[str]:
    raw = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        return list(raw.iterdump())
    finally:
        raw.close()


@pytest.mark.slow
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_full_disk_fails_the_commit_and_loses_nothing(driver: str, tmp_path: Path) -> None:
    db = tmp_path / "full.db"
    done = run("faults", "full", driver, str(db))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["error"] == "StoreError"  # a typed error, not an OSError or a crash
    assert report["version_after_failure"] == 0  # the caller's execution is left as it was
    assert report["reads_while_full"]
    assert len(report["committed"]) > 6  # small ones, some big ones, and one after the fault
    integrity(db)
    with open_store(driver, db) as store:
        for eid, version in report["committed"].items():
            exe = store.load(eid)
            assert exe is not None and exe.version == version, eid
        assert store.load(report["failed"]) is None  # nothing of the failed commit landed
        assert sorted(store.ids_with_prefix("")) == sorted(report["committed"])


@pytest.fixture
def shared_dir() -> Iterator[Path]:
    """A folder an unprivileged user may write (pytest's tmp_path is private to root)."""
    with tempfile.TemporaryDirectory(prefix="harel-ro-") as name:
        os.chmod(name, 0o777)
        yield Path(name)


@pytest.mark.slow
@pytest.mark.parametrize("driver", DRIVERS)
def test_a_read_only_file_fails_the_commit_and_keeps_reading(driver: str, shared_dir: Path) -> None:
    db = shared_dir / "ro.db"
    with open_store(driver, db) as store:
        store.commit(Execution(id="kept", definition_id="f", context={"k": 1}), [])
    before = integrity(db)
    db.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    done = run("faults", "readonly", driver, str(db))
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["error"] == "StoreError"
    assert "not writable by this user" in report["message"]  # what stops it, in its words
    assert report["version_after_failure"] == 1
    assert report["reads_after"] == 1
    assert integrity(db) == before
