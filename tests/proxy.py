"""A loopback TCP proxy in front of a server, for tests that need a misbehaving network.

It forwards bytes both ways and watches the HTTP/1.1 requests that cross it: it counts
them, tracks how many are awaiting their answer at once (and on how many connections), and
can delay each request (a connection's requests one after the other). Its
``mode`` misbehaves from the next request on: ``hang`` holds requests and never answers,
``cut`` drops the connection instead of forwarding a request, ``drop`` forwards it and
drops the connection instead of the answer (and ``hang_on`` holds only the requests with
those bytes in them), ``blackhole`` swallows every byte either way on
every connection (HTTP/2 too: a replica's sync) while it lasts. ``on_answer``, if
set, runs once when the next answer arrives, before it is passed on. With ``listen`` False
it answers a change notifications request (``GET /beta/listen``) with a 404 itself, as a
server without them does. With ``tls`` it
terminates TLS in front of a plain-HTTP server.

It runs on threads, so it only suits clients that release the GIL while they wait (our HTTP
does, and the replica's helper process is not in this one; the libsql driver does not).
"""

from __future__ import annotations

import contextlib
import re
import socket
import ssl
import threading
import time
from collections.abc import Callable
from typing import Literal

# Unanchored: a request pipelined behind another one follows that one's body at once.
REQUEST_LINE = re.compile(rb"(?:GET|POST|PUT|DELETE|HEAD) /\S* HTTP/1\.[01]\r\n")
STATUS_LINE = re.compile(rb"HTTP/1\.[01] \d{3} ")
Mode = Literal["forward", "hang", "cut", "drop", "blackhole"]


class Proxy:
    def __init__(self, target_port: int, *, tls: ssl.SSLContext | None = None) -> None:
        self.target_port = target_port
        self.mode: Mode = "forward"
        self.delay = 0.0  # seconds added before each request is forwarded
        self.on_answer: Callable[[], object] | None = None
        self.listen = True  # False: a change notifications request is answered 404
        self.hang_on: bytes | None = None  # a request holding these bytes is never answered
        self.requests = 0  # requests seen, whatever became of them
        self.in_flight = 0  # requests awaiting their answer, on every connection
        self.max_in_flight = 0
        self.max_busy = 0  # the most connections with a request awaiting its answer at once
        self._busy: dict[socket.socket, int] = {}  # a client's connection -> its in_flight
        self._tls = tls
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, scheme: str = "http", host: str = "127.0.0.1") -> str:
        return f"{scheme}://{host}:{self.port}"

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop, and drop every connection (a shutdown wakes a thread blocked on one)."""
        self._closed = True
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        if self._tls is not None:
            try:
                client = self._tls.wrap_socket(client, server_side=True)
            except (OSError, ssl.SSLError):
                client.close()
                return
        with self._lock:
            self._sockets.append(client)
        try:
            server = socket.create_connection(("127.0.0.1", self.target_port))
        except OSError:
            client.close()
            return
        with self._lock:
            self._sockets.append(server)
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()
        self._pipe(client, server, True)

    def _count(self, client: socket.socket, seen: int) -> None:
        """``seen`` requests sent (positive) or answered (negative) on ``client``."""
        with self._lock:
            self.in_flight += seen
            self.max_in_flight = max(self.max_in_flight, self.in_flight)
            left = self._busy.get(client, 0) + seen
            if left > 0:
                self._busy[client] = left
            else:
                self._busy.pop(client, None)
            self.max_busy = max(self.max_busy, len(self._busy))

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        """Forward ``src`` to ``dst`` (``upstream``: from the client) until either closes."""
        try:
            while data := src.recv(65536):
                if self.mode == "blackhole":
                    continue  # swallowed: neither forwarded nor answered
                if upstream and not self.listen and data.startswith(b"GET /beta/listen"):
                    src.sendall(b"HTTP/1.1 404 Not Found\r\ncontent-length: 9\r\n\r\nnot found")
                    break
                pattern = REQUEST_LINE if upstream else STATUS_LINE
                seen = len(pattern.findall(data))
                if seen and upstream:
                    with self._lock:
                        self.requests += seen
                    self._count(src, seen)
                    if self.mode == "cut":  # the request never reaches the server
                        break
                    while self.mode == "hang" or (self.hang_on and self.hang_on in data):
                        if self._closed:
                            return
                        time.sleep(0.01)
                    if self.delay:
                        time.sleep(self.delay)
                elif seen:
                    self._count(dst, -seen)
                    with self._lock:
                        then, self.on_answer = self.on_answer, None
                    if then is not None:
                        then()
                    if self.mode == "drop":  # the server did the work; its answer is lost
                        break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with self._lock:
                self._busy.pop(src if upstream else dst, None)
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
