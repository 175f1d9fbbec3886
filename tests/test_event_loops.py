"""An `AsyncLibsqlStore` is tied to no event loop: made under one loop and used under the
next (``asyncio.run`` twice, the first loop closed), or under two live loops in two threads,
it works on every kind it can be (a remote sqld, a local file, an embedded replica), and a
closed loop leaves nothing behind: no socket, no transport, no ResourceWarning.

Each test ends with `no_leaks`, which collects garbage and fails on any ResourceWarning that
flushes (an unclosed socket or transport of a closed loop); the module's filter also makes
any ResourceWarning an error."""

from __future__ import annotations

import asyncio
import gc
import ssl
import threading
import warnings
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest
import trustme

from harel_store import AsyncLibsqlStore, Event, Execution, StoreError
from harel_store.relay import AsyncRelay
from harel_store.wakeup import Waiter, notify
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer

pytestmark = pytest.mark.filterwarnings("error::ResourceWarning")

T = TypeVar("T")
Create = Callable[[], Awaitable[AsyncLibsqlStore]]
KINDS = [
    pytest.param("remote", marks=pytest.mark.sqld),
    "file",
    pytest.param("replica", marks=pytest.mark.sqld),
]


@pytest.fixture(params=KINDS)
def create(request: pytest.FixtureRequest, tmp_path: Path) -> Create:
    """A coroutine function opening a store of this kind (the same database every time)."""
    kind = str(request.param)
    options: dict[str, Any] = {}
    database: str | Path = tmp_path / "state.db"
    if kind != "file":
        server: SqldServer = request.getfixturevalue("server")
        options["auth_token"] = server.token
        if kind == "remote":
            database = server.url
        else:
            options.update(sync_url=server.url, sync_interval=60.0)

    async def open_store() -> AsyncLibsqlStore:
        return await AsyncLibsqlStore.create(database, **options)

    return open_store


def no_leaks() -> None:
    """Collect garbage; fail on any ResourceWarning it flushes (a closed loop's socket)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        gc.collect()
    leaks = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    assert not leaks, leaks


def run(coroutine: Awaitable[T]) -> T:
    """``asyncio.run``, each call a new loop closed at the end; bounded, so a hang fails."""

    async def bounded() -> T:
        return await asyncio.wait_for(coroutine, 20)

    return asyncio.run(bounded())


def emit(exe: Execution, tag: str) -> list[tuple[str | None, Event]]:
    return [(None, Event(name="go", id=f"{exe.id}-{tag}"))]


async def commit_all(store: AsyncLibsqlStore, exes: list[Execution], tag: str) -> None:
    """Commit each of ``exes`` at once: concurrent calls, so that what a loop binds (a lock
    waited for, the group commit's sender) is bound to this loop."""
    await asyncio.gather(*(store.commit(exe, emit(exe, tag)) for exe in exes))


def test_a_store_made_under_one_loop_works_under_the_next(create: Create) -> None:
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(4)]

    async def first() -> AsyncLibsqlStore:
        store = await create()
        await commit_all(store, exes, "a")
        assert len(await store.claim_outbox("w1", lease=60.0)) == 4
        return store

    store = run(first())  # the loop is closed now, its idle connections with it

    async def second() -> None:
        await commit_all(store, exes, "b")
        assert [exe.version for exe in exes] == [2, 2, 2, 2]
        loaded = await asyncio.gather(*(store.load(exe.id) for exe in exes))
        assert [exe.version for exe in loaded if exe is not None] == [2, 2, 2, 2]
        page = await store.list_executions(limit=10)
        assert sorted(s.id for s in page.items) == [exe.id for exe in exes]
        claimed = await store.claim_outbox("w2", lease=60.0)  # the first four are w1's
        assert sorted(e.event.id for e in claimed) == [f"{exe.id}-b" for exe in exes]
        assert await store.ack(claimed) == 4
        assert await store.pending_outbox() != []  # w1's, leased still
        await store.close()

    run(second())
    no_leaks()


def test_a_store_is_closed_from_a_loop_it_was_never_used_on(create: Create) -> None:
    """Closed from the next loop while a call of that loop runs: the call ends first (a
    file, a replica), or meets the closed store as a StoreError (remote: close does not
    wait for the calls in flight), never a raw error."""
    exes = [Execution(id=f"exe-{i}", definition_id="d") for i in range(3)]
    exe = exes[0]

    async def first() -> AsyncLibsqlStore:
        store = await create()
        await commit_all(store, exes, "a")
        return store

    store = run(first())

    async def close() -> None:
        loaded, closed = await asyncio.gather(
            store.load(exe.id), store.close(), return_exceptions=True
        )
        assert closed is None
        assert isinstance(loaded, StoreError) or (
            isinstance(loaded, Execution) and loaded.version == 1
        ), repr(loaded)

    run(close())
    no_leaks()

    async def after() -> None:
        with pytest.raises(StoreError):
            await store.load(exe.id)

    run(after())


def test_two_live_loops_in_two_threads_share_one_store(create: Create) -> None:
    store = run(create())
    both = threading.Barrier(2, timeout=20)
    errors: list[BaseException] = []
    exes = {t: [Execution(id=f"{t}-{i}", definition_id="d") for i in range(6)] for t in "ab"}

    def worker(tag: str) -> None:
        async def main() -> None:
            await asyncio.to_thread(both.wait)  # both loops live from here on
            for round_ in range(3):
                await commit_all(store, exes[tag], f"{round_}")
                page = await store.list_executions(id_prefix=f"{tag}-", limit=50)
                assert len(page.items) == 6
                claimed = await store.claim_outbox(f"w-{tag}", limit=6)
                await store.ack(claimed)

        try:
            run(main())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(tag,)) for tag in "ab"]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert not errors, errors

    async def check() -> None:
        for exe in exes["a"] + exes["b"]:
            loaded = await store.load(exe.id)
            assert exe.version == 3 and loaded is not None and loaded.version == 3
        assert await store.pending_outbox() == []
        await store.close()

    run(check())
    no_leaks()


@pytest.mark.sqld
def test_close_from_another_loop_while_a_write_is_in_flight(
    proxy: Proxy, server: SqldServer, one_flight: None
) -> None:
    """A write in flight on loop A when loop B closes the store lands and says so; one that
    waited behind it was never sent and is a StoreError, its execution where it was."""
    store = run(AsyncLibsqlStore.create(proxy.url(), auth_token=server.token))
    first, second = (Execution(id=f"exe-{i}", definition_id="d") for i in range(2))
    outcomes: dict[str, Any] = {}

    async def on_a() -> None:
        proxy.delay = 0.3
        sent = asyncio.ensure_future(store.commit(first, emit(first, "a")))
        await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "the write sent")
        waiting = asyncio.ensure_future(store.commit(second, emit(second, "a")))
        await asyncio.sleep(0)
        await asyncio.to_thread(lambda: run(store.close()))  # loop B, in another thread
        for name, call in (("sent", sent), ("waiting", waiting)):
            try:
                outcomes[name] = await call
            except StoreError as exc:
                outcomes[name] = exc

    run(on_a())
    proxy.delay = 0
    assert outcomes["sent"] == [1] and first.version == 1
    assert isinstance(outcomes["waiting"], StoreError) and second.version == 0
    assert "closed" in str(outcomes["waiting"])

    async def stored() -> None:
        store = await AsyncLibsqlStore.create(server.url, auth_token=server.token)
        assert (await store.load(first.id)) is not None
        assert (await store.load(second.id)) is None
        await store.close()

    run(stored())
    no_leaks()


@pytest.mark.sqld
def test_a_tls_store_made_under_one_loop_works_under_the_next(
    server: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Over TLS (a proxy terminating it in front of sqld): a TLS connection left idle by a
    closed loop is not leaked, and the next loop's requests go out (on it or a new one)."""
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
    exes = [Execution(id=f"tls-{i}", definition_id="d") for i in range(3)]
    with Proxy(server.port or 0, tls=context) as proxy:
        url = proxy.url("https", "localhost")

        async def first() -> AsyncLibsqlStore:
            store = await AsyncLibsqlStore.create(url, auth_token=server.token)
            await commit_all(store, exes, "a")
            return store

        store = run(first())

        async def second() -> None:
            await commit_all(store, exes, "b")
            loaded = await asyncio.gather(*(store.load(exe.id) for exe in exes))
            assert [exe.version for exe in loaded if exe is not None] == [2, 2, 2]
            await store.close()

        run(second())
    no_leaks()


def test_an_async_relay_runs_under_one_loop_then_the_next(create: Create) -> None:
    seen: list[str] = []

    async def deliver(entry: Any) -> None:
        seen.append(entry.event.id)

    async def first() -> tuple[AsyncLibsqlStore, AsyncRelay]:
        store = await create()
        relay = AsyncRelay(store, "w1", on_outbox=deliver)
        await commit_all(store, [Execution(id=f"a-{i}", definition_id="d") for i in range(3)], "a")
        assert await relay.run_once() == 3
        return store, relay

    store, relay = run(first())

    async def second() -> None:
        await commit_all(store, [Execution(id=f"b-{i}", definition_id="d") for i in range(3)], "b")
        assert await relay.run_once() == 3
        assert await store.pending_outbox() == []
        await store.close()

    run(second())
    assert sorted(seen) == [f"{t}-{i}-{t}" for t in "ab" for i in range(3)]
    no_leaks()


def test_a_waiter_is_awaited_under_one_loop_then_the_next() -> None:
    waiter = Waiter("test-event-loops")
    try:
        assert run(waiter.await_signal(0.01)) is False  # its event bound to that loop

        async def woken() -> bool:
            loop = asyncio.get_running_loop()
            wake = threading.Thread(target=notify, args=(waiter.key, ["outbox"]))
            loop.call_later(0.01, wake.start)
            return await waiter.await_signal(5)

        assert run(woken()) is True
    finally:
        waiter.close()
    no_leaks()
