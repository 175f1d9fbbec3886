"""Push, not poll: another process's commit wakes a relay (and a `wait_for`) within
milliseconds on a file, on sqld and on an embedded replica, sync and async, while their
poll is 30 s; a timer armed elsewhere fires on time; an idle relay writes nothing; a server
without change notifications is polled; a restarted server's notifications come back.

The bound a test allows (`WOKEN`, 1.5 s) is far from a push's milliseconds and far below a
30 s poll: it tells the two apart on a loaded machine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    AsyncRelay,
    DueTimer,
    Event,
    Execution,
    LibsqlStore,
    OutboxEntry,
    Relay,
    SqliteStore,
)
from harel_store.batch import Batch
from harel_store.store import Store
from tests.conftest import reset_remote
from tests.sqld import SqldServer
from tests.workers.common import REPO

WOKEN = 1.5  # seconds: a push is milliseconds, a poll here 30 s
POLL = 30.0
WAIT = 20.0  # the most a test waits for what must happen

KINDS = ["libsql-file", "sqlite-file", "libsql-remote", "libsql-replica"]
ASYNC_KINDS = ["libsql-file", "libsql-remote", "libsql-replica"]


@dataclass
class Database:
    """One database of a test: how this process opens it, and what another process opens."""

    kind: str
    driver: str
    target: str  # what the other process opens: the file, or the primary's URL
    options: dict[str, Any]
    env: dict[str, str]

    def open(self, **kwargs: Any) -> Store:
        cls = SqliteStore if self.driver == "sqlite" else LibsqlStore
        database = self.options.get("database", self.target)
        options = {k: v for k, v in self.options.items() if k != "database"}
        return cls(database, **options, **kwargs)

    async def aopen(self, **kwargs: Any) -> AsyncLibsqlStore:
        database = self.options.get("database", self.target)
        options = {k: v for k, v in self.options.items() if k != "database"}
        return await AsyncLibsqlStore.create(database, **options, **kwargs)

    def other(self, *commands: str) -> list[float]:
        """Run `tests.workers.commit` with these commands in another process; the times it
        printed."""
        done = subprocess.run(
            [sys.executable, "-m", "tests.workers.commit", self.driver, self.target, *commands],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        return [float(line.split()[1]) for line in done.stdout.splitlines()]


def database(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Database:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    if kind.endswith("-file"):
        driver = kind.split("-")[0]
        path = str(tmp_path / "wake.db")
        SqliteStore(path).close()  # migrated before any process opens it
        return Database(kind, driver, path, {}, env)
    server = request.getfixturevalue("sqld")
    reset_remote(server)
    env["HAREL_AUTH_TOKEN"] = server.token
    options: dict[str, Any] = {"auth_token": server.token}
    if kind.endswith("-replica"):
        options.update(database=str(tmp_path / "replica.db"), sync_url=server.url)
    return Database(kind, "libsql", server.url, options, env)


@pytest.fixture(params=KINDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    return database(str(request.param), tmp_path, request)


@pytest.fixture(params=ASYNC_KINDS)
def adb(request: pytest.FixtureRequest, tmp_path: Path) -> Database:
    return database(str(request.param), tmp_path, request)


@contextlib.contextmanager
def running(relay: Relay) -> Iterator[None]:
    thread = threading.Thread(target=relay.run, daemon=True)
    thread.start()
    try:
        yield
    finally:
        relay.stop()
        thread.join(WAIT)
        assert not thread.is_alive(), "run() did not return after stop()"


def until(condition: Callable[[], bool], what: str, within: float = WAIT) -> None:
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.005)


def test_another_process_wakes_an_idle_relay(db: Database) -> None:
    store = db.open()
    store.save(Execution(id="target", definition_id="d"))
    started: list[float] = []
    relay = Relay(store, "w", on_outbox=lambda entry: started.append(time.time()), poll=POLL)
    with running(relay):
        time.sleep(0.3)  # its first look found nothing: it waits (up to 30 s)
        sent = db.other("emit", "target", "sleep", "0.5", "emit", "target")
        until(lambda: len(started) == 2, "both events handled")
    store.close()
    for at, handled in zip(sent, started, strict=True):
        assert handled - at < WOKEN


def test_another_process_wakes_an_idle_async_relay(adb: Database) -> None:
    async def main() -> list[float]:
        store = await adb.aopen()
        await store.save(Execution(id="target", definition_id="d"))
        started: list[float] = []

        async def handle(entry: OutboxEntry) -> None:
            started.append(time.time())

        relay = AsyncRelay(store, "w", on_outbox=handle, poll=POLL)
        task = asyncio.create_task(relay.run())
        await asyncio.sleep(0.3)
        commands = ("emit", "target", "sleep", "0.5", "emit", "target")
        sent = await asyncio.to_thread(adb.other, *commands)
        deadline = time.monotonic() + WAIT
        while len(started) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        relay.stop()
        await asyncio.wait_for(task, WAIT)
        await store.close()
        return [handled - at for at, handled in zip(sent, started, strict=True)]

    lags = asyncio.run(main())
    assert len(lags) == 2 and max(lags) < WOKEN, lags


def test_a_timer_armed_by_another_process_fires_on_time(db: Database) -> None:
    store = db.open()
    fired: list[tuple[float, DueTimer]] = []
    relay = Relay(store, "w", on_timer=lambda t: fired.append((time.time(), t)), poll=POLL)
    with running(relay):
        time.sleep(0.3)
        (fire_at,) = db.other("timer", "1.0")
        until(lambda: bool(fired), "the timer fired")
    store.close()
    ((at, timer),) = fired
    assert timer.fire_at == fire_at
    assert fire_at <= at < fire_at + WOKEN  # on time: not at a poll 30 s away


def test_an_idle_relay_writes_nothing_and_claims_when_told(db: Database) -> None:
    store = db.open()
    store.save(Execution(id="target", definition_id="d"))
    sent: list[str] = []
    execute = store._conn.execute

    def spy(request: Any) -> Any:
        sent.append("write" if isinstance(request, Batch) else "read")
        return execute(request)

    store._conn.execute = spy  # type: ignore[method-assign]
    handled: list[OutboxEntry] = []
    relay = Relay(store, "w", on_outbox=handled.append, on_timer=print, poll=0.05)
    with running(relay):
        time.sleep(1.0)  # idle: it looks every 50 ms
        idle = list(sent)
        db.other("emit", "target")
        until(lambda: len(handled) == 1, "the event handled")
    store.close()
    assert "write" not in idle and idle.count("read") >= 5, idle
    assert "write" in sent[len(idle) :]  # told of work, it claimed


def test_a_server_without_change_notifications_is_polled(
    server: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    proxy.listen = False
    store = LibsqlStore(proxy.url(), auth_token=server.token)
    store.save(Execution(id="target", definition_id="d"))
    started: list[float] = []
    relay = Relay(store, "w", on_outbox=lambda e: started.append(time.time()), poll=0.3)
    with caplog.at_level(logging.INFO, logger="harel_store"), running(relay):
        time.sleep(0.5)
        other = LibsqlStore(server.url, auth_token=server.token)
        source = Execution(id="source", definition_id="d")
        other.commit(source, [("target", Event(name="go"))])
        sent = time.time()
        other.close()
        until(lambda: bool(started), "the event handled at a poll")
    store.close()
    assert started[0] - sent < 0.3 + WOKEN
    assert "offers no change notifications (HTTP 404)" in caplog.text
    assert server.token not in caplog.text


@pytest.mark.slow
def test_a_relay_hears_a_server_again_after_it_restarts(tmp_path: Path) -> None:
    with SqldServer(tmp_path / "sqld", auth=True) as server:
        LibsqlStore(server.url, auth_token=server.token, migrate=True).close()
        store = LibsqlStore(server.url, auth_token=server.token)
        store.save(Execution(id="target", definition_id="d"))
        started: list[float] = []
        relay = Relay(store, "w", on_outbox=lambda e: started.append(time.time()), poll=POLL)
        with running(relay):
            time.sleep(0.3)
            server.kill()  # a crash: its streams break (SIGTERM would wait for them 30 s)
            time.sleep(0.5)
            server.start()
            other = LibsqlStore(server.url, auth_token=server.token)
            other.commit(Execution(id="source", definition_id="d"), [("target", Event(name="go"))])
            sent = time.time()
            other.close()
            # The stream comes back within its longest pause (5 s) and says "look".
            until(lambda: bool(started), "the event handled", within=10.0)
        store.close()
        server.kill()
    assert started[0] - sent < 10.0 < POLL


def test_without_inotify_a_file_is_watched_by_its_data_version(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another system, or inotify's limits reached: the watch asks the file's data_version
    every 10 ms instead, and a commit elsewhere still wakes a relay at once."""
    from harel_store.connection import watch

    monkeypatch.setattr(watch, "_LIBC", None)
    db = database("libsql-file", tmp_path, request)
    store = db.open()
    store.save(Execution(id="target", definition_id="d"))
    started: list[float] = []
    relay = Relay(store, "w", on_outbox=lambda entry: started.append(time.time()), poll=POLL)
    with running(relay):
        time.sleep(0.3)
        (sent,) = db.other("emit", "target")
        until(lambda: bool(started), "the event handled")
    store.close()
    assert started[0] - sent < WOKEN
