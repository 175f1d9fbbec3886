"""Several processes commit to the same executions in one file at the same time.

Each retries on StoreConflict (reload, redo). Nothing else may escape: "database is
locked" included (the store waits up to its busy_timeout, then raises StoreBusy).
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path

import pytest

from tests.workers.common import EXECUTIONS, open_store, race

PROCESSES = 4
COMMITS = 300


@pytest.mark.slow
@pytest.mark.parametrize("drivers", [("libsql",), ("sqlite",), ("libsql", "sqlite")])
def test_racing_processes_lose_no_commit_and_raise_only_conflicts(
    drivers: tuple[str, ...], tmp_path: Path
) -> None:
    db, go = tmp_path / "race.db", tmp_path / "go"
    open_store(drivers[0], db).close()  # schema first: concurrent opens are tested elsewhere
    results = race(
        go,
        [
            ("racer", drivers[i % len(drivers)], str(db), f"p{i}", str(COMMITS))
            for i in range(PROCESSES)
        ],
    )
    for returncode, _, err in results:
        assert returncode == 0, f"a racer failed with something other than a conflict:\n{err}"
    reports = [json.loads(out) for _, out, _ in results]

    expected = {eid: sum(r["commits"][eid] for r in reports) for eid in EXECUTIONS}
    assert sum(expected.values()) == PROCESSES * COMMITS
    with open_store(drivers[0], db) as store:
        assert {eid: store.load(eid).version for eid in EXECUTIONS} == expected  # type: ignore[union-attr]
        outbox = [entry.event.id for entry in store.pending_outbox()]
    emitted = [e for r in reports for e in r["emits"]]
    assert sorted(outbox) == sorted(emitted), "the outbox must hold each successful emit once"
    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        marks = raw.execute("SELECT count(*) FROM harel_processed_events").fetchone()[0]
    finally:
        raw.close()
    assert marks == PROCESSES * COMMITS
    # The test raced for real: processes lost CAS rounds to each other.
    assert sum(r["conflicts"] for r in reports) > 0
