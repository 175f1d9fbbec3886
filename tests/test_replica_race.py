"""Two embedded replicas (two processes, two files) race commits on the same executions.

The CAS is decided at the primary: every version advances by exactly one per successful
commit, the loser gets StoreConflict and nothing of its batch reaches the primary, and the
loser's next load (no explicit sync) already sees the version that won.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harel_store import LibsqlStore
from tests.conftest import reset_remote
from tests.sqld import SqldServer
from tests.workers.common import race
from tests.workers.replica_racer import EXECUTIONS

PROCESSES = 2
COMMITS = 40


@pytest.mark.sqld
def test_racing_replicas_lose_nothing_and_the_loser_writes_nothing(
    sqld: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reset_remote(sqld)
    monkeypatch.setenv("HAREL_AUTH_TOKEN", sqld.token)
    go = tmp_path / "go"
    results = race(
        go,
        [
            ("replica_racer", sqld.url, str(tmp_path / f"replica-{i}.db"), f"p{i}", str(COMMITS))
            for i in range(PROCESSES)
        ],
    )
    for returncode, _, err in results:
        assert returncode == 0, f"a racer failed with something other than a conflict:\n{err}"
        assert sqld.token not in err
    reports = [json.loads(out) for _, out, _ in results]
    landed = {eid: [t for r in reports for t in r["landed"][eid]] for eid in EXECUTIONS}
    won = sorted(t for tags in landed.values() for t in tags)
    lost = sorted(t for r in reports for t in r["lost"])
    assert len(won) == PROCESSES * COMMITS
    assert lost, "the replicas never raced each other"
    assert sum(r["stale"] for r in reports) == 0, "a loser reloaded an older version than won"

    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        for eid, tags in landed.items():
            assert store.load(eid).version == len(tags)  # type: ignore[union-attr]
        assert sorted(e.event.id for e in store.pending_outbox()) == won
        assert sorted(s.child_id.removeprefix("child-") for s in store.pending_spawns()) == won
        timers = [path for eid in EXECUTIONS for path, _ in store.timers_of(eid)]
        assert sorted(timers) == won
        traced = [s["tag"] for eid in EXECUTIONS for s in store.read_trace(eid)]
        assert sorted(traced) == won
        for eid, tags in landed.items():
            assert all(store.is_processed(eid, f"in-{t}") for t in tags)
    marks = sqld.rows("SELECT event_id FROM harel_processed_events")
    assert sorted(m.removeprefix("in-") for (m,) in marks) == won
