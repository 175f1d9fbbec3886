"""kill -9 at any instant: nothing committed is lost, nothing uncommitted is half-there.

A child process (workers/crash.py) commits a steady stream of deterministic steps (emits,
dedupe markers, timers, spawns, trace) to a real file and logs each commit only after
``commit`` returned. The parent SIGKILLs it at random moments, reopens the file and
checks every row against the log.
"""

from __future__ import annotations

import json
import random
import signal
import sqlite3
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.workers.common import (
    EXECUTIONS,
    TRACE_MAX,
    emit_ids,
    open_store,
    spawn,
    timers_after,
)

KILLS = 25


def read_log(log: Path) -> tuple[dict[str, int], set[str]]:
    """Last logged commit per execution, and the event ids whose ack was started."""
    committed = dict.fromkeys(EXECUTIONS, 0)
    acking: set[str] = set()
    for line in log.read_text(encoding="utf-8").splitlines():
        kind, *rest = line.split()
        if kind == "commit":
            eid, n = rest[0], int(rest[1])
            assert n == committed[eid] + 1, f"log skips a step: {line!r}"
            committed[eid] = n
        else:
            acking.add(rest[0])
    return committed, acking


def check(driver: str, db: Path, log: Path, writers: int = 1) -> dict[str, int]:
    """Check every invariant after a kill, ``writers`` commits having been in flight at
    most; return the versions found."""
    text = log.read_text(encoding="utf-8")
    if not text.endswith("\n"):  # a line torn by the kill: its commit is the one in flight
        log.write_text(text[: text.rfind("\n") + 1], encoding="utf-8")
    committed, acking = read_log(log)
    with open_store(driver, db, trace_max=TRACE_MAX) as store:  # reopening recovers the WAL
        versions = {}
        for eid in EXECUTIONS:
            exe = store.load(eid)
            versions[eid] = 0 if exe is None else exe.version
            if exe is not None:
                assert exe.context == {"n": exe.version}
            v = versions[eid]
            first = max(1, v - TRACE_MAX + 1)
            assert store.read_trace(eid) == [
                {"eid": eid, "n": n, "index": n - 1} for n in range(first, v + 1)
            ]
    in_flight = [eid for eid in EXECUTIONS if versions[eid] == committed[eid] + 1]
    for eid in EXECUTIONS:
        assert committed[eid] <= versions[eid] <= committed[eid] + 1, (eid, committed, versions)
    assert len(in_flight) <= writers, f"more than {writers} commit(s) in flight: {in_flight}"

    raw = sqlite3.connect(db)
    try:
        assert raw.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        landed_emits = {
            i for eid in EXECUTIONS for n in range(1, versions[eid] + 1) for i in emit_ids(eid, n)
        }
        outbox = [json.loads(e)["id"] for (e,) in raw.execute("SELECT event FROM harel_outbox")]
        assert len(outbox) == len(set(outbox)), "an emit is in the outbox twice"
        assert set(outbox) <= landed_emits, "outbox rows of a commit that did not land"
        assert landed_emits - set(outbox) <= acking, "a committed emit vanished unacked"
        processed = set(raw.execute("SELECT execution_id, event_id FROM harel_processed_events"))
        assert processed == {
            (eid, f"in-{eid}-{n}") for eid in EXECUTIONS for n in range(1, versions[eid] + 1)
        }
        timers = {
            (e, p): at
            for e, p, at in raw.execute("SELECT execution_id, path, fire_at FROM harel_timers")
        }
        assert timers == {
            (eid, p): at for eid in EXECUTIONS for p, at in timers_after(versions[eid]).items()
        }
        spawns = Counter(raw.execute("SELECT parent_id, child_id FROM harel_spawns"))
        assert spawns == Counter(
            (eid, f"child-{eid}-{n}")
            for eid in EXECUTIONS
            for n in range(1, versions[eid] + 1)
            if n % 3 == 0
        )
        trace_ids = {e for (e,) in raw.execute("SELECT DISTINCT execution_id FROM harel_trace")}
        assert trace_ids == {eid for eid in EXECUTIONS if versions[eid]}
    finally:
        raw.close()
    with log.open("a", encoding="utf-8") as f:  # they landed: now commits like the others
        for eid in in_flight:
            f.write(f"commit {eid} {versions[eid]}\n")
    return versions


@pytest.mark.slow
@pytest.mark.parametrize(
    ("driver", "mode"),
    [
        ("libsql", "serial"),
        ("sqlite", "serial"),
        # Each execution from its own thread, or its own task of the async store: commits go
        # in groups, one transaction for several (harel_store.connection.local).
        ("libsql", "threads"),
        ("sqlite", "threads"),
        ("libsql", "tasks"),
    ],
)
def test_sigkill_at_random_instants_loses_and_tears_nothing(
    driver: str, mode: str, tmp_path: Path
) -> None:
    db, log = tmp_path / "crash.db", tmp_path / "commits.log"
    log.touch()
    rng = random.Random(f"crash-{driver}-{mode}")
    for kill in range(KILLS):
        errors = (tmp_path / "stderr").open("w+")
        child = spawn(
            "crash",
            driver,
            str(db),
            str(log),
            str(kill),
            mode,
            stdout=subprocess.PIPE,
            stderr=errors,
        )
        try:
            assert child.stdout is not None
            if child.stdout.readline() != "ready\n":
                errors.seek(0)
                pytest.fail(f"the child did not start:\n{errors.read()}")
            time.sleep(rng.uniform(0.02, 0.3))
        finally:
            child.send_signal(signal.SIGKILL)
            child.wait()
            if child.stdout is not None:
                child.stdout.close()
            errors.close()
        assert child.returncode == -signal.SIGKILL, "the child died before it was killed"
        check(driver, db, log, 1 if mode == "serial" else len(EXECUTIONS))
    total = sum(read_log(log)[0].values())
    # The stream really ran between kills (so the kills hit it mid-flight).
    assert total >= 5 * KILLS, f"only {total} commits in {KILLS} runs"
