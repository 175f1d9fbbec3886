"""An embedded replica never stops the process: every call returns within its bound, other
threads and the event loop keep running meanwhile, and the replica recovers.

The primary misbehaves for real: a proxy that swallows every byte (a primary that accepts
and never answers), sqld SIGSTOPped, sqld killed right after a write of ours lands, a dead
port, and a replica process killed with -9 in the middle of a sync. libsql's own sync has no
timeout and holds the GIL: before, each of these stopped every thread of the process for as
long as the primary stayed away (600 s and more).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore, OutcomeUnknown, StoreError
from tests.proxy import Proxy
from tests.sqld import SqldServer
from tests.test_remote import step
from tests.workers.common import REPO, spawn

pytestmark = pytest.mark.sqld

TIMEOUT = 1.0
BOUND = 2 * TIMEOUT + 1  # what any call may take, whatever the primary does
GAVE_UP = r"^(no answer from|the replica .* did not catch up)"  # a sync past its timeout
STALL = 0.5  # the longest another thread may go unscheduled (libsql's own sync: forever)


class Ticker:
    """A thread that ticks every 5 ms and keeps the longest gap between two ticks."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tick, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        last = time.monotonic()
        while not self._stop.wait(0.005):
            now = time.monotonic()
            self.longest = max(self.longest, now - last)
            last = now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


@pytest.fixture
def ticker() -> Iterator[Ticker]:
    ticking = Ticker()
    yield ticking
    ticking.stop()
    assert ticking.longest < STALL, f"a thread stood still for {ticking.longest:.2f} s"


@contextmanager
def bounded() -> Iterator[None]:
    began = time.monotonic()
    yield
    took = time.monotonic() - began
    assert took <= BOUND, f"the call took {took:.2f} s, past {BOUND} s"


def stop(pid: int) -> None:
    """SIGSTOP, and wait until every thread of the process has stopped (state T): a busy
    machine may let a thread run on for a moment after the signal is sent."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 5
    while Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "T":
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.005)


def helpers() -> list[int]:
    """The replica sync helpers this process has running."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rpartition(")")[2].split()[1])
        if ppid == os.getpid() and b"replica_helper.py" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.fixture(autouse=True)
def no_helper_left() -> Iterator[None]:
    yield
    deadline = time.monotonic() + 5
    while helpers():
        assert time.monotonic() < deadline, f"sync helpers left running: {helpers()}"
        time.sleep(0.02)


def replica(url: str, path: Path, token: str, **kwargs: Any) -> LibsqlStore:
    return LibsqlStore(path, sync_url=url, auth_token=token, timeout=TIMEOUT, **kwargs)


@pytest.fixture
def server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SqldServer]:
    """A server of this test's own (the `proxy` fixture's too): it will be stopped, and a
    fresh replica's first sync must not pull the session server's whole history within
    TIMEOUT."""
    failed = request.session.testsfailed
    srv = SqldServer(tmp_path / "sqld", auth=True)
    srv.start()
    LibsqlStore(srv.url, auth_token=srv.token, migrate=True).close()
    yield srv
    if srv.pid is not None:
        os.kill(srv.pid, signal.SIGCONT)
    srv.stop()
    if request.session.testsfailed > failed:
        print(f"\nsqld log kept at {srv.log_path}:\n{srv.log_tail()}")


@pytest.mark.parametrize("silent_from", ["the first request", "the first sync"])
def test_opening_against_a_primary_that_never_answers_is_bounded(
    silent_from: str, server: SqldServer, proxy: Proxy, tmp_path: Path, ticker: Ticker
) -> None:
    if silent_from == "the first request":
        proxy.mode = "blackhole"
    else:  # the store's own request passes; the sync that follows it never gets an answer
        proxy.on_answer = lambda: setattr(proxy, "mode", "blackhole")
    with bounded(), pytest.raises(StoreError, match=GAVE_UP) as info:
        replica(proxy.url(), tmp_path / "r.db", server.token)
    assert server.token not in str(info.value)
    proxy.mode = "forward"
    with replica(proxy.url(), tmp_path / "r.db", server.token) as store:  # the file opens
        assert store.load("nothing") is None


def test_a_primary_that_stops_answering_bounds_sync_and_commit(
    server: SqldServer, proxy: Proxy, tmp_path: Path, ticker: Ticker
) -> None:
    with replica(proxy.url(), tmp_path / "r.db", server.token) as store:
        exe = Execution(id="x", definition_id="d")
        step(store, exe, 1)
        assert store.load("x").version == 1  # type: ignore[union-attr]
        proxy.mode = "blackhole"
        with bounded(), pytest.raises(StoreError, match=GAVE_UP):
            store.sync()
        with bounded():  # nothing of ours is missing: the file answers, primary or not
            assert store.load("x").version == 1  # type: ignore[union-attr]
        with bounded(), pytest.raises(OutcomeUnknown):
            step(store, exe, 2)
        assert exe.version == 1 and store._conn.behind  # type: ignore[attr-defined]
        with bounded(), pytest.raises(StoreError, match=GAVE_UP):
            store.load("x")  # it may have landed: no answer from a copy that may lack it
        proxy.mode = "forward"
        assert store.load("x").version == 1  # type: ignore[union-attr]  # swallowed: it did not
        step(store, exe, 2)
        assert store.load("x").version == 2  # type: ignore[union-attr]


def test_a_stopped_primary_bounds_every_call_and_the_replica_resumes(
    server: SqldServer, tmp_path: Path, ticker: Ticker
) -> None:
    assert server.pid is not None
    with replica(server.url, tmp_path / "r.db", server.token) as store:
        exe = Execution(id="x", definition_id="d")
        step(store, exe, 1)
        assert store.load("x").version == 1  # type: ignore[union-attr]  # caught up
        stop(server.pid)
        # libsql may answer one sync from what its replicator fetched ahead before the stop
        # (it prefetches frames beside its handshake); the next one must reach the primary.
        with bounded(), pytest.raises(StoreError):
            store.sync()
            store.sync()
        with bounded():
            assert store.load("x").version == 1  # type: ignore[union-attr]
        with bounded(), pytest.raises(OutcomeUnknown):
            step(store, exe, 2)
        with bounded(), pytest.raises(StoreError):
            store.load("x")
        os.kill(server.pid, signal.SIGCONT)
        # The request the stopped server had received may have landed once it resumed.
        seen = store.load("x")
        assert seen is not None and seen.version in (1, 2)
        with LibsqlStore(server.url, auth_token=server.token) as remote:
            assert remote.load("x").version == seen.version  # type: ignore[union-attr]


@pytest.mark.parametrize("then", ["stops", "goes silent", "dies"])
def test_a_primary_lost_right_after_a_write_lands_bounds_the_read_after(
    then: str, server: SqldServer, tmp_path: Path, ticker: Ticker
) -> None:
    """The commit's answer arrives, then the primary stops, swallows everything or dies
    before the sync that follows it: the commit still returns at once, and the read after
    it (which must see it) is bounded."""
    assert server.pid is not None
    pid = server.pid
    with Proxy(server.port or 0) as proxy:
        store = replica(proxy.url(), tmp_path / "r.db", server.token)
        exe = Execution(id="x", definition_id="d")
        step(store, exe, 1)
        assert store.load("x").version == 1  # type: ignore[union-attr]  # caught up
        proxy.on_answer = {
            "stops": lambda: stop(pid),
            "goes silent": lambda: setattr(proxy, "mode", "blackhole"),
            "dies": server.kill,
        }[then]
        with bounded():
            step(store, exe, 2)
        assert exe.version == 2 and proxy.on_answer is None
        with bounded(), pytest.raises(StoreError):
            store.load("x")
        if then == "dies":
            proxy.close()  # a dead port
            with bounded(), pytest.raises(StoreError):
                store.load("x")
            store.close()
            return
        os.kill(pid, signal.SIGCONT)
        proxy.mode = "forward"
        assert store.load("x").version == 2  # type: ignore[union-attr]
        store.close()


@pytest.mark.slow
def test_the_replica_recovers_when_the_primary_is_back_on_the_same_port(
    server: SqldServer, tmp_path: Path, ticker: Ticker
) -> None:
    with replica(server.url, tmp_path / "r.db", server.token) as store:
        exe = Execution(id="x", definition_id="d")
        step(store, exe, 1)
        assert store.load("x").version == 1  # type: ignore[union-attr]  # caught up
        server.stop()
        with bounded():
            assert store.load("x").version == 1  # type: ignore[union-attr]
        with bounded(), pytest.raises(StoreError):
            store.sync()
        with bounded(), pytest.raises(StoreError, match=r"^cannot reach"):
            step(store, exe, 2)
        server.start()  # the same port and data
        store.sync()
        step(store, exe, 2)
        assert store.load("x").version == 2  # type: ignore[union-attr]
        assert store.is_processed("x", "in-x-2")
    with LibsqlStore(server.url, auth_token=server.token) as remote:
        assert remote.load("x").version == 2  # type: ignore[union-attr]


def test_background_syncs_never_run_in_a_callers_call_and_are_bounded(
    server: SqldServer, proxy: Proxy, tmp_path: Path, ticker: Ticker, caplog: Any
) -> None:
    with (
        LibsqlStore(server.url, auth_token=server.token) as writer,
        replica(proxy.url(), tmp_path / "r.db", server.token, sync_interval=0.1) as store,
    ):
        step(writer, Execution(id="a", definition_id="d"), 1)
        deadline = time.monotonic() + 10
        while store.load("a") is None:
            assert time.monotonic() < deadline, "the interval never brought the write"
            time.sleep(0.01)
        proxy.mode = "blackhole"
        with caplog.at_level(logging.WARNING, logger="harel_store"):
            began = time.monotonic()
            while time.monotonic() - began < 3 * TIMEOUT:  # several background syncs fail
                with bounded():
                    calls = time.monotonic()
                    assert store.load("a") is not None
                    # A read never waits for a sync it did not need (one takes TIMEOUT).
                    assert time.monotonic() - calls < TIMEOUT / 2
                time.sleep(0.05)
        failures = [r for r in caplog.records if "background sync failed" in r.getMessage()]
        assert len(failures) == 1, "logged once, not once an interval"
        assert server.token not in caplog.text
        proxy.mode = "forward"
        step(writer, Execution(id="b", definition_id="d"), 1)
        deadline = time.monotonic() + 10
        while store.load("b") is None:
            assert time.monotonic() < deadline, "the interval never resumed"
            time.sleep(0.01)


def test_a_replica_process_killed_during_a_sync_loses_nothing_and_reopens(
    server: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HAREL_AUTH_TOKEN", server.token)
    path = tmp_path / "r.db"
    blob = "x" * 20_000
    with LibsqlStore(server.url, auth_token=server.token) as writer:
        for round_ in range(3):
            worker = spawn("replica_syncer", server.url, str(path), stdout=subprocess.PIPE)
            assert worker.stdout is not None
            helper = int(worker.stdout.readline())
            assert worker.stdout.readline().strip() == "syncing"
            for n in range(60):  # ~1.2 MB for it to pull while it syncs
                exe = Execution(id=f"r{round_}-{n}", definition_id="d", context={"blob": blob})
                writer.commit(exe, [])
            worker.kill()
            worker.wait()
            worker.stdout.close()
            deadline = time.monotonic() + 5
            while Path(f"/proc/{helper}").exists() and _alive(helper):
                assert time.monotonic() < deadline, "the helper outlived its process"
                time.sleep(0.02)
        with replica(server.url, path, server.token) as store:
            ids = {e.id for e in store.list_executions(limit=1000).items}
        assert ids == {f"r{r}-{n}" for r in range(3) for n in range(60)}
    with sqlite3.connect(path) as db:  # no libsql of this process has it open now
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_an_async_replica_never_stalls_the_event_loop(
    server: SqldServer, proxy: Proxy, tmp_path: Path
) -> None:
    async def main() -> float:
        store = await AsyncLibsqlStore.create(
            tmp_path / "r.db", sync_url=proxy.url(), auth_token=server.token, timeout=TIMEOUT
        )
        longest = 0.0
        done = asyncio.Event()

        async def tick() -> None:
            nonlocal longest
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.005)
                longest = max(longest, time.monotonic() - last)
                last = time.monotonic()

        ticking = asyncio.create_task(tick())
        try:
            exe = Execution(id="x", definition_id="d")
            await store.commit(exe, [])
            assert (await store.load("x")) is not None
            proxy.mode = "blackhole"
            with bounded(), pytest.raises(StoreError):
                await store.sync()
        finally:
            done.set()
            await ticking
            await store.close()
        return longest

    longest = asyncio.run(main())
    assert longest < STALL, f"the event loop stood still for {longest:.2f} s"


def test_a_replica_file_serves_one_store_at_a_time(server: SqldServer, tmp_path: Path) -> None:
    """libsql's replica sync assumes it alone writes its file: a second store on it (of this
    process or another) is refused once its `timeout` has passed, and the file is free again
    once the first closes."""
    path = tmp_path / "r.db"
    with replica(server.url, path, server.token) as store:
        with pytest.raises(StoreError, match="is open in another store") as info:
            replica(server.url, path, server.token)
        assert server.token not in str(info.value)
        other = subprocess.run(
            [sys.executable, "-c", OPEN_REPLICA, server.url, str(path)],
            env={**os.environ, "PYTHONPATH": str(REPO), "HAREL_AUTH_TOKEN": server.token},
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert other.returncode == 1 and "is open in another store" in other.stderr
        assert store.load("nothing") is None  # the refused ones disturbed nothing
    with replica(server.url, path, server.token):
        pass


OPEN_REPLICA = """
import os, sys
from harel_store import LibsqlStore, StoreError
try:
    LibsqlStore(
        sys.argv[2], sync_url=sys.argv[1], auth_token=os.environ["HAREL_AUTH_TOKEN"], timeout=1
    )
except StoreError as exc:
    sys.exit(str(exc))
"""


@pytest.mark.sqld
def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_not_followed(
    sqld: Any, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    (tmp_path / "r.db-lock").symlink_to(elsewhere)
    with pytest.raises(StoreError, match=r"r\.db-lock is a symbolic link"):
        replica(sqld.url, tmp_path / "r.db", sqld.token)
    assert not elsewhere.exists()  # neither created nor locked through the link
