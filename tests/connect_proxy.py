"""A loopback HTTP proxy that serves ``CONNECT`` only, as the proxies the client meets in the
field do for TLS: whatever host it is asked for, it tunnels to 127.0.0.1:``target_port`` (so
a made-up host name reaches the test server). It keeps each tunnel request's head and the
first line sent through each tunnel, refuses a tunnel without ``credentials`` (407) when
they are set, and with ``silent`` never answers at all."""

from __future__ import annotations

import base64
import contextlib
import socket
import threading


class ConnectProxy:
    def __init__(
        self, target_port: int, *, credentials: str | None = None, silent: bool = False
    ) -> None:
        self.target_port = target_port
        self.credentials = credentials  # "user:password"
        self.silent = silent
        self.connects: list[str] = []  # the head of each CONNECT request
        self.first_lines: list[bytes] = []  # the first line through each tunnel
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, credentials: str = "") -> str:
        return f"http://{credentials + '@' if credentials else ''}127.0.0.1:{self.port}"

    def __enter__(self) -> ConnectProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            sockets = [self._listener, *self._sockets]
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self._sockets.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _serve(self, client: socket.socket) -> None:
        head = b""
        with contextlib.suppress(OSError):
            while b"\r\n\r\n" not in head:
                data = client.recv(4096)
                if not data:
                    return
                head += data
            text = head.split(b"\r\n\r\n")[0].decode("latin-1")
            with self._lock:
                self.connects.append(text)
            if self.silent:
                client.recv(1)  # until the client gives up
                return
            fields = {
                k.lower(): v for k, _, v in (ln.partition(": ") for ln in text.split("\r\n")[1:])
            }
            if not text.startswith("CONNECT "):
                client.sendall(b"HTTP/1.1 405 Method Not Allowed\r\nContent-Length: 0\r\n\r\n")
                return
            if self.credentials is not None:
                wanted = "Basic " + base64.b64encode(self.credentials.encode()).decode()
                if fields.get("proxy-authorization") != wanted:
                    client.sendall(
                        b"HTTP/1.1 407 Proxy Authentication Required\r\n"
                        b'Proxy-Authenticate: Basic realm="test"\r\nContent-Length: 0\r\n\r\n'
                    )
                    return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            with self._lock:
                self._sockets.append(server)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            threading.Thread(target=self._pipe, args=(server, client), daemon=True).start()
            self._pipe(client, server, first=True)

    def _pipe(self, src: socket.socket, dst: socket.socket, *, first: bool = False) -> None:
        try:
            while data := src.recv(65536):
                if first:
                    with self._lock:
                        self.first_lines.append(data.split(b"\r\n")[0])
                    first = False
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
