"""Local files: durable pragmas by default, and one file shared by both drivers."""

from __future__ import annotations

from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore, SqliteStore
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
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 5000
    with driver(tmp_path / "a.db", synchronous="NORMAL", busy_timeout=0.25) as store:
        conn = raw(store)
        assert conn.execute("PRAGMA synchronous").fetchone()[0] == 1
        assert conn.execute("PRAGMA busy_timeout").fetchone()[0] == 250


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
