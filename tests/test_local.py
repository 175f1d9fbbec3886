"""Local files: durable pragmas by default, and one file shared by both drivers."""

from __future__ import annotations

import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore, StoreBusy
from tests.helpers import raw

DRIVERS = [LibsqlStore, SqliteStore]


@pytest.mark.parametrize("driver", DRIVERS)
def test_a_file_opens_in_wal_with_full_sync_and_a_busy_timeout(
    driver: type, tmp_path: Path
) -> None:
    with driver(tmp_path / "a.db") as store:
        conn = raw(store)
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
        # The store waits for a busy file itself (the GIL free), not the driver.
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 0
        assert store._conn.busy_timeout == 5.0
    with driver(tmp_path / "a.db", synchronous="NORMAL", busy_timeout=0.25) as store:
        conn = raw(store)
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1
        assert store._conn.busy_timeout == 0.25


LOCKER = """
import sqlite3, sys, time
conn = sqlite3.connect(sys.argv[1], isolation_level=None)
conn.execute("BEGIN IMMEDIATE")
print("locked", flush=True)
time.sleep(float(sys.argv[2]))
conn.execute("COMMIT")
"""


@pytest.mark.parametrize("driver", DRIVERS)
def test_waiting_for_a_file_another_process_locked_frees_this_process(
    driver: type, tmp_path: Path
) -> None:
    """While a write waits for another process's lock, this process's other threads run
    (libsql's own busy wait held the GIL: a ticker made 1 tick in 2 s); the write goes
    once the lock is free, and past busy_timeout it is a StoreBusy, nothing written."""
    path = tmp_path / "locked.db"
    store = driver(path, busy_timeout=0.6)
    store.save(Execution(id="a", definition_id="d"))
    ticks: list[float] = []
    done = threading.Event()

    def tick() -> None:
        while not done.is_set():
            ticks.append(time.monotonic())
            time.sleep(0.005)

    def locker(seconds: float) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", LOCKER, str(path), str(seconds)],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        return proc

    ticker = threading.Thread(target=tick)
    ticker.start()
    try:
        proc = locker(0.3)  # released within busy_timeout: the write waits, then goes
        started = time.monotonic()
        store.commit(store.load("a"), [])
        assert 0.2 < time.monotonic() - started < 0.6 + 0.5
        proc.communicate()
        proc = locker(1.5)  # held past busy_timeout
        started = time.monotonic()
        with pytest.raises(StoreBusy, match="locked"):
            store.commit(store.load("a"), [])
        waited = time.monotonic() - started
        proc.communicate()
    finally:
        done.set()
        ticker.join()
    assert 0.5 < waited < 0.6 + 0.5
    during = [t for t in ticks if started <= t <= started + waited]
    assert len(during) > waited / 0.005 / 4  # the ticker ran all along
    assert store.load("a").version == 2  # the refused write wrote nothing
    store.close()


@pytest.mark.parametrize("driver", DRIVERS)
def test_bad_local_options_are_refused_before_opening(driver: type, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="synchronous"):
        driver(tmp_path / "b.db", synchronous="SOMETIMES")
    with pytest.raises(ValueError, match="busy_timeout"):
        driver(tmp_path / "b.db", busy_timeout=-1)
    assert not (tmp_path / "b.db").exists()


@pytest.mark.parametrize(("writer", "reader"), [DRIVERS, DRIVERS[::-1]])
def test_a_file_written_by_one_driver_is_read_by_the_other(
    writer: type, reader: type, tmp_path: Path
) -> None:
    exe = Execution(id="x", definition_id="d", context={"é": [1, 2.5, None]})
    with writer(tmp_path / "c.db") as store:
        [seq] = store.commit(exe, [("y", Event(name="e"))], processed_event_id="ev", trace={"a": 1})
    with reader(tmp_path / "c.db") as store:
        assert store.load("x") == exe
        assert [e.seq for e in store.pending_outbox()] == [seq]
        assert store.is_processed("x", "ev")
        assert store.read_trace("x") == [{"a": 1, "index": 0}]
        store.commit(exe, [])
    with writer(tmp_path / "c.db") as store:
        assert store.load("x").version == 2


def test_the_cas_write_names_only_the_indexed_columns_that_change(tmp_path: Path) -> None:
    """SQLite rewrites an index entry whenever its column is named in SET, so a typical
    step's UPDATE leaves status and parent_id out; a change still names them. Seen in the
    statements SQLite runs (sqlite3's trace callback)."""
    store = SqliteStore(tmp_path / "s.db")
    ran: list[str] = []
    store._conn.db.set_trace_callback(ran.append)  # type: ignore[attr-defined]

    def set_list(exe: Execution) -> set[str]:
        ran.clear()
        store.save(exe)
        [update] = [s for s in ran if s.startswith("UPDATE harel_executions")]
        return set(re.findall(r"(?:\bSET|,)\s+(\w+) = ", update.rsplit("WHERE", 1)[0]))

    exe = Execution(id="a", definition_id="d")
    store.save(exe)
    # updated_at (0005) moves on every write, so every shape names it: its index is rewritten.
    summary = {"data", "version", "outcome", "active_path", "finished_at", "updated_at"}
    exe.active_path = "s1"
    assert set_list(exe) == summary  # the typical step
    exe.status = "finished"
    assert set_list(exe) == summary | {"status"}
    exe.parent_id = "p"
    assert set_list(exe) == summary | {"status", "parent_id"}  # the rare change: all of it
    assert set_list(exe) == summary
    loaded = store.load("a")
    assert loaded is not None
    assert set_list(loaded) == summary  # a load tells the store the row's summary too
    other = SqliteStore(tmp_path / "s.db")  # knows nothing of the row: writes all of it
    other._conn.db.set_trace_callback(ran.append)  # type: ignore[attr-defined]
    ran.clear()
    other.save(loaded)
    [update] = [s for s in ran if s.startswith("UPDATE harel_executions")]
    assert "status = 'finished'" in update and "parent_id = 'p'" in update
    other.close()
    store.close()
