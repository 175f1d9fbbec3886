"""`wait_for` on every kind of store (sync and async): the execution as soon as it reaches a
status, woken by a commit of this process or of another one (with its fallback poll made
30 s, so only a wake-up passes), the builtin TimeoutError, bad arguments, a store closed
under a waiter, and many waiters sharing one read a change.
"""

from __future__ import annotations

import asyncio
import math
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore, StoreError, awaiting
from harel_store.batch import Batch
from tests.helpers import Refusal, raises_each
from tests.test_wakeup import WOKEN, Database, database

FINAL = ("finished", "failed", "cancelled")


@pytest.fixture(autouse=True)
def no_poll(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a wake-up ends a wait within a test's bound: the reader's poll is 30 s."""
    monkeypatch.setattr(awaiting, "POLL", 30.0)


def sync(store: Any) -> Any:
    """The store a helper thread writes through (an async store's facade runs one loop)."""
    return getattr(store, "sync_store", store)


def finish(store: Any, execution_id: str, status: str = "finished") -> None:
    store = sync(store)
    exe = store.load(execution_id)
    exe.status = status
    store.commit(exe, [])


def later(seconds: float, action: Any, *args: Any) -> threading.Thread:
    def run() -> None:
        time.sleep(seconds)
        action(*args)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def test_an_execution_already_there_comes_back_at_once(store: Any) -> None:
    store.save(Execution(id="a", definition_id="d", status="failed"))
    started = time.monotonic()
    exe = store.wait_for("a", timeout=0)
    assert (exe.id, exe.status, exe.version) == ("a", "failed", 1)
    assert store.wait_for("a", status="failed", timeout=5).status == "failed"
    assert time.monotonic() - started < WOKEN


def test_a_commit_of_this_process_wakes_the_waiter(store: Any) -> None:
    store.save(Execution(id="a", definition_id="d"))
    helper = later(0.3, finish, store, "a")
    started = time.monotonic()
    exe = store.wait_for("a", timeout=10)
    helper.join()
    assert exe.status == "finished" and exe.version == 2
    assert time.monotonic() - started < 0.3 + WOKEN


def test_a_waiter_waits_for_an_execution_not_yet_made(store: Any) -> None:
    later(0.2, sync(store).save, Execution(id="new", definition_id="d"))
    assert store.wait_for("new", status="running", timeout=10).version == 1


def test_a_status_not_reached_is_a_timeout(store: Any) -> None:
    store.save(Execution(id="a", definition_id="d"))
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=r"'a' did not reach cancelled or failed within 0\.4 s"):
        store.wait_for("a", status=["failed", "cancelled"], timeout=0.4)
    assert 0.4 <= time.monotonic() - started < 0.4 + WOKEN
    with pytest.raises(TimeoutError):
        store.wait_for("missing", timeout=0)


BAD_WAITS: list[tuple[dict[str, Any], type[Exception]]] = [
    ({"timeout": -1}, ValueError),
    ({"timeout": math.nan}, ValueError),
    ({"timeout": math.inf}, ValueError),
    ({"timeout": "1"}, TypeError),
    ({"timeout": True}, TypeError),
    ({"timeout": 1, "status": "done"}, ValueError),
    ({"timeout": 1, "status": ["finished", "over"]}, ValueError),
    ({"timeout": 1, "status": []}, ValueError),
]


def test_bad_arguments_are_refused(store: Any) -> None:
    cases: list[Refusal] = [
        (lambda options=options: store.wait_for("a", **options), error)
        for options, error in BAD_WAITS
    ]
    cases.append((lambda: store.wait_for("", timeout=1), (ValueError, TypeError)))
    raises_each(cases)


def test_another_process_wakes_a_waiter(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    for kind in ("libsql-file", "sqlite-file", "libsql-remote", "libsql-replica"):
        (tmp_path / kind).mkdir()
        db: Database = database(kind, tmp_path / kind, request)
        store = db.open()
        store.save(Execution(id="a", definition_id="d"))
        done: list[float] = []

        def wait(store: Any = store, done: list[float] = done) -> None:
            store.wait_for("a", timeout=20)
            done.append(time.time())

        thread = threading.Thread(target=wait)
        thread.start()
        time.sleep(0.3)
        (at,) = db.other("finish", "a")
        thread.join(20)
        store.close()
        assert done and done[0] - at < WOKEN, kind


def test_an_async_waiter_is_woken_by_another_process(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    for kind in ("libsql-file", "libsql-remote", "libsql-replica"):
        (tmp_path / kind).mkdir()
        db = database(kind, tmp_path / kind, request)

        async def main(db: Database = db) -> float:
            store: AsyncLibsqlStore = await db.aopen()
            await store.save(Execution(id="a", definition_id="d"))
            waiter = asyncio.create_task(store.wait_for("a", timeout=20))
            await asyncio.sleep(0.3)
            (at,) = await asyncio.to_thread(db.other, "finish", "a")
            exe = await waiter
            woken = time.time()
            assert exe.status == "finished"
            with pytest.raises(TimeoutError):  # the builtin, on every Python
                await store.wait_for("a", status="cancelled", timeout=0.1)
            await store.close()
            return woken - at

        assert asyncio.run(main()) < WOKEN, kind


def test_closing_the_store_ends_a_wait(open_store: Any) -> None:
    store = open_store()
    store.save(Execution(id="a", definition_id="d"))
    later(0.3, sync(store).close)
    with pytest.raises(StoreError, match="closed"):
        store.wait_for("a", timeout=10)


def test_many_waiters_share_one_read_a_change(tmp_path: Path) -> None:
    store = LibsqlStore(tmp_path / "many.db")
    ids = [f"e{i}" for i in range(20)]
    for execution_id in ids:
        store.save(Execution(id=execution_id, definition_id="d"))
    reads: list[str] = []
    execute = store._conn.execute

    def spy(request: Any) -> Any:
        if not isinstance(request, Batch):
            reads.append(getattr(request, "statement", request)[0].name)
        return execute(request)

    store._conn.execute = spy  # type: ignore[method-assign]
    got: dict[str, Execution] = {}
    waiters = [
        threading.Thread(target=lambda i=i: got.update({i: store.wait_for(i, timeout=20)}))
        for i in ids
    ]
    for thread in waiters:
        thread.start()
    time.sleep(0.5)
    before = reads.count("awaited")
    for execution_id in ids:
        finish(store, execution_id)
        time.sleep(0.01)
    for thread in waiters:
        thread.join(20)
    store.close()
    assert sorted(got) == sorted(ids) and all(e.status == "finished" for e in got.values())
    # A read of every status a signal (a commit signals twice: this process's own news, and
    # the file's watch; fewer when changes come faster than reads), not one a waiter: 20
    # waiters and 20 changes would be 400 reads.
    assert reads.count("awaited") - before <= 3 * len(ids)


def test_waits_for_one_execution_each_get_their_own_copy(store: Any) -> None:
    store.save(Execution(id="a", definition_id="d"))
    results: list[Execution] = []
    threads = [
        threading.Thread(target=lambda: results.append(store.wait_for("a", timeout=10)))
        for _ in range(3)
    ]
    if hasattr(store, "_loop"):  # an async store's facade drives one loop: one waiter
        threads = threads[:1]
    for thread in threads:
        thread.start()
    time.sleep(0.3)
    finish(store, "a")
    for thread in threads:
        thread.join(10)
    assert len(results) == len(threads)
    assert len({id(exe) for exe in results}) == len(results)
    assert all(exe.status in FINAL for exe in results)


def wanted(store: Any) -> dict[str, frozenset[str]]:
    """The statuses the store's reader asks for, by execution waited for."""
    with store._awaits._lock:
        return store._awaits._wanted(store._awaits._calls)


def test_an_execution_is_read_for_the_statuses_its_calls_still_wait_for(tmp_path: Path) -> None:
    """What the reader asks of an execution is what the calls waiting on it now want: a
    call that leaves (its timeout) takes its statuses along, those that stay keep theirs."""
    store = LibsqlStore(tmp_path / "w.db")
    store.save(Execution(id="a", definition_id="d"))
    results: dict[str, str] = {}

    def wait(name: str, status: Any, timeout: float) -> None:
        try:
            results[name] = store.wait_for("a", status=status, timeout=timeout).status
        except TimeoutError:
            results[name] = "timeout"

    def started(name: str, status: Any, timeout: float, waiting: int) -> threading.Thread:
        thread = threading.Thread(target=wait, args=(name, status, timeout))
        thread.start()
        deadline = time.monotonic() + 10
        while len(store._awaits._calls.get("a", ())) < waiting and time.monotonic() < deadline:
            time.sleep(0.01)  # until the call waits
        assert len(store._awaits._calls.get("a", ())) == waiting, f"{name} did not wait"
        return thread

    threads = [started("long", ["finished", "cancelled"], 20, 1)]
    threads.append(started("other", "finished", 20, 2))
    threads.insert(0, started("short", "failed", 3, 3))  # 3 s: its thread may start late
    assert wanted(store) == {"a": frozenset({"failed", "finished", "cancelled"})}
    threads[0].join(10)
    assert results == {"short": "timeout"}
    assert wanted(store) == {"a": frozenset({"finished", "cancelled"})}
    finish(store, "a", "failed")  # what only the call gone waited for: nobody wakes
    time.sleep(0.3)
    assert results == {"short": "timeout"}
    finish(store, "a", "finished")
    for thread in threads:
        thread.join(20)
    assert results == {"short": "timeout", "long": "finished", "other": "finished"}
    assert wanted(store) == {}
    store.close()


def test_the_statuses_wanted_are_those_of_the_calls_waiting_whatever_the_order() -> None:
    """`Awaits`' books, calls coming and going in any order, several on one execution with
    statuses in common: after each step, each execution is asked for exactly the statuses
    of its calls still waiting (no more: a read in vain; no fewer: a wake-up missed)."""
    import random

    from harel_store.awaiting import Awaits, Call

    class NoStore:  # never read: no reader runs
        pass

    awaits = Awaits(NoStore(), "books")  # type: ignore[arg-type]
    awaits._thread = threading.current_thread()  # as if a reader ran: add() starts none
    rng = random.Random(7)
    statuses = [frozenset(s) for s in ({"finished"}, {"failed", "cancelled"}, set(FINAL))]
    waiting: list[Call] = []
    for _ in range(3_000):
        if waiting and rng.random() < 0.5:
            call = waiting.pop(rng.randrange(len(waiting)))
            awaits.remove(call)
            awaits.remove(call)  # a second time: nothing (the caller's finally after a resolve)
        else:
            call = Call(rng.choice("abc"), rng.choice(statuses))
            waiting.append(call)
            awaits.add(call)
        expected: dict[str, frozenset[str]] = {}
        for call in waiting:
            expected[call.execution_id] = expected.get(call.execution_id, frozenset()) | (
                call.statuses
            )
        assert awaits._wanted(awaits._calls) == expected
    for call in waiting:
        awaits.remove(call)
    assert awaits._calls == {} and awaits._counts == {}
