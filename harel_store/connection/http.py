"""A minimal HTTP/1.1 client for one origin: ``POST`` only, keep-alive, and one deadline
that bounds a whole request (connect, TLS handshake, send, the whole answer).

`Client` is for threads, `AsyncClient` for asyncio (on any loop: its connections belong to
none); both share one sans-IO answer parser.
Neither retries: a kept-alive connection is only checked for EOF (or stray bytes) before it
is used again, which catches the usual case of a server closing an idle connection.

Both honour the proxy variables as curl and httpx do (``https_proxy``, ``http_proxy``,
``all_proxy``, ``no_proxy``, in lower or upper case, read when the client is made): through
a proxy, every connection is a ``CONNECT`` tunnel to the origin (for ``http://`` too), opened
within the request's deadline; credentials in the proxy's URL go as ``Proxy-Authorization``.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import os
import re
import select
import socket
import ssl
import sys
import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from time import monotonic
from typing import Any, Generic, TypeVar
from urllib.parse import unquote, urlsplit
from urllib.request import getproxies_environment

from harel_store.lazy import asyncio

__all__ = [
    "AsyncClient",
    "BadResponse",
    "Broken",
    "Client",
    "ConnectFailed",
    "HTTPFailure",
    "Response",
    "Stream",
    "TimedOut",
]

MAX_HEAD = 64 * 1024
MAX_BODY = 256 * 1024 * 1024
_READ = 64 * 1024
_HEX = frozenset(b"0123456789abcdefABCDEF")
_OWN_HEADERS = frozenset({"host", "content-length", "connection", "transfer-encoding"})
_Conn = TypeVar("_Conn")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")


class HTTPFailure(Exception):
    """A request failed. ``sent``: its bytes may have reached the server (so a write's
    fate is unknown). The message never holds a header value."""

    sent: bool

    def __init__(self, message: str, *, sent: bool) -> None:
        super().__init__(message)
        self.sent = sent


class ConnectFailed(HTTPFailure):
    """No connection: DNS, refused, TLS handshake or certificate verification."""

    def __init__(self, message: str) -> None:
        super().__init__(message, sent=False)


class TimedOut(HTTPFailure):
    """The request's deadline passed (connecting, sending or receiving)."""


class Broken(HTTPFailure):
    """The connection closed or broke before the whole answer came."""


class BadResponse(HTTPFailure):
    """The answer is not HTTP/1.x as this client reads it, or is over its size caps."""

    def __init__(self, message: str) -> None:
        super().__init__(message, sent=True)


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    headers: dict[str, str]  # names lower-cased; repeated ones joined with ", "
    body: bytes

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


_HEAD, _LENGTH, _CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER, _TO_EOF = range(7)


class _Parser:
    """One answer out of the bytes appended to ``buf``: `parse` after each append,
    `eof` when the connection ends. ``reusable`` is known once an answer is complete (bytes
    left in ``buf`` then came after it: the next answer's, or nobody's)."""

    __slots__ = ("body", "buf", "headers", "left", "reusable", "state", "status")

    def __init__(self) -> None:
        self.buf = bytearray()
        self.body = bytearray()
        self.state = _HEAD
        self.status = 0
        self.headers: dict[str, str] = {}
        self.left = 0  # bytes still due: of the body, the chunk, or allowed in the trailer
        self.reusable = False

    def parse(self) -> Response | None:
        buf = self.buf
        while True:
            state = self.state
            if state == _LENGTH:
                if len(buf) < self.left:
                    return None
                return self._done(bytes(buf[: self.left]), self.left)
            if state == _HEAD:
                end = buf.find(b"\r\n\r\n")
                if end < 0 or end > MAX_HEAD:
                    if len(buf) > MAX_HEAD:
                        raise BadResponse("the answer's head is over 64 KiB")
                    return None
                head = buf[:end].decode("latin-1")
                del buf[: end + 4]
                self._head(head)
            elif state == _CHUNK_DATA:
                if not buf:
                    return None
                take = min(self.left, len(buf))
                self.body += buf[:take]
                del buf[:take]
                self.left -= take
                if not self.left:
                    self.state = _CHUNK_END
            elif state == _TO_EOF:
                if len(buf) > MAX_BODY:
                    raise BadResponse("the answer's body is over 256 MiB")
                return None
            else:  # a line: a chunk's size, the CRLF after its data, or a trailer field
                end = buf.find(b"\r\n")
                if end < 0:
                    if len(buf) > 4096 + self.left:
                        raise BadResponse("a chunk line too long")
                    return None
                line = bytes(buf[:end])
                del buf[: end + 2]
                if state == _CHUNK_SIZE:
                    self._chunk_size(line)
                elif state == _CHUNK_END:
                    if line:
                        raise BadResponse("no CRLF after a chunk's data")
                    self.state = _CHUNK_SIZE
                elif not line:
                    return self._done(bytes(self.body), 0)
                else:
                    self.left -= end + 2
                    if self.left < 0:
                        raise BadResponse("the answer's trailer is over 64 KiB")

    def feed(self, chunk: bytes) -> Response | None:
        """`parse` after ``chunk`` is appended; ``b""`` (the connection ended): `eof`."""
        if not chunk:
            return self.eof()
        self.buf += chunk
        return self.parse()

    def eof(self) -> Response:
        if self.state == _TO_EOF:
            self.reusable = False
            return self._done(bytes(self.buf), len(self.buf))
        if self.state == _HEAD and not self.buf and not self.status:
            raise Broken("the connection closed before any answer came", sent=True)
        raise Broken("the connection closed before the answer was complete", sent=True)

    def _done(self, body: bytes, used: int) -> Response:
        del self.buf[:used]  # what is left: the next answer's start, or bytes nobody asked for
        return Response(self.status, self.headers, body)

    def _head(self, head: str) -> None:
        lines = head.split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code = rest[:3]
        if (
            version not in ("HTTP/1.1", "HTTP/1.0")
            or not (code.isascii() and code.isdigit())
            or rest[3:4] not in ("", " ")
        ):
            raise BadResponse(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
        headers: dict[str, str] = {}
        for line in lines[1:]:
            name, colon, value = line.partition(":")
            if not colon or not name or name[0] in " \t" or name[-1] in " \t":
                raise BadResponse("a malformed header line in the answer")
            name = name.lower()
            value = value.strip(" \t")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        status = int(code)
        if status < 200:
            if status == 101:
                raise BadResponse("the server switched protocols (101)")
            self.status = status
            return  # an interim answer (100 Continue, 103): the real one follows
        self.status = status
        self.headers = headers
        connection = headers.get("connection")
        tokens = {t.strip().lower() for t in connection.split(",")} if connection else set()
        self.reusable = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
        coding = headers.get("transfer-encoding")
        length = headers.get("content-length")
        if status in (204, 304):
            self.state, self.left = _LENGTH, 0
        elif coding is not None:
            if length is not None:
                self.reusable = False
            if coding.rpartition(",")[2].strip().lower() == "chunked":
                self.state = _CHUNK_SIZE
            else:
                self.state, self.reusable = _TO_EOF, False
        elif length is not None:
            if not (length.isascii() and length.isdigit()):
                raise BadResponse("a malformed Content-Length in the answer")
            self.state, self.left = _LENGTH, int(length)
            if self.left > MAX_BODY:
                raise BadResponse("the answer's body is over 256 MiB")
        else:
            self.state, self.reusable = _TO_EOF, False

    def _chunk_size(self, line: bytes) -> None:
        size = line.partition(b";")[0].strip(b" \t")
        if not size or len(size) > 16 or not _HEX.issuperset(size):
            raise BadResponse("a malformed chunk size in the answer")
        self.left = int(size, 16)
        if not self.left:
            self.state, self.left = _TRAILER, MAX_HEAD
        elif len(self.body) + self.left > MAX_BODY:
            raise BadResponse("the answer's body is over 256 MiB")
        else:
            self.state = _CHUNK_DATA


def _readable(fd: int) -> bool:
    """Whether an idle connection has something to read: EOF, a reset or stray bytes."""
    poll = getattr(select, "poll", None)
    if poll is None:
        return bool(select.select([fd], [], [], 0)[0])
    poller = poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


def _connect_failure(exc: OSError, proxy: _Proxy | None = None) -> ConnectFailed:
    if isinstance(exc, ssl.SSLError):
        return ConnectFailed(f"TLS handshake failed: {exc}")
    through = f" (the proxy {proxy.shown})" if proxy is not None else ""
    if isinstance(exc, ConnectionRefusedError):
        return ConnectFailed(f"connection refused{through}")
    if isinstance(exc, socket.gaierror):
        return ConnectFailed(f"cannot resolve the host name{through}: {exc.strerror or exc}")
    return ConnectFailed(f"cannot connect{through}: {exc.strerror or exc}")


@dataclass(frozen=True, slots=True)
class _Proxy:
    """Where connections go instead of the origin, and the tunnel request to send there
    (``problem``: why the proxy named cannot be used, said when a connection is needed)."""

    host: str
    port: int
    shown: str  # scheme://host:port, never the credentials
    connect: bytes = field(repr=False)  # its Proxy-Authorization holds the password
    problem: str | None = None


def _bypassed(no_proxy: str, host: str, port: int) -> bool:
    """Whether ``no_proxy`` (comma-separated: ``*``, host names that also match their
    subdomains, with or without a leading ``.`` or ``*.``, IP addresses or networks, any of
    them with ``:port``) exempts ``host``:``port`` from the proxy."""
    host = host.lower().rstrip(".")
    for entry in no_proxy.replace(" ", ",").split(","):
        name, wanted = entry.strip().lower(), ""
        if name == "*":
            return True
        if name.startswith("["):  # [v6] or [v6]:port
            name, _, wanted = name[1:].partition("]")
            wanted = wanted.removeprefix(":")
        elif name.count(":") == 1:
            name, _, wanted = name.partition(":")
        name = name.removeprefix("*").removeprefix(".").rstrip(".")
        if not name or (wanted and wanted != str(port)):
            continue
        try:
            network = ipaddress.ip_network(name, strict=False)
        except ValueError:
            if host == name or host.endswith(f".{name}"):
                return True
            continue
        with contextlib.suppress(ValueError):
            if ipaddress.ip_address(host) in network:
                return True
    return False


def _proxy_for(scheme: str, host: str, port: int) -> _Proxy | None:
    """The proxy the environment names for ``scheme``://``host``:``port``, if any."""
    found = getproxies_environment()  # lower case first; HTTP_PROXY not under CGI
    if _bypassed(found.get("no", ""), host, port):
        return None
    url = found.get(scheme) or found.get("all")
    if not url:
        return None
    kind, sep, rest = url.partition("://")
    if not sep or not _SCHEME.fullmatch(kind):  # no scheme ("user:pw@host:port") is http
        kind, rest = "http", url
    # Users write passwords raw: one may hold /, ? or # (which end a URL's authority for a
    # parser by the book) or @. Whatever comes before the last @ is the user part, and the
    # address after it is all that is ever shown.
    userinfo, at, address = rest.rpartition("@")
    parts = urlsplit(f"{kind}://{address}")
    try:
        proxy_port = parts.port or 80
    except ValueError:
        proxy_port = 0
    shown = f"{kind.lower()}://{parts.netloc}"
    target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    lines = [f"CONNECT {target} HTTP/1.1", f"Host: {target}"]
    if at:
        user, _, password = userinfo.partition(":")
        secret = f"{unquote(user)}:{unquote(password)}"
        lines.append(f"Proxy-Authorization: Basic {base64.b64encode(secret.encode()).decode()}")
    problem = None
    if parts.scheme != "http" or not parts.hostname or not proxy_port:
        problem = f"the proxy {shown} is not http://host[:port]"
    elif parts.path not in ("", "/") or parts.query or parts.fragment:
        problem = f"the proxy {shown} has a path, query or fragment"
    request = "\r\n".join([*lines, "", ""]).encode("latin-1", errors="replace")
    return _Proxy(parts.hostname or "", proxy_port, shown, request, problem)


def _tunnel_answer(proxy: _Proxy, buf: bytes) -> bool:
    """Whether ``buf`` holds the proxy's whole answer to CONNECT (a 2xx: the tunnel is
    open); a refusal, or an answer that is not HTTP, raises ConnectFailed naming it."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        if len(buf) > MAX_HEAD:
            raise ConnectFailed(f"the proxy {proxy.shown} sent an answer head over 64 KiB")
        return False
    line = buf[: buf.find(b"\r\n")].decode("latin-1")
    version, _, rest = line.partition(" ")
    code = rest[:3]
    if not (version.startswith("HTTP/1.") and code.isascii() and code.isdigit()):
        raise ConnectFailed(f"the proxy {proxy.shown} did not answer in HTTP: {line[:80]!r}")
    if not code.startswith("2"):
        reason = "".join(c if c.isprintable() else "?" for c in rest[:80])
        hint = " (its credentials, in the proxy URL, are missing or wrong)" if code == "407" else ""
        raise ConnectFailed(f"the proxy {proxy.shown} refused the tunnel: {reason}{hint}")
    if len(buf) > end + 4:  # the origin speaks only when spoken to
        raise ConnectFailed(f"the proxy {proxy.shown} sent bytes after its answer to CONNECT")
    return True


class _Origin(Generic[_Conn]):
    """What both clients share: the address, the request's fixed bytes, the timeout, the
    idle connections (newest last)."""

    def __init__(
        self,
        origin: str,
        *,
        headers: Mapping[str, str],
        timeout: float,
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("an origin is http://host[:port] or https://host[:port]")
        if parts.path not in ("", "/") or parts.query or parts.fragment or "@" in parts.netloc:
            raise ValueError("an origin has no user, path, query or fragment")
        if not timeout > 0:
            raise ValueError(f"timeout must be positive, not {timeout!r}")
        self._host = parts.hostname
        self._port = parts.port or (443 if parts.scheme == "https" else 80)
        self._ssl: ssl.SSLContext | None = None
        if parts.scheme == "https":
            self._ssl = ssl_context or ssl.create_default_context()
        self._timeout = timeout
        self._late = f"timed out after {timeout:g} s"
        self._proxy = _proxy_for(parts.scheme, self._host, self._port)
        self._dial = (self._host, self._port)
        if self._proxy is not None:
            self._dial = (self._proxy.host, self._proxy.port)
        host = f"[{self._host}]" if ":" in self._host else self._host
        if parts.port is not None:
            host = f"{host}:{self._port}"
        lines = [b"Connection: keep-alive"]
        for name, value in headers.items():
            if any(c in name for c in "\r\n\0") or any(c in value for c in "\r\n\0"):
                raise ValueError(f"header {name!r} has a CR, LF or NUL in its name or value")
            if not name or ":" in name or name != name.strip() or name.lower() in _OWN_HEADERS:
                raise ValueError(f"header {name!r} cannot be set")
            try:
                lines.append(f"{name}: {value}".encode("latin-1"))
            except UnicodeEncodeError:
                raise ValueError(f"header {name!r} is not latin-1 text") from None
        self._host_line = f" HTTP/1.1\r\nHost: {host}\r\nContent-Length: ".encode("ascii")
        self._tail = b"\r\n" + b"\r\n".join(lines) + b"\r\n\r\n"
        self._starts: dict[str, bytes] = {}
        self._idle: list[_Conn] = []
        self._lock = threading.Lock()  # of the pool (an async client's may serve threads)
        self._closed = False

    def _request(self, path: str, body: bytes, method: bytes = b"POST") -> bytes:
        start = self._starts.get(path) if method == b"POST" else None
        if start is None:
            if not (path.startswith("/") and path.isascii() and path.isprintable()) or (
                " " in path
            ):
                raise ValueError(f"not a request path: {path!r}")
            start = method + b" " + path.encode("ascii") + self._host_line
            if method == b"POST" and len(self._starts) < 64:
                self._starts[path] = start
        return b"".join((start, b"%d" % len(body), self._tail, body))


class Client(_Origin[socket.socket]):
    """HTTP/1.1 to one origin from any number of threads at once, each request bounded
    by ``timeout`` seconds as a whole. Raises `HTTPFailure`'s subclasses."""

    def post(self, path: str, body: bytes) -> Response:
        deadline = monotonic() + self._timeout
        if self._closed:
            raise RuntimeError("closed")
        data = self._request(path, body)
        sock = self._take() or self._connect(deadline)
        parser = _Parser()
        response = self._exchange(sock, data, deadline, parser)
        assert response is not None
        with self._lock:
            if parser.reusable and not parser.buf and not self._closed:
                self._idle.append(sock)
                return response
        sock.close()
        return response

    def stream(self, path: str) -> Stream:
        """``GET path`` on a connection of its own, its answer's head read within
        ``timeout``: a `Stream` of the body as it comes (server-sent events), which the
        caller closes."""
        deadline = monotonic() + self._timeout
        if self._closed:
            raise RuntimeError("closed")
        data = self._request(path, b"", b"GET")
        parser = _Parser()
        sock = self._connect(deadline)
        answer = self._exchange(sock, data, deadline, parser, stream=True)
        if answer is not None:  # the whole answer already (an error's, say)
            parser.body[:] = answer.body
        return Stream(sock, parser, self._late, answer is not None)

    def _exchange(
        self,
        sock: socket.socket,
        data: bytes,
        deadline: float,
        parser: _Parser,
        *,
        stream: bool = False,
    ) -> Response | None:
        """Send ``data`` on ``sock`` and read the answer within the deadline: the whole of it,
        or with ``stream`` its head only (None unless the whole answer came with it). On a
        failure the socket is closed and the failure raised as an HTTPFailure."""
        sent = False
        try:
            sock.settimeout(self._left(deadline, sent))
            sent = True
            sock.sendall(data)
            response = None
            while response is None and not (stream and parser.state != _HEAD):
                sock.settimeout(self._left(deadline, sent))
                response = parser.feed(sock.recv(_READ))
            return response
        except BaseException as exc:
            sock.close()
            if isinstance(exc, TimeoutError):
                raise TimedOut(self._late, sent=sent) from exc
            if isinstance(exc, OSError):
                raise Broken(f"the connection broke: {exc.strerror or exc}", sent=sent) from exc
            raise

    def close(self) -> None:
        """Close the idle connections; a request in flight closes its own when done."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    def _left(self, deadline: float, sent: bool) -> float:
        left = deadline - monotonic()
        if left <= 0:
            raise TimedOut(self._late, sent=sent)
        return left

    def _take(self) -> socket.socket | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                sock = self._idle.pop()  # the newest: the least likely to have timed out
            pending = sock.pending() if isinstance(sock, ssl.SSLSocket) else 0
            if not pending and not _readable(sock.fileno()):
                return sock
            sock.close()

    def _connect(self, deadline: float) -> socket.socket:
        sock = None
        proxy = self._proxy
        if proxy is not None and proxy.problem:
            raise ConnectFailed(proxy.problem)
        host, port = self._dial
        try:
            hosts = _resolve(host, port, self._left(deadline, False))
            if hosts is None:
                raise TimeoutError("resolving the host name")
            for i, address in enumerate(hosts):  # as create_connection: the next on a failure
                try:
                    sock = socket.create_connection((address, port), self._left(deadline, False))
                    break
                except OSError:
                    if i == len(hosts) - 1:
                        raise
            assert sock is not None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if proxy is not None:
                sock.settimeout(self._left(deadline, False))
                sock.sendall(proxy.connect)
                answer = b""
                while not _tunnel_answer(proxy, answer):
                    sock.settimeout(self._left(deadline, False))
                    data = sock.recv(_READ)
                    if not data:
                        raise ConnectFailed(f"the proxy {proxy.shown} closed the connection")
                    answer += data
            if self._ssl is not None:
                sock.settimeout(self._left(deadline, False))  # the handshake's deadline
                sock = self._ssl.wrap_socket(sock, server_hostname=self._host)
            return sock
        except BaseException as exc:
            if sock is not None:
                sock.close()
            if isinstance(exc, TimeoutError):
                raise TimedOut(self._late, sent=False) from exc
            if isinstance(exc, OSError):
                raise _connect_failure(exc, proxy) from exc
            raise


_AddrInfo = list[tuple[Any, ...]]  # getaddrinfo's: family, type, proto, name, address
_lookups: dict[tuple[str, int], Future[_AddrInfo]] = {}  # the lookups in flight
_lookups_lock = threading.Lock()


def _forget_lookups() -> None:
    """In a forked child: the lookups in flight were the parent's threads', which are gone."""
    global _lookups_lock
    _lookups.clear()
    _lookups_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_lookups)


def _numeric(host: str, port: int) -> _AddrInfo | None:
    """``host`` as an address, if it is an IP address (that needs no resolver)."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST)
    except (socket.gaierror, UnicodeError):  # UnicodeError: a name IDNA cannot encode
        return None


def _lookup(host: str, port: int) -> Future[_AddrInfo]:
    """``getaddrinfo(host, port)`` on a thread, as the resolver has no timeout of its own:
    one lookup per host and port at a time, which every request that needs it meanwhile
    waits for (each within its own deadline), so a resolver that hangs holds one thread, not
    one per request. Its outcome is not kept: the next request after it asks again."""
    key = (host, port)
    with _lookups_lock:
        future = _lookups.get(key)
        if future is not None:
            return future
        future = _lookups[key] = Future()
        future.set_running_or_notify_cancel()  # a waiter that gives up cancels nothing

    def ask() -> None:
        try:
            info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except Exception as exc:  # UnicodeError too
            outcome: _AddrInfo | OSError = (
                exc if isinstance(exc, OSError) else socket.gaierror(f"not a host name ({exc})")
            )
        else:
            outcome = info or OSError("no address for the host")
        with _lookups_lock:
            if _lookups.get(key) is future:
                del _lookups[key]
        if isinstance(outcome, OSError):
            future.set_exception(outcome)
        else:
            future.set_result(outcome)

    try:
        threading.Thread(target=ask, daemon=True, name="harel-resolve").start()
    except RuntimeError as exc:  # "can't start new thread"
        with _lookups_lock:
            if _lookups.get(key) is future:
                del _lookups[key]
        raise OSError(f"no thread to resolve the host name: {exc}") from None
    return future


def _own(exc: OSError) -> OSError:
    """A copy of a lookup's failure, which many waiters may raise at once."""
    try:
        return type(exc)(*exc.args)
    except (TypeError, ValueError):
        return OSError(*exc.args)


def _resolve(host: str, port: int, wait: float) -> list[str] | None:
    """``host``'s addresses, resolved within ``wait`` seconds (None: not in time)."""
    info = _numeric(host, port)
    if info is None:
        try:
            info = _lookup(host, port).result(wait)
        except TimeoutError:
            return None
        except OSError as exc:
            raise _own(exc) from None
    return list(dict.fromkeys(str(entry[4][0]) for entry in info))


async def _resolve_async(host: str, port: int) -> _AddrInfo:
    """`_resolve` for a task: the same lookups, bounded by the request's own timeout (and
    not on the loop's executor, where a hanging resolver would fill it and hold up
    ``asyncio.run``'s shutdown)."""
    info = _numeric(host, port)
    if info is not None:
        return info
    try:
        return await asyncio.wrap_future(_lookup(host, port))
    except OSError as exc:
        raise _own(exc) from None


class Stream:
    """An answer read as it comes: its ``status`` and ``headers``, then its body by `read`.
    `close` may be called from any thread, and ends a `read` under way."""

    def __init__(self, sock: socket.socket, parser: _Parser, late: str, done: bool) -> None:
        self._sock = sock
        self._parser = parser
        self._late = late
        self._ended = done
        self.status = parser.status
        self.headers = parser.headers

    def read(self, timeout: float) -> bytes:
        """The body's next bytes (chunked framing removed), waiting up to ``timeout``
        seconds for some; b"" once the body has ended. Raises TimedOut, Broken or
        BadResponse."""
        parser = self._parser
        while not self._take() and not self._ended:
            try:
                self._sock.settimeout(timeout)
                chunk = self._sock.recv(_READ)
            except TimeoutError as exc:
                raise TimedOut(self._late, sent=True) from exc
            except (OSError, ValueError) as exc:  # ValueError: a TLS socket closed meanwhile
                raise Broken(f"the connection broke: {exc}", sent=True) from exc
            if not chunk:
                self._ended = True
                if parser.state != _TO_EOF:
                    parser.eof()  # raises: the body was cut short
                break
            parser.buf += chunk
            answer = parser.parse()
            if answer is not None:
                self._ended = True
                if not parser.body:  # a body of a known length comes whole
                    parser.body += answer.body
        body = bytes(parser.body)
        parser.body.clear()
        return body

    def _take(self) -> bool:
        """Whether body bytes are ready (a body read to the connection's end, or of a
        length a proxy set, is taken as it comes, not at its end)."""
        parser = self._parser
        if parser.state == _TO_EOF and parser.buf:
            parser.body += parser.buf
            parser.buf.clear()
        elif parser.state == _LENGTH and parser.buf and not self._ended:
            take = min(parser.left, len(parser.buf))
            parser.body += parser.buf[:take]
            del parser.buf[:take]
            parser.left -= take
            self._ended = not parser.left
        return bool(parser.body)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)  # a read under way in another thread ends
        self._sock.close()


class _Socket:
    """One connection of an `AsyncClient`: a non-blocking socket, and its TLS state (an
    `ssl.SSLObject` over memory buffers), that belongs to no event loop. A request's loop
    reads and writes it only while the request runs (``loop.sock_recv``, ``sock_sendall``),
    so an idle connection serves whichever loop sends next, and closing one needs none: a
    loop that closed leaves nothing behind."""

    __slots__ = ("incoming", "outgoing", "sock", "tls")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.tls: ssl.SSLObject | None = None
        self.incoming = ssl.MemoryBIO()  # TLS records received, not yet read
        self.outgoing = ssl.MemoryBIO()  # TLS records to send

    async def start_tls(
        self, loop: asyncio.AbstractEventLoop, context: ssl.SSLContext, host: str
    ) -> None:
        self.tls = tls = context.wrap_bio(self.incoming, self.outgoing, server_hostname=host)
        while True:
            try:
                tls.do_handshake()  # a truststore context verifies the peer here too
                break
            except ssl.SSLWantReadError:
                await self._flush(loop)
                await self._receive(loop)
        await self._flush(loop)

    async def send(self, loop: asyncio.AbstractEventLoop, data: bytes) -> None:
        if self.tls is not None:
            view = memoryview(data)
            while view:
                view = view[self.tls.write(view) :]
            data = self.outgoing.read()
        try:
            sent = self.sock.send(data)  # a request fits the socket's buffer, as a rule
        except (BlockingIOError, InterruptedError):
            sent = 0
        if sent < len(data):
            await loop.sock_sendall(self.sock, memoryview(data)[sent:])

    async def answer(self, loop: asyncio.AbstractEventLoop, parser: _Parser) -> Response:
        """The answer read into ``parser`` (which may hold its start already)."""
        response = parser.parse() if parser.buf else None
        while response is None:
            response = parser.feed(await self.recv(loop))
        return response

    async def recv(self, loop: asyncio.AbstractEventLoop) -> bytes:
        """The next bytes of the answer; ``b""`` at the end of the connection (a TLS
        peer's close_notify, or its bare EOF, which the sync client reads as EOF too)."""
        tls = self.tls
        if tls is None:
            return await loop.sock_recv(self.sock, _READ)
        while True:
            try:
                return tls.read(_READ)
            except ssl.SSLWantReadError:
                if self.incoming.eof:
                    return b""
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            await self._flush(loop)  # TLS 1.3 may answer a record with one of its own
            await self._receive(loop)

    async def _receive(self, loop: asyncio.AbstractEventLoop) -> None:
        data = await loop.sock_recv(self.sock, _READ)
        if data:
            self.incoming.write(data)
        else:
            self.incoming.write_eof()

    async def _flush(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.outgoing.pending:
            await loop.sock_sendall(self.sock, self.outgoing.read())

    def stale(self) -> bool:
        """Whether the server closed this connection, or sent bytes nobody asked for, while
        it was idle (or just opened). TLS records that carry no data (a TLS 1.3 session
        ticket) are read and are no reason to drop it."""
        tls = self.tls
        if tls is None:
            return _readable(self.sock.fileno())
        try:
            while _readable(self.sock.fileno()):
                data = self.sock.recv(_READ)
                if not data:
                    return True
                self.incoming.write(data)
            if self.incoming.pending or tls.pending():
                tls.read(_READ)
                return True  # data: not an answer to anything
        except ssl.SSLWantReadError:
            return False
        except OSError:  # ssl.SSLError too: a reset, a close_notify, a broken record
            return True
        return False

    def close(self) -> None:
        """Close at once: no TLS close_notify, no loop needed."""
        self.sock.close()


class AsyncClient(_Origin[_Socket]):
    """Async version of `Client`: any number of tasks at once, on any event loop (or on
    several, in several threads); its idle connections are tied to none of them. A request
    cancelled from outside closes its connection and lets `CancelledError` through."""

    async def post(self, path: str, body: bytes) -> Response:
        if self._closed:
            raise RuntimeError("closed")
        return await self._bounded(self._exchange, self._request(path, body))

    async def _bounded(
        self,
        exchange: Callable[[bytes, list[bool]], Awaitable[Response]],
        data: bytes,
    ) -> Response:
        """``exchange(data, sent)`` within the timeout; TimedOut says whether it was sent."""
        sent = [False]  # set by the exchange once the request starts to go out
        try:
            if sys.version_info >= (3, 11):
                async with asyncio.timeout(self._timeout):
                    return await exchange(data, sent)
            return await asyncio.wait_for(exchange(data, sent), self._timeout)
        except (TimeoutError, asyncio.TimeoutError) as exc:
            raise TimedOut(self._late, sent=sent[0]) from exc

    async def aclose(self) -> None:
        """Close the idle connections (from any loop); a request in flight closes its own
        when done."""
        self.close()

    def close(self) -> None:
        """`aclose`, from anywhere: it needs no event loop."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _exchange(self, data: bytes, sent: list[bool]) -> Response:
        loop = asyncio.get_running_loop()
        conn = self._take()
        if conn is None:
            conn = await self._connect(loop)
            if conn.stale():  # a new connection the server closed (or wrote to) at once
                conn.close()
                raise Broken("the server closed the connection at once", sent=False)
        parser = _Parser()
        try:
            sent[0] = True
            await conn.send(loop, data)
            response = await conn.answer(loop, parser)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, OSError) and not isinstance(exc, TimeoutError):
                raise Broken(f"the connection broke: {exc.strerror or exc}", sent=True) from exc
            raise
        with self._lock:
            if parser.reusable and not parser.buf and not self._closed:
                self._idle.append(conn)
                return response
        conn.close()
        return response

    def _take(self) -> _Socket | None:
        while True:
            with self._lock:
                if not self._idle:
                    return None
                conn = self._idle.pop()  # the newest: the least likely to have timed out
            if not conn.stale():
                return conn
            conn.close()

    async def _connect(self, loop: asyncio.AbstractEventLoop) -> _Socket:
        proxy = self._proxy
        if proxy is not None and proxy.problem:
            raise ConnectFailed(proxy.problem)
        host, port = self._dial
        try:
            addresses = await _resolve_async(host, port)
        except OSError as exc:
            raise _connect_failure(exc, proxy) from exc
        failure: OSError = OSError("no address for the host")
        for family, kind, proto, _, address in addresses:
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await loop.sock_connect(sock, address)
            except OSError as exc:
                sock.close()
                failure = exc
                continue
            except BaseException:
                sock.close()
                raise
            break
        else:
            if isinstance(failure, TimeoutError):  # the kernel's own connect timeout
                raise TimedOut(self._late, sent=False) from failure
            raise _connect_failure(failure, proxy) from failure
        conn = _Socket(sock)
        try:
            if proxy is not None:
                await loop.sock_sendall(sock, proxy.connect)
                answer = b""
                while not _tunnel_answer(proxy, answer):
                    data = await loop.sock_recv(sock, _READ)
                    if not data:
                        raise ConnectFailed(f"the proxy {proxy.shown} closed the connection")
                    answer += data
            if self._ssl is not None:
                await conn.start_tls(loop, self._ssl, self._host)
        except BaseException as exc:
            conn.close()
            if isinstance(exc, TimeoutError):
                raise TimedOut(self._late, sent=False) from exc
            if isinstance(exc, OSError):
                raise _connect_failure(exc, proxy) from exc
            raise
        return conn


class _Piped:
    """A `Pipeline`'s connection: the bytes read past the last answer (the next one's
    start), the future of the last request sent (whether the one after it may read), how
    many requests on it have not finished, and whether it ended (shut down: the last of
    them closes it)."""

    __slots__ = ("buf", "ended", "last", "pending", "sock")

    def __init__(self, sock: _Socket) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.last: asyncio.Future[bool] | None = None
        self.pending = 0
        self.ended = False


class Pipeline:
    """Requests of one event loop's tasks to an `AsyncClient`'s origin over one connection,
    each sent as soon as it is asked for, without waiting for the answers to those before
    it (HTTP/1.1 pipelining): the server reads and answers them one at a time, in the order
    they were sent, and their answers come back in that order.

    Each request is bounded by the client's timeout as a whole, its wait for the answers
    before its own included. A connection that fails (broken, timed out, an answer that is
    not HTTP, one that says ``Connection: close``, bytes past the last answer due) fails
    every request sent on it that has no answer yet, as sent (`Broken`); the next request
    opens another. `close` (from the pipeline's loop) lets the requests sent have their
    answers, then closes the connection; a request after it raises RuntimeError.
    """

    def __init__(self, client: AsyncClient) -> None:
        self._client = client
        self._conn: _Piped | None = None
        self._sending: asyncio.Lock | None = None  # one request's bytes at a time
        self._closing = False

    async def post(self, path: str, body: bytes) -> Response:
        client = self._client
        if client._closed or self._closing:
            raise RuntimeError("closed")
        return await client._bounded(self._exchange, client._request(path, body))

    def close(self) -> None:
        """Close the connection once no request on it waits for its answer."""
        self._closing = True
        piped = self._conn
        if piped is not None and not piped.pending:
            self._conn = None
            piped.sock.close()

    async def _exchange(self, data: bytes, sent: list[bool]) -> Response:
        loop = asyncio.get_running_loop()
        if self._sending is None:
            self._sending = asyncio.Lock()
        async with self._sending:
            if self._closing or self._client._closed:
                raise RuntimeError("closed")
            piped = self._conn
            if piped is not None and not piped.pending and (piped.buf or piped.sock.stale()):
                self._conn = None  # idle, and the server closed it or sent stray bytes
                piped.sock.close()
                piped = None
            if piped is None:
                sock = self._client._take() or await self._client._connect(loop)
                if sock.stale():
                    sock.close()
                    raise Broken("the server closed the connection at once", sent=False)
                piped = self._conn = _Piped(sock)
            before, mine = piped.last, loop.create_future()
            piped.last = mine
            piped.pending += 1
            try:
                sent[0] = True
                await piped.sock.send(loop, data)
            except BaseException as exc:
                self._finish(piped, mine, ok=False)
                if isinstance(exc, OSError):
                    raise Broken(f"the connection broke: {exc.strerror or exc}", sent=True) from exc
                raise
        try:
            if before is not None and not await asyncio.shield(before):
                raise Broken("the connection failed before this request's answer", sent=True)
            parser = _Parser()
            parser.buf, piped.buf = piped.buf, bytearray()
            response = await piped.sock.answer(loop, parser)
        except BaseException as exc:
            self._finish(piped, mine, ok=False)
            if isinstance(exc, OSError):
                raise Broken(f"the connection broke: {exc.strerror or exc}", sent=True) from exc
            raise
        piped.buf = parser.buf
        # Not reusable, or bytes past the last answer due (nobody's): nothing more is read.
        self._finish(piped, mine, ok=parser.reusable and not (piped.last is mine and piped.buf))
        return response

    def _finish(self, piped: _Piped, mine: asyncio.Future[bool], ok: bool) -> None:
        """A request on ``piped`` finished (``ok``: its connection may go on). A failure
        ends the connection: shut down, so that a request before reading it wakes to its
        end (a socket closed under a loop's reader would leave that reader waiting until
        its timeout); the requests after it fail; the last request to finish closes it."""
        piped.pending -= 1
        if not ok and not piped.ended:
            piped.ended = True
            if self._conn is piped:
                self._conn = None
            with contextlib.suppress(OSError):
                piped.sock.sock.shutdown(socket.SHUT_RDWR)
        if not mine.done():
            mine.set_result(not piped.ended)
        if piped.last is mine:
            piped.last = None
        if not piped.pending and (piped.ended or self._closing or self._conn is not piped):
            if self._conn is piped:
                self._conn = None
            piped.sock.close()
