"""Hostile review of the pipelined async writes (issue 51: `http.Pipeline`, `hrana._asender`).

Each test states the contract it checks; those that fail demonstrate a defect."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Event, Execution, OutcomeUnknown, StoreError
from harel_store.connection import hrana
from harel_store.connection.http import Broken, Pipeline
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer
from tests.test_flights import client
from tests.test_http_client import Server, echo, read_request


def emit(exe: Execution, tag: str) -> Any:
    return [(None, Event(name="go", id=f"{exe.id}-{tag}"))]


# --- defects ---------------------------------------------------------------------------


def test_an_idle_connection_the_server_closed_does_not_close_the_pipeline(
    serve: Callable[..., Server],
) -> None:
    """The server ends an idle keep-alive connection (as any server does after its idle
    timeout). The next request goes on a new connection, and so do the ones after it:
    the pipeline itself was not closed. (`Pipeline._exchange` calls ``self.close()`` on the
    stale connection, which sets ``_closing`` for good.)"""

    def once_then_close(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        while (body := read_request(conn, buf, server)) is not None:
            conn.sendall(echo(body))
            if server.accepted == 1:
                return  # the first connection: idle after its answer, and closed

    server = serve(once_then_close)

    async def main() -> None:
        pipe = Pipeline(client(server))
        assert (await pipe.post("/p", b"a")).body == b"a"
        await asyncio.to_thread(
            wait_until, lambda: pipe._conn is not None and pipe._conn.sock.stale(), "closed"
        )
        assert (await pipe.post("/p", b"b")).body == b"b"  # a new connection
        try:
            assert (await pipe.post("/p", b"c")).body == b"c"
        finally:
            pipe.close()

    asyncio.run(main())


@pytest.mark.sqld
def test_after_the_server_drops_an_idle_connection_the_loops_writes_still_land(
    proxy: Proxy, server: SqldServer
) -> None:
    """The same at the store: its pipeline's idle connection dropped (a server's or a load
    balancer's idle timeout), the loop's later writes must land, not fail with
    OutcomeUnknown without ever being sent."""

    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token, timeout=5.0)
        try:
            first = Execution(id="idle-0", definition_id="d")
            await store.commit(first, emit(first, "x"))
            with proxy._lock:  # drop every connection, idle now, as an idle timeout would
                sockets = list(proxy._sockets)
            for sock in sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
            await asyncio.sleep(0.1)
            outcomes = []
            for n in (1, 2, 3):
                exe = Execution(id=f"idle-{n}", definition_id="d")
                sent = proxy.requests
                try:
                    await store.commit(exe, emit(exe, "x"))
                    outcomes.append(("ok", exe.version))
                except StoreError as exc:
                    outcomes.append(
                        (type(exc).__name__, f"requests sent: {proxy.requests - sent}", str(exc))
                    )
            assert outcomes == [("ok", 1)] * 3, outcomes
        finally:
            await store.close()

    asyncio.run(main())


def test_bytes_past_the_last_answer_are_never_taken_for_the_next_answer(
    serve: Callable[..., Server],
) -> None:
    """The server sends bytes nobody asked for after an answer (here a whole second answer:
    a buggy proxy, a duplicated response). With no request behind it they belong to no
    request: the next request must not be handed them as its answer (the old client
    dropped such a connection; `Pipeline` keeps them in ``_buf`` for the next request)."""

    def doubled(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        first = True
        while (body := read_request(conn, buf, server)) is not None:
            conn.sendall(echo(body) + (echo(b"stray") if first else b""))
            first = False

    server = serve(doubled)

    async def main() -> None:
        pipe = Pipeline(client(server))
        try:
            assert (await pipe.post("/p", b"one")).body == b"one"
            await asyncio.sleep(0.1)
            answers = []
            for body in (b"two", b"three"):
                try:
                    answers.append((await pipe.post("/p", body)).body)
                except Broken:
                    answers.append(body)  # failing is fine; another's answer is not
            assert answers == [b"two", b"three"], answers
        finally:
            pipe.close()

    asyncio.run(main())


def _answering(conn: socket.socket, server: Server) -> None:
    buf = bytearray()
    while (body := read_request(conn, buf, server)) is not None:
        conn.sendall(echo(body))


def test_a_request_cancelled_just_as_the_one_before_it_is_answered_leaks_no_socket(
    serve: Callable[..., Server],
) -> None:
    """B waits behind A; A's answer comes and B is cancelled before its turn runs (its
    caller's timeout, a cancelled sender). Nobody reads the connection any more, so it must
    be closed, not only shut down (`_exchange` passes ``reading=False`` after the shield
    raised, though ``before`` is done)."""

    def two_then_answer(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        while True:
            bodies = [read_request(conn, buf, server) for _ in range(2)]
            if None in bodies:
                return
            conn.sendall(b"".join(echo(b) for b in bodies if b is not None))

    server = serve(two_then_answer)

    async def main() -> None:
        pipe = Pipeline(client(server))
        b = asyncio.ensure_future(pipe.post("/p", b"b"))
        assert (await pipe.post("/p", b"a")).body == b"a"
        conn = pipe._conn
        assert conn is not None and not b.done()
        b.cancel()
        await asyncio.gather(b, return_exceptions=True)
        assert b.cancelled()
        pipe.close()
        try:
            assert conn.sock.sock.fileno() == -1, "the pipeline's socket was left open"
        finally:
            conn.sock.close()

    asyncio.run(main())


def test_a_request_answered_after_a_later_one_failed_to_send_leaks_no_socket(
    serve: Callable[..., Server],
) -> None:
    """A is being read; C, behind it, is cancelled half sent (so the connection is only shut
    down, for A to close); A's answer was already in: A succeeds, and then nobody closes the
    connection."""
    go = threading.Event()

    def one_then_stall(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        body = read_request(conn, buf, server)
        go.wait(10)
        if body is not None:
            conn.sendall(echo(body))
        server.stop.wait(10)

    server = serve(one_then_stall)

    async def main() -> None:
        pipe = Pipeline(client(server))
        a = asyncio.ensure_future(pipe.post("/p", b"a"))
        await asyncio.to_thread(wait_until, lambda: len(server.heads) == 1, "A read")
        c = asyncio.ensure_future(pipe.post("/p", b"c" * (32 << 20)))
        await asyncio.sleep(0.3)  # C blocked half sent: the server reads nothing more
        assert not c.done() and not a.done()
        conn = pipe._conn
        assert conn is not None
        go.set()
        time.sleep(0.2)  # A's answer in the socket's buffer, the loop not yet told
        c.cancel()
        await asyncio.gather(c, return_exceptions=True)
        assert (await a).body == b"a"
        pipe.close()
        try:
            assert conn.sock.sock.fileno() == -1, "the pipeline's socket was left open"
        finally:
            conn.sock.close()

    asyncio.run(main())


async def _hold_flights(
    store: AsyncLibsqlStore, proxy: Proxy, exes: list[Execution]
) -> list[asyncio.Future[Any]]:
    proxy.mode = "hang"
    sent = proxy.requests
    calls = [asyncio.ensure_future(store.commit(exes[0], emit(exes[0], "x")))]
    await asyncio.to_thread(wait_until, lambda: proxy.requests > sent, "the first sent")
    for exe in exes[1:]:
        calls.append(asyncio.ensure_future(store.commit(exe, emit(exe, "x"))))
        await asyncio.sleep(0.02)
    await asyncio.sleep(0.05)
    return calls


@pytest.mark.sqld
def test_close_from_the_same_loop_lets_the_flights_sent_have_their_outcome(
    proxy: Proxy, server: SqldServer
) -> None:
    """The contract: closing while writes fly, those sent get their real outcome (from the
    same loop too), those never sent fail saying the store closed. `aclose` on the writes'
    own loop cancels the sender, which cancels every flight: the writes sent say
    OutcomeUnknown, and (the proxy letting them through) land."""
    exes = [Execution(id=f"s-{i}", definition_id="d") for i in range(hrana.FLIGHTS + 1)]

    async def main() -> list[Any]:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        calls = await _hold_flights(store, proxy, exes)
        closing = asyncio.ensure_future(store.close())
        await asyncio.sleep(0.1)
        proxy.mode = "forward"
        await closing
        return await asyncio.gather(*calls, return_exceptions=True)

    outcomes = asyncio.run(main())
    assert isinstance(outcomes[-1], StoreError) and "closed" in str(outcomes[-1])
    assert not any(isinstance(r, OutcomeUnknown) for r in outcomes), outcomes


# --- what held -------------------------------------------------------------------------


def test_answers_in_tiny_pieces_and_many_at_once_each_go_to_their_own_request(
    serve: Callable[..., Server],
) -> None:
    """Six requests read before any answer; their answers (a 100 Continue before some,
    chunked and Content-Length ones) sent in one buffer a byte or a few at a time, then
    all in one write: each request gets its own body."""

    def answer(body: bytes, n: int) -> bytes:
        head = b"HTTP/1.1 100 Continue\r\n\r\n" if n % 2 else b""
        if n % 3 == 0:
            return head + (
                b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
            )
        return head + echo(body)

    def handler(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        rounds = 0
        while True:
            bodies = []
            for _ in range(6):
                body = read_request(conn, buf, server)
                if body is None:
                    return
                bodies.append(body)
            data = b"".join(answer(b, n) for n, b in enumerate(bodies))
            if rounds == 0:
                for i in range(0, len(data), 3):
                    conn.sendall(data[i : i + 3])
                    time.sleep(0.0005)
            else:
                conn.sendall(data)
            rounds += 1

    server = serve(handler)

    async def main() -> None:
        pipe = Pipeline(client(server))
        try:
            for r in range(2):
                bodies = [b"r%d-%d-" % (r, i) + b"x" * (i * 37) for i in range(6)]
                answers = await asyncio.gather(*(pipe.post("/p", b) for b in bodies))
                assert [a.body for a in answers] == bodies
            assert server.accepted == 1
        finally:
            pipe.close()

    asyncio.run(main())


def test_requests_larger_than_the_socket_buffers_are_not_interleaved(
    serve: Callable[..., Server],
) -> None:
    """Four 6 MiB requests at once (each `send` partial, the next one wanting to go): the
    server reads four whole requests, each its own body, in order."""
    server = serve(_answering)

    async def main() -> None:
        pipe = Pipeline(client(server))
        try:
            bodies = [bytes([65 + i]) * (6 << 20) for i in range(4)]
            answers = await asyncio.gather(*(pipe.post("/p", b) for b in bodies))
            assert [a.body == b for a, b in zip(answers, bodies, strict=True)] == [True] * 4
        finally:
            pipe.close()

    asyncio.run(main())


def test_an_http_1_0_answer_fails_those_behind_it_as_sent_and_the_next_goes_on_a_new_one(
    serve: Callable[..., Server],
) -> None:
    def handler(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        bodies = []
        for _ in range(3):
            body = read_request(conn, buf, server)
            if body is None:
                return
            bodies.append(body)
        if server.accepted == 1:
            conn.sendall(
                b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(bodies[0]), bodies[0])
                + b"".join(echo(b) for b in bodies[1:])
            )
            server.stop.wait(10)
            return
        conn.sendall(b"".join(echo(b) for b in bodies))

    server = serve(handler)

    async def main() -> None:
        pipe = Pipeline(client(server, timeout=2.0))
        try:
            results = await asyncio.gather(
                *(pipe.post("/p", b"r%d" % i) for i in range(3)), return_exceptions=True
            )
            assert getattr(results[0], "body", None) == b"r0"
            assert all(isinstance(r, Broken) and r.sent for r in results[1:]), results
            again = await asyncio.gather(*(pipe.post("/p", b"s%d" % i) for i in range(3)))
            assert [a.body for a in again] == [b"s0", b"s1", b"s2"]
        finally:
            pipe.close()

    asyncio.run(main())


@pytest.mark.sqld
def test_two_loops_in_two_threads_write_at_once_each_on_its_own_pipeline(
    proxy: Proxy, server: SqldServer
) -> None:
    store_box: list[AsyncLibsqlStore] = []
    errors: list[BaseException] = []
    pipelines: list[Any] = []

    async def make() -> None:
        store_box.append(await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token))

    asyncio.run(make())
    store = store_box[0]
    proxy.delay = 0.01

    def writer(tag: str) -> None:
        async def go() -> None:
            exes = [Execution(id=f"{tag}-{i}", definition_id="d") for i in range(12)]

            async def two(exe: Execution) -> None:
                for n in range(2):
                    await store.commit(exe, emit(exe, str(n)))

            await asyncio.gather(*(two(e) for e in exes))
            assert [e.version for e in exes] == [2] * 12
            mine = store._remote._loops[asyncio.get_running_loop()]  # type: ignore[union-attr]
            pipelines.append(mine.pipeline)

        try:
            asyncio.run(go())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in ("ta", "tb")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    proxy.delay = 0

    async def check() -> None:
        assert len(pipelines) == 2 and pipelines[0] is not pipelines[1]
        for tag in ("ta", "tb"):
            for i in range(12):
                loaded = await store.load(f"{tag}-{i}")
                assert loaded is not None and loaded.version == 2
        await store.close()

    asyncio.run(check())
    assert not errors, errors
