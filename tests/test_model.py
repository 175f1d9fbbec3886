"""Random sequences of commits, acks, sweeps, claims, fails, extends, revives and purges,
checked against a plain model.

After every step the store (both drivers) must agree with a few dicts that implement the
contract in the most obvious way. Leases run on the database's clock, which a test cannot
set: the model's clock moves instead by moving every lease's end back (`elapse`), so a
lease (or a failed row's wait for its retry) runs out exactly when the model says it does.
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from harel_store import (
    DeadLetter,
    DueTimer,
    Event,
    Execution,
    LibsqlStore,
    OutboxEntry,
    SpawnEntry,
    SqliteStore,
    StoreConflict,
    TimerOp,
)
from harel_store.models import ArmedTimer, PendingOutbox, PendingSpawn, RelayItem
from harel_store.store import Store
from tests.helpers import raw

IDS = ["a", "b", "c%", "d_"]
PATHS = ["p", "q"]
WORKERS = ["w1", "w2"]
TRACE_MAX = 3
FAR = 1e12
# Leases, retries and clock steps far apart from the real seconds a test run takes.
LEASES = [100.0, 10_000.0]
RETRIES = [0.0, 100.0]
MAX_ATTEMPTS = [None, 1, 2, 3]
GONE = 10**6  # a seq no run reaches
LATE = 10**6  # a time past every timer (a sweep's re-arm moves one 100 later)
Key = tuple[Any, ...]  # ("outbox", seq) / ("spawn", seq) / ("timer", execution_id, path)
KINDS = {"outbox": 0, "spawn": 1, "timer": 2}  # dead_letters' tie order


def key_of(item: RelayItem) -> Key:
    if isinstance(item, OutboxEntry):
        return ("outbox", item.seq)
    if isinstance(item, SpawnEntry):
        return ("spawn", item.seq)
    return ("timer", item.execution_id, item.path)


def letter(d: DeadLetter) -> tuple[Any, ...]:
    """A dead letter as plain values (its event by id)."""
    item: tuple[Any, ...] = tuple(d.item)
    if isinstance(d.item, OutboxEntry):
        item = (d.item.seq, d.item.target_id, d.item.event.id)
    return (d.kind, item, d.attempts, d.last_error)


def claim(row: PendingOutbox | PendingSpawn | ArmedTimer) -> tuple[Any, ...]:
    """An operator view's claim and attempts of a row (claimed_until only as set or not:
    it is on the database's clock)."""
    return (row.claimed_by, row.claimed_until is not None, row.attempts, row.last_error)


def named(key: Key) -> Any:
    """The key `dead_letter` takes: a seq, or a timer's (execution_id, path)."""
    return key[1:] if key[0] == "timer" else key[1]


class StoreModel(RuleBasedStateMachine):
    driver: type[Store] = LibsqlStore

    def __init__(self) -> None:
        super().__init__()
        self.store = self.driver(":memory:", trace_max=TRACE_MAX)
        self.exes: dict[str, tuple[int, dict[str, Any]]] = {}
        # The queues' rows, live and dead (a dead letter stays until acked, revived or
        # purged): outbox seq -> (target, event id), spawn seq -> (parent, child),
        # (execution, path) -> fire_at.
        self.outbox: dict[int, tuple[str | None, str]] = {}
        self.sources: dict[int, str] = {}  # outbox seq -> the execution that emitted it
        self.written: list[str] = []  # executions, the one last written last
        self.processed: set[tuple[str, str]] = set()
        self.timers: dict[tuple[str, str], float] = {}
        self.spawns: dict[int, tuple[str, str]] = {}
        self.trace: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.next_outbox = self.next_spawn = 1
        self.counter = 0
        # Per row: its claim as (claimed_by, the time left of claimed_until), present while
        # claimed_until is set (a failed row waits out its retry held by None); its attempts
        # and last error; and, for a dead letter, the claim that made it one (claims counted
        # in the order they ran).
        self.claims: dict[Key, tuple[str | None, float]] = {}
        self.attempts: dict[Key, int] = {}
        self.errors: dict[Key, str] = {}
        self.dead: dict[Key, int] = {}
        self.claims_run = 0
        self.failures = 0
        # Round-robin (0011): each outbox entry's and spawn's rank, and where the claims of each
        # kind stand (sql/queries.sql: insert_outbox, advance_clock, rerank_items_*).
        self.ranks: dict[Key, int] = {}
        self.clock = {"outbox": 0, "spawn": 0}

    def teardown(self) -> None:
        self.store.close()

    # --- the model's helpers ---

    def _exists(self, key: Key) -> bool:
        if key[0] == "outbox":
            return key[1] in self.outbox
        if key[0] == "spawn":
            return key[1] in self.spawns
        return (key[1], key[2]) in self.timers

    def _per_row(self) -> list[dict[Key, Any]]:
        return [self.claims, self.attempts, self.errors, self.dead]

    def _forget(self, key: Key) -> None:
        """The row is gone, or re-armed anew: no claim, no attempts, no error, not dead."""
        for per_row in self._per_row():
            per_row.pop(key, None)

    def _prune(self) -> None:
        """Forget what rows no longer exist (a purge took them)."""
        for per_row in self._per_row():
            for key in [k for k in per_row if not self._exists(k)]:
                del per_row[key]

    def _row(self, item: RelayItem) -> Key | None:
        """The row an item names, if it still exists (a timer only at that fire_at)."""
        key = key_of(item)
        if not self._exists(key):
            return None
        if (
            isinstance(item, DueTimer)
            and self.timers[(item.execution_id, item.path)] != item.fire_at
        ):
            return None
        return key

    def _flow(self, key: Key) -> str:
        """An outbox entry's or a spawn's flow key: its target's (its child's) root key."""
        if key[0] == "outbox":
            target = self.outbox[key[1]][0]
            return "" if target is None else target.partition(".")[0]
        return self.spawns[key[1]][1].partition(".")[0]

    def _ranked(self, kind: str) -> list[Key]:
        """The live rows of ``kind`` (outbox, spawn), in the claims' order: rank, then seq."""
        rows = self.outbox if kind == "outbox" else self.spawns
        live = [(kind, seq) for seq in rows if self._live((kind, seq))]
        return sorted(live, key=lambda k: (self.ranks[k], k[1]))

    def _rank(self, key: Key) -> None:
        """A row just written: its key's last live rank + 1, or where the claims stand."""
        flow = self._flow(key)
        rows = self.outbox if key[0] == "outbox" else self.spawns
        same = [
            self.ranks[k]
            for seq in rows
            if (k := (key[0], seq)) != key and self._live(k) and self._flow(k) == flow
        ]
        self.ranks[key] = max(max(same, default=0) + 1, self.clock[key[0]])

    def _advance(self, worker: str) -> None:
        """After a claim of outbox entries or spawns: each kind's clock moved to the highest
        rank ``worker`` holds (its lease run out or not)."""
        for kind in ("outbox", "spawn"):
            rows = self.outbox if kind == "outbox" else self.spawns
            held = [
                self.ranks[(kind, seq)]
                for seq in rows
                if self._live((kind, seq))
                and self.claims.get((kind, seq), (None, 0.0))[0] == worker
            ]
            self.clock[kind] = max([self.clock[kind], *held])

    def _rerank(self, keys: list[Key]) -> None:
        """Rows come back (revived): the keys of those ranked behind where the claims stand
        have their live rows ranked again from there, in their order."""
        for kind in ("outbox", "spawn"):
            stale = {
                self._flow(k)
                for k in keys
                if k[0] == kind
                and self._exists(k)
                and self._live(k)
                and self.ranks[k] < self.clock[kind]
            }
            position: dict[str, int] = {}
            for k in self._ranked(kind):
                flow = self._flow(k)
                if flow in stale:
                    self.ranks[k] = self.clock[kind] + position.get(flow, 0)
                    position[flow] = position.get(flow, 0) + 1

    def _free(self, key: Key) -> bool:
        return self.claims.get(key, (None, 0.0))[1] <= 0.0

    def _held_by(self, key: Key, worker: str) -> bool:
        holder, left = self.claims.get(key, (None, 0.0))
        return holder == worker and left > 0.0

    def _live(self, key: Key) -> bool:
        return key not in self.dead

    def _item(self, key: Key) -> RelayItem:
        if key[0] == "outbox":
            target, event_id = self.outbox[key[1]]
            return OutboxEntry(key[1], target, Event(name="e", id=event_id))
        if key[0] == "spawn":
            parent, child = self.spawns[key[1]]
            return SpawnEntry(key[1], parent, child, "r", {"n": int(child[3:])})
        return DueTimer(key[1], key[2], self.timers[(key[1], key[2])])

    def _keys(self) -> list[Key]:
        return (
            [("outbox", s) for s in sorted(self.outbox)]
            + [("spawn", s) for s in sorted(self.spawns)]
            + [("timer", e, p) for e, p in sorted(self.timers)]
        )

    def _pool(self) -> list[RelayItem]:
        """Items to hand back: every row's (live or dead), and some of rows already gone, or
        of a timer at another time."""
        items = [self._item(k) for k in self._keys()]
        acked = [s for s in range(1, self.next_outbox) if s not in self.outbox][-2:]
        items += [OutboxEntry(s, None, Event(name="e", id="gone")) for s in [*acked, GONE]]
        done = [s for s in range(1, self.next_spawn) if s not in self.spawns][-2:]
        items += [SpawnEntry(s, "a", "gone", "r", {}) for s in [*done, GONE]]
        items += [DueTimer(e, p, at + 0.5) for (e, p), at in sorted(self.timers.items())[:2]]
        items += [DueTimer(e, p, 3.0) for e in IDS[:2] for p in PATHS if (e, p) not in self.timers]
        return items

    def _items(self, data: st.DataObject, max_size: int = 4) -> list[RelayItem]:
        """Some items of the pool, duplicates and all."""
        return data.draw(st.lists(st.sampled_from(self._pool()), max_size=max_size))

    def _claimed(self, data: st.DataObject) -> list[RelayItem]:
        """Items for `fail` and `extend`: some of rows with a claim (held, run out, or
        waiting out a retry), some others, in any order."""
        claimed = [self._item(k) for k in self._keys() if k in self.claims]
        some = data.draw(st.lists(st.sampled_from(claimed), min_size=1, max_size=3))
        return data.draw(st.permutations(some + self._items(data, max_size=2)))

    def _ack(self, items: list[RelayItem]) -> int:
        """Remove what ``items`` name, one after the other; return how many rows went."""
        removed = 0
        for item in items:
            key = self._row(item)
            if key is None:
                continue
            if key[0] == "outbox":
                del self.outbox[key[1]]
            elif key[0] == "spawn":
                del self.spawns[key[1]]
            else:
                del self.timers[(key[1], key[2])]
            self._forget(key)
            removed += 1
        return removed

    # --- the rules ---

    @rule(
        eid=st.sampled_from(IDS),
        skew=st.sampled_from([0, 0, 0, -1, 1]),
        to=st.lists(st.sampled_from([None, *IDS]), max_size=2),
        processed=st.booleans(),
        timer=st.one_of(
            st.none(),
            st.tuples(st.just("schedule"), st.sampled_from(PATHS), st.integers(0, 20)),
            st.tuples(st.just("cancel"), st.sampled_from(PATHS), st.just(0)),
            st.tuples(st.just("refire"), st.sampled_from(PATHS), st.sampled_from([0, 5])),
        ),
        spawn=st.booleans(),
        trace=st.booleans(),
        data=st.data(),
    )
    def commit(
        self,
        eid: str,
        skew: int,
        to: list[str | None],
        processed: bool,
        timer: tuple[str, str, float] | None,
        spawn: bool,
        trace: bool,
        data: st.DataObject,
    ) -> None:
        # Items it consumes: pending, claimed, dead or gone ones, and timers at a time they
        # no longer fire at.
        acks = self._items(data, max_size=2)
        if timer is not None and timer[0] == "refire":
            # The handler of a firing of its own timer: consumes it and re-arms it, at the
            # same time or a later one (or just arms it, if it is not armed).
            _, path, later = timer
            at = self.timers.get((eid, path))
            if at is not None:
                acks.append(DueTimer(eid, path, at))
            timer = ("schedule", path, (at or 0.0) + later)
        self._commit(eid, skew, to, processed, timer, spawn, trace, acks)

    @initialize(
        eids=st.lists(st.sampled_from(IDS), min_size=1, max_size=3, unique=True),
        ats=st.lists(st.integers(0, 20), min_size=3, max_size=3),
    )
    def seed(self, eids: list[str], ats: list[int]) -> None:
        """Something in every queue to begin with (with many rules, commits are rare): each
        execution emits two events, spawns a child and arms a timer."""
        for eid, at in zip(eids, ats, strict=False):
            self._commit(eid, 0, [None, eid], False, ("schedule", "p", at), True, False, [])

    def _commit(
        self,
        eid: str,
        skew: int,
        to: list[str | None],
        processed: bool,
        timer: tuple[str, str, float] | None,
        spawn: bool,
        trace: bool,
        acks: list[RelayItem],
    ) -> None:
        self.counter += 1
        n = self.counter
        version = self.exes.get(eid, (0, {}))[0]
        stale = skew != 0 and version + skew >= 0
        exe = Execution(
            id=eid,
            definition_id="m",
            version=version + skew if stale else version,
            context={"n": n},
        )
        before = exe.version
        events = [(t, Event(name="e", id=f"ev{n}-{k}")) for k, t in enumerate(to)]
        ops = []
        if timer is not None:
            action, path, at = timer
            ops.append(
                TimerOp.schedule(path, float(at)) if action == "schedule" else TimerOp.cancel(path)
            )
        try:
            seqs = self.store.commit(
                exe,
                events,
                f"in{n}" if processed else None,
                ops,
                [(f"kid{n}", "r", {"n": n})] if spawn else [],
                {"n": n} if trace else None,
                acks=acks,
            )
        except StoreConflict:
            assert stale, "a conflict on a fresh version"
            assert exe.version == before
            return  # nothing written, nothing acked: the invariants check it
        assert not stale, "a stale version committed"
        assert exe.version == version + 1
        self.exes[eid] = (version + 1, {"n": n})
        self.written = [e for e in self.written if e != eid] + [eid]
        # The acks consume the items as they were before this commit: what it writes itself
        # (a re-armed timer, at its old time or not) stays.
        self._ack(acks)
        assert seqs == list(range(self.next_outbox, self.next_outbox + len(events)))
        for seq, (target, event) in zip(seqs, events, strict=True):
            self.outbox[seq] = (target, event.id)
            self.sources[seq] = eid
            self._rank(("outbox", seq))
        self.next_outbox += len(events)
        if processed:
            self.processed.add((eid, f"in{n}"))
        for op in ops:
            self._forget(("timer", eid, op.path))  # re-armed (anew) or cancelled
            if op.action == "schedule":
                assert op.fire_at is not None
                self.timers[(eid, op.path)] = op.fire_at
            else:
                self.timers.pop((eid, op.path), None)
        if spawn:
            self.spawns[self.next_spawn] = (eid, f"kid{n}")
            self._rank(("spawn", self.next_spawn))
            self.next_spawn += 1
        if trace:
            ring = self.trace.setdefault(eid, [])
            ring.append((ring[-1][0] + 1 if ring else 0, {"n": n}))
            del ring[:-TRACE_MAX]

    @precondition(lambda self: self.outbox)
    @rule(data=st.data())
    def ack_outbox(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.outbox)))  # live or dead
        self.store.ack_outbox(seq)
        del self.outbox[seq]
        self._forget(("outbox", seq))

    @rule(seq=st.integers(0, 1000))
    def ack_unknown(self, seq: int) -> None:
        self.store.ack_outbox(seq)
        self.outbox.pop(seq, None)
        self.store.ack_spawn(seq)
        self.spawns.pop(seq, None)
        self._forget(("outbox", seq))
        self._forget(("spawn", seq))

    @precondition(lambda self: self.spawns)
    @rule(data=st.data())
    def ack_spawn(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.spawns)))
        self.store.ack_spawn(seq)
        del self.spawns[seq]
        self._forget(("spawn", seq))

    @precondition(lambda self: self.outbox or self.spawns or self.timers)
    @rule(data=st.data())
    def ack(self, data: st.DataObject) -> None:
        """Any mix of kinds, live, dead or gone, duplicates included: one count of rows."""
        items = self._items(data)
        assert self.store.ack(items) == self._ack(items)

    @rule(now=st.integers(0, 20), rearm=st.booleans())
    def sweep(self, now: int, rearm: bool) -> None:
        due = self.store.due_timers(float(now))
        assert sorted(due) == sorted(
            (e, p, at)
            for (e, p), at in self.timers.items()
            if at <= now and self._live(("timer", e, p))
        )
        for eid, path, at in due:
            if rearm:  # re-armed between the sweep and the delete: the delete must spare it
                self.store.commit(
                    Execution(
                        id=eid,
                        definition_id="m",
                        version=self.exes[eid][0],
                        context=self.exes[eid][1],
                    ),
                    [],
                    timers=[TimerOp.schedule(path, at + 100)],
                )
                self.exes[eid] = (self.exes[eid][0] + 1, self.exes[eid][1])
                self.written = [e for e in self.written if e != eid] + [eid]
                self.timers[(eid, path)] = at + 100
            else:
                del self.timers[(eid, path)]
            self._forget(("timer", eid, path))
            self.store.delete_timer(eid, path, at)

    @rule(eid=st.sampled_from(IDS), skew=st.sampled_from([0, 0, 1, -1]))
    def purge(self, eid: str, skew: int) -> None:
        version = self.exes.get(eid, (0, {}))[0] + skew
        if version < 0:
            return
        exists = eid in self.exes
        expect = exists and skew == 0
        assert self.store.purge(eid, version) is expect
        if exists and not expect:
            return
        # Everything it owns goes, dead letters included.
        self.exes.pop(eid, None)
        self.processed = {(e, i) for e, i in self.processed if e != eid}
        self.timers = {k: v for k, v in self.timers.items() if k[0] != eid}
        self.outbox = {s: v for s, v in self.outbox.items() if v[0] != eid}
        self.spawns = {s: v for s, v in self.spawns.items() if v[0] != eid}
        self.trace.pop(eid, None)
        self._prune()

    def _claim(
        self, order: list[Key], worker: str, limit: int, lease: float, max_attempts: int | None
    ) -> list[Key]:
        """What a claim takes of the rows in ``order`` (live or dead, in the claim's order),
        and which it makes dead letters."""
        free = [k for k in order if self._live(k) and self._free(k)]
        if max_attempts is not None:
            # Of the first `limit` rows it could take, those at max_attempts die; it passes
            # over every row at max_attempts.
            self.claims_run += 1
            for k in free[:limit]:
                if self.attempts.get(k, 0) >= max_attempts:
                    self.dead[k] = self.claims_run
                    self.claims.pop(k, None)
            free = [k for k in free if self.attempts.get(k, 0) < max_attempts]
        for k in free[:limit]:
            self.attempts[k] = self.attempts.get(k, 0) + 1
            self.claims[k] = (worker, lease)
        return free[:limit]

    def _claim_outbox(
        self, worker: str, limit: int, lease: float, max_attempts: int | None
    ) -> list[OutboxEntry]:
        got = self.store.claim_outbox(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        taken = self._claim(self._ranked("outbox"), worker, limit, lease, max_attempts)
        taken.sort(key=lambda k: k[1])  # handed out oldest first
        self._advance(worker)
        assert [(e.seq, e.target_id, e.event.id) for e in got] == [
            (k[1], *self.outbox[k[1]]) for k in taken
        ]
        return got

    def _claim_spawns(
        self, worker: str, limit: int, lease: float, max_attempts: int | None
    ) -> list[SpawnEntry]:
        got = self.store.claim_spawns(worker, limit=limit, lease=lease, max_attempts=max_attempts)
        taken = self._claim(self._ranked("spawn"), worker, limit, lease, max_attempts)
        taken.sort(key=lambda k: k[1])
        self._advance(worker)
        assert [(p.seq, p.parent_id, p.child_id) for p in got] == [
            (k[1], *self.spawns[k[1]]) for k in taken
        ]
        return got

    def _claim_due_timers(
        self, worker: str, now: int, limit: int, lease: float, max_attempts: int | None
    ) -> list[DueTimer]:
        got = self.store.claim_due_timers(
            worker, float(now), limit=limit, lease=lease, max_attempts=max_attempts
        )
        due = sorted((at, e, p) for (e, p), at in self.timers.items() if at <= now)
        free = [k for _, e, p in due if self._live(k := ("timer", e, p)) and self._free(k)]
        if max_attempts is not None:
            # All the claimable due timers are read (their claim ranks them in their keys):
            # the first `limit` of those at max_attempts die.
            self.claims_run += 1
            for k in [k for k in free if self.attempts.get(k, 0) >= max_attempts][:limit]:
                self.dead[k] = self.claims_run
                self.claims.pop(k, None)
            free = [k for k in free if self.attempts.get(k, 0) < max_attempts]
        turns: dict[str, int] = {}
        ranked = []
        for k in free:  # soonest first: each timer's turn in its execution's root key
            flow = k[1].partition(".")[0]
            turns[flow] = turns.get(flow, 0) + 1
            ranked.append((turns[flow], self.timers[(k[1], k[2])], k[1], k[2]))
        taken = [("timer", e, p) for _, _, e, p in sorted(ranked)[:limit]]
        for k in taken:
            self.attempts[k] = self.attempts.get(k, 0) + 1
            self.claims[k] = (worker, lease)
        taken.sort(key=lambda k: (self.timers[(k[1], k[2])], k[1], k[2]))  # soonest first
        assert got == [(e, p, self.timers[(e, p)]) for _, e, p in taken]
        assert all(isinstance(t, DueTimer) for t in got)
        assert len({t.event_id for t in got}) == len(got)
        return got

    @rule(
        worker=st.sampled_from(WORKERS),
        limit=st.integers(1, 3),
        lease=st.sampled_from(LEASES),
        max_attempts=st.sampled_from(MAX_ATTEMPTS),
    )
    def claim_outbox(self, worker: str, limit: int, lease: float, max_attempts: int | None) -> None:
        self._claim_outbox(worker, limit, lease, max_attempts)

    @rule(
        worker=st.sampled_from(WORKERS),
        limit=st.integers(1, 3),
        lease=st.sampled_from(LEASES),
        max_attempts=st.sampled_from(MAX_ATTEMPTS),
    )
    def claim_spawns(self, worker: str, limit: int, lease: float, max_attempts: int | None) -> None:
        self._claim_spawns(worker, limit, lease, max_attempts)

    @rule(
        worker=st.sampled_from(WORKERS),
        now=st.one_of(st.integers(0, 20), st.just(LATE)),
        limit=st.integers(1, 3),
        lease=st.sampled_from(LEASES),
        max_attempts=st.sampled_from(MAX_ATTEMPTS),
    )
    def claim_due_timers(
        self, worker: str, now: int, limit: int, lease: float, max_attempts: int | None
    ) -> None:
        self._claim_due_timers(worker, now, limit, lease, max_attempts)

    def _fail(self, worker: str, items: list[RelayItem], retry_in: float) -> None:
        """Only the rows ``worker`` holds under a live lease: their error recorded, held by
        nobody, claimable ``retry_in`` from now."""
        self.failures += 1
        error = f"boom {self.failures}"
        failed = 0
        for item in items:
            key = self._row(item)
            if key is not None and self._held_by(key, worker):
                self.errors[key] = error
                self.claims[key] = (None, retry_in)
                failed += 1
        assert self.store.fail(worker, items, error=error, retry_in=retry_in) == failed

    @precondition(lambda self: self.claims)
    @rule(
        worker=st.sampled_from(WORKERS),
        retry_in=st.sampled_from(RETRIES),
        data=st.data(),
    )
    def fail(self, worker: str, retry_in: float, data: st.DataObject) -> None:
        self._fail(worker, self._claimed(data), retry_in)

    @rule(
        kind=st.sampled_from(list(KINDS)),
        worker=st.sampled_from(WORKERS),
        max_attempts=st.integers(1, 3),
        rounds=st.integers(1, 4),
    )
    def retry_at_once(self, kind: str, worker: str, max_attempts: int, rounds: int) -> None:
        """A relay whose handler always fails and retries at once: each round claims what it
        can and fails it, until the rows are dead letters (the chain the rules above make
        only now and then)."""
        for _ in range(rounds):
            got: list[RelayItem]
            if kind == "outbox":
                got = [*self._claim_outbox(worker, 3, LEASES[0], max_attempts)]
            elif kind == "spawn":
                got = [*self._claim_spawns(worker, 3, LEASES[0], max_attempts)]
            else:
                got = [*self._claim_due_timers(worker, LATE, 3, LEASES[0], max_attempts)]
            self._fail(worker, got, 0.0)

    @precondition(lambda self: self.claims)
    @rule(worker=st.sampled_from(WORKERS), lease=st.sampled_from(LEASES), data=st.data())
    def extend(self, worker: str, lease: float, data: st.DataObject) -> None:
        items = self._claimed(data)
        held = [item for item in items if (k := self._row(item)) and self._held_by(k, worker)]
        assert self.store.extend(worker, items, lease=lease) == held
        for item in held:
            self.claims[key_of(item)] = (worker, lease)

    @precondition(lambda self: self.outbox or self.spawns or self.timers)
    @rule(data=st.data())
    def revive(self, data: st.DataObject) -> None:
        """Rows (dead or live, held or not): attempts 0, no claim, live; their last error
        kept. Returns how many rows (a duplicate counts once)."""
        dead = [self._item(k) for k in self._keys() if k in self.dead]
        items = self._items(data)
        if dead:
            some = data.draw(st.lists(st.sampled_from(dead), max_size=2))
            items = data.draw(st.permutations(some + items))
        rows = {key for item in items if (key := self._row(item)) is not None}
        for key in rows:
            self.attempts.pop(key, None)
            self.claims.pop(key, None)
            self.dead.pop(key, None)
        self._rerank(list(rows))
        assert self.store.revive(items) == len(rows)

    @rule(seconds=st.sampled_from([50.0, 1_000.0, 10_000.0]))
    def elapse(self, seconds: float) -> None:
        """The clock moves on by ``seconds``: every lease's end moves back as much."""
        db = raw(self.store)
        for table in ("harel_outbox", "harel_spawns", "harel_timers"):
            db.execute(f"UPDATE {table} SET claimed_until = claimed_until - ?", (seconds,))
        db.commit()
        self.claims = {k: (by, left - seconds) for k, (by, left) in self.claims.items()}

    # --- the invariants ---

    @invariant()
    def agrees(self) -> None:
        s = self.store
        for eid in IDS:
            got = s.load(eid)
            if eid in self.exes:
                assert got is not None
                assert (got.version, got.context) == self.exes[eid]
            else:
                assert got is None
            assert s.read_trace(eid) == [{**e, "index": i} for i, e in self.trace.get(eid, [])]
        assert s.ids_with_prefix("") == sorted(self.exes)
        live_outbox = [seq for seq in sorted(self.outbox) if self._live(("outbox", seq))]
        assert [(o.seq, o.target_id, o.event.id) for o in s.pending_outbox()] == [
            (seq, *self.outbox[seq]) for seq in live_outbox
        ]
        assert [(p.seq, p.parent_id, p.child_id) for p in s.pending_spawns()] == [
            (seq, *v) for seq, v in sorted(self.spawns.items()) if self._live(("spawn", seq))
        ]
        live_timers = {k: at for k, at in self.timers.items() if self._live(("timer", *k))}
        assert sorted(s.due_timers(FAR)) == sorted((e, p, at) for (e, p), at in live_timers.items())
        for n in range(1, self.counter + 1):
            for eid in IDS:
                assert s.is_processed(eid, f"in{n}") == ((eid, f"in{n}") in self.processed)
        assert [o.seq for o in s.pending_outbox(limit=2)] == live_outbox[:2]
        # Newest first is (updated_at, id) descending, and updated_at follows the writes.
        newest = s.list_executions(newest_first=True, limit=1000).items
        keys = [(x.updated_at, x.id) for x in newest]
        assert keys == sorted(keys, reverse=True)
        assert sorted(x.id for x in newest) == sorted(self.exes)
        at = {x.id: x.updated_at for x in newest}
        times = [at[e] for e in self.written if e in at]
        assert times == sorted(times)

    def _meta(self, key: Key) -> tuple[Any, ...]:
        """A row's claim and attempts as an operator view shows them (see `claim`)."""
        holder, left = self.claims.get(key, (None, None))
        return (holder, left is not None, self.attempts.get(key, 0), self.errors.get(key))

    def _letter(self, key: Key) -> tuple[Any, ...]:
        """A dead row as `letter` gives it."""
        item = (key[1], *self.outbox[key[1]]) if key[0] == "outbox" else tuple(self._item(key))
        return (key[0], item, self.attempts.get(key, 0), self.errors.get(key))

    def _dead_at(self) -> dict[Key, float]:
        """When each dead letter died (not in the API: read as `elapse` writes)."""
        db = raw(self.store)
        at = {}
        for kind, table in (("outbox", "harel_outbox"), ("spawn", "harel_spawns")):
            query = f"SELECT -seq, dead_at FROM {table} WHERE dead_at IS NOT NULL"
            at.update({(kind, seq): t for seq, t in db.execute(query).fetchall()})
        query = "SELECT execution_id, path, dead_at FROM harel_timers WHERE dead_at IS NOT NULL"
        at.update({("timer", e, p): t for e, p, t in db.execute(query).fetchall()})
        return at

    @invariant()
    def queues_agree(self) -> None:
        s = self.store
        live = [k for k in self._keys() if self._live(k)]
        stats = s.stats(FAR)
        # A failed row waiting out its retry is held by nobody: not claimed.
        held = [k[0] for k, (by, left) in self.claims.items() if by is not None and left > 0]
        dead = [k[0] for k in self.dead]
        pending = [k[0] for k in live]
        assert (stats.claimed_outbox, stats.claimed_spawns, stats.claimed_timers) == (
            held.count("outbox"),
            held.count("spawn"),
            held.count("timer"),
        )
        assert (stats.dead_outbox, stats.dead_spawns, stats.dead_timers) == (
            dead.count("outbox"),
            dead.count("spawn"),
            dead.count("timer"),
        )
        assert (stats.pending_outbox, stats.pending_spawns, stats.timers_due) == (
            pending.count("outbox"),
            pending.count("spawn"),
            pending.count("timer"),
        )
        # The operator views: live rows only, each with its claim, attempts and last error.
        assert [(o.seq, o.source_id, *claim(o)) for o in s.outbox_view(limit=1000)] == [
            (k[1], self.sources[k[1]], *self._meta(k)) for k in live if k[0] == "outbox"
        ]
        assert [(p.seq, *claim(p)) for p in s.spawns_view(limit=1000)] == [
            (k[1], *self._meta(k)) for k in live if k[0] == "spawn"
        ]
        timers = sorted((self.timers[k[1:]], *k[1:]) for k in live if k[0] == "timer")
        assert [(t.fire_at, t.execution_id, t.path, *claim(t)) for t in s.timers_view()] == [
            (at, e, p, *self._meta(("timer", e, p))) for at, e, p in timers
        ]
        for eid in IDS:
            assert s.timers_of(eid) == [(p, at) for at, e, p in timers if e == eid]
        # The dead letters: exactly the model's, each as it was when it died.
        letters = s.dead_letters(limit=1000)
        assert sorted(letter(d) for d in letters) == sorted(self._letter(k) for k in self.dead)
        assert len(letters) == len(self.dead)
        if letters:
            # In the order they died, ties broken by kind, then key; the time (the database's
            # clock, in ms) one per claim, and no earlier for a later claim.
            at = self._dead_at()
            assert sorted(at) == sorted(self.dead)
            assert letters == sorted(
                letters, key=lambda d: (at[key_of(d.item)], KINDS[d.kind], key_of(d.item)[1:])
            )
            deaths = sorted((self.dead[k], at[k]) for k in self.dead)  # (claim, time)
            assert [t for _, t in deaths] == sorted(t for _, t in deaths)
            assert len({c for c, _ in deaths}) == len(set(deaths))
        assert s.dead_letters(limit=2) == letters[:2]
        for kind in KINDS:
            assert s.dead_letters(kind=kind, limit=1000) == [d for d in letters if d.kind == kind]
        for d in letters:
            assert s.dead_letter(d.kind, named(key_of(d.item))) == d
        for k in live[:1]:
            assert s.dead_letter(k[0], named(k)) is None


# 3,600 steps a driver (~75 CPU-s for the two on CI's 2 cores at 6,000), in runs long enough
# for the relays' chains (claim, the lease runs out or the holder fails, claim again at
# max_attempts: a dead letter, revived). Each CI run draws new ones.
SETTINGS = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LibsqlModel(StoreModel):
    driver = LibsqlStore


class SqliteModel(StoreModel):
    driver = SqliteStore


pytestmark = pytest.mark.slow  # ~30-110 s a model under load

TestLibsqlAgainstModel = SETTINGS(LibsqlModel).TestCase
TestSqliteAgainstModel = SETTINGS(SqliteModel).TestCase
