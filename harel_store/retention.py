"""Retention: what the store removes once it is no longer needed, in short writes.

Final execution trees (whole, every member older than the horizon; an execution whose parent
is gone is a root), dedupe markers and dead letters, each call one short write transaction
sized by `harel_store.pace`, and the counts of what would go (``harel-store gc --dry-run``).
"""

from __future__ import annotations

import json
import time

from harel_store.batch import Batch, Conflicted, Plan, statement
from harel_store.checks import (
    check_finite,
)
from harel_store.connection.local import LocalConnection
from harel_store.core import (
    _PURGE_TRIES,
    COMPANIONS,
    MAX_FORGET,
    MAX_PURGE,
    StoreCore,
    _batch_limit,
)
from harel_store.errors import StoreError
from harel_store.operation import operation


def _purge_companions(batch: Batch, ids: list[str]) -> None:
    """Add what the executions ``ids`` own (each deleted only once its row is gone)."""
    array = json.dumps(ids)
    for name in COMPANIONS:
        batch.add(f"purge_{name}", array)


def _purge_batch(members: list[tuple[str, int]]) -> Batch:
    """The executions (id, version), whole trees, deleted all together under their version
    CAS, or none (`Conflicted`), with everything they own; also none when one of them has
    gained a child since they were read (it would be left without its parent)."""
    ids = [execution_id for execution_id, _ in members]
    batch = Batch()
    batch.guard("purge_executions", json.dumps(members), rows=len(members))
    batch.guard("purge_children_left", json.dumps(ids), rows=0)
    _purge_companions(batch, ids)
    return batch


def _ripe_trees(walk: str, before: float, limit: int) -> Plan[list[tuple[str, int]]]:
    """The members (id, version) of the first trees that ``walk`` (finished_trees or
    orphan_trees) reads whose every member is final and last updated before ``before``, up
    to ``limit`` of them (a larger tree alone); none when no such tree is left."""
    window = limit
    while True:
        trees: dict[str, list[tuple[str, int, int]]] = {}
        for root, execution_id, version, ripe in (yield statement(walk, before, window)):
            trees.setdefault(root, []).append((execution_id, version, ripe))
        chosen: list[tuple[str, int]] = []
        for tree in trees.values():
            if not all(ripe for _, _, ripe in tree):
                continue  # a member running or updated since the horizon: the tree stays
            if chosen and len(chosen) + len(tree) > limit:
                break
            chosen.extend((execution_id, version) for execution_id, version, _ in tree)
        if chosen or len(trees) < window:
            return chosen
        window *= 2  # every tree read must stay: read past them


class Retention(StoreCore):
    """The retention operations (`harel_store.store.Store` has them all)."""

    @operation
    def clock(self) -> Plan[float]:
        """The database's clock now, epoch seconds: the clock of every time the store writes
        (``updated_at``, a marker's time, a lease), so the one to take a horizon from."""
        return float((yield statement("clock")))

    @operation
    def purge_finished(self, before: float, *, limit: int = 1000) -> Plan[int]:
        """Remove up to ``limit`` (1..10000) finished, failed or cancelled executions last
        updated before ``before`` (epoch seconds, the database's clock), each with everything
        it owns; return how many. A child goes only with its root, and a tree only whole,
        when every member is final and last updated before ``before`` (a tree larger than
        ``limit`` goes whole, alone in its call). An execution whose parent row is gone is
        the root of its own tree. One short write transaction; call again until 0. On a
        local file the store sizes each call's transaction by time, not only by ``limit``
        (about 10 ms of write lock, 2 ms while another connection writes the file), so a
        call may remove fewer than ``limit`` while more are due.
        """
        before = check_finite(before, "before")
        limit = _batch_limit(limit, MAX_PURGE)
        limit = yield from self._retention_size("executions", limit)
        for _ in range(_PURGE_TRIES):
            chosen = yield from _ripe_trees("finished_trees", before, limit)
            if not chosen:  # the roots' trees are done (or must wait): the orphans' then
                chosen = yield from _ripe_trees("orphan_trees", before, limit)
            if not chosen:
                return 0
            started = time.perf_counter()
            try:
                yield _purge_batch(chosen)
            except Conflicted:  # a member moved since it was read: read them again
                continue
            yield from self._retention_wrote("executions", len(chosen), started)
            self._forget(execution_id for execution_id, _ in chosen)
            return len(chosen)
        raise StoreError(
            f"purge_finished: the executions it read changed under each of {_PURGE_TRIES} tries"
        )

    @operation
    def forget_processed(self, before: float, *, limit: int = 10000) -> Plan[int]:
        """Remove up to ``limit`` (1..100000) dedupe markers recorded before ``before``
        (epoch seconds, the database's clock); return how many. One short write
        transaction; call again until 0. A marker forgotten no longer stops its event from
        being handled again: keep markers longer than any redelivery can come."""
        before = check_finite(before, "before")
        limit = _batch_limit(limit, MAX_FORGET)
        limit = yield from self._retention_size("markers", limit)
        batch = Batch()
        forgot = batch.add("forget_markers", before, limit)
        batch.add("renew_markers_since", before, limit)
        started = time.perf_counter()
        results = yield batch
        removed: int = results[forgot]
        yield from self._retention_wrote("markers", removed, started)
        return removed

    @operation
    def purge_dead(self, before: float, *, limit: int = 1000) -> Plan[int]:
        """Remove up to ``limit`` (1..100000) dead letters (outbox entries, spawns, timers)
        that died before ``before`` (epoch seconds, the database's clock), oldest first;
        return how many. Call again until 0."""
        before = check_finite(before, "before")
        left = _batch_limit(limit, MAX_FORGET)
        total = 0
        for kind in ("outbox", "spawns", "timers"):  # one short transaction each
            size = yield from self._retention_size("dead", left)
            batch = Batch()
            batch.add(f"purge_dead_{kind}", before, size)
            started = time.perf_counter()
            (removed,) = yield batch
            yield from self._retention_wrote("dead", removed, started)
            total += removed
            left -= removed
            if removed == size:  # as many as it could take: more may be left (call again)
                break
        return total

    def _retention_size(self, kind: str, limit: int) -> Plan[int]:
        """How many items of ``kind`` the next retention write takes, up to ``limit``: on a
        local file, what its time budget holds (`harel_store.pace`)."""
        local = isinstance(self._conn, LocalConnection)
        others_wrote = False
        if local:
            version = yield statement("data_version")
            others_wrote, self._seen_version = version != self._seen_version, version
        return self._pacer.size(kind, limit, local=local, others_wrote=others_wrote)

    def _retention_wrote(self, kind: str, items: int, started: float) -> Plan[None]:
        """After a retention write begun at ``started`` (perf_counter) removed ``items``: on
        a local file, time it, and write the pages it left in the WAL back to the file."""
        if items and isinstance(self._conn, LocalConnection):
            self._pacer.took(kind, items, time.perf_counter() - started)
            yield statement("checkpoint")

    @operation
    def retention_counts(
        self,
        *,
        finished_before: float | None = None,
        markers_before: float | None = None,
        dead_before: float | None = None,
    ) -> Plan[tuple[int, int, int]]:
        """What `purge_finished`, `forget_processed` and `purge_dead` would remove, called
        until 0 with these times (None: that kind is not counted): the executions, the
        markers and the dead letters. One read, to the end of each walk."""
        times = [
            None if at is None else check_finite(at, name)
            for at, name in (
                (finished_before, "finished_before"),
                (markers_before, "markers_before"),
                (dead_before, "dead_before"),
            )
        ]
        executions, markers, dead = yield statement("retention_counts", *times)
        return executions, markers, dead
