"""An engine-like relay in real worker processes (tests/workers/engine.py), a loop written
by hand and `harel_store.Relay`: every event is delivered and its outbox entry consumed in
the target's own commit, deduplicated by the event's id. A handler that ends its process
still counts its attempt, until the entry is a dead letter; workers SIGKILLed in the
middle of a batch lose no event's effect and apply none twice.
"""

from __future__ import annotations

import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from harel_store import Event, Execution, LibsqlStore
from harel_store.store import Store
from tests.conftest import reset_remote
from tests.sqld import SqldServer
from tests.test_claims import elapse
from tests.workers.common import open_store, run, spawn

TARGETS = [f"t{i}" for i in range(4)]


def seed(store: Store, events: int, poison: bool = False) -> list[str]:
    """The targets, and ``events`` events for them (a poison one first); their ids."""
    for target in TARGETS:
        store.save(Execution(id=target, definition_id="d", context={"applied": []}))
    emits = [(TARGETS[0], Event(name="poison", id="poison"))] if poison else []
    emits += [(TARGETS[i % len(TARGETS)], Event(name="ev", id=f"ev-{i}")) for i in range(events)]
    store.commit(Execution(id="source", definition_id="d"), emits)
    return [event.id for _, event in emits if event.name != "poison"]


def applied(store: Store) -> Counter[str]:
    """Every event's effect, counted over the targets."""
    effects: Counter[str] = Counter()
    for target in TARGETS:
        exe = store.load(target)
        assert exe is not None
        effects.update(exe.context["applied"])
    return effects


@pytest.fixture(params=["by-hand", "relay"])
def mode(request: pytest.FixtureRequest) -> list[str]:
    """The worker's options: its own loop, or rounds of harel_store.Relay."""
    return ["--relay"] if request.param == "relay" else []


@pytest.fixture(params=["libsql", "sqlite", "remote"])
def where(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[str, str, Store]]:
    """(driver, database, the test's own store on it)."""
    if request.param == "remote":
        server: SqldServer = request.getfixturevalue("sqld")
        reset_remote(server)
        monkeypatch.setenv("HAREL_AUTH_TOKEN", server.token)
        store: Store = LibsqlStore(server.url, auth_token=server.token)
        driver, database = "libsql", server.url
    else:
        driver, database = request.param, str(tmp_path / "engine.db")
        store = open_store(driver, database)
    try:
        yield driver, database, store
    finally:
        store.close()


@pytest.mark.slow
def test_a_handler_that_ends_its_process_counts_an_attempt_until_a_dead_letter(
    where: tuple[str, str, Store], mode: list[str]
) -> None:
    driver, database, store = where
    events = seed(store, events=6, poison=True)
    worker = ("engine", driver, database, "w", "--limit", "1", "--max-attempts", "3", *mode)
    for attempt in (1, 2, 3):
        ended = run(*worker)
        assert (ended.returncode, ended.stdout.splitlines()[-1]) == (3, "poisoned 1"), ended
        (first, *_) = store.outbox_view()
        assert (first.seq, first.attempts, first.claimed_by) == (1, attempt, "w")
        elapse(store, 30.0)  # its lease runs out: the next worker may claim it again
    last = run(*worker)
    assert last.returncode == 0, last.stderr
    assert "outbox entry 1 is a dead letter after 3 attempts" in last.stderr
    assert "poisoned" not in last.stdout
    (dead,) = store.dead_letters()
    assert (dead.kind, dead.item.seq, dead.attempts, dead.item.event.id) == (
        "outbox",
        1,
        3,
        "poison",
    )
    assert applied(store) == Counter(events)
    assert store.pending_outbox() == []


def lines(proc: subprocess.Popen[str], until: int) -> list[str]:
    """Read the worker's stdout until it has delivered ``until`` events."""
    assert proc.stdout is not None
    seen: list[str] = []
    while sum(line.startswith(("applied", "seen")) for line in seen) < until:
        line = proc.stdout.readline()
        assert line, f"the worker ended first: {seen}"
        seen.append(line)
    return seen


@pytest.mark.slow
def test_workers_killed_mid_batch_lose_no_effect_and_apply_none_twice(
    where: tuple[str, str, Store], mode: list[str]
) -> None:
    driver, database, store = where
    events = seed(store, events=200)
    procs: list[subprocess.Popen[str]] = []
    try:
        # Two victims, each killed in the middle of a batch of 20 it holds under a 1 s lease.
        for name, after in (("v1", 3), ("v2", 11)):
            victim = spawn(
                "engine",
                *(driver, database, name, "--limit", "20", "--lease", "1"),
                *("--hang-after", str(after), *mode),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            procs.append(victim)
            lines(victim, after)
            victim.send_signal(signal.SIGKILL)
            victim.wait()
        # The survivors wait out the victims' leases, then share the rest.
        drivers = [driver] * 4 if database.startswith("http") else ["libsql", "sqlite"] * 2
        survivors = [
            spawn(
                "engine",
                *(kind, database, f"s{i}", "--limit", "10", *mode),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            for i, kind in enumerate(drivers)
        ]
        procs += survivors
        results = [p.communicate(timeout=120) for p in survivors]
        for p, (_, err) in zip(survivors, results, strict=True):
            assert p.returncode == 0, err
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.communicate()
    effects = applied(store)
    assert [e for e, n in effects.items() if n > 1] == [], "an effect applied twice"
    assert set(effects) == set(events), "an event's effect was lost"
    store.sync()
    assert store.pending_outbox() == [] and store.dead_letters() == []
    delivered_by_survivors = sum(
        line.startswith(("applied ", "seen ")) for out, _ in results for line in out.splitlines()
    )
    # What the victims held and never delivered went to the survivors.
    assert delivered_by_survivors >= len(events) - 14
