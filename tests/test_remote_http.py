"""A remote primary over HTTP (Hrana 3, `harel_store.connection.http`): what a request
costs, how long a wait can be, what an unanswered write means, async concurrency and
cancellation, TLS, and values that come back exactly. Each test runs against the session's
real sqld, through a loopback proxy (`tests.proxy`) where it needs the network to
misbehave."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import trustme

from harel_store import (
    AsyncLibsqlStore,
    DefinitionRecord,
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    StoreBusy,
    StoreConflict,
    StoreError,
    TimerOp,
)
from harel_store.connection import http
from tests.helpers import wait_until
from tests.proxy import Proxy
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld


def step(store: Any, exe: Execution, n: int) -> Any:
    """A typical commit: one emit, the dedupe marker, one timer, a trace step."""
    return store.commit(
        exe,
        [(None, Event(name="tick", id=f"emit-{exe.id}-{n}"))],
        processed_event_id=f"in-{exe.id}-{n}",
        timers=[TimerOp.schedule("t", float(n))],
        trace={"n": n},
    )


def requests_of(proxy: Proxy, call: Callable[[], Any]) -> int:
    before = proxy.requests
    call()
    return proxy.requests - before


# --- one request per read and per write ---


def test_a_commit_is_one_request_and_so_is_a_read(proxy: Proxy, server: SqldServer) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token) as store:
        exe = Execution(id="one", definition_id="d")
        assert requests_of(proxy, lambda: step(store, exe, 1)) == 1
        assert requests_of(proxy, lambda: step(store, exe, 2)) == 1
        assert requests_of(proxy, lambda: store.load("one")) == 1
        assert requests_of(proxy, lambda: store.load_for_event("one", "in-one-2")) == 1
        assert requests_of(proxy, store.pending_outbox) == 1
        stale = Execution(id="one", definition_id="d", version=1)
        before = proxy.requests
        with pytest.raises(StoreConflict) as info:  # the conflict read rides in the same request
            step(store, stale, 9)
        assert proxy.requests - before == 1
        assert (info.value.expected, info.value.found) == (1, 2)


def test_a_relay_delivers_an_event_in_two_requests_and_each_relay_call_is_one(
    proxy: Proxy, server: SqldServer
) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token) as store:
        store.save(Execution(id="target", definition_id="d"))
        source = Execution(id="source", definition_id="d")
        events = [("target", Event(name="go", id=f"ev-{i}")) for i in range(3)]
        spawns = [("child", "root", {})]
        store.commit(source, events, timers=[TimerOp.schedule("t", 1.0)], spawns=spawns)
        claims = [
            lambda: store.claim_outbox("w", limit=2, max_attempts=3),
            lambda: store.claim_spawns("w", max_attempts=3),
            lambda: store.claim_due_timers("w", 5.0),
        ]
        held: list[Any] = []
        for claim in claims:
            assert requests_of(proxy, lambda claim=claim: held.extend(claim())) == 1
        first, second, spawn, timer = held
        # The engine's delivery of one event: its read, then one commit that handles it and
        # consumes its entry (and, here, the spawn and the timer too).
        exe, seen = store.load_for_event("target", first.event.id)
        assert exe is not None and not seen
        deliver = lambda: store.commit(  # noqa: E731
            exe, [], processed_event_id=first.event.id, acks=(first, spawn, timer)
        )
        assert requests_of(proxy, deliver) == 1
        assert requests_of(proxy, lambda: store.extend("w", [second], lease=60.0)) == 1
        assert requests_of(proxy, lambda: store.fail("w", [second], error="no")) == 1
        assert requests_of(proxy, lambda: store.revive([second])) == 1
        assert requests_of(proxy, lambda: store.dead_letters()) == 1
        rest = store.claim_outbox("w")
        assert requests_of(proxy, lambda: store.ack(rest)) == 1
        assert store.pending_outbox() == [] and store.pending_spawns() == []


# --- bounded waits ---


def test_a_hung_primary_fails_within_the_timeout_while_other_threads_run(
    proxy: Proxy, server: SqldServer
) -> None:
    store = LibsqlStore(proxy.url(), auth_token=server.token, timeout=0.5)
    exe = Execution(id="hung", definition_id="d")
    step(store, exe, 1)
    proxy.mode = "hang"  # accepts the request, never answers
    ticks = 0
    stop = threading.Event()

    def ticker() -> None:
        nonlocal ticks
        while not stop.wait(0.01):
            ticks += 1

    thread = threading.Thread(target=ticker)
    thread.start()
    try:
        started = time.monotonic()
        with pytest.raises(OutcomeUnknown, match=r"no answer from .* within 0.5 s"):
            step(store, exe, 2)
        waited = time.monotonic() - started
        assert exe.version == 1
        with pytest.raises(StoreError, match="no answer") as info:
            store.load("hung")
        assert type(info.value) is StoreError  # a read changes nothing: no unknown outcome
    finally:
        stop.set()
        thread.join()
        store.close()
    assert 0.5 <= waited < 5  # bounded by the timeout, not by the server
    assert ticks >= 20  # the other thread ran all along


def test_a_hung_primary_never_blocks_the_event_loop(proxy: Proxy, server: SqldServer) -> None:
    async def main() -> tuple[int, BaseException]:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token, timeout=0.5)
        exe = Execution(id="hung", definition_id="d")
        await store.commit(exe, [])
        proxy.mode = "hang"
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.01)
                ticks += 1

        tick = asyncio.create_task(ticker())
        try:
            with pytest.raises(OutcomeUnknown) as info:
                await store.commit(exe, [])
        finally:
            tick.cancel()
            await store.close()
        assert exe.version == 1
        return ticks, info.value

    ticks, _ = asyncio.run(main())
    assert ticks >= 20


@pytest.fixture
def trickler() -> Iterator[str]:
    """A server that answers every request with a byte every 0.1 s, forever."""
    listener = socket.create_server(("127.0.0.1", 0))
    closed = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            conn.recv(65536)
            answer = b"HTTP/1.1 200 OK\r\nContent-Length: 1000000\r\n\r\n" + b"x" * 10**6
            for byte in answer:
                if closed.wait(0.1):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    def accept() -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    closed.set()
    listener.close()


def test_a_trickling_server_cannot_stretch_a_call_past_the_timeout(trickler: str) -> None:
    started = time.monotonic()
    with pytest.raises(StoreError, match=r"no answer from .* within 0.5 s"):
        LibsqlStore(trickler, timeout=0.5)  # opening reads the schema's revision
    assert time.monotonic() - started < 2

    async def main() -> None:
        started = time.monotonic()
        with pytest.raises(StoreError, match=r"no answer from .* within 0.5 s"):
            await AsyncLibsqlStore.create(trickler, timeout=0.5)
        assert time.monotonic() - started < 2

    asyncio.run(main())


@pytest.mark.parametrize("token", ["abc\ndef", "abc\rdef", "abc\x00def"])
def test_a_token_that_cannot_be_a_header_is_refused_without_showing_it(token: str) -> None:
    with pytest.raises(ValueError, match="Authorization") as info:
        LibsqlStore("http://127.0.0.1:1", auth_token=token)
    assert "abc" not in str(info.value) and "def" not in str(info.value)


# --- a write with no answer: OutcomeUnknown, and the reload tells ---


def test_a_lost_answer_is_an_unknown_outcome_that_a_reload_resolves(
    proxy: Proxy, server: SqldServer
) -> None:
    with LibsqlStore(proxy.url(), auth_token=server.token) as store:
        landed = Execution(id="landed", definition_id="d")
        proxy.mode = "drop"  # the server commits, the answer is lost
        with pytest.raises(OutcomeUnknown, match="may or may not have landed"):
            step(store, landed, 1)
        assert landed.version == 0
        proxy.mode = "forward"
        assert store.load("landed").version == 1  # type: ignore[union-attr]
        with pytest.raises(StoreConflict):  # retrying the same write is safe: the CAS says no
            step(store, landed, 1)

        lost = Execution(id="lost", definition_id="d")
        proxy.mode = "cut"  # the request never reaches the server
        with pytest.raises(OutcomeUnknown):
            step(store, lost, 1)
        before = proxy.requests
        with pytest.raises(StoreError) as info:
            store.load("lost")
        assert type(info.value) is StoreError
        assert proxy.requests - before == 2  # a read is sent once more: it changed nothing
        proxy.mode = "forward"
        assert store.load("lost") is None
        step(store, lost, 1)  # the retry lands
        assert store.load("lost").version == 1  # type: ignore[union-attr]


# --- async: concurrent, correct, and cancellations that settle ---


def test_async_commits_to_different_executions_are_in_flight_at_once(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        proxy.delay = 0.2
        exes = [Execution(id=f"par-{i}", definition_id="d") for i in range(8)]
        sent = proxy.requests
        await asyncio.gather(*(store.commit(e, [(None, Event(name="x"))]) for e in exes))
        assert proxy.max_in_flight == 1  # one write request at a time: group commit
        assert proxy.requests - sent <= 2  # the first alone at most, then the rest together
        proxy.max_in_flight = 0
        loaded = await asyncio.gather(*(store.load(e.id) for e in exes))
        assert proxy.max_in_flight == 8  # reads are not limited
        proxy.delay = 0
        assert [e.version for e in exes] == [1] * 8 == [e.version for e in loaded if e]
        assert len(await store.pending_outbox()) == 8

        # Many tasks on one execution: the CAS lets exactly one win each version.
        await store.save(Execution(id="shared", definition_id="d"))
        wins = 0

        async def bump(n: int) -> None:
            nonlocal wins
            for i in range(5):
                while True:
                    exe = await store.load("shared")
                    assert exe is not None
                    try:
                        await store.commit(exe, [(None, Event(name=f"{n}-{i}"))])
                        wins += 1
                        break
                    except StoreConflict:
                        continue

        await asyncio.gather(*(bump(n) for n in range(8)))
        shared = await store.load("shared")
        assert wins == 40 and shared is not None and shared.version == 41
        assert len(await store.pending_outbox()) == 8 + 40
        await store.close()

    asyncio.run(main())


def test_a_cancelled_remote_call_settles_before_the_cancellation_arrives(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        exe = Execution(id="c", definition_id="d")
        proxy.delay = 0.3
        task = asyncio.create_task(store.commit(exe, [(None, Event(name="x"))]))
        await asyncio.to_thread(wait_until, lambda: proxy.in_flight == 1, "the request sent")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert exe.version == 1  # it landed, and exe says so when the cancellation arrives

        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(store.commit(exe, []), 0.05)
        assert exe.version == 2

        sent = proxy.requests
        task = asyncio.create_task(store.commit(exe, []))
        task.cancel()  # before it ever ran: nothing is sent
        with pytest.raises(asyncio.CancelledError):
            await task
        assert exe.version == 2 and proxy.requests == sent
        proxy.delay = 0
        stored = await store.load("c")
        assert stored is not None and stored.version == 2
        assert len(await store.pending_outbox()) == 1
        await store.close()

    asyncio.run(main())


def test_a_cancelled_call_on_a_file_settles_too(tmp_path: Path) -> None:
    """On a local file each call runs on a worker thread: a cancellation waits for it."""

    async def main() -> None:
        store = await AsyncLibsqlStore.create(tmp_path / "c.db")
        exe = Execution(id="c", definition_id="d")
        for n in range(30):
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(store.commit(exe, [(None, Event(name="x"))]), n / 10_000)
            stored = await store.load("c")
            assert exe.version == (0 if stored is None else stored.version)
            assert len(await store.pending_outbox()) == exe.version
        await store.close()

    asyncio.run(main())


# --- TLS ---


def test_tls_urls_are_verified_against_the_system_trust_store(
    server: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sqld behind a TLS-terminating proxy whose certificate a throwaway CA signed; the CA
    is made trusted the way an operator does, through SSL_CERT_FILE."""
    ca = trustme.CA()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ca.issue_cert("localhost").configure_cert(context)
    ca_file = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(ca_file))
    with Proxy(server.port or 0, tls=context) as proxy:
        monkeypatch.setenv("SSL_CERT_FILE", str(ca_file))
        for scheme in ("https", "libsql"):
            with LibsqlStore(proxy.url(scheme, "localhost"), auth_token=server.token) as store:
                exe = Execution(id=f"tls-{scheme}", definition_id="d")
                step(store, exe, 1)
                assert store.load(exe.id) == exe

        async def via_async() -> Execution | None:
            store = await AsyncLibsqlStore.create(
                proxy.url("https", "localhost"), auth_token=server.token
            )
            await store.commit(Execution(id="tls-async", definition_id="d"), [])
            loaded = await store.load("tls-async")
            await store.close()
            return loaded

        assert asyncio.run(via_async()) is not None
        assert proxy.requests > 0

        monkeypatch.setenv("SSL_CERT_FILE", str(tmp_path / "no-such-bundle.pem"))
        monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path))
        with pytest.raises(StoreError, match="CERTIFICATE_VERIFY_FAILED") as info:
            LibsqlStore(proxy.url("https", "localhost"), auth_token=server.token)
        assert server.token not in str(info.value)


# --- values come back exactly ---


def test_floats_and_wide_integers_travel_exactly(server: SqldServer) -> None:
    """sqld's JSON parser rounds some doubles: the store sends them as text (see hrana.py),
    so a swept timer's fire_at deletes it, and integers beyond 2**53 keep every digit."""
    rng = random.Random(7)
    times = [rng.uniform(1e9, 2e9) for _ in range(200)] + [0.1, 1 / 3, 5e-324, 1e300]
    with LibsqlStore(server.url, auth_token=server.token) as store:
        for i, at in enumerate(times):
            store.commit(
                Execution(id=f"t{i:03d}", definition_id="d"), [], timers=[TimerOp.schedule("p", at)]
            )
        due = store.due_timers(2e300)
        assert sorted(at for _, _, at in due) == sorted(times)
        for eid, path, at in due:
            store.delete_timer(eid, path, at)
        assert store.due_timers(2e300) == []

        for version in (2**53 + 1, 2**53 + 2, 2**63 - 1):
            record = DefinitionRecord(definition_id="wide", version=version, digest="x", source={})
            assert store.publish_definition(record).version == version
            assert store.load_definition("wide", version) == record


# --- a batch refused as busy is sent again, within busy_timeout ---


def test_a_batch_the_server_refused_as_busy_is_sent_again_within_busy_timeout(
    server: SqldServer,
) -> None:
    """sqld answers SQLITE_BUSY when it cannot hand a batch the write lock (a checkpoint
    holds it; the batch's snapshot went stale): the batch rolled back, so it is sent again
    after a pause, for up to busy_timeout. The refusal is injected in front of the real
    server (its own reply, word for word), since sqld gives it only under load."""
    store = LibsqlStore(server.url, auth_token=server.token, busy_timeout=0.3)
    conn = store._conn
    real = conn._client
    refusals = 2
    sent = 0

    class Refusing:
        """The real client, but a batch gets sqld's busy reply while refusals last."""

        def post(self, path: str, body: bytes) -> http.Response:
            nonlocal refusals, sent
            sent += 1
            requests = json.loads(body)["requests"]  # a write's end with a close; a read not
            if "batch" not in requests[0] or refusals == 0:
                return real.post(path, body)
            refusals -= 1
            busy = {"message": "SQLite error: database is locked", "code": "SQLITE_BUSY"}
            results = []
            for request in requests[:-1]:
                steps = request["batch"]["steps"]
                result = {
                    "step_results": [None] * len(steps),
                    "step_errors": [busy] + [None] * (len(steps) - 1),
                }
                results.append({"type": "ok", "response": {"type": "batch", "result": result}})
            close = {"type": "ok", "response": {"type": "close"}}
            reply = {"baton": None, "base_url": None, "results": [*results, close]}
            return http.Response(200, {}, json.dumps(reply).encode())

    conn._client = Refusing()
    try:
        exe = Execution(id="busy", definition_id="d")
        step(store, exe, 1)
        assert (sent, exe.version) == (3, 1)  # refused twice, then it landed
        refusals = 1_000_000
        with pytest.raises(StoreBusy):
            step(store, exe, 2)
        assert exe.version == 1 and sent > 4
        refusals = 0
        assert store.load("busy").version == 1  # type: ignore[union-attr]
    finally:
        conn._client = real
        store.close()
