"""A loop's write requests in flight at once (issue 51): HTTP/1.1 pipelining on one
connection (`http.Pipeline`), against loopback test servers, and the store's writes
pipelined to the session's real sqld through a proxy that holds each request (`hrana.FLIGHTS`)."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Event, Execution, OutcomeUnknown, StoreError
from harel_store.connection import hrana
from harel_store.connection.http import AsyncClient, Broken, Pipeline, TimedOut
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer
from tests.test_http_client import Server, echo, read_request


def batched(count: int, *, then: str = "answer") -> Callable[[socket.socket, Server], None]:
    """A handler that reads ``count`` requests before it answers any (so they can only have
    come pipelined), then answers them in order in one write, each its body echoed; with
    ``then="close"`` it answers the first only and closes the connection."""

    def handler(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        mode = then if server.accepted == 1 else "answer"  # a later connection answers all
        while True:
            bodies = []
            for _ in range(count):
                body = read_request(conn, buf, server)
                if body is None:
                    return
                bodies.append(body)
            if mode == "close":
                conn.sendall(echo(bodies[0]))
                return
            if mode == "connection-close":
                first = echo(bodies[0]).replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n", 1)
                conn.sendall(first + b"".join(echo(b) for b in bodies[1:]))
                return
            conn.sendall(b"".join(echo(body) for body in bodies))

    return handler


def client(server: Server, timeout: float = 5.0) -> AsyncClient:
    return AsyncClient(server.origin, headers={}, timeout=timeout, ssl_context=None)


def test_requests_go_out_before_the_answers_and_each_gets_its_own(
    serve: Callable[..., Server],
) -> None:
    server = serve(batched(3))

    async def main() -> None:
        pipe = Pipeline(client(server))
        for _ in range(2):  # and again on the same connection
            answers = await asyncio.gather(*(pipe.post("/p", b"r%d" % i) for i in range(3)))
            assert [a.body for a in answers] == [b"r0", b"r1", b"r2"]
        assert server.accepted == 1
        pipe.close()

    asyncio.run(main())


@pytest.mark.parametrize("then", ["close", "connection-close"])
def test_a_connection_that_ends_fails_the_requests_after_the_answered_one_as_sent(
    serve: Callable[..., Server], then: str
) -> None:
    """The server answers the first and closes (or says ``Connection: close`` and sends the
    others' answers anyway, which are not read): those after it are Broken, sent (their
    writes may have landed), and the next request goes on a new connection."""
    server = serve(batched(3, then=then))

    async def main() -> None:
        pipe = Pipeline(client(server))
        results = await asyncio.gather(
            *(pipe.post("/p", b"r%d" % i) for i in range(3)), return_exceptions=True
        )
        assert getattr(results[0], "body", None) == b"r0"
        for failed in results[1:]:
            assert isinstance(failed, Broken) and failed.sent, failed
        answers = await asyncio.gather(*(pipe.post("/p", b"s%d" % i) for i in range(3)))
        assert [a.body for a in answers] == [b"s0", b"s1", b"s2"] and server.accepted == 2
        pipe.close()

    asyncio.run(main())


def test_a_request_behind_one_that_hangs_times_out_as_sent_and_nothing_waits_longer(
    serve: Callable[..., Server],
) -> None:
    def never(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        while read_request(conn, buf, server) is not None:
            pass

    server = serve(never)

    async def main() -> None:
        pipe = Pipeline(client(server, timeout=0.5))
        started = asyncio.get_running_loop().time()
        results = await asyncio.gather(
            *(pipe.post("/p", b"r%d" % i) for i in range(3)), return_exceptions=True
        )
        took = asyncio.get_running_loop().time() - started
        # The first times out; those behind it too, or fail as its connection ends: as sent.
        assert isinstance(results[0], TimedOut) and results[0].sent, results
        assert all(isinstance(r, (TimedOut, Broken)) and r.sent for r in results), results
        assert took < 2.0  # each within its own timeout: none left waiting on a dead socket
        pipe.close()

    asyncio.run(main())


def test_close_lets_the_requests_sent_have_their_answers_then_refuses(
    serve: Callable[..., Server],
) -> None:
    server = serve(batched(2))

    async def main() -> None:
        pipe = Pipeline(client(server))
        calls = [asyncio.ensure_future(pipe.post("/p", b"r%d" % i)) for i in range(2)]
        await asyncio.to_thread(wait_until, lambda: len(server.heads) == 2, "both sent")
        pipe.close()
        assert [a.body for a in await asyncio.gather(*calls)] == [b"r0", b"r1"]
        with pytest.raises(RuntimeError):
            await pipe.post("/p", b"late")

    asyncio.run(main())


# --- the store's writes, pipelined to sqld ---


def emit(exe: Execution, tag: str) -> Any:
    return [(None, Event(name="go", id=f"{exe.id}-{tag}"))]


@pytest.mark.sqld
def test_a_loops_writes_overlap_on_one_connection_and_each_lands_as_its_own(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        proxy.delay = 0.05
        exes = [Execution(id=f"f-{i}", definition_id="d") for i in range(32)]

        async def three(exe: Execution) -> None:
            for n in range(3):
                await store.commit(exe, emit(exe, str(n)), f"in-{exe.id}-{n}")

        await asyncio.gather(*(three(e) for e in exes))
        assert proxy.max_in_flight > 1 and proxy.max_busy == 1  # one write at the server
        proxy.delay = 0
        assert [e.version for e in exes] == [3] * 32
        for e in exes:
            loaded, seen = await store.load_for_event(e.id, f"in-{e.id}-2")
            assert loaded is not None and loaded.version == 3 and seen
        assert len(await store.pending_outbox(limit=200)) == 96
        await store.close()

    asyncio.run(main())


@pytest.mark.sqld
def test_pipelined_writes_run_at_the_server_in_the_order_sent(
    proxy: Proxy, server: SqldServer
) -> None:
    """Four commits of one execution, each expecting the version the one before it makes,
    sent one after the other without waiting (each its own request, the proxy holding
    them): all four land, so the server ran them in the order sent."""

    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        proxy.delay = 0.2
        copies = [Execution(id="o", definition_id="d", version=v) for v in range(hrana.FLIGHTS)]
        sent = proxy.requests
        calls = []
        for n, exe in enumerate(copies):
            calls.append(asyncio.ensure_future(store.commit(exe, emit(exe, str(n)))))
            await asyncio.to_thread(wait_until, lambda n=n: proxy.requests > sent + n, "sent")
        await asyncio.gather(*calls)
        assert proxy.requests - sent == hrana.FLIGHTS
        assert [e.version for e in copies] == list(range(1, hrana.FLIGHTS + 1))
        loaded = await store.load("o")
        assert loaded is not None and loaded.version == hrana.FLIGHTS
        await store.close()

    asyncio.run(main())


async def all_flights_held(
    store: AsyncLibsqlStore, proxy: Proxy, exes: list[Execution]
) -> list[asyncio.Future[Any]]:
    """A commit of each of ``exes``, the proxy holding the first (``hang``) so that the
    others go out pipelined behind it (and the ones past `FLIGHTS` wait)."""
    proxy.mode = "hang"
    sent = proxy.requests
    calls = [asyncio.ensure_future(store.commit(exes[0], emit(exes[0], "x")))]
    await asyncio.to_thread(wait_until, lambda: proxy.requests > sent, "the first sent")
    for exe in exes[1:]:  # each alone: its own request, while a flight is free
        calls.append(asyncio.ensure_future(store.commit(exe, emit(exe, "x"))))
        await asyncio.sleep(0.02)  # sent by the client, unread by the held proxy
    await asyncio.sleep(0.05)
    return calls


@pytest.mark.sqld
def test_a_lost_connection_makes_every_write_on_it_unknown_and_a_reload_tells(
    proxy: Proxy, server: SqldServer
) -> None:
    """The server ran the first write, and the connection drops instead of its answer:
    that write and every one pipelined behind it are OutcomeUnknown; a reload tells what
    landed (the first did; the others may or may not have, each whole)."""

    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token, timeout=5.0)
        exes = [Execution(id=f"u-{i}", definition_id="d") for i in range(hrana.FLIGHTS)]
        calls = await all_flights_held(store, proxy, exes)
        proxy.mode = "drop"  # the first goes on; its answer (and the connection) is lost
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(r, OutcomeUnknown) for r in results), results
        assert [e.version for e in exes] == [0] * len(exes)
        proxy.mode = "forward"
        first = await store.load(exes[0].id)
        assert first is not None and first.version == 1
        # Each is whole or absent (one the server still runs may land yet): an outbox
        # entry read is never without its execution read after it.
        pending = {e.event.id for e in await store.pending_outbox()}
        for exe in exes:
            if f"{exe.id}-x" in pending:
                assert await store.load(exe.id) is not None
        again = Execution(id="after", definition_id="d")
        await store.commit(again, [])  # on a new connection
        assert again.version == 1
        await store.close()

    asyncio.run(main())


@pytest.mark.sqld
def test_close_from_another_loop_lets_the_flights_land_and_refuses_what_waits(
    proxy: Proxy, server: SqldServer
) -> None:
    """Every flight busy (the proxy holding them), one write more waits: loop B closes the
    store; the writes sent land and say so, the one that waited was never sent."""
    exes = [Execution(id=f"c-{i}", definition_id="d") for i in range(hrana.FLIGHTS + 1)]
    outcomes: list[Any] = []

    async def on_a() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        calls = await all_flights_held(store, proxy, exes)
        await asyncio.to_thread(lambda: asyncio.run(store.close()))  # loop B
        proxy.mode = "forward"
        outcomes.extend(await asyncio.gather(*calls, return_exceptions=True))

    asyncio.run(on_a())
    assert all(isinstance(r, list) and len(r) == 1 for r in outcomes[:-1]), outcomes
    assert isinstance(outcomes[-1], StoreError) and "closed" in str(outcomes[-1])
    assert [e.version for e in exes] == [1] * hrana.FLIGHTS + [0]

    async def stored() -> None:
        store = await AsyncLibsqlStore.create(server.url, auth_token=server.token)
        landed = [await store.load(e.id) is not None for e in exes]
        assert landed == [True] * hrana.FLIGHTS + [False]
        await store.close()

    asyncio.run(stored())
