"""Group commit on a local file: the commits that arrive while a write transaction of the
store is being written wait, and the next transaction carries all of them, each in its own
SAVEPOINT with its own outcome (harel_store/connection/local.py). The stdlib driver's trace
callback shows the transactions; the outcomes are checked on both drivers."""

from __future__ import annotations

import asyncio
import dis
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    SqliteStore,
    StoreConflict,
    StoreError,
)
from harel_store.connection import local as local_module
from harel_store.connection.local import LocalConnection
from harel_store.store import Store
from tests.helpers import refused_batch, wait_until
from tests.test_local import LOCKER

DRIVERS: dict[str, type[Store]] = {"libsql": LibsqlStore, "sqlite": SqliteStore}
LOCAL = local_module.__file__


def local(store: Store) -> LocalConnection:
    conn = store._conn
    assert isinstance(conn, LocalConnection)
    return conn


def emit(exe: Execution, n: int) -> list[tuple[str | None, Event]]:
    return [(None, Event(name="go", id=f"{exe.id}-{n}"))]


@contextmanager
def statements(store: Store) -> Iterator[list[str]]:
    """The statements a SqliteStore's connection runs meanwhile."""
    ran: list[str] = []
    db = local(store).db
    db.set_trace_callback(ran.append)  # type: ignore[attr-defined]
    try:
        yield ran
    finally:
        db.set_trace_callback(None)  # type: ignore[attr-defined]


def queued_then_released(
    store: Store, calls: list[Callable[[], Any]], meanwhile: Callable[[], Any] = lambda: None
) -> list[Any]:
    """Run each call in its own thread while the connection is held, so that every one of
    their writes waits in the queue; then (after ``meanwhile``, in a thread of its own) let
    them go, and return each one's result or exception."""
    conn = local(store)
    outcomes: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            outcomes[i] = calls[i]()
        except Exception as exc:
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    other = threading.Thread(target=meanwhile)
    with conn._lock:  # a write under way: whatever comes now waits
        for t in threads:
            t.start()
        wait_until(lambda: len(conn._queue) == len(calls), "every write waits")
        other.start()
    for t in [*threads, other]:
        t.join(timeout=30)
    return outcomes


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_writes_that_wait_commit_together_each_with_its_own_outcome(
    driver: str, tmp_path: Path
) -> None:
    store = DRIVERS[driver](tmp_path / "group.db")
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(6)]
    for exe in exes:
        store.commit(exe, emit(exe, 1))
    stale = store.load("exe-0")
    assert stale is not None
    calls: list[Callable[[], Any]] = [
        *(lambda exe=exe: store.commit(exe, emit(exe, 2)) for exe in exes),
        lambda: store.commit(stale, emit(stale, 99)),  # behind exe-0's commit in the group
        lambda: local(store).execute(refused_batch()),
    ]
    outcomes = queued_then_released(store, calls)
    assert all(isinstance(seqs, list) and len(seqs) == 1 for seqs in outcomes[:6]), outcomes
    conflict, refused = outcomes[6:]
    assert isinstance(conflict, StoreConflict) and conflict.found == 2, conflict
    assert stale.version == 1  # restored, as after any failed commit
    assert type(refused) is StoreError and "malformed JSON" in str(refused), refused
    # What the members that failed wrote is gone; every other member's write is there.
    for exe in exes:
        loaded = store.load(exe.id)
        assert loaded is not None and loaded.version == 2
    events = sorted(entry.event.id for entry in store.pending_outbox(limit=100))
    assert events == sorted(f"exe-{i}-{n}" for i in range(6) for n in (1, 2))
    store.close()


def test_the_group_is_one_transaction_a_lone_write_its_own(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "group.db")
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(5)]
    with statements(store) as ran:
        store.commit(exes[0], emit(exes[0], 1))
    assert [s for s in ran if s in ("COMMIT", "SAVEPOINT harel_member")] == ["COMMIT"]
    with statements(store) as ran:
        calls = [lambda exe=exe: store.commit(exe, emit(exe, 1)) for exe in exes[1:]]
        outcomes = queued_then_released(store, calls)
    assert all(isinstance(seqs, list) for seqs in outcomes), outcomes
    assert ran.count("BEGIN IMMEDIATE") == ran.count("COMMIT") == 1, ran
    assert ran.count("SAVEPOINT harel_member") == 0  # none failed: no savepoint was needed
    # One stale member: the group is written again, each member in its own savepoint.
    with statements(store) as ran:
        stale = exes[1].model_copy(update={"version": 0})
        calls = [lambda exe=exe: store.commit(exe, emit(exe, 2)) for exe in exes[1:]]
        outcomes = queued_then_released(store, [*calls, lambda: store.commit(stale, [])])
    assert all(isinstance(seqs, list) for seqs in outcomes[:4]), outcomes
    assert isinstance(outcomes[4], StoreConflict) and outcomes[4].found == 2
    assert ran.count("BEGIN IMMEDIATE") == 2 and ran.count("COMMIT") == 1, ran
    assert ran.count("ROLLBACK") == 1 and ran.count("ROLLBACK TO harel_member") == 1
    assert ran.count("SAVEPOINT harel_member") == ran.count("RELEASE harel_member") == 5
    store.close()


def test_async_tasks_commit_in_groups_each_with_its_own_outcome(tmp_path: Path) -> None:
    sync = SqliteStore(tmp_path / "group.db")
    exes = [Execution(id=f"exe-{i:02d}", definition_id="d") for i in range(32)]

    async def main() -> list[Any]:
        store = AsyncLibsqlStore(sync)
        stale = exes[0].model_copy()
        await store.commit(exes[0], emit(exes[0], 0))  # stale is now one version behind

        async def rounds(exe: Execution) -> None:
            for n in range(1, 6):
                await store.commit(exe, emit(exe, n))

        return await asyncio.gather(
            *(rounds(exe) for exe in exes), store.commit(stale, []), return_exceptions=True
        )

    with statements(sync) as ran:
        outcomes = asyncio.run(main())
    assert outcomes[:32] == [None] * 32
    assert isinstance(outcomes[32], StoreConflict)
    commits = 32 * 5 + 2
    assert ran.count("COMMIT") < commits / 4, f"{ran.count('COMMIT')} transactions"
    assert [sync.load(exe.id).version for exe in exes] == [6] + [5] * 31  # type: ignore[union-attr]
    assert len(sync.pending_outbox(limit=1000)) == 32 * 5 + 1
    sync.close()


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_a_group_waits_for_another_process_holding_the_file(driver: str, tmp_path: Path) -> None:
    db = tmp_path / "group.db"
    store = DRIVERS[driver](db)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(8)]
    other = subprocess.Popen(
        [sys.executable, "-c", LOCKER, str(db), "0.5"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert other.stdout is not None and other.stdout.readline() == "locked\n"
        calls = [lambda exe=exe: store.commit(exe, emit(exe, 1)) for exe in exes]
        outcomes = queued_then_released(store, calls)
    finally:
        other.communicate(timeout=30)
    assert all(isinstance(seqs, list) for seqs in outcomes), outcomes
    assert [store.load(exe.id) is not None for exe in exes] == [True] * 8
    store.close()


def test_a_cancelled_task_whose_write_waits_learns_what_is_stored(tmp_path: Path) -> None:
    """A task cancelled while its batch waits for the loop's group still gets its outcome
    (a request once queued is never abandoned half-way): its ``exe.version`` says whether
    the commit landed, and the others land."""
    sync = LibsqlStore(tmp_path / "group.db")
    conn = local(sync)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(6)]

    async def main() -> None:
        store = AsyncLibsqlStore(sync)
        conn._lock.acquire()  # the first write is stuck in its worker until released
        try:
            first = asyncio.create_task(store.commit(exes[0], emit(exes[0], 1)))
            await asyncio.to_thread(wait_until, lambda: len(conn._queue) == 1, "the first write")
            rest = [asyncio.create_task(store.commit(e, emit(e, 1))) for e in exes[1:]]
            await asyncio.sleep(0.05)  # they wait on the loop, behind the first
            rest[2].cancel()
            await asyncio.sleep(0.05)
        finally:
            conn._lock.release()
        outcomes = await asyncio.gather(first, *rest, return_exceptions=True)
        assert isinstance(outcomes[3], asyncio.CancelledError)
        assert all(isinstance(o, list) for i, o in enumerate(outcomes) if i != 3), outcomes

    asyncio.run(main())
    for exe in exes:
        stored = sync.load(exe.id)
        assert (stored.version if stored else 0) == exe.version, exe.id
    assert exes[0].version == 1 and exes[1].version == 1
    sync.close()


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_writes_waiting_when_the_store_closes_fail_or_land_as_they_say(
    driver: str, tmp_path: Path
) -> None:
    db = tmp_path / "group.db"
    store = DRIVERS[driver](db)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(6)]
    calls = [lambda exe=exe: store.commit(exe, emit(exe, 1)) for exe in exes]
    # The store closes while they wait: it waits for the connection too, a race with them.
    outcomes = queued_then_released(store, calls, meanwhile=store.close)
    with DRIVERS[driver](db) as again:
        for exe, outcome in zip(exes, outcomes, strict=True):
            stored = again.load(exe.id)
            if isinstance(outcome, list):
                assert stored is not None and exe.version == 1
            else:
                assert isinstance(outcome, StoreError) and "closed" in str(outcome), outcome
                assert stored is None and exe.version == 0


def interrupted_group(
    store: Store, monkeypatch: pytest.MonkeyPatch, *, after_commit: bool
) -> tuple[list[Execution], list[Any], int]:
    """Four threads whose commits wait, then go as one group; the thread that leads it is
    interrupted (KeyboardInterrupt, once) right after its COMMIT ran, or right before.
    Returns the executions, each thread's outcome (its result or what it raised) and the
    index of the leader."""
    conn = local(store)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(4)]
    outcomes: list[Any] = [None] * 4
    leader: list[int] = []
    commit = LocalConnection._commit
    names = {f"writer-{i}": i for i in range(4)}

    def interrupted(self: LocalConnection) -> None:
        if not leader:
            leader.append(names[threading.current_thread().name])
            if after_commit:
                commit(self)
            raise KeyboardInterrupt
        commit(self)

    monkeypatch.setattr(LocalConnection, "_commit", interrupted)

    def run(i: int) -> None:
        try:
            outcomes[i] = store.commit(exes[i], emit(exes[i], 1))
        except BaseException as exc:  # the leader's KeyboardInterrupt, or a failure
            outcomes[i] = exc

    threads = [threading.Thread(target=run, args=(i,), name=f"writer-{i}") for i in range(4)]
    with conn._lock:  # a write under way: the four wait, and go as one group
        for t in threads:
            t.start()
        wait_until(lambda: len(conn._queue) == 4, "every write waits")
    for t in threads:
        t.join(timeout=30)
    assert not any(t.is_alive() for t in threads), "a writer hangs"
    assert len(leader) == 1
    return exes, outcomes, leader[0]


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_an_interrupt_after_the_commit_is_the_leaders_alone(
    driver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every write of the group landed: the others are told so (their seqs, their version
    moved on); only the leader's thread sees the interrupt."""
    store = DRIVERS[driver](tmp_path / "group.db")
    exes, outcomes, lead = interrupted_group(store, monkeypatch, after_commit=True)
    assert isinstance(outcomes[lead], KeyboardInterrupt), outcomes
    for i, (exe, outcome) in enumerate(zip(exes, outcomes, strict=True)):
        stored = store.load(exe.id)
        assert stored is not None and stored.version == 1, exe.id  # all four landed
        if i != lead:
            assert isinstance(outcome, list) and len(outcome) == 1, outcomes
            assert exe.version == 1
    store.close()


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_an_interrupt_before_the_commit_leaves_the_others_to_a_new_leader(
    driver: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing of the group was written: the leader's write never lands (its caller was
    interrupted), the others are written by the next leader and told so, none hangs."""
    store = DRIVERS[driver](tmp_path / "group.db")
    exes, outcomes, lead = interrupted_group(store, monkeypatch, after_commit=False)
    assert isinstance(outcomes[lead], KeyboardInterrupt), outcomes
    assert store.load(exes[lead].id) is None and exes[lead].version == 0
    for i, (exe, outcome) in enumerate(zip(exes, outcomes, strict=True)):
        if i != lead:
            assert isinstance(outcome, list) and len(outcome) == 1, outcomes
            stored = store.load(exe.id)
            assert stored is not None and stored.version == exe.version == 1, exe.id
    assert not local(store)._queue
    store.close()


def traced(thread: Callable[[], None], tracer: Any) -> Callable[[], None]:
    """``thread`` run with ``tracer`` as this thread's trace function (sys.settrace)."""

    def run() -> None:
        sys.settrace(tracer)
        try:
            thread()
        finally:
            sys.settrace(None)

    return run


def in_local(frame: FrameType) -> bool:
    return frame.f_code.co_filename == LOCAL


def test_an_interrupt_as_a_writer_gets_the_connection_leaves_it_free(tmp_path: Path) -> None:
    """The interrupt lands at the first instruction a waiting writer runs once it holds the
    connection's lock: the lock is released (another thread's write goes through) and the
    interrupted write is withdrawn, not written."""
    store = SqliteStore(tmp_path / "group.db")
    conn = local(store)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(2)]
    outcomes: list[Any] = [None, None]
    fired: list[str] = []

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not in_local(frame) or fired:
            return None
        frame.f_trace_opcodes = True

        def opcode(frame: FrameType, event: str, arg: Any) -> Any:
            if event == "opcode" and not fired and conn._lock._is_owned():  # type: ignore[attr-defined]
                fired.append(frame.f_code.co_name)
                raise KeyboardInterrupt
            return opcode

        return opcode

    def write(i: int) -> None:
        try:
            outcomes[i] = store.commit(exes[i], emit(exes[i], 1))
        except BaseException as exc:
            outcomes[i] = exc

    first = threading.Thread(target=traced(lambda: write(0), tracer), daemon=True)
    with conn._lock:  # a write under way: the first waits for the connection
        first.start()
        wait_until(lambda: len(conn._queue) == 1, "the first write waits")
    first.join(timeout=10)
    assert fired and isinstance(outcomes[0], KeyboardInterrupt), (fired, outcomes)
    second = threading.Thread(target=write, args=(1,), daemon=True)
    second.start()
    second.join(timeout=10)
    assert not second.is_alive(), f"another write hangs: the lock is held ({fired})"
    assert isinstance(outcomes[1], list), outcomes
    assert store.load(exes[0].id) is None and exes[0].version == 0  # withdrawn
    assert not conn._queue
    store.close()


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="SIGINT: the main thread"
)
def test_a_writer_interrupted_while_it_waits_as_a_leader_takes_its_group(tmp_path: Path) -> None:
    """This (main) thread's write waits in the queue with another; SIGINT interrupts its wait
    while the leader is taking its group from the queue (paused there by a trace hook). The
    interrupt is this thread's alone: the leader and the other writer get their results, and
    the interrupted write is not written."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    store = SqliteStore(tmp_path / "group.db")
    conn = local(store)
    main = threading.main_thread().ident
    assert main is not None
    exes = {name: Execution(id=name, definition_id="d") for name in ("lead", "other", "main")}
    outcomes: dict[str, Any] = {}
    held = threading.Event()

    def write(name: str) -> None:
        try:
            outcomes[name] = store.commit(exes[name], emit(exes[name], 1))
        except BaseException as exc:
            outcomes[name] = exc

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        # The leader starts taking its group (the first comprehension it runs in local.py).
        if in_local(frame) and frame.f_code.co_name in ("<listcomp>", "<genexpr>"):
            sys.settrace(None)
            signal.pthread_kill(main, signal.SIGINT)
            wait_until(lambda: "main" in outcomes, "the main thread's wait is interrupted")
        return None

    def leader() -> None:
        with conn._lock:  # the connection held: the others wait
            held.set()
            wait_until(lambda: len(conn._queue) == 2, "the other write and the main one wait")
            traced(lambda: write("lead"), tracer)()

    lead = threading.Thread(target=leader, daemon=True)
    other = threading.Thread(target=write, args=("other",), daemon=True)
    try:
        lead.start()
        held.wait()
        other.start()
        wait_until(lambda: len(conn._queue) == 1, "the other write waits")
        write("main")
        lead.join(timeout=10)
        other.join(timeout=10)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert not lead.is_alive() and not other.is_alive(), f"a writer hangs: {outcomes}"
    assert isinstance(outcomes["main"], KeyboardInterrupt), outcomes
    assert isinstance(outcomes["lead"], list) and isinstance(outcomes["other"], list), outcomes
    assert store.load("main") is None and exes["main"].version == 0
    assert not conn._queue
    store.close()


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_an_interrupt_once_the_groups_transaction_returned_is_the_leaders_alone(
    driver: str, tmp_path: Path
) -> None:
    """The leader of a group of four is interrupted at the first line it runs once its
    transaction returned, before it told the others their outcomes: they still get them
    (each its own result, their writes landed once), none hangs."""
    store = DRIVERS[driver](tmp_path / "group.db")
    conn = local(store)
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(4)]
    outcomes: list[Any] = [None] * 4
    fired: list[int] = []
    returned: list[FrameType] = []  # the leader's frame, once its transaction returned

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not in_local(frame) or fired:
            return None

        def local_trace(frame: FrameType, event: str, arg: Any) -> Any:
            if fired:
                return None
            if event == "return" and frame.f_code.co_name == "_retried":
                caller = frame.f_back
                if caller is not None and caller.f_code.co_name in ("_lead", "_write_group"):
                    returned.append(caller)
            elif event == "line" and returned and frame is returned[0]:
                fired.append(exes.index(current[threading.get_ident()]))
                raise KeyboardInterrupt
            return local_trace

        return local_trace

    current: dict[int, Execution] = {}

    def write(i: int) -> None:
        current[threading.get_ident()] = exes[i]
        try:
            outcomes[i] = store.commit(exes[i], emit(exes[i], 1))
        except BaseException as exc:
            outcomes[i] = exc

    threads = [
        threading.Thread(target=traced(lambda i=i: write(i), tracer), daemon=True) for i in range(4)
    ]
    with conn._lock:  # a write under way: the four wait, and go as one group
        for t in threads:
            t.start()
        wait_until(lambda: len(conn._queue) == 4, "every write waits")
    for t in threads:
        t.join(timeout=10)
    assert not [t for t in threads if t.is_alive()], f"writers hang: {outcomes}"
    assert len(fired) == 1, fired
    lead = fired[0]
    assert isinstance(outcomes[lead], KeyboardInterrupt), outcomes
    for i, exe in enumerate(exes):
        stored = store.load(exe.id)
        assert stored is not None and stored.version == 1, exe.id  # all four landed, once
        if i != lead:
            assert isinstance(outcomes[i], list) and exe.version == 1, outcomes
    assert not conn._queue
    store.close()


# The instructions after which CPython runs a pending signal's handler (its "eval breaker":
# a call returned, a loop's jump back; and a function's start), 3.10 to 3.13.
CHECKS_SIGNALS = frozenset(
    ("CALL", "CALL_FUNCTION", "CALL_FUNCTION_KW", "CALL_FUNCTION_EX", "CALL_METHOD", "CALL_KW")
) | {"JUMP_BACKWARD", "JUMP_ABSOLUTE"}


def interrupted_at(store: Store, n: int) -> bool:
    """Three writes wait, then go as one group; KeyboardInterrupt lands at the n-th instant
    where a signal's handler may run (`CHECKS_SIGNALS`) in local.py in whichever thread
    holds the connection. Checks what each writer was told; False when the writes ended
    before that instant."""
    conn = local(store)
    exes = [Execution(id=f"exe-{n}-{i}", definition_id="d") for i in range(3)]
    outcomes: list[Any] = [None] * 3
    fired: list[int] = []
    count = [0]

    def tracer(frame: FrameType, event: str, arg: Any) -> Any:
        if not in_local(frame):
            return None
        frame.f_trace_opcodes = True
        last: list[str] = []  # the instruction this frame ran last

        def opcode(frame: FrameType, event: str, arg: Any) -> Any:
            if event != "opcode":
                return opcode
            due = not last or last[0] in CHECKS_SIGNALS
            last[:] = [dis.opname[frame.f_code.co_code[frame.f_lasti]]]
            if due and not fired and conn._lock._is_owned():  # type: ignore[attr-defined]
                count[0] += 1
                if count[0] == n:
                    fired.append(threading.get_ident())
                    raise KeyboardInterrupt
            return opcode

        return opcode

    def write(i: int) -> None:
        try:
            outcomes[i] = store.commit(exes[i], emit(exes[i], 1))
        except BaseException as exc:
            outcomes[i] = exc

    threads = [
        threading.Thread(target=traced(lambda i=i: write(i), tracer), daemon=True) for i in range(3)
    ]
    with conn._lock:
        for t in threads:
            t.start()
        wait_until(lambda: len(conn._queue) == 3, "every write waits")
    for t in threads:
        t.join(timeout=10)
    assert not [t for t in threads if t.is_alive()], f"instant {n}: {outcomes}"
    assert conn._lock.acquire(timeout=5), f"instant {n}: the lock is held"
    conn._lock.release()
    if not fired:
        return False
    interrupted = [
        t.ident for t, o in zip(threads, outcomes, strict=True) if type(o) is KeyboardInterrupt
    ]
    assert interrupted == fired, f"instant {n}: {outcomes}"
    for exe, outcome in zip(exes, outcomes, strict=True):
        stored = store.load(exe.id)
        if isinstance(outcome, list):
            assert stored is not None and stored.version == exe.version == 1, (n, outcomes)
        elif not isinstance(outcome, KeyboardInterrupt):
            assert isinstance(outcome, OutcomeUnknown), (n, outcomes)
    assert all(m.outcome is not None or m.withdrawn for m in conn._queue), n
    return True


@pytest.mark.parametrize("driver", ["libsql", "sqlite"])
def test_an_interrupt_at_any_instant_of_the_connections_holder_is_its_own(
    driver: str, tmp_path: Path
) -> None:
    """`interrupted_at` every instant, until the writes end before it: each time the lock
    ends free, no writer hangs, only the interrupted thread sees the interrupt, and each
    other one is told its result (its write landed, once) or OutcomeUnknown."""
    store = DRIVERS[driver](tmp_path / "group.db", synchronous="OFF")  # type: ignore[call-arg]
    n = 1
    while interrupted_at(store, n):
        n += 1
    assert n > 50  # the writes ran that many
    store.close()
