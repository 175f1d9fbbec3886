"""The HTTP/1.1 client (`harel_store.connection.http`), sync and async, against small real
servers on 127.0.0.1 written here (one thread per connection), and against the real sqld."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote

import pytest
import trustme

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore, StoreError
from harel_store.cli import main
from harel_store.connection.http import (
    AsyncClient,
    BadResponse,
    Broken,
    Client,
    ConnectFailed,
    Response,
    TimedOut,
)
from tests.connect_proxy import ConnectProxy
from tests.helpers import refused_port
from tests.sqld import SqldServer

PATH = "/v3/pipeline"
MODES = ["sync", "async"]


class Server:
    """A loopback server: each connection runs ``handler(conn, server)`` on its own thread
    (behind TLS with ``tls``). Counts the connections; `close` ends them all."""

    def __init__(
        self,
        handler: Callable[[socket.socket, Server], None],
        *,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.handler = handler
        self.tls = tls
        self.accepted = 0
        self.heads: list[str] = []  # of the requests read by `read_request`
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.conns: list[socket.socket] = []
        self.threads: list[threading.Thread] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self.listener.getsockname()[1]
        self.origin = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            thread = threading.Thread(target=self._serve, args=(conn,), daemon=True)
            with self.lock:
                self.accepted += 1
                self.threads.append(thread)
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            if self.tls is not None:
                conn = self.tls.wrap_socket(conn, server_side=True)
            with self.lock:
                self.conns.append(conn)
            self.handler(conn, self)
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.stop.set()
        for sock in [self.listener, *self.conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(2)
        for thread in self.threads:
            thread.join(2)


def read_request(conn: socket.socket, buf: bytearray, server: Server) -> bytes | None:
    """The body of the next request on ``conn`` (it has a Content-Length), None at EOF."""
    while (end := buf.find(b"\r\n\r\n")) < 0:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    head = buf[:end].decode("latin-1")
    del buf[: end + 4]
    with server.lock:
        server.heads.append(head)
    fields = dict(line.split(": ", 1) for line in head.split("\r\n")[1:])
    length = int(fields["Content-Length"])
    while len(buf) < length:
        data = conn.recv(65536)
        if not data:
            return None
        buf += data
    body = bytes(buf[:length])
    del buf[:length]
    return body


def answering(
    answer: bytes | Callable[[bytes], bytes], *, then_close: bool = False, bytewise: bool = False
) -> Callable[[socket.socket, Server], None]:
    """A handler sending ``answer`` (or ``answer(body)``) to each request on a connection."""

    def handler(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        while (body := read_request(conn, buf, server)) is not None:
            data = answer(body) if callable(answer) else answer
            if bytewise:
                conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                for i in range(len(data)):
                    conn.sendall(data[i : i + 1])
            else:
                conn.sendall(data)
            if then_close:
                return

    return handler


def echo(body: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


def run(
    mode: str,
    origin: str,
    bodies: Sequence[bytes],
    *,
    between: Callable[[], None] | None = None,
    **options: Any,
) -> list[Response]:
    """Post each of ``bodies`` in turn on one client of ``mode``; close it."""
    options.setdefault("headers", {})
    options.setdefault("timeout", 2.0)
    options.setdefault("ssl_context", None)
    if mode == "sync":
        client = Client(origin, **options)
        try:
            answers = []
            for i, body in enumerate(bodies):
                if i and between:
                    between()
                answers.append(client.post(PATH, body))
            return answers
        finally:
            client.close()

    async def main() -> list[Response]:
        client = AsyncClient(origin, **options)
        try:
            answers = []
            for i, body in enumerate(bodies):
                if i and between:
                    between()
                answers.append(await client.post(PATH, body))
            return answers
        finally:
            await client.aclose()

    return asyncio.run(main())


# --- answers ---


@pytest.mark.parametrize("mode", MODES)
def test_content_length_answer_and_the_request_sent(
    mode: str, serve: Callable[..., Server]
) -> None:
    answer = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nX-Two: a\r\nx-two: b\r\n"
    server = serve(answering(answer + b"Content-Length: 6\r\n\r\nh\xc3\xa9llo"))
    headers = {"Authorization": "Bearer t0k", "Content-Type": "application/json"}
    (response,) = run(mode, server.origin, [b'{"a":1}'], headers=headers)
    assert response.status == 200
    assert response.headers == {
        "content-type": "text/plain",
        "x-two": "a, b",
        "content-length": "6",
    }
    assert response.body == b"h\xc3\xa9llo"
    assert response.text == "héllo"
    lines = server.heads[0].split("\r\n")
    assert lines[0] == "POST /v3/pipeline HTTP/1.1"
    assert sorted(lines[1:]) == sorted(
        [
            f"Host: 127.0.0.1:{server.port}",
            "Content-Length: 7",
            "Connection: keep-alive",
            "Authorization: Bearer t0k",
            "Content-Type: application/json",
        ]
    )


CHUNKED = (
    b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"5;name=value\r\nhello\r\n6\r\n world\r\nA \r\n, chunked!\r\n0\r\nX-Trailer: t\r\n\r\n"
)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bytewise", [False, True], ids=["whole", "bytewise"])
def test_chunked_answer(mode: str, bytewise: bool, serve: Callable[..., Server]) -> None:
    server = serve(answering(CHUNKED, bytewise=bytewise))
    answers = run(mode, server.origin, [b"1", b"2"])
    assert [r.body for r in answers] == [b"hello world, chunked!"] * 2
    assert server.accepted == 1


@pytest.mark.parametrize("mode", MODES)
def test_interim_answers_are_skipped_and_the_head_may_come_bytewise(
    mode: str, serve: Callable[..., Server]
) -> None:
    answer = (
        b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nLink: </x>\r\n\r\n"
        b"HTTP/1.1 201 Created\r\nContent-Length: 2\r\n\r\nok"
    )
    server = serve(answering(answer, bytewise=True))
    answers = run(mode, server.origin, [b"1", b"2"])
    assert [(r.status, r.body, r.headers) for r in answers] == [
        (201, b"ok", {"content-length": "2"})
    ] * 2
    assert server.accepted == 1


@pytest.mark.parametrize("mode", MODES)
def test_an_answer_read_to_eof_closes_the_connection(
    mode: str, serve: Callable[..., Server]
) -> None:
    server = serve(answering(b"HTTP/1.1 200 OK\r\n\r\nall of it", then_close=True))
    answers = run(mode, server.origin, [b"1", b"2"])
    assert [r.body for r in answers] == [b"all of it"] * 2
    assert server.accepted == 2


@pytest.mark.parametrize("mode", MODES)
def test_no_body_for_204(mode: str, serve: Callable[..., Server]) -> None:
    server = serve(answering(b"HTTP/1.1 204 No Content\r\n\r\n"))
    answers = run(mode, server.origin, [b"1", b"2"])
    assert [(r.status, r.body) for r in answers] == [(204, b"")] * 2
    assert server.accepted == 1


@pytest.mark.parametrize("mode", MODES)
def test_large_bodies_both_ways(mode: str, serve: Callable[..., Server]) -> None:
    big = bytes(range(256)) * 4096  # 1 MiB
    chunk = b"%x\r\n%s\r\n" % (16384, big[:16384])
    chunked = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + chunk * 64 + b"0\r\n\r\n"
    server = serve(answering(lambda body: echo(body) if body else chunked))
    answers = run(mode, server.origin, [big, b""])
    assert answers[0].body == big
    assert answers[1].body == big[:16384] * 64
    assert server.accepted == 1


# --- keep-alive ---


@pytest.mark.parametrize("mode", MODES)
def test_connections_are_kept_alive(mode: str, serve: Callable[..., Server]) -> None:
    server = serve(answering(echo))
    answers = run(mode, server.origin, [b"1", b"2", b"3"])
    assert [r.body for r in answers] == [b"1", b"2", b"3"]
    assert server.accepted == 1


@pytest.mark.parametrize("mode", MODES)
def test_an_idle_connection_the_server_closed_is_not_used(
    mode: str, serve: Callable[..., Server]
) -> None:
    done = threading.Semaphore(0)

    def handler(conn: socket.socket, server: Server) -> None:
        answering(echo, then_close=True)(conn, server)
        conn.close()
        done.release()

    server = serve(handler)

    def server_closed() -> None:
        assert done.acquire(timeout=2)
        time.sleep(0.02)  # the FIN crosses loopback

    answers = run(mode, server.origin, [b"1", b"2", b"3"], between=server_closed)
    assert [r.body for r in answers] == [b"1", b"2", b"3"]
    assert server.accepted == 3
    assert len(server.heads) == 3  # nothing was sent on a closed connection


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("head", "reused"),
    [
        (b"HTTP/1.1 200 OK\r\nConnection: close", False),
        (b"HTTP/1.1 200 OK\r\nConnection: Keep-Alive, Close", False),
        (b"HTTP/1.0 200 OK", False),
        (b"HTTP/1.0 200 OK\r\nConnection: keep-alive", True),
    ],
)
def test_connection_close_and_http_1_0(
    mode: str, head: bytes, reused: bool, serve: Callable[..., Server]
) -> None:
    server = serve(answering(head + b"\r\nContent-Length: 2\r\n\r\nok"))  # the server stays
    answers = run(mode, server.origin, [b"1", b"2"])
    assert [r.body for r in answers] == [b"ok", b"ok"]
    assert server.accepted == (1 if reused else 2)


# --- failures ---


def hang(conn: socket.socket, server: Server) -> None:
    read_request(conn, bytearray(), server)
    server.stop.wait(10)


@pytest.mark.parametrize("mode", MODES)
def test_connection_refused(mode: str) -> None:
    with pytest.raises(ConnectFailed, match="connection refused") as info:
        run(mode, f"http://127.0.0.1:{refused_port()}", [b"1"])
    assert info.value.sent is False
    assert isinstance(info.value.__cause__, ConnectionRefusedError)


@pytest.mark.parametrize("mode", MODES)
def test_no_answer_times_out(mode: str, serve: Callable[..., Server]) -> None:
    server = serve(hang)
    started = time.monotonic()
    with pytest.raises(TimedOut, match=r"timed out after 0\.3 s") as info:
        run(mode, server.origin, [b"1"], timeout=0.3)
    assert 0.3 <= time.monotonic() - started < 0.8
    assert info.value.sent is True


@pytest.mark.parametrize("mode", MODES)
def test_a_trickling_answer_is_bounded_by_the_timeout(
    mode: str, serve: Callable[..., Server]
) -> None:
    def trickle(conn: socket.socket, server: Server) -> None:
        read_request(conn, bytearray(), server)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        data = b"HTTP/1.1 200 OK\r\nContent-Length: 100000\r\n\r\n"
        for i in range(len(data)):  # for 4 s: then a client that waited gets Broken
            conn.sendall(data[i : i + 1])
            if server.stop.wait(0.1):
                return

    server = serve(trickle)
    started = time.monotonic()
    with pytest.raises(TimedOut) as info:
        run(mode, server.origin, [b"1"], timeout=0.5)
    assert time.monotonic() - started < 2
    assert info.value.sent is True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("answer", "message"),
    [
        (b"", "before any answer"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nhalf!", "before the answer was complete"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhel", "was complete"),
        (b"HTTP/1.1 200 OK\r\nContent-Le", "before the answer was complete"),
    ],
)
def test_a_connection_closed_mid_answer_is_broken(
    mode: str, answer: bytes, message: str, serve: Callable[..., Server]
) -> None:
    server = serve(answering(answer, then_close=True))
    with pytest.raises(Broken, match=message) as info:
        run(mode, server.origin, [b"1"])
    assert info.value.sent is True


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    "answer",
    [
        b"SSH-2.0-OpenSSH_9.6\r\n\r\n",
        b"HTTP/2 200\r\n\r\n",
        b"HTTP/1.1 2000 OK\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n",
        b"HTTP/1.1 200 OK\r\n folded: x\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 1, 2\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nContent-Length: 999999999999\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nabc\r\n",
        b"HTTP/1.1 101 Switching Protocols\r\n\r\n",
        b"HTTP/1.1 200 OK\r\nX-Big: " + b"a" * 70000 + b"\r\n\r\n",
    ],
)
def test_malformed_answers(mode: str, answer: bytes, serve: Callable[..., Server]) -> None:
    server = serve(answering(answer + b"padding", then_close=True))
    with pytest.raises(BadResponse) as info:
        run(mode, server.origin, [b"1"])
    assert info.value.sent is True


@pytest.mark.parametrize("mode", MODES)
def test_a_cancelled_or_failed_request_does_not_leave_its_connection_pooled(
    mode: str, serve: Callable[..., Server]
) -> None:
    def first_hangs(conn: socket.socket, server: Server) -> None:
        (hang if server.accepted == 1 else answering(echo))(conn, server)

    server = serve(first_hangs)
    if mode == "sync":
        client = Client(server.origin, headers={}, timeout=0.2, ssl_context=None)
        with pytest.raises(TimedOut):
            client.post(PATH, b"1")
        assert client.post(PATH, b"2").body == b"2"
        client.close()
    else:

        async def main() -> None:
            client = AsyncClient(server.origin, headers={}, timeout=5, ssl_context=None)
            task = asyncio.create_task(client.post(PATH, b"1"))
            await asyncio.sleep(0.1)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert (await client.post(PATH, b"2")).body == b"2"
            await client.aclose()

        asyncio.run(main())
    assert server.accepted == 2


@pytest.mark.parametrize("mode", MODES)
def test_a_closed_client_refuses_requests(mode: str, serve: Callable[..., Server]) -> None:
    server = serve(answering(echo))
    client = Client(server.origin, headers={}, timeout=1, ssl_context=None)
    aclient = AsyncClient(server.origin, headers={}, timeout=1, ssl_context=None)
    client.close()
    asyncio.run(aclient.aclose())
    with pytest.raises(RuntimeError, match="closed"):
        if mode == "sync":
            client.post(PATH, b"")
        else:
            asyncio.run(aclient.post(PATH, b""))


# --- what is refused before sending ---


@pytest.mark.parametrize("client", [Client, AsyncClient])
@pytest.mark.parametrize("value", ["s3cret\nX-Evil: 1", "s3cret\r", "s3cret\0"])
def test_header_values_with_cr_lf_nul_are_refused_without_repeating_them(
    client: type[Client] | type[AsyncClient], value: str
) -> None:
    with pytest.raises(ValueError, match="Authorization") as info:
        client("http://127.0.0.1:1", headers={"Authorization": value}, timeout=1, ssl_context=None)
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize(
    "origin",
    ["ftp://host", "http://", "http://host/path", "http://host?q=1", "http://u:s3cret@host"],
)
def test_origins_that_are_not_one(origin: str) -> None:
    with pytest.raises(ValueError) as info:
        Client(origin, headers={}, timeout=1, ssl_context=None)
    assert "s3cret" not in str(info.value)


def test_request_paths_are_checked() -> None:
    client = Client("http://127.0.0.1:1", headers={}, timeout=1, ssl_context=None)
    for path in ("no-slash", "/a b", "/a\r\nX: y"):
        with pytest.raises(ValueError, match="not a request path"):
            client.post(path, b"")
    client.close()


# --- TLS ---


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


def tls_server_context(ca: trustme.CA) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("127.0.0.1", "localhost").configure_cert(context)
    return context


@pytest.mark.parametrize("mode", MODES)
def test_tls_with_a_trusted_certificate(
    mode: str, ca: trustme.CA, serve: Callable[..., Server]
) -> None:
    server = serve(answering(echo), tls=tls_server_context(ca))
    trust = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(trust)
    origin = f"https://127.0.0.1:{server.port}"
    answers = run(mode, origin, [b"1", b"2", b"x" * 100_000], ssl_context=trust)
    assert [r.body for r in answers] == [b"1", b"2", b"x" * 100_000]
    assert server.accepted == 1
    to_eof = serve(answering(b"HTTP/1.1 200 OK\r\n\r\nall", then_close=True), tls=server.tls)
    origin = f"https://127.0.0.1:{to_eof.port}"
    assert [r.body for r in run(mode, origin, [b"1"], ssl_context=trust)] == [b"all"]


@pytest.mark.parametrize("mode", MODES)
def test_tls_with_an_untrusted_certificate(
    mode: str, ca: trustme.CA, serve: Callable[..., Server]
) -> None:
    server = serve(answering(echo), tls=tls_server_context(ca))
    untrusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # no CA at all
    with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED") as info:
        run(mode, f"https://127.0.0.1:{server.port}", [b"1"], ssl_context=untrusting)
    assert info.value.sent is False
    assert isinstance(info.value.__cause__, ssl.SSLError)


@pytest.mark.parametrize("mode", MODES)
def test_tls_against_a_plain_http_server(mode: str, serve: Callable[..., Server]) -> None:
    def plain(conn: socket.socket, server: Server) -> None:
        conn.recv(65536)  # a ClientHello
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")

    server = serve(plain)
    context = ssl.create_default_context()
    with pytest.raises(ConnectFailed, match=r"\[SSL") as info:
        run(mode, f"https://127.0.0.1:{server.port}", [b"1"], ssl_context=context)
    assert info.value.sent is False


# --- concurrency ---


def test_many_threads_at_once(serve: Callable[..., Server]) -> None:
    server = serve(answering(echo))
    client = Client(server.origin, headers={}, timeout=5, ssl_context=None)

    def worker(n: int) -> list[bool]:
        bodies = [f"thread {n} post {i}".encode() for i in range(50)]
        return [client.post(PATH, body).body == body for body in bodies]

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(worker, range(16)))
    client.close()
    assert all(all(r) and len(r) == 50 for r in results)
    assert 1 <= server.accepted <= 16


def test_many_tasks_at_once(serve: Callable[..., Server]) -> None:
    server = serve(answering(echo))

    async def main() -> list[bool]:
        client = AsyncClient(server.origin, headers={}, timeout=5, ssl_context=None)

        async def worker(n: int) -> bool:
            bodies = [f"task {n} post {i}".encode() for i in range(20)]
            return all([(await client.post(PATH, body)).body == body for body in bodies])

        results = await asyncio.gather(*(worker(n) for n in range(32)))
        await client.aclose()
        return results

    assert all(asyncio.run(main()))
    assert 1 <= server.accepted <= 32


# --- the real server ---

PIPELINE = json.dumps(
    {
        "baton": None,
        "requests": [
            {"type": "execute", "stmt": {"sql": "SELECT 1", "args": [], "want_rows": True}},
            {"type": "close"},
        ],
    }
).encode()


@pytest.mark.sqld
@pytest.mark.parametrize("mode", MODES)
def test_a_hrana_pipeline_on_sqld(mode: str, sqld: SqldServer) -> None:
    headers = {"Authorization": f"Bearer {sqld.token}", "Content-Type": "application/json"}
    answers = run(mode, sqld.url, [PIPELINE, PIPELINE], headers=headers)
    for response in answers:
        assert response.status == 200, response.text
        result = json.loads(response.body)["results"][0]
        assert result["type"] == "ok"
        assert result["response"]["result"]["rows"] == [[{"type": "integer", "value": "1"}]]
    (refused,) = run(mode, sqld.url, [PIPELINE], headers={"Content-Type": "application/json"})
    assert refused.status == 401


def test_a_slow_resolver_is_bounded_by_the_timeout(
    serve: Callable[..., Server], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The system's resolver has no timeout: a name it has not resolved yet (here a resolver
    held in this process, as a silent DNS server would) times out with the request, which
    ends while the resolver still has no answer. The server is real."""
    server = serve(hang)
    port = int(server.origin.rsplit(":", 1)[1])
    real = socket.getaddrinfo
    release, resolved = threading.Event(), threading.Event()

    def held(host: Any, *args: Any, **kwargs: Any) -> Any:
        if host != "held.invalid" or kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            return real(host, *args, **kwargs)  # ("is it an IP address?" needs no DNS)
        release.wait(10)
        resolved.set()
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", held)
    client = Client(f"http://held.invalid:{port}", headers={}, timeout=0.3, ssl_context=None)
    try:
        with pytest.raises(TimedOut, match=r"timed out after 0\.3 s") as info:
            client.post("/", b"1")
        assert not resolved.is_set()  # the request did not wait for the resolver
        assert info.value.sent is False
    finally:
        release.set()
        client.close()


# --- proxies in the environment ---

PROXY_VARIABLES = ["http_proxy", "https_proxy", "all_proxy", "no_proxy", "REQUEST_METHOD"]


@pytest.fixture
def proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No proxy variable set but those the test sets."""
    for name in PROXY_VARIABLES:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


@pytest.mark.parametrize("mode", MODES)
def test_http_proxy_tunnels_every_connection_with_its_credentials(
    mode: str, serve: Callable[..., Server], proxy_env: pytest.MonkeyPatch
) -> None:
    """The origin's name resolves nowhere: only a proxy can reach it (this one tunnels to
    the server whatever it is asked for)."""
    server = serve(answering(echo))
    with ConnectProxy(server.port, credentials="op:p@ss w:rd") as proxy:
        proxy_env.setenv("HTTP_PROXY", proxy.url("op:p%40ss%20w%3Ard"))
        origin = f"http://db.example.invalid:{server.port}"
        answers = run(mode, origin, [b"1", b"2"], headers={"Authorization": "Bearer TOKEN"})
        assert [r.body for r in answers] == [b"1", b"2"]
        (connect,) = proxy.connects  # one tunnel, kept alive
        secret = base64.b64encode(b"op:p@ss w:rd").decode()
        assert connect.split("\r\n") == [
            f"CONNECT db.example.invalid:{server.port} HTTP/1.1",
            f"Host: db.example.invalid:{server.port}",
            f"Proxy-Authorization: Basic {secret}",
        ]  # the token goes through the tunnel only
        assert f"Host: db.example.invalid:{server.port}" in server.heads[0]
        assert "Proxy-Authorization" not in server.heads[0]


@pytest.mark.parametrize("mode", MODES)
def test_https_through_the_proxy_verifies_the_origin(
    mode: str, ca: trustme.CA, serve: Callable[..., Server], proxy_env: pytest.MonkeyPatch
) -> None:
    server = serve(answering(echo), tls=tls_server_context(ca))
    trust = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(trust)
    with ConnectProxy(server.port) as proxy:
        proxy_env.setenv("https_proxy", proxy.url())
        proxy_env.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # not for https
        answers = run(mode, f"https://localhost:{server.port}", [b"1"], ssl_context=trust)
        assert [r.body for r in answers] == [b"1"]
        assert [c.split("\r\n")[0] for c in proxy.connects] == [
            f"CONNECT localhost:{server.port} HTTP/1.1"
        ]
        untrusting = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        with pytest.raises(ConnectFailed, match="CERTIFICATE_VERIFY_FAILED"):
            run(mode, f"https://localhost:{server.port}", [b"1"], ssl_context=untrusting)


@pytest.mark.parametrize(
    ("no_proxy", "proxied"),
    [
        ("", True),
        ("*", False),
        ("example.invalid", False),
        (".example.invalid", False),
        ("*.example.invalid", False),
        ("other.test, db.example.invalid", False),
        ("db.example.invalid:{port}", False),
        ("DB.Example.Invalid", False),
        ("example.invalid:1", True),
        ("ample.invalid", True),
        ("db.example.invalid.other", True),
        ("127.0.0.1", True),
    ],
)
def test_no_proxy_names(
    no_proxy: str, proxied: bool, serve: Callable[..., Server], proxy_env: pytest.MonkeyPatch
) -> None:
    """A name NO_PROXY exempts is resolved here, and resolves nowhere."""
    server = serve(answering(echo))
    with ConnectProxy(server.port) as proxy:
        proxy_env.setenv("http_proxy", proxy.url())
        proxy_env.setenv("NO_PROXY", no_proxy.format(port=server.port))
        origin = f"http://db.example.invalid:{server.port}"
        if proxied:
            assert [r.body for r in run("sync", origin, [b"1"])] == [b"1"]
        else:
            with pytest.raises(ConnectFailed, match="cannot resolve the host name"):
                run("sync", origin, [b"1"])
        assert len(proxy.connects) == proxied


@pytest.mark.parametrize(
    ("no_proxy", "proxied"),
    [("127.0.0.1", False), ("127.0.0.0/8", False), ("10.0.0.0/8,::1", True), ("*", False)],
)
@pytest.mark.parametrize("mode", MODES)
def test_no_proxy_addresses(
    mode: str,
    no_proxy: str,
    proxied: bool,
    serve: Callable[..., Server],
    proxy_env: pytest.MonkeyPatch,
) -> None:
    server = serve(answering(echo))
    with ConnectProxy(server.port) as proxy:
        proxy_env.setenv("ALL_PROXY", proxy.url())
        proxy_env.setenv("no_proxy", no_proxy)
        assert [r.body for r in run(mode, server.origin, [b"1"])] == [b"1"]
        assert len(proxy.connects) == proxied


@pytest.mark.parametrize("mode", MODES)
def test_a_proxy_refusing_the_tunnel_is_named_without_its_credentials(
    mode: str, serve: Callable[..., Server], proxy_env: pytest.MonkeyPatch
) -> None:
    server = serve(answering(echo))
    with ConnectProxy(server.port, credentials="op:right") as proxy:
        for given in ["op:wrong-pw", ""]:
            proxy_env.setenv("HTTP_PROXY", proxy.url(given))
            with pytest.raises(ConnectFailed) as info:
                run(mode, server.origin, [b"1"])
            assert str(info.value) == (
                f"the proxy http://127.0.0.1:{proxy.port} refused the tunnel: 407 Proxy"
                " Authentication Required (its credentials, in the proxy URL, are missing or"
                " wrong)"
            )
            assert info.value.sent is False
    assert server.accepted == 0


@pytest.mark.parametrize("mode", MODES)
def test_a_silent_proxy_is_bounded_by_the_timeout(
    mode: str, serve: Callable[..., Server], proxy_env: pytest.MonkeyPatch
) -> None:
    server = serve(answering(echo))
    with ConnectProxy(server.port, silent=True) as proxy:
        proxy_env.setenv("HTTP_PROXY", proxy.url())
        with pytest.raises(TimedOut, match=r"timed out after 0\.3 s") as info:
            run(mode, server.origin, [b"1"], timeout=0.3)
        assert info.value.sent is False
        assert len(proxy.connects) == 1


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(
    ("proxy", "problem"),
    [
        ("socks5://127.0.0.1:1080", "the proxy socks5://127.0.0.1:1080 is not http://host[:port]"),
        ("http://u:pw@127.0.0.1:1/x", "the proxy http://127.0.0.1:1 has a path, query or fragment"),
        ("http://127.0.0.1:99999", "the proxy http://127.0.0.1:99999 is not http://host[:port]"),
    ],
)
def test_a_proxy_this_client_cannot_use_is_refused_at_connect(
    mode: str, proxy: str, problem: str, proxy_env: pytest.MonkeyPatch
) -> None:
    proxy_env.setenv("HTTP_PROXY", proxy)
    with pytest.raises(ConnectFailed) as info:
        run(mode, "http://127.0.0.1:9", [b"1"])
    assert str(info.value) == problem


def eventually(check: Callable[[], bool], seconds: float = 10.0) -> bool:
    end = time.monotonic() + seconds
    while not check() and time.monotonic() < end:
        time.sleep(0.02)
    return check()


@pytest.mark.sqld
def test_a_store_commits_and_listens_through_the_proxy(
    server: SqldServer, proxy_env: pytest.MonkeyPatch
) -> None:
    """The store's requests, sync and async, its change notifications stream (what relays
    and wait_for listen to) and a bare `Client.stream` of sqld's events all go through the
    proxy of HTTP_PROXY; NO_PROXY=127.0.0.1 then bypasses it."""
    with ConnectProxy(server.port or 0, credentials="op:pw") as proxy:
        proxy_env.setenv("HTTP_PROXY", proxy.url("op:pw"))
        headers = {"Authorization": f"Bearer {server.token}"}
        listen = Client(server.url, headers=headers, timeout=10, ssl_context=None)
        stream = listen.stream("/beta/listen?table=harel_executions")
        assert stream.status == 200
        with LibsqlStore(server.url, auth_token=server.token) as store:
            exe = Execution(id="proxied-1", definition_id="d")
            store.save(exe)
            received = b""
            while b"changes" not in received:
                received += stream.read(10)  # the save's event, through the tunnel
            stream.close()
            listen.close()

            def finish() -> None:
                time.sleep(0.3)
                exe.status = "finished"
                store.commit(exe, [])

            thread = threading.Thread(target=finish)
            thread.start()
            assert store.wait_for("proxied-1", timeout=20).status == "finished"
            thread.join()
            assert eventually(
                lambda: any(
                    line.startswith(b"GET /beta/listen?table=harel_executions")
                    for line in proxy.first_lines
                )
            )

        async def main() -> Execution | None:
            store = await AsyncLibsqlStore.create(server.url, auth_token=server.token)
            async with store:
                await store.save(Execution(id="proxied-2", definition_id="d"))
                return await store.load("proxied-2")

        loaded = asyncio.run(main())
        assert loaded is not None and loaded.version == 1
        assert sum(line.startswith(b"POST /v3/pipeline") for line in proxy.first_lines) >= 2
        assert all(f"127.0.0.1:{server.port}" in c.split("\r\n")[0] for c in proxy.connects)

        proxy_env.setenv("NO_PROXY", "127.0.0.1")
        tunnels = len(proxy.connects)
        with LibsqlStore(server.url, auth_token=server.token) as store:
            store.save(Execution(id="direct-1", definition_id="d"))
            assert store.wait_for("direct-1", status="running", timeout=5).version == 1
        assert len(proxy.connects) == tunnels


@pytest.mark.sqld
def test_a_store_behind_a_refusing_proxy_says_so_without_secrets(
    server: SqldServer, proxy_env: pytest.MonkeyPatch
) -> None:
    with ConnectProxy(server.port or 0, credentials="op:right-pw") as proxy:
        proxy_env.setenv("http_proxy", proxy.url("op:wrong-pw"))
        with pytest.raises(StoreError) as info:
            LibsqlStore(server.url, auth_token=server.token)
    message = str(info.value)
    assert message == (
        f"cannot reach {server.url}: the proxy http://127.0.0.1:{proxy.port} refused the"
        " tunnel: 407 Proxy Authentication Required (its credentials, in the proxy URL, are"
        " missing or wrong)"
    )
    assert "wrong-pw" not in repr(info.value) and server.token not in repr(info.value)


# --- issue 48 class 9: no part of a proxy's credentials is ever shown ---

# Passwords as users put them in HTTP(S)_PROXY: raw (/, ?, #, @ and : cut a URL before its
# "@" when it is parsed by the book) and percent-escaped; (in the URL, what the proxy wants).
PROXY_PASSWORDS = [
    ("s3cr/et", "s3cr/et"),
    ("s3cr?et", "s3cr?et"),
    ("s3cr#et", "s3cr#et"),
    ("s3cr@et", "s3cr@et"),
    ("s3:cr:et", "s3:cr:et"),
    ("s3cr%2Fet%40x", "s3cr/et@x"),
    ("a/b?c#d@e:f%3Ag", "a/b?c#d@e:f:g"),
]


def assert_no_credentials(text: str, given: str) -> None:
    """Neither the user name nor any piece of the password (as given, or decoded) shows."""
    assert "admin" not in text, text
    for password in (given, unquote(given)):
        for piece in re.split(r"[/?#@:%]", password):
            assert len(piece) < 2 or piece not in text, (piece, text)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("given", "password"), PROXY_PASSWORDS)
def test_a_proxy_password_of_any_characters_is_sent_and_never_shown(
    mode: str,
    given: str,
    password: str,
    serve: Callable[..., Server],
    proxy_env: pytest.MonkeyPatch,
) -> None:
    """The credentials reach the proxy decoded; a refusal (a wrong password with the same
    characters), an unreachable proxy and an unusable one name host and port only."""
    server = serve(answering(echo))
    with ConnectProxy(server.port, credentials=f"admin:{password}") as proxy:
        proxy_env.setenv("HTTP_PROXY", proxy.url(f"admin:{given}"))
        origin = f"http://db.example.invalid:{server.port}"
        assert [r.body for r in run(mode, origin, [b"1"])] == [b"1"]
        proxy_env.setenv("HTTP_PROXY", proxy.url(f"admin:x{given}"))
        with pytest.raises(ConnectFailed) as info:
            run(mode, origin, [b"1"])
        assert str(info.value) == (
            f"the proxy http://127.0.0.1:{proxy.port} refused the tunnel: 407 Proxy"
            " Authentication Required (its credentials, in the proxy URL, are missing or"
            " wrong)"
        )
        proxy_env.delenv("HTTP_PROXY")
        proxy_env.setenv("HTTPS_PROXY", proxy.url(f"admin:x{given}"))
        with pytest.raises(ConnectFailed) as info:
            run(mode, f"https://db.example.invalid:{server.port}", [b"1"])
        assert str(info.value).startswith(f"the proxy http://127.0.0.1:{proxy.port} refused")
    port = refused_port()
    for variable, origin in [("HTTP_PROXY", "http://h.invalid:1"), ("HTTPS_PROXY", "https://h")]:
        proxy_env.setenv(variable, f"http://admin:{given}@127.0.0.1:{port}")
        with pytest.raises(ConnectFailed) as info:
            run(mode, origin, [b"1"])
        assert str(info.value) == f"connection refused (the proxy http://127.0.0.1:{port})"
        proxy_env.setenv(variable, f"http://admin:{given}@127.0.0.1:{port}/path")
        with pytest.raises(ConnectFailed) as info:
            run(mode, origin, [b"1"])
        assert str(info.value) == f"the proxy http://127.0.0.1:{port} has a path, query or fragment"
        proxy_env.setenv(variable, f"socks5://admin:{given}@127.0.0.1:{port}")
        with pytest.raises(ConnectFailed) as info:
            run(mode, origin, [b"1"])
        assert str(info.value) == (f"the proxy socks5://127.0.0.1:{port} is not http://host[:port]")
        proxy_env.delenv(variable)


@pytest.mark.parametrize(("given", "password"), PROXY_PASSWORDS[:5])
def test_the_cli_shows_no_proxy_credentials(
    given: str, password: str, proxy_env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """What a user sees: the CLI's one line names the proxy by host and port."""
    port = refused_port()
    proxy_env.setenv("HTTP_PROXY", f"http://admin:{given}@127.0.0.1:{port}")
    proxy_env.delenv("HAREL_AUTH_TOKEN", raising=False)
    proxy_env.delenv("TURSO_AUTH_TOKEN", raising=False)
    proxy_env.setenv("RUST_LOG", "off")  # what main() sets: undone after the test
    assert main(["--url", "http://db.example.invalid:8080", "status"]) == 1
    err = capsys.readouterr().err
    assert f"connection refused (the proxy http://127.0.0.1:{port})" in err, err
    assert_no_credentials(err, given)


# --- issue 48 class 12: a hanging resolver costs one thread per host, not one per request ---


def resolve_threads() -> int:
    return sum(
        t.name == "harel-resolve" or t.name.startswith("asyncio_") for t in threading.enumerate()
    )


@pytest.fixture
def hanging_resolver(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """``socket.getaddrinfo`` hangs for every ``.invalid`` name (a silent DNS server);
    yields the names asked, in order. Released at the end of the test."""
    real = socket.getaddrinfo
    release = threading.Event()
    asked: list[str] = []

    def held(host: Any, *args: Any, **kwargs: Any) -> Any:
        if not str(host).endswith(".invalid") or kwargs.get("flags", 0) & socket.AI_NUMERICHOST:
            return real(host, *args, **kwargs)  # other tests' threads resolve 127.0.0.1
        asked.append(host)
        release.wait(30)
        return real("127.0.0.1", *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", held)
    yield asked
    release.set()


def test_a_hanging_resolver_holds_one_thread_per_host(hanging_resolver: list[str]) -> None:
    before = resolve_threads()
    client = Client("http://held.invalid:9", headers={}, timeout=0.05, ssl_context=None)
    try:
        for _ in range(40):
            with pytest.raises(TimedOut, match=r"timed out after 0\.05 s"):
                client.post("/", b"1")
        assert resolve_threads() - before <= 1
        assert hanging_resolver == ["held.invalid"]  # the later requests waited for it
    finally:
        client.close()
    # Another host is asked at once, not after the one that hangs.
    other = Client("http://other.invalid:9", headers={}, timeout=0.05, ssl_context=None)
    with pytest.raises(TimedOut):
        other.post("/", b"1")
    assert hanging_resolver == ["held.invalid", "other.invalid"]


def test_a_hanging_resolver_neither_fills_nor_holds_up_the_event_loop(
    hanging_resolver: list[str],
) -> None:
    """The async client's lookups share the sync client's: 40 of them on one loop neither
    queue on its default executor nor keep `asyncio.run` from returning."""
    before = resolve_threads()
    counted: list[int] = []

    async def main() -> None:
        client = AsyncClient("http://held-a.invalid:9", headers={}, timeout=0.05, ssl_context=None)
        for _ in range(40):
            with pytest.raises(TimedOut):
                await client.post("/", b"1")
        counted.append(resolve_threads() - before)
        assert await asyncio.to_thread(lambda: 7) == 7  # the executor is free
        await client.aclose()

    runner = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    runner.start()
    runner.join(5)
    assert not runner.is_alive(), "asyncio.run is held up by the resolver's threads"
    assert counted and counted[0] <= 1
    assert hanging_resolver == ["held-a.invalid"]


@pytest.mark.parametrize("mode", MODES)
def test_a_name_no_resolver_can_take_is_a_connect_failure(mode: str) -> None:
    """(Found beside class 12.) IDNA refuses an empty label: a ConnectFailed, not a raw
    UnicodeError, and no lookup stays behind in flight for it."""
    for _ in range(2):
        with pytest.raises(ConnectFailed, match="cannot resolve the host name: not a host name"):
            run(mode, "http://a..b:1", [b"1"])


# --- issue 48 class 14: a stream of a fixed length is handed on as it arrives ---


def test_a_stream_with_a_content_length_is_handed_on_as_it_arrives(
    serve: Callable[..., Server],
) -> None:
    """A proxy that gives sqld's event stream a Content-Length: each event is read when it
    comes, not when the (here 1 MB) body ends; the body ends at its length, and one cut
    short is Broken."""
    events = [b"event: changes\ndata: %d\n\n" % i for i in range(3)]
    length = 1_000_000

    def dribble(conn: socket.socket, server: Server) -> None:
        buf = bytearray()
        while b"\r\n\r\n" not in buf:
            buf += conn.recv(4096)
        path = buf.split(b" ")[1]
        size = length if path == b"/long" else sum(map(len, events))
        conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        conn.sendall(b"Content-Length: %d\r\n\r\n" % size)
        for event in events:
            conn.sendall(event)
            server.stop.wait(0.3)
        if path == b"/long":
            server.stop.wait(10)  # the rest of the body never comes (the proxy holds it)

    server = serve(dribble)
    client = Client(server.origin, headers={}, timeout=5, ssl_context=None)
    try:
        stream = client.stream("/long")
        assert stream.status == 200 and stream.headers["content-length"] == str(length)
        got = b""
        while got != b"".join(events):
            got += stream.read(2)  # TimedOut if the body is held until its end
        stream.close()
        whole = client.stream("/whole")
        got = b""
        while data := whole.read(2):
            got += data
        assert got == b"".join(events)
        assert whole.read(2) == b""
        whole.close()
        short = client.stream("/long")
        server.close()  # the server goes away with 999,9xx bytes of the body still due
        with pytest.raises(Broken, match="before the answer was complete"):
            while short.read(2):
                pass
        short.close()
    finally:
        client.close()
