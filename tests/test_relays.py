"""Many relay workers, one database: claimed outbox entries, spawns and timers.

Worker processes (workers/relay.py) claim, deliver (one fsynced line in a file of their own,
written before the ack) and ack. With nobody dying every item is delivered exactly once;
a worker SIGKILLed while it holds claims loses nothing, and only what it had already
delivered is delivered again. A trigger the test adds logs every claim with the database's
clock, so the test checks, without timing anything, that no row was ever handed to a second
worker while the first one's lease was still running.
"""

from __future__ import annotations

import json
import signal
import sqlite3
import subprocess
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from harel_store import Event, Execution, LibsqlStore, TimerOp
from harel_store.store import Store
from tests.conftest import reset_remote
from tests.sqld import SqldServer
from tests.workers.common import open_store, race, spawn
from tests.workers.relay import FAR_FUTURE

NOW_SQL = "((julianday('now') - 2440587.5) * 86400.0)"
# Every claim, as the claim's own statement saw it: which row, who held it until when, who
# takes it until when, and the database's clock. Re-arming a timer (claimed_by set to NULL)
# is not a claim.
CLAIM_LOG = [
    "CREATE TABLE relay_claims "
    "(item TEXT, old_by TEXT, old_until REAL, new_by TEXT, new_until REAL, at REAL)",
    *(
        f"CREATE TRIGGER relay_claims_{table} AFTER UPDATE OF claimed_until ON harel_{table} "
        "WHEN NEW.claimed_by IS NOT NULL BEGIN INSERT INTO relay_claims VALUES "
        f"({item}, OLD.claimed_by, OLD.claimed_until, NEW.claimed_by, NEW.claimed_until, "
        f"{NOW_SQL}); END"
        for table, item in [
            ("outbox", "'outbox ' || NEW.seq"),
            ("spawns", "'spawn ' || NEW.seq"),
            ("timers", "'timer ' || NEW.execution_id || ' ' || NEW.path"),
        ]
    ),
]
DROP_CLAIM_LOG = [
    *(f"DROP TRIGGER IF EXISTS relay_claims_{t}" for t in ("outbox", "spawns", "timers")),
    "DROP TABLE IF EXISTS relay_claims",
]


class Claim(NamedTuple):
    item: str
    old_by: str | None
    old_until: float | None
    new_by: str
    new_until: float
    at: float


def run_sql(conn: Any, statements: Iterable[str]) -> None:
    """Run statements on a sqlite3 or libsql connection and commit."""
    for sql in statements:
        conn.execute(sql)
    conn.commit()


def claims(conn: Any) -> list[Claim]:
    return [Claim(*row) for row in conn.execute("SELECT * FROM relay_claims").fetchall()]


def seed(store: Store, executions: int, emits: int, spawns: int, timers: int) -> set[str]:
    """Commit a backlog (per execution: emits, spawns, due timers); return its items as the
    relay names them. Timer times are whole and fractional (``delete_timer`` matches them)."""
    outbox: set[str] = set()
    armed: set[str] = set()
    for i in range(executions):
        exe = Execution(id=f"exe-{i}", definition_id="relay")
        seqs = store.commit(
            exe,
            [(f"to-{i}", Event(name="tick", id=f"ev-{i}-{k}")) for k in range(emits)],
            spawns=[(f"child-{i}-{k}", "root", {"k": k}) for k in range(spawns)],
            timers=[TimerOp.schedule(f"t{k}", 1000 + (i * timers + k) / 4) for k in range(timers)],
        )
        outbox |= {f"outbox {seq}" for seq in seqs}
        armed |= {f"timer exe-{i} t{k}" for k in range(timers)}
    items = pending(store)
    assert len(items) == executions * (emits + spawns + timers)
    assert {i for i in items if i.startswith(("outbox", "timer"))} == outbox | armed
    return items


def pending(store: Store) -> set[str]:
    """Every undelivered item in the store, claimed or not."""
    return (
        {f"outbox {e.seq}" for e in store.pending_outbox()}
        | {f"spawn {s.seq}" for s in store.pending_spawns()}
        | {f"timer {eid} {path}" for eid, path, _ in store.due_timers(FAR_FUTURE)}
    )


def delivered(out: Path) -> list[str]:
    """The items a worker delivered, in order (a missing file: none)."""
    return out.read_text(encoding="utf-8").splitlines() if out.exists() else []


def claimed(stdout: str) -> list[str]:
    """The items a worker reported claiming (``claimed N [items]`` lines)."""
    items: list[str] = []
    for line in stdout.splitlines():
        if line.startswith("claimed "):
            _, n, batch = line.split(" ", 2)
            assert len(json.loads(batch)) == int(n)
            items += json.loads(batch)
    return items


def check_no_claim_taken_under_a_live_lease(log: list[Claim]) -> None:
    stolen = [c for c in log if c.old_until is not None and c.old_until > c.at]
    assert not stolen, f"rows handed to a worker while another's lease ran: {stolen[:5]}"


def check_each_delivered_once(
    expected: set[str], workers: dict[str, tuple[Path, str]], log: list[Claim]
) -> None:
    """Nobody died: each item claimed once, delivered once, nothing left; every worker
    delivered what it claimed. ``workers``: name -> (OUT_FILE, stdout)."""
    everything: Counter[str] = Counter()
    shared = 0
    for name, (out, stdout) in workers.items():
        mine = delivered(out)
        assert Counter(mine) == Counter(claimed(stdout)), f"{name} delivered not what it claimed"
        assert Counter(mine) == Counter(c.item for c in log if c.new_by == name), (
            f"{name}'s claims did not return the rows they leased"
        )
        everything.update(mine)
        shared += bool(mine)
    # Which workers get work is the scheduler's call (on a busy machine one may start after
    # the others drained the backlog): at least two must have shared it.
    assert shared >= 2, "the workers did not share the backlog"
    twice = sorted(item for item, n in everything.items() if n > 1)
    assert not twice, f"{len(twice)} items delivered twice, e.g. {twice[:5]}"
    assert set(everything) == expected, f"lost: {sorted(expected - set(everything))[:5]}"
    assert [c for c in log if c.old_by is not None] == [], "a row was claimed twice"
    check_no_claim_taken_under_a_live_lease(log)


def check_drained(store: Store) -> None:
    assert pending(store) == set()
    stats = store.stats(FAR_FUTURE)
    assert (stats.claimed_outbox, stats.claimed_spawns, stats.claimed_timers) == (0, 0, 0)


@pytest.mark.slow
def test_workers_on_one_file_deliver_every_item_exactly_once(tmp_path: Path) -> None:
    db = tmp_path / "relay.db"
    with open_store("libsql", db) as store:
        expected = seed(store, executions=20, emits=30, spawns=10, timers=10)
    raw = sqlite3.connect(db)
    try:
        run_sql(raw, CLAIM_LOG)
        names = {f"w{i}": ("libsql", "sqlite")[i % 2] for i in range(4)}
        outs = {name: tmp_path / f"{name}.out" for name in names}
        results = race(
            tmp_path / "go",
            [
                ("relay", driver, str(db), name, str(outs[name]), "--limit", "10")
                for name, driver in names.items()
            ],
        )
        for returncode, _, err in results:
            assert returncode == 0, f"a relay worker failed:\n{err}"
        stdouts = {name: out for name, (_, out, _) in zip(names, results, strict=True)}
        log = claims(raw)
    finally:
        raw.close()
    check_each_delivered_once(expected, {n: (outs[n], stdouts[n]) for n in names}, log)
    assert len(log) == len(expected)
    with open_store("sqlite", db) as store:
        check_drained(store)


@pytest.mark.slow
def test_a_worker_killed_holding_claims_loses_nothing_and_repeats_only_its_deliveries(
    tmp_path: Path,
) -> None:
    db, victim_out = tmp_path / "relay.db", tmp_path / "victim.out"
    with open_store("sqlite", db) as store:
        expected = seed(store, executions=6, emits=10, spawns=4, timers=4)
    raw = sqlite3.connect(db)
    errors = (tmp_path / "victim.err").open("w+")
    procs: list[subprocess.Popen[str]] = []
    try:
        run_sql(raw, CLAIM_LOG)
        # A 1 s lease; it acks its first two deliveries and hangs after the third, before
        # its ack: killed there, it holds 27 claims it never delivered.
        victim = spawn(
            "relay",
            *("sqlite", str(db), "victim", str(victim_out)),
            *("--lease", "1", "--limit", "10", "--slow", "0.05", "--hang-after", "3"),
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        procs.append(victim)
        assert victim.stdout is not None
        seen: list[str] = []
        while sum(line.startswith("delivered ") for line in seen) < 3:
            line = victim.stdout.readline()
            if not line:
                errors.seek(0)
                pytest.fail(f"the victim ended before it was killed:\n{errors.read()}")
            seen.append(line)
        victim.send_signal(signal.SIGKILL)
        victim.wait()
        assert victim.returncode == -signal.SIGKILL
        with open_store("sqlite", db) as store:
            left = pending(store)  # what the survivors must deliver, each once
        # At once: the victim's lease may still be running when they first look.
        survivors = {"s0": "libsql", "s1": "sqlite"}
        outs = {name: tmp_path / f"{name}.out" for name in survivors}
        for name, driver in survivors.items():
            procs.append(
                spawn(
                    "relay",
                    *(driver, str(db), name, str(outs[name]), "--limit", "10"),
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                )
            )
        results = [p.communicate(timeout=120) for p in procs[1:]]
        for p, (_, err) in zip(procs[1:], results, strict=True):
            assert p.returncode == 0, f"a surviving worker failed:\n{err}"
        log = claims(raw)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()  # reaps it and closes its pipes
        errors.close()
        raw.close()

    by_victim = delivered(victim_out)
    held = claimed("".join(seen))
    assert len(held) == 30 and by_victim == held[:3]
    undelivered = set(held) - set(by_victim)
    # Gone from the store: exactly the two items whose acks returned; the third, delivered
    # but not acked, and every claim never delivered are still there.
    assert left == expected - set(by_victim[:2])
    # The survivors deliver exactly what was left, once each, and only what they claimed.
    by_survivors: Counter[str] = Counter()
    for name, (stdout, _) in zip(survivors, results, strict=True):
        mine = delivered(outs[name])
        assert Counter(mine) == Counter(claimed(stdout))
        by_survivors.update(mine)
    assert by_survivors == Counter(left)
    everything = Counter(by_victim) + by_survivors
    assert set(everything) == expected, "an item was never delivered"
    # Delivered twice: only the one the victim delivered and did not ack.
    assert {item for item, n in everything.items() if n > 1} == {by_victim[2]}
    # The victim's undelivered claims went to the survivors only once its lease ran out, by
    # the database's clock at the claim.
    for item in undelivered:
        retaken = [c for c in log if c.item == item and c.new_by != "victim"]
        assert len(retaken) == 1, (item, retaken)
        assert retaken[0].old_by == "victim"
        assert retaken[0].old_until is not None and retaken[0].old_until <= retaken[0].at
    check_no_claim_taken_under_a_live_lease(log)
    assert Counter(c.item for c in log if c.new_by == "victim") == Counter(held)
    with open_store("libsql", db) as store:
        check_drained(store)


@pytest.mark.slow
@pytest.mark.sqld
def test_workers_on_a_server_deliver_every_item_exactly_once(
    sqld: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import libsql

    reset_remote(sqld)
    monkeypatch.setenv("HAREL_AUTH_TOKEN", sqld.token)
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        expected = seed(store, executions=10, emits=15, spawns=5, timers=5)
    conn = libsql.connect(sqld.url, auth_token=sqld.token)
    try:
        run_sql(conn, DROP_CLAIM_LOG)  # a table left by an interrupted run
        run_sql(conn, CLAIM_LOG)
        names = [f"r{i}" for i in range(4)]
        outs = {name: tmp_path / f"{name}.out" for name in names}
        results = race(
            tmp_path / "go",
            [
                ("relay", "libsql", sqld.url, name, str(outs[name]), "--limit", "10")
                for name in names
            ],
        )
        for returncode, _, err in results:
            assert returncode == 0, f"a relay worker failed:\n{err}"
            assert sqld.token not in err
        stdouts = {name: out for name, (_, out, _) in zip(names, results, strict=True)}
        log = claims(conn)
    finally:
        run_sql(conn, DROP_CLAIM_LOG)
        conn.close()
    check_each_delivered_once(expected, {n: (outs[n], stdouts[n]) for n in names}, log)
    assert len(log) == len(expected)
    with LibsqlStore(sqld.url, auth_token=sqld.token) as store:
        check_drained(store)
