"""Retention writes sized by time (`harel_store.pace`): on a local file a retention call
takes what its time budget holds, starting small, never more than its ``limit``; the pacer's
arithmetic; a remote store's count bound. Speed itself is measured by
``benchmarks/retention.py``, not here."""

from __future__ import annotations

from typing import Any

from harel_store import LibsqlStore, pace
from harel_store.pace import Pacer
from tests.test_retention import (
    BEFORE,
    OLD,
    _own_connection,
    drain,
    ids,
    new,
    set_recorded,
    set_updated,
)


def test_the_first_write_of_a_kind_is_small_and_the_next_sized_from_its_time() -> None:
    pacer = Pacer()
    for kind in pace.REMOTE:
        assert pacer.size(kind, 1000, local=True, others_wrote=False) == pace.FIRST
        assert pacer.size(kind, 5, local=True, others_wrote=False) == 5  # never past limit
    pacer.took("executions", 100, 0.020)  # 0.2 ms an execution
    assert pacer.size("executions", 1000, local=True, others_wrote=False) == int(pace.IDLE / 0.0002)
    # Another connection wrote since: the shorter budget, a waiting commit waits less.
    assert pacer.size("executions", 1000, local=True, others_wrote=True) == int(pace.BUSY / 0.0002)
    assert pacer.size("executions", 3, local=True, others_wrote=False) == 3
    # A slow write halves the next (the estimate is the mean of the last and the new).
    pacer.took("executions", 10, 0.006)  # 0.6 ms an execution
    assert pacer.size("executions", 1000, local=True, others_wrote=False) == int(pace.IDLE / 0.0004)
    # However slow, a write takes one item; a write that removed nothing changes nothing.
    pacer.took("markers", 1, 10.0)
    pacer.took("markers", 0, 0.0)
    assert pacer.size("markers", 1000, local=True, others_wrote=True) == 1
    # A remote write is bounded by count: this process cannot time the server's.
    assert pacer.size("executions", 1000, local=False, others_wrote=False) == 100
    assert pacer.size("markers", 50, local=False, others_wrote=True) == 50


def test_a_local_purge_starts_small_then_takes_what_its_budget_holds(tmp_path: Any) -> None:
    with LibsqlStore(tmp_path / "paced.db") as store:
        for i in range(60):
            new(store, f"r{i:03d}", "finished")
        set_updated(store, {f"r{i:03d}": OLD + i for i in range(60)})
        counts = drain(lambda: store.purge_finished(BEFORE, limit=1000))
        assert counts[0] == pace.FIRST  # today's code took all 60 in its first write
        assert sum(counts) == 60 and counts[-1] == 0 and ids(store) == []
        assert all(count <= 1000 for count in counts)


def test_every_store_kind_drains_whatever_its_bound(store: Any) -> None:
    for i in range(30):
        new(store, f"r{i:03d}", "finished")
    set_updated(store, {f"r{i:03d}": OLD for i in range(30)})
    counts = drain(lambda: store.purge_finished(BEFORE, limit=1000))
    if _own_connection(store):
        assert counts[0] == pace.FIRST
    else:  # a server's: under its count bound, all at once
        assert counts == [30, 0]
    assert ids(store) == []


def test_forget_processed_starts_small_too(tmp_path: Any) -> None:
    with LibsqlStore(tmp_path / "paced.db") as store:
        exe = new(store, "m", processed_event_id="ev0")
        for n in range(1, 40):
            store.commit(exe, [], processed_event_id=f"ev{n}")
        set_recorded(store, {("m", f"ev{n}"): OLD + n for n in range(40)})
        counts = drain(lambda: store.forget_processed(BEFORE, limit=1000))
        assert counts[0] == pace.FIRST and sum(counts) == 40
        assert store.retention_counts(markers_before=BEFORE) == (0, 0, 0)
