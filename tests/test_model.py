"""Random sequences of commits, acks, sweeps, claims and purges, checked against a plain
model.

After every step the store (both drivers) must agree with a few dicts that implement the
contract in the most obvious way. Leases run on the database's clock, which a test cannot
set: the model's clock moves instead by moving every lease's end back (`elapse`), so a
lease runs out exactly when the model says it does.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from harel_store import Event, Execution, LibsqlStore, SqliteStore, StoreConflict, TimerOp
from harel_store.store import Store
from tests.helpers import raw

IDS = ["a", "b", "c%", "d_"]
PATHS = ["p", "q"]
TRACE_MAX = 3
FAR = 1e12
# Leases and clock steps far apart from the real seconds a test run takes.
LEASES = [100.0, 10_000.0]
Held = tuple[str, ...]  # ("outbox", seq) / ("spawn", seq) / ("timer", execution_id, path)


class StoreModel(RuleBasedStateMachine):
    driver: type[Store] = LibsqlStore

    def __init__(self) -> None:
        super().__init__()
        self.store = self.driver(":memory:", trace_max=TRACE_MAX)
        self.exes: dict[str, tuple[int, dict[str, Any]]] = {}
        self.outbox: dict[int, tuple[str | None, str]] = {}
        self.sources: dict[int, str] = {}  # outbox seq -> the execution that emitted it
        self.written: list[str] = []  # executions, the one last written last
        self.processed: set[tuple[str, str]] = set()
        self.timers: dict[tuple[str, str], float] = {}
        self.spawns: dict[int, tuple[str, str]] = {}
        self.trace: dict[str, list[tuple[int, dict[str, Any]]]] = {}
        self.next_outbox = self.next_spawn = 1
        self.counter = 0
        self.leases: dict[Held, float] = {}  # what is claimed, and the lease's time left

    def teardown(self) -> None:
        self.store.close()

    @rule(
        eid=st.sampled_from(IDS),
        skew=st.sampled_from([0, 0, 0, -1, 1]),
        to=st.lists(st.sampled_from([None, *IDS]), max_size=2),
        processed=st.booleans(),
        timer=st.one_of(
            st.none(),
            st.tuples(st.just("schedule"), st.sampled_from(PATHS), st.integers(0, 20)),
            st.tuples(st.just("cancel"), st.sampled_from(PATHS), st.just(0)),
        ),
        spawn=st.booleans(),
        trace=st.booleans(),
    )
    def commit(
        self,
        eid: str,
        skew: int,
        to: list[str | None],
        processed: bool,
        timer: tuple[str, str, int] | None,
        spawn: bool,
        trace: bool,
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
            )
        except StoreConflict:
            assert stale, "a conflict on a fresh version"
            assert exe.version == before
            return
        assert not stale, "a stale version committed"
        assert exe.version == version + 1
        self.exes[eid] = (version + 1, {"n": n})
        self.written = [e for e in self.written if e != eid] + [eid]
        assert seqs == list(range(self.next_outbox, self.next_outbox + len(events)))
        for seq, (target, event) in zip(seqs, events, strict=True):
            self.outbox[seq] = (target, event.id)
            self.sources[seq] = eid
        self.next_outbox += len(events)
        if processed:
            self.processed.add((eid, f"in{n}"))
        for op in ops:
            self.leases.pop(("timer", eid, op.path), None)  # re-armed or cancelled: unclaimed
            if op.action == "schedule":
                assert op.fire_at is not None
                self.timers[(eid, op.path)] = op.fire_at
            else:
                self.timers.pop((eid, op.path), None)
        if spawn:
            self.spawns[self.next_spawn] = (eid, f"kid{n}")
            self.next_spawn += 1
        if trace:
            ring = self.trace.setdefault(eid, [])
            ring.append((ring[-1][0] + 1 if ring else 0, {"n": n}))
            del ring[:-TRACE_MAX]

    @precondition(lambda self: self.outbox)
    @rule(data=st.data())
    def ack_outbox(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.outbox)))
        self.store.ack_outbox(seq)
        del self.outbox[seq]
        self.leases.pop(("outbox", seq), None)

    @rule(seq=st.integers(0, 1000))
    def ack_unknown(self, seq: int) -> None:
        self.store.ack_outbox(seq)
        self.outbox.pop(seq, None)
        self.store.ack_spawn(seq)
        self.spawns.pop(seq, None)
        self.leases.pop(("outbox", seq), None)
        self.leases.pop(("spawn", seq), None)

    @precondition(lambda self: self.spawns)
    @rule(data=st.data())
    def ack_spawn(self, data: st.DataObject) -> None:
        seq = data.draw(st.sampled_from(sorted(self.spawns)))
        self.store.ack_spawn(seq)
        del self.spawns[seq]
        self.leases.pop(("spawn", seq), None)

    @rule(now=st.integers(0, 20), rearm=st.booleans())
    def sweep(self, now: int, rearm: bool) -> None:
        due = self.store.due_timers(float(now))
        assert sorted(due) == sorted((e, p, at) for (e, p), at in self.timers.items() if at <= now)
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
            self.leases.pop(("timer", eid, path), None)
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
        self.exes.pop(eid, None)
        self.processed = {(e, i) for e, i in self.processed if e != eid}
        self.timers = {k: v for k, v in self.timers.items() if k[0] != eid}
        self.outbox = {s: v for s, v in self.outbox.items() if v[0] != eid}
        self.spawns = {s: v for s, v in self.spawns.items() if v[0] != eid}
        self.trace.pop(eid, None)
        self.leases = {
            k: v
            for k, v in self.leases.items()
            if (k[0] == "outbox" and int(k[1]) in self.outbox)
            or (k[0] == "spawn" and int(k[1]) in self.spawns)
            or (k[0] == "timer" and (k[1], k[2]) in self.timers)
        }

    def _free(self, key: Held) -> bool:
        return self.leases.get(key, 0.0) <= 0.0

    @rule(
        worker=st.sampled_from(["w1", "w2"]), limit=st.integers(1, 3), lease=st.sampled_from(LEASES)
    )
    def claim_outbox(self, worker: str, limit: int, lease: float) -> None:
        got = self.store.claim_outbox(worker, limit=limit, lease=lease)
        free = [seq for seq in sorted(self.outbox) if self._free(("outbox", seq))]
        assert [(e.seq, e.target_id, e.event.id) for e in got] == [
            (seq, *self.outbox[seq]) for seq in free[:limit]
        ]
        for seq in free[:limit]:
            self.leases[("outbox", seq)] = lease

    @rule(
        worker=st.sampled_from(["w1", "w2"]), limit=st.integers(1, 3), lease=st.sampled_from(LEASES)
    )
    def claim_spawns(self, worker: str, limit: int, lease: float) -> None:
        got = self.store.claim_spawns(worker, limit=limit, lease=lease)
        free = [seq for seq in sorted(self.spawns) if self._free(("spawn", seq))]
        assert [(p.seq, p.parent_id, p.child_id) for p in got] == [
            (seq, *self.spawns[seq]) for seq in free[:limit]
        ]
        for seq in free[:limit]:
            self.leases[("spawn", seq)] = lease

    @rule(
        worker=st.sampled_from(["w1", "w2"]),
        now=st.integers(0, 20),
        limit=st.integers(1, 3),
        lease=st.sampled_from(LEASES),
    )
    def claim_due_timers(self, worker: str, now: int, limit: int, lease: float) -> None:
        got = self.store.claim_due_timers(worker, float(now), limit=limit, lease=lease)
        due = sorted(
            (at, e, p)
            for (e, p), at in self.timers.items()
            if at <= now and self._free(("timer", e, p))
        )[:limit]
        assert got == [(e, p, at) for at, e, p in due]
        for _, e, p in due:
            self.leases[("timer", e, p)] = lease

    @rule(seconds=st.sampled_from([50.0, 1_000.0]))
    def elapse(self, seconds: float) -> None:
        """The clock moves on by ``seconds``: every lease's end moves back as much."""
        db = raw(self.store)
        for table in ("harel_outbox", "harel_spawns", "harel_timers"):
            db.execute(f"UPDATE {table} SET claimed_until = claimed_until - ?", (seconds,))
        db.commit()
        self.leases = {k: left - seconds for k, left in self.leases.items()}

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
        assert [(o.seq, o.target_id, o.event.id) for o in s.pending_outbox()] == [
            (seq, *v) for seq, v in sorted(self.outbox.items())
        ]
        assert [(p.seq, p.parent_id, p.child_id) for p in s.pending_spawns()] == [
            (seq, *v) for seq, v in sorted(self.spawns.items())
        ]
        assert sorted(s.due_timers(FAR)) == sorted((e, p, at) for (e, p), at in self.timers.items())
        for n in range(1, self.counter + 1):
            for eid in IDS:
                assert s.is_processed(eid, f"in{n}") == ((eid, f"in{n}") in self.processed)
        stats = s.stats(FAR)
        held = [k[0] for k, left in self.leases.items() if left > 0]
        assert (stats.claimed_outbox, stats.claimed_spawns, stats.claimed_timers) == (
            held.count("outbox"),
            held.count("spawn"),
            held.count("timer"),
        )
        assert [o.seq for o in s.pending_outbox(limit=2)] == sorted(self.outbox)[:2]
        assert [(o.seq, o.source_id) for o in s.outbox_view(limit=1000)] == [
            (seq, self.sources[seq]) for seq in sorted(self.outbox)
        ]
        # Newest first is (updated_at, id) descending, and updated_at follows the writes.
        newest = s.list_executions(newest_first=True, limit=1000).items
        keys = [(x.updated_at, x.id) for x in newest]
        assert keys == sorted(keys, reverse=True)
        assert sorted(x.id for x in newest) == sorted(self.exes)
        at = {x.id: x.updated_at for x in newest}
        times = [at[e] for e in self.written if e in at]
        assert times == sorted(times)


SETTINGS = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)


class LibsqlModel(StoreModel):
    driver = LibsqlStore


class SqliteModel(StoreModel):
    driver = SqliteStore


TestLibsqlAgainstModel = SETTINGS(LibsqlModel).TestCase
TestSqliteAgainstModel = SETTINGS(SqliteModel).TestCase
