"""Hardening of the wake-up and of `wait_for` (issue 48, classes 3, 5, 6, 8 and 11): a watch
that fails to start is tried again; every finish on sqld is seen by its notification, and the
safety read is paced; waiting costs reads in proportion to what changed, not to the waiters;
a forked child's waiters are woken; a watch after a chdir watches the store's file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import Execution, LibsqlStore, SqliteStore, StoreError, awaiting, wakeup
from harel_store.awaiting import Call
from harel_store.batch import Batch
from harel_store.connection import watch
from tests.test_wakeup import WOKEN, database

FINAL = frozenset(("finished", "failed", "cancelled"))


@pytest.fixture
def no_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a wake-up ends a wait within a test's bound: the reader's poll is 30 s."""
    monkeypatch.setattr(awaiting, "POLL", 30.0)


def later(seconds: float, action: Any, *args: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def finish(store: Any, execution_id: str) -> None:
    exe = store.load(execution_id)
    exe.status = "finished"
    store.commit(exe, [])


@pytest.mark.usefixtures("no_poll")
def test_a_watch_that_fails_to_start_is_tried_again(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EMFILE from os.pipe as the watch starts: the wait still ends on this process's
    commit, nothing stays registered dead, and the next wait hears another process."""
    db = database("libsql-file", tmp_path, request)
    store = db.open()
    store.save(Execution(id="a", definition_id="d"))
    store.save(Execution(id="b", definition_id="d"))
    pipe = os.pipe
    failures = [OSError(errno.EMFILE, os.strerror(errno.EMFILE))]

    def failing_pipe() -> tuple[int, int]:
        if failures:
            raise failures.pop()
        return pipe()

    monkeypatch.setattr(watch.os, "pipe", failing_pipe)
    key = store._conn.key
    try:
        later(0.3, finish, store, "a")
        started = time.monotonic()
        assert store.wait_for("a", timeout=10).status == "finished"
        assert time.monotonic() - started < 0.3 + WOKEN
        assert not failures and wakeup.WATCH_RETRY <= 1.0
        time.sleep(wakeup.WATCH_RETRY)  # a failed start is tried again at most this often
        done: list[float] = []
        waiter = threading.Thread(
            target=lambda: done.append(store.wait_for("b", timeout=10) and time.time())
        )
        waiter.start()
        time.sleep(0.5)
        (at,) = db.other("finish", "b")
        waiter.join(15)
        assert done and done[0] - at < WOKEN
    finally:
        store.close()
    assert key not in wakeup._watches  # none left registered (a file's stops at once)


@pytest.mark.usefixtures("no_poll")
def test_a_watch_whose_thread_fails_is_made_again(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The watch started, and its thread failed to open its connection (EMFILE): a waiter
    already waiting makes it again and hears another process's commit."""
    from harel_store.connection import local

    db = database("libsql-file", tmp_path, request)
    store = db.open()
    store.save(Execution(id="a", definition_id="d"))
    libsql = local.import_libsql()
    failures = [OSError(errno.EMFILE, os.strerror(errno.EMFILE))]

    class Failing:
        def connect(self, *args: Any, **kwargs: Any) -> Any:
            if failures:
                raise failures.pop()
            return libsql.connect(*args, **kwargs)

    monkeypatch.setattr(local, "import_libsql", Failing)
    done: list[float] = []
    try:
        waiter = threading.Thread(
            target=lambda: done.append(store.wait_for("a", timeout=10) and time.time())
        )
        waiter.start()
        time.sleep(0.5 + wakeup.WATCH_RETRY)  # the failure, and the watch made again
        assert not failures
        (at,) = db.other("finish", "a")
        waiter.join(15)
    finally:
        store.close()
    assert done and done[0] - at < WOKEN


def test_waiting_costs_reads_in_proportion_to_what_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The work of the store's connection a commit (SQLite's VM steps: its commit, and the
    reads of wait_for's reader that it causes) does not grow with the calls waiting, nor
    with the executions finished long ago."""
    monkeypatch.setattr(awaiting, "MARGIN", 0.2)  # what "long ago" is, to the reader
    steps: list[int] = []
    for waiting in (0, 2000):
        store = SqliteStore(tmp_path / f"w{waiting}.db", synchronous="OFF")
        store.save(Execution(id="busy", definition_id="d"))
        for i in range(1000):
            store.save(Execution(id=f"old{i}", definition_id="d", status="finished"))
        time.sleep(awaiting.MARGIN + 0.3)  # long ago, as the reader reckons
        calls = [Call(f"e{i}", FINAL) for i in range(waiting)]
        for call in calls:
            store._awaits.add(call)
        time.sleep(0.5)  # the calls' first read
        count = [0]

        def step(count: list[int] = count) -> int:
            count[0] += 1
            return 0

        store._conn.db.set_progress_handler(step, 10)
        exe = store.load("busy")
        assert exe is not None
        for _ in range(20):
            store.commit(exe, [])
            time.sleep(0.03)  # the reader reads after each
        store._conn.db.set_progress_handler(None, 0)
        for call in calls:
            store._awaits.remove(call)
        store.close()
        steps.append(count[0])
    # A commit causes a read or two of constant cost (what changed, nothing here): a few
    # times a bare commit's steps, where reading every waited execution is a thousand times.
    assert steps[1] < 5 * steps[0], steps


@pytest.mark.parametrize("waiting", [1, awaiting.BY_ID + 1])
def test_a_change_is_read_back_a_few_times_not_for_as_long_as_a_margin(
    tmp_path: Path, waiting: int
) -> None:
    """Calls wait on executions nobody touches while the database finishes others fast:
    each change comes back in a few of the reader's reads (those within LAG of it, and the
    sweeps; none where few are waited for, each read by id), not in every read for as long
    as it stays within MARGIN (~250 times each, the reader holding the store's connection a
    quarter of the time)."""
    store = SqliteStore(tmp_path / "w.db", synchronous="OFF")
    rows = [0]
    read = store._awaited_changes

    def counted(*args: Any) -> Any:
        now, changed = read(*args)
        rows[0] += len(changed)
        return now, changed

    store._awaited_changes = counted  # type: ignore[method-assign]
    calls = [Call(f"nobody{i}", FINAL) for i in range(waiting)]
    for call in calls:
        store._awaits.add(call)
    commits = 300
    try:
        time.sleep(0.3)  # its first read
        for i in range(commits):
            store.save(Execution(id=f"x{i}", definition_id="d", status="finished"))
            time.sleep(0.002)
        time.sleep(0.3)
    finally:
        for call in calls:
            store._awaits.remove(call)
        store.close()
    # By id: none. Else about 23 here (LAG / PACE reads and MARGIN / SWEEP sweeps); 250 before.
    assert rows[0] <= 40 * commits, rows


@pytest.mark.parametrize("others", [0, awaiting.BY_ID])
def test_a_commit_that_stalled_after_its_write_is_heard(tmp_path: Path, others: int) -> None:
    """Another writer's transaction stalls 1.5 s between its write of the execution
    (updated_at: the database's clock then) and its COMMIT, while the reader reads (a new
    call): it is seen within a sweep (or at once, where few are waited for and each is read
    by id), not by the safety read seconds later."""
    import json
    import sqlite3

    path = tmp_path / "w.db"
    store = SqliteStore(path)  # the stdlib's sqlite3, as the foreign writer's
    for execution_id in ("x", "y"):
        store.save(Execution(id=execution_id, definition_id="d"))
    got: dict[str, float] = {}

    def wait(execution_id: str) -> None:
        with contextlib.suppress(StoreError):  # y's, when the store closes
            store.wait_for(execution_id, status="finished", timeout=30)
            got[execution_id] = time.monotonic()

    calls = [Call(f"other{i}", FINAL) for i in range(others)]  # more than BY_ID with x, y
    for call in calls:
        store._awaits.add(call)
    waiting = threading.Thread(target=wait, args=("x",))
    waiting.start()
    time.sleep(0.3)  # its first read
    writer = sqlite3.connect(path, isolation_level=None)
    try:
        writer.execute("BEGIN IMMEDIATE")
        data, version = writer.execute(
            "SELECT data, version FROM harel_executions WHERE id = 'x'"
        ).fetchone()
        record = {**json.loads(data), "status": "finished", "version": version + 1}
        writer.execute(
            "UPDATE harel_executions SET data = ?, version = ?, status = 'finished', "
            "updated_at = (julianday('now') - 2440587.5) * 86400.0 WHERE id = 'x'",
            (json.dumps(record), version + 1),
        )
        time.sleep(1.2)
        threading.Thread(target=wait, args=("y",), daemon=True).start()  # a read meanwhile
        time.sleep(0.3)
        writer.execute("COMMIT")
        committed = time.monotonic()
        waiting.join(30)
    finally:
        writer.close()
        store.close()
    assert got["x"] - committed < 0.9, got["x"] - committed  # the safety read: >= 1 s


@pytest.mark.usefixtures("no_poll")
def test_a_forked_child_waiter_is_woken(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """The parent watches the file (a waiter of its own); a child forked meanwhile waits on
    the same file and is woken by the parent's commit (another process to it)."""
    db = database("libsql-file", tmp_path, request)
    store = db.open()
    store.save(Execution(id="a", definition_id="d"))
    parent_waiter = store._waiter()  # the parent's watch runs
    time.sleep(0.2)
    pid = os.fork()
    if pid == 0:  # the child
        code = 1
        try:
            child = db.open()
            started = time.monotonic()
            exe = child.wait_for("a", timeout=8)
            code = 0 if exe.status == "finished" and time.monotonic() - started < 8 else 2
        except BaseException:
            code = 3
        finally:
            os._exit(code)
    try:
        time.sleep(1.0)
        finish(store, "a")
        _, status = os.waitpid(pid, 0)
    finally:
        parent_waiter.close()
        store.close()
    assert os.waitstatus_to_exitcode(status) == 0


@pytest.mark.usefixtures("no_poll")
def test_a_watch_made_after_chdir_watches_the_stores_file(
    tmp_path: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "here").mkdir()
    (tmp_path / "there").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    SqliteStore("rel.db").close()  # migrated
    db = database("libsql-file", tmp_path, request)
    db.target = str(tmp_path / "here" / "rel.db")
    store = LibsqlStore("rel.db")
    store.save(Execution(id="a", definition_id="d"))
    monkeypatch.chdir(tmp_path / "there")
    done: list[float] = []
    waiter = threading.Thread(
        target=lambda: done.append(store.wait_for("a", timeout=10) and time.time())
    )
    waiter.start()
    time.sleep(0.5)
    (at,) = db.other("finish", "a")
    waiter.join(15)
    store.close()
    assert not (tmp_path / "there" / "rel.db").exists()
    assert done and done[0] - at < WOKEN


def test_the_safety_read_is_paced_while_the_watch_is_live(sqld: Any) -> None:
    """Waiting with nothing changing on a server whose notifications flow: the reads of
    every waited execution come further and further apart, as a relay's poll, not one
    every `POLL`."""
    from tests.conftest import reset_remote

    reset_remote(sqld)
    store = LibsqlStore(sqld.url, auth_token=sqld.token)
    reads: list[str] = []
    execute = store._conn.execute

    def spy(request: Any) -> Any:
        if not isinstance(request, Batch):
            reads.append(getattr(request, "statement", request)[0].name)
        return execute(request)

    store._conn.execute = spy  # type: ignore[method-assign]
    poll = 0.1
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(awaiting, "POLL", poll)
            with pytest.raises(TimeoutError):
                store.wait_for("never", timeout=3.0)
    finally:
        store.close()
    # every POLL: 30 reads; doubling from POLL: 0.1, 0.3, 0.7, 1.5, 3.1: about 5 (the first
    # while the streams open, at POLL), and those the streams' opening signals bring (a few
    # waited for: read by id too): about 11.
    assert reads.count("awaited") <= 16, reads


@pytest.mark.slow
def test_every_finish_on_sqld_is_heard_not_caught_by_the_safety_read(
    sqld: Any, no_poll: None
) -> None:
    """Sequential short waits, each on an execution another client finishes a few ms after
    the wait starts: each wait ends on the server's notification, never on the safety read
    (`no_poll`: 30 s, so that no wait a loaded machine slows to a second passes for one)."""
    from tests.conftest import reset_remote

    reset_remote(sqld)
    store = LibsqlStore(sqld.url, auth_token=sqld.token)
    other = LibsqlStore(sqld.url, auth_token=sqld.token)
    # Another process, as far as this one can tell: its commits raise no in-process signal.
    other._notify = lambda signals: None  # type: ignore[method-assign]
    slow: list[tuple[int, float]] = []
    try:
        for i in range(200):
            # A large record: its commit writes many pages, which widens the window between
            # sqld's notification and the commit's visibility, where a read sees nothing.
            exe = Execution(id=f"o{i}", definition_id="d", context={"blob": "x" * 100_000})
            other.save(exe)

            def finish(exe: Execution = exe) -> None:
                time.sleep(0.005)
                exe.status = "finished"
                other.commit(exe, [])

            started = time.monotonic()
            helper = threading.Thread(target=finish)
            helper.start()
            done = store.wait_for(exe.id, timeout=10)
            took = time.monotonic() - started
            helper.join()
            assert done.status == "finished"
            if took >= 3.0:
                slow.append((i, round(took, 3)))
    finally:
        other.close()
        store.close()
    assert not slow, f"waits that took the safety read: {slow}"
