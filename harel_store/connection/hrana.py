"""A remote libSQL primary (sqld, Turso) over Hrana 3 over HTTP, with httpx.

Every request is one ``POST /v3/pipeline`` on a new stream that it also closes, so no
server-side state outlives it: a read is one statement; a write is one Hrana batch
(``BEGIN IMMEDIATE``, the steps, each run only if the one before succeeded, a guard after
each guarded step, ``COMMIT``, ``ROLLBACK`` if the ``COMMIT`` did not run, and the
conflict read if a guard failed). The sync and the async client share the wire format;
only the sending differs.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import random
import ssl
import threading
import time
from typing import Any

import httpx

from harel_store.batch import Batch, Conflicted, Request, Statement, shape, statement
from harel_store.errors import OutcomeUnknown, StoreBusy, StoreError, scrub, translate

_BEGIN, _COMMIT, _ROLLBACK = (statement(n) for n in ("begin", "commit", "rollback"))
_GUARD = statement("guard_changed")


def _value(param: Any) -> dict[str, Any]:
    if param is None:
        return {"type": "null"}
    if isinstance(param, str):
        return {"type": "text", "value": param}
    if isinstance(param, int):  # bool too: SQLite has no other
        return {"type": "integer", "value": str(int(param))}  # a decimal string: exact
    if isinstance(param, float):
        # As decimal text, not a JSON number: sqld's JSON parser rounds about one double in
        # six to a neighbour, where SQLite (3.43+) converts the shortest repr exactly. Every
        # float the store binds meets a REAL column, whose affinity makes it a REAL again.
        return {"type": "text", "value": repr(param)}
    if isinstance(param, bytes):
        return {"type": "blob", "base64": base64.b64encode(param).decode("ascii")}
    raise TypeError(f"cannot send a {type(param).__name__} to the server")


def _stmt(statement: Statement) -> dict[str, Any]:
    query, params = statement
    return {
        "sql": query.sql,
        "args": [_value(p) for p in params],
        "want_rows": query.kind != "!",
    }


def _column(value: dict[str, Any]) -> Any:
    kind = value["type"]
    if kind == "integer":
        return int(value["value"])
    if kind == "blob":
        return base64.b64decode(value["base64"])
    return value.get("value")  # text, float (JSON numbers in the reply are exact), null


def _result(statement: Statement, result: dict[str, Any]) -> Any:
    rows = [tuple(_column(v) for v in row) for row in result["rows"]]
    return shape(statement[0].kind, rows, result["affected_row_count"])


def _ok(step: int) -> dict[str, Any]:
    return {"type": "ok", "step": step}


class _Wire:
    """One request as a pipeline body, and how to read the reply."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.write = isinstance(request, Batch)
        if not isinstance(request, Batch):
            self.body = _body({"type": "execute", "stmt": _stmt(request)})
            return
        steps: list[dict[str, Any]] = [{"stmt": _stmt(_BEGIN)}]
        self.positions: list[int] = []
        self.guards: dict[int, int] = {}  # wire index of a guard -> the batch step it guards
        for index, step in enumerate(request.steps):
            steps.append({"condition": _ok(len(steps) - 1), "stmt": _stmt(step)})
            self.positions.append(len(steps) - 1)
            if index in request.guards:
                steps.append({"condition": _ok(len(steps) - 1), "stmt": _stmt(_GUARD)})
                self.guards[len(steps) - 1] = index
        self.commit = len(steps)
        steps.append({"condition": _ok(self.commit - 1), "stmt": _stmt(_COMMIT)})
        steps.append(
            {"condition": {"type": "not", "cond": _ok(self.commit)}, "stmt": _stmt(_ROLLBACK)}
        )
        self.conflict: int | None = None
        if request.conflict is not None and self.guards:
            self.conflict = len(steps)
            failed = [{"type": "error", "step": g} for g in self.guards]
            steps.append(
                {"condition": {"type": "or", "conds": failed}, "stmt": _stmt(request.conflict)}
            )
        self.body = _body({"type": "batch", "batch": {"steps": steps}})

    def decode(self, reply: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        """The request's result, or the server's error (nothing of the request applied)."""
        first = reply["results"][0]
        if first["type"] != "ok":
            return None, first["error"]
        result = first["response"]["result"]
        if not isinstance(self.request, Batch):
            return _result(self.request, result), None
        request, results, errors = self.request, result["step_results"], result["step_errors"]
        if results[self.commit] is not None:
            steps = zip(request.steps, self.positions, strict=True)
            return [_result(step, results[p]) for step, p in steps], None
        failed = next(j for j, error in enumerate(errors) if error is not None)
        if failed in self.guards:
            found = None
            if self.conflict is not None and request.conflict is not None:
                found = _result(request.conflict, results[self.conflict])
            raise Conflicted(self.guards[failed], found)
        return None, errors[failed]


def _body(first: dict[str, Any]) -> bytes:
    body = {"baton": None, "requests": [first, {"type": "close"}]}
    return json.dumps(body, separators=(",", ":")).encode("ascii")


class ServerError(Exception):
    """An error as the server reported it: the ``__cause__`` of the StoreError raised."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(f"{message} ({code})" if code else message)
        self.message = message
        self.code = code


# At most this many write batches of one connection are in flight at once (reads are not
# limited). The server runs writes one at a time, so more only queue there. Measured on
# sqld 0.24.32 (loopback, 32 tasks committing): 2 to 6 in flight gave the same throughput
# (~360-500 commits/s), 32 gave ~150; and with 6 or more in flight its write queue wedged
# for good now and then (every writer parked behind a connection that was gone, after
# ~4,000 to ~14,000 commits); with 4, never in ~29,000.
WRITES_IN_FLIGHT = 4

# What an https client reads when the server answered in plain HTTP (OpenSSL's words).
_PLAIN_HTTP = ("WRONG_VERSION_NUMBER", "RECORD_LAYER_FAILURE", "HTTP_REQUEST")


class HranaConnection:
    """A remote primary at ``url`` (``http(s)://``, as `url.parse_database` makes it): every
    request one HTTP round trip, from any thread or task at once.

    ``timeout`` bounds each phase of a request (connecting, sending, waiting for the
    answer). A write that was sent and got no complete answer raises `OutcomeUnknown`.
    A request the server refused as busy (SQLITE_BUSY: its write lock was not to be had,
    so the batch rolled back) is sent again after a short pause, for up to ``busy_timeout``
    seconds, as SQLite's busy wait does on a local file; then `StoreBusy`.
    """

    def __init__(
        self, url: str, where: str, *, auth_token: str, timeout: float, busy_timeout: float
    ) -> None:
        try:
            parts = httpx.URL(url)
        except httpx.InvalidURL as exc:
            raise ValueError(f"not a usable URL: {where} ({exc})") from None
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"not an http(s) URL: {where}")
        self.url = str(parts.copy_with(username=None, password=None, query=None))
        self.where = where
        self.key = self.url  # what tells this database apart in the process: no secret
        self._endpoint = self.url.rstrip("/") + "/v3/pipeline"
        self._secrets = (auth_token,) if auth_token else ()
        self._plain_hint = ""
        if parts.scheme == "https":
            host = parts.netloc.decode("ascii")
            self._plain_hint = (
                "; the server answered without TLS: for a plain-HTTP server use "
                f"http://{host} or libsql://{host}?tls=0"
            )
        headers = {"Content-Type": "application/json"}
        if auth_token:
            headers["Authorization"] = f"Bearer {auth_token}"
        self._timeout = timeout
        self._busy_timeout = busy_timeout
        self._options: dict[str, Any] = {
            "headers": headers,
            "timeout": httpx.Timeout(timeout),
            # Also for http://: httpx would otherwise load its own CA bundle (~20 ms).
            "verify": _system_trust(),
        }
        self._client = httpx.Client(**self._options)
        self._aclient: httpx.AsyncClient | None = None
        self._write_slots = threading.BoundedSemaphore(WRITES_IN_FLIGHT)
        self._awrite_slots = asyncio.Semaphore(WRITES_IN_FLIGHT)
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"the store on {self.where} is closed")

    def execute(self, request: Request) -> Any:
        self._check_open()
        wire = _Wire(request)
        with self._write_slots if wire.write else contextlib.nullcontext():
            return self._send(wire)

    async def aexecute(self, request: Request) -> Any:
        """Async version of `execute`, on an ``httpx.AsyncClient`` (made on first use)."""
        self._check_open()
        if self._aclient is None:
            self._aclient = httpx.AsyncClient(**self._options)
            self._awrite_slots = asyncio.Semaphore(WRITES_IN_FLIGHT)
        wire = _Wire(request)
        async with self._awrite_slots if wire.write else contextlib.nullcontext():
            return await self._asend(self._aclient, wire)

    def _send(self, wire: _Wire) -> Any:
        started = time.monotonic()
        for tries in itertools.count():
            try:
                answer: httpx.Response | httpx.HTTPError = self._client.post(
                    self._endpoint, content=wire.body
                )
            except httpx.HTTPError as exc:
                answer = exc
            result, pause = self._settle(wire, answer, started, tries)
            if pause is None:
                return result
            time.sleep(pause)
        raise AssertionError("unreachable")

    async def _asend(self, client: httpx.AsyncClient, wire: _Wire) -> Any:
        """Async version of `_send`."""
        started = time.monotonic()
        for tries in itertools.count():
            try:
                answer: httpx.Response | httpx.HTTPError = await client.post(
                    self._endpoint, content=wire.body
                )
            except httpx.HTTPError as exc:
                answer = exc
            result, pause = self._settle(wire, answer, started, tries)
            if pause is None:
                return result
            await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def _settle(
        self, wire: _Wire, answer: httpx.Response | httpx.HTTPError, started: float, tries: int
    ) -> tuple[Any, float | None]:
        """What one attempt came to: ``(result, None)``, or ``(None, pause)`` to send the
        request again after ``pause`` seconds; the store's error if neither."""
        if isinstance(answer, httpx.HTTPError):
            # A read whose connection broke (a kept-alive one the server had just closed,
            # say) runs once more: it changed nothing. A timeout is not retried: that would
            # double the wait.
            if (
                tries == 0
                and not wire.write
                and isinstance(answer, httpx.TransportError)
                and not isinstance(answer, httpx.TimeoutException)
            ):
                return None, 0.0
            raise self._lost(answer, wire) from answer
        try:
            return self._answer(wire, answer), None
        except StoreBusy:
            pause = min(0.002 * 2**tries, 0.05) * random.uniform(0.5, 1.5)
            if time.monotonic() + pause - started < self._busy_timeout:
                return None, pause
            raise

    def _lost(self, exc: httpx.HTTPError, wire: _Wire) -> StoreError:
        what = scrub(str(exc) or type(exc).__name__, self._secrets)
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)):
            plain = any(marker in what for marker in _PLAIN_HTTP)
            return StoreError(
                f"cannot reach {self.where}: {what}{self._plain_hint if plain else ''}"
            )
        if isinstance(exc, httpx.TimeoutException):
            message = f"no answer from {self.where} within {self._timeout:g} s"
        elif isinstance(exc, httpx.TransportError):
            message = f"the connection to {self.where} broke before the answer came: {what}"
        else:
            return StoreError(f"cannot send to {self.where}: {what}")
        if wire.write:
            return OutcomeUnknown(
                f"{message}; the write may or may not have landed: reload to learn which"
            )
        return StoreError(message)

    def _answer(self, wire: _Wire, response: httpx.Response) -> Any:
        if response.status_code != 200:
            raise self._refused(wire, response)
        try:
            result, error = wire.decode(response.json())
        except Conflicted:
            raise
        except (ValueError, KeyError, TypeError, IndexError, StopIteration) as exc:
            message = f"{self.where} sent a reply that is not a Hrana pipeline result ({exc!r})"
            if wire.write:
                raise OutcomeUnknown(f"{message}; the write may or may not have landed") from exc
            raise StoreError(message) from exc
        if error is not None:
            cause = ServerError(
                scrub(str(error.get("message", "")), self._secrets), error.get("code")
            )
            raise translate(cause) from cause
        return result

    def _refused(self, wire: _Wire, response: httpx.Response) -> StoreError:
        status = response.status_code
        text = scrub(" ".join(response.text.split())[:300], self._secrets)
        message = f"HTTP {status} from {self.where}: {text}"
        if status in (401, 403):
            return StoreError(
                f"authentication failed: the server refused the auth token ({message})"
            )
        if wire.write and status >= 500:  # a proxy's 502, a server dying mid-batch
            return OutcomeUnknown(
                f"{message}; the write may or may not have landed: reload to learn which"
            )
        return StoreError(message)

    def sync(self) -> None:
        """Nothing to pull: every read goes to the primary."""

    def close(self) -> None:
        self._closed = True
        self._client.close()

    async def aclose(self) -> None:
        self._closed = True
        if self._aclient is not None:
            await self._aclient.aclose()
        self._client.close()


def _system_trust() -> ssl.SSLContext:
    """TLS verified against the operating system's trust store (SSL_CERT_FILE is honoured)."""
    import truststore

    return truststore.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
