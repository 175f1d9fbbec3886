"""Group commit on a remote primary: the writes that arrive while a store's write requests
are in flight wait, and the next request carries them, each its own transaction with its
own outcome; a loop's tasks have up to `FLIGHTS` requests in flight, pipelined on one
connection (one write at the server at a time), threads one. Against the session's real
sqld, through a loopback proxy (`tests.proxy`) that holds each request long enough for the
others to queue."""

from __future__ import annotations

import asyncio
import json
import threading
from collections import Counter
from typing import Any

import pytest

from harel_store import (
    AsyncLibsqlStore,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    StoreConflict,
    StoreError,
)
from harel_store.batch import Batch
from harel_store.connection.hrana import FLIGHTS, GROUP_MAX, SPLIT_LEAST, _body, _Pending, _Wire
from tests.helpers import refused_batch, wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld

HOLD = 0.3  # seconds the proxy holds each request: the others arrive meanwhile


def emit(exe: Execution, n: int = 0) -> Any:
    return [(None, Event(name="go", id=f"{exe.id}-{n}"))]


async def open_async(proxy: Proxy, server: SqldServer, **kwargs: Any) -> AsyncLibsqlStore:
    return await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token, **kwargs)


async def behind_a_write_in_flight(store: AsyncLibsqlStore, proxy: Proxy) -> asyncio.Task[Any]:
    """A commit the proxy holds, so that what follows queues behind it."""
    proxy.delay = HOLD
    first = asyncio.create_task(store.commit(Execution(id="first", definition_id="d"), []))
    await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "the first write sent")
    return first


def test_concurrent_async_commits_go_pipelined_on_one_connection_each_with_its_outcome(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        first = await behind_a_write_in_flight(store, proxy)
        exes = [Execution(id=f"g-{i}", definition_id="d") for i in range(16)]
        sent = proxy.requests
        results = await asyncio.gather(*(store.commit(e, emit(e), f"in-{e.id}") for e in exes))
        await first
        # The 16 went while the first was in flight, shared by the free flights (SPLIT_LEAST
        # each): two requests more, on the first's connection, the server running one after
        # the other: never two writes at the server.
        assert proxy.requests - sent == 2 and FLIGHTS >= 3 and SPLIT_LEAST == 8
        assert 1 < proxy.max_in_flight <= 3 and proxy.max_busy == 1  # (counted as it reads)
        assert [e.version for e in exes] == [1] * 16
        assert all(len(seqs) == 1 for seqs in results)
        assert len({seqs[0] for seqs in results}) == 16  # each its own outbox entry
        proxy.delay = 0
        for e in exes:
            stored = await store.load_for_event(e.id, f"in-{e.id}")
            assert stored[0] is not None and stored[0].version == 1 and stored[1]
        assert len(await store.pending_outbox()) == 16
        await store.close()

    asyncio.run(main())


def test_writers_that_commit_again_at_once_stay_in_one_group(
    proxy: Proxy, server: SqldServer
) -> None:
    """Each answered writer writes again at once: the next group waits for them (a few
    turns of the loop) rather than leaving with the first back, so 8 tasks committing 10
    times each take 10 requests, not 20 of two alternating halves."""

    async def main() -> None:
        store = await open_async(proxy, server)
        exes = [Execution(id=f"s-{i}", definition_id="d") for i in range(8)]
        await asyncio.gather(*(store.save(e) for e in exes))

        async def writer(exe: Execution) -> None:
            for n in range(10):
                await store.commit(exe, emit(exe, n))

        sent = proxy.requests
        await asyncio.gather(*(writer(e) for e in exes))
        assert proxy.requests - sent == 10
        assert [e.version for e in exes] == [11] * 8
        assert len(await store.pending_outbox()) == 80
        await store.close()

    asyncio.run(main())


def test_a_group_is_bounded_and_the_rest_go_in_the_next_request(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        first = await behind_a_write_in_flight(store, proxy)
        count = FLIGHTS * GROUP_MAX + 20  # more than the free flights carry
        exes = [Execution(id=f"b-{i}", definition_id="d") for i in range(count)]
        sent = proxy.requests
        await asyncio.gather(*(store.commit(e, []) for e in exes))
        await first
        # GROUP_MAX in each free flight, the rest as a flight lands: GROUP_MAX, then 20 + 128
        # (the first's share) in two more; never more than FLIGHTS at once, on one connection
        assert proxy.requests - sent == FLIGHTS + 1
        assert 1 < proxy.max_in_flight <= FLIGHTS and proxy.max_busy == 1
        proxy.delay = 0
        assert all(e.version == 1 for e in exes)
        page = await store.list_executions(limit=count + 1)
        assert len(page.items) == count + 1
        await store.close()

    asyncio.run(main())


def test_reads_are_never_queued_behind_writes(proxy: Proxy, server: SqldServer) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        await store.save(Execution(id="r", definition_id="d"))
        proxy.delay = HOLD
        exes = [Execution(id=f"w-{i}", definition_id="d") for i in range(4)]
        writes = [store.commit(e, []) for e in exes]
        reads = [store.load("r") for _ in range(8)]
        done = await asyncio.gather(*writes, *reads)
        assert proxy.max_in_flight == 1 + 8  # one write request, and every read at once
        assert all(r is not None and r.version == 1 for r in done[4:])
        await store.close()

    asyncio.run(main())


def test_a_stale_commit_in_a_group_fails_alone(proxy: Proxy, server: SqldServer) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        exes = [Execution(id=f"c-{i}", definition_id="d") for i in range(8)]
        for e in exes:
            await store.save(e)
        stale = {1, 4, 6}
        for i in stale:  # another writer moves these on: our copies are one behind
            moved = await store.load(f"c-{i}")
            assert moved is not None
            await store.commit(moved, [])
        first = await behind_a_write_in_flight(store, proxy)
        sent = proxy.requests
        results = await asyncio.gather(
            *(store.commit(e, emit(e)) for e in exes), return_exceptions=True
        )
        await first
        # Written optimistically, one member's guard failed: all of it again, each in a
        # savepoint, where the stale ones fail alone.
        assert proxy.requests - sent == 2
        for i, (e, result) in enumerate(zip(exes, results, strict=True)):
            if i in stale:
                assert isinstance(result, StoreConflict)
                assert (result.execution_id, result.expected, result.found) == (e.id, 1, 2)
                assert e.version == 1
            else:
                assert isinstance(result, list) and len(result) == 1
                assert e.version == 2
        proxy.delay = 0
        assert len(await store.pending_outbox()) == 8 - len(stale)
        for e in exes:
            stored = await store.load(e.id)
            assert stored is not None and stored.version == 2
        await store.close()

    asyncio.run(main())


@pytest.mark.parametrize("mode", ["drop", "cut"])
def test_a_lost_answer_makes_every_member_unknown_and_a_reload_tells(
    proxy: Proxy, server: SqldServer, mode: str, one_flight: None
) -> None:
    """``drop``: the server committed the group, its answer is lost; ``cut``: the request
    never reached the server. Either way every member is OutcomeUnknown, exe as it was."""

    async def main() -> None:
        store = await open_async(proxy, server, timeout=5.0)
        first = await behind_a_write_in_flight(store, proxy)
        exes = [Execution(id=f"l-{i}", definition_id="d") for i in range(6)]
        commits = [asyncio.create_task(store.commit(e, emit(e))) for e in exes]
        await asyncio.sleep(0.05)  # the six wait for the write in flight
        proxy.mode = mode  # type: ignore[assignment]  # from the next request (or answer) on
        results = await asyncio.gather(*commits, return_exceptions=True)
        await asyncio.gather(first, return_exceptions=True)  # "drop" loses its answer too
        assert all(isinstance(r, OutcomeUnknown) for r in results), results
        assert [e.version for e in exes] == [0] * 6
        proxy.mode, proxy.delay = "forward", 0
        landed = [await store.load(e.id) for e in exes]
        if mode == "drop":
            assert all(s is not None and s.version == 1 for s in landed)
            assert len(await store.pending_outbox()) == 6
        else:
            assert landed == [None] * 6
            assert await store.pending_outbox() == []
        await store.close()

    asyncio.run(main())


def test_a_cancelled_member_settles_and_the_others_are_undisturbed(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        first = await behind_a_write_in_flight(store, proxy)
        exes = [Execution(id=f"x-{i}", definition_id="d") for i in range(5)]
        commits = [asyncio.create_task(store.commit(e, emit(e))) for e in exes]
        await asyncio.sleep(0.05)  # all five wait for the write in flight
        commits[2].cancel()
        with pytest.raises(asyncio.CancelledError):
            await commits[2]
        # The cancellation arrived once its group's answer did: exe says what is stored.
        assert exes[2].version == 1
        await first
        for task in (*commits[:2], *commits[3:]):
            assert len(await task) == 1
        assert [e.version for e in exes] == [1] * 5
        proxy.delay = 0
        assert len(await store.pending_outbox()) == 5
        await store.close()

    asyncio.run(main())


def test_threads_sharing_a_sync_store_group_their_commits(proxy: Proxy, server: SqldServer) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token) as store:
        proxy.delay = HOLD
        first = Execution(id="first", definition_id="d")
        holder = threading.Thread(target=store.commit, args=(first, []))
        holder.start()
        wait_until(lambda: proxy.in_flight == 1, "the first write sent")
        exes = [Execution(id=f"t-{i}", definition_id="d") for i in range(8)]
        errors: list[BaseException] = []

        def commit(exe: Execution) -> None:
            try:
                store.commit(exe, emit(exe), f"in-{exe.id}")
            except BaseException as exc:  # pragma: no cover - reported below
                errors.append(exc)

        sent = proxy.requests
        threads = [threading.Thread(target=commit, args=(e,)) for e in exes]
        for thread in threads:
            thread.start()
        for thread in (holder, *threads):
            thread.join()
        assert errors == []
        assert proxy.requests - sent == 1 and proxy.max_in_flight == 1
        assert first.version == 1 and [e.version for e in exes] == [1] * 8
        proxy.delay = 0
        assert len(store.pending_outbox()) == 8
        assert all(store.load_for_event(e.id, f"in-{e.id}")[1] for e in exes)


def test_a_group_is_one_transaction_written_optimistically_then_with_a_savepoint_a_member() -> None:
    """Measured (benchmarks/remote.py): sqld commits a group of 32 as one transaction in
    about a third of the time it takes for 32 transactions. Its members go one after the
    other with no savepoint; only when one fails is the group sent again, each member in a
    savepoint of its own."""
    batches = []
    for i in range(3):
        batch = Batch()
        batch.guard("cancel_timer", f"exe-{i}", "t")
        batch.on_conflict("execution_version", f"exe-{i}")
        batches.append(batch)

    def words(group: list[_Pending]) -> tuple[int, ...]:
        body = json.loads(_body(group))
        assert [r["type"] for r in body["requests"]] == ["batch", "close"]
        sqls = [step["stmt"]["sql"] for step in body["requests"][0]["batch"]["steps"]]
        count = Counter(sql.split()[0].rstrip(";") for sql in sqls)
        return tuple(count[w] for w in ("BEGIN", "COMMIT", "SAVEPOINT", "RELEASE", "SELECT"))

    group = [_Pending(_Wire(b)) for b in batches]
    # BEGIN, COMMIT, no savepoint, the guards' SELECTs, no conflict read (the replay has it)
    assert words(group) == (1, 1, 0, 0, 3)
    for pending in group:
        pending.wire.saved = True
    assert words(group) == (1, 1, 3, 3, 6)  # the guards and the conflict reads
    # A lone write is a transaction of its own, as it always was.
    alone = json.loads(_body([_Pending(_Wire(batches[0]))]))
    assert not any("SAVEPOINT" in s["stmt"]["sql"] for s in alone["requests"][0]["batch"]["steps"])


def test_a_member_the_server_refuses_fails_alone(proxy: Proxy, server: SqldServer) -> None:
    async def main() -> None:
        store = await open_async(proxy, server)
        assert store._remote is not None
        exes = [Execution(id=f"r-{i}", definition_id="d") for i in range(4)]
        first = await behind_a_write_in_flight(store, proxy)
        sent = proxy.requests
        refused, *results = await asyncio.gather(
            store._remote.aexecute(refused_batch()),
            *(store.commit(e, emit(e)) for e in exes),
            return_exceptions=True,
        )
        await first
        assert proxy.requests - sent == 2  # written optimistically, then each in a savepoint
        assert type(refused) is StoreError and "malformed JSON" in str(refused), refused
        assert all(isinstance(seqs, list) and len(seqs) == 1 for seqs in results), results
        proxy.delay = 0
        assert len(await store.pending_outbox()) == 4
        assert [(await store.load(e.id)).version for e in exes] == [1] * 4  # type: ignore[union-attr]
        await store.close()

    asyncio.run(main())
