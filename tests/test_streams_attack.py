"""A hostile review of the reads' kept streams (`hrana._Streams`, be583a4): against real
sqld servers (the session's, or one of the test's own where it must be restarted or
configured), the store's HTTP clients wrapped only to record or alter the bodies."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore
from harel_store.connection import hrana, http
from harel_store.errors import StoreError
from tests.proxy import Proxy
from tests.sqld import SqldServer, free_port

pytestmark = pytest.mark.sqld


def conn_of(store: LibsqlStore) -> hrana.HranaConnection:
    conn = store._conn
    assert isinstance(conn, hrana.HranaConnection)
    return conn


def raw(server: SqldServer, body: dict[str, Any]) -> http.Response:
    """One pipeline sent by hand, beside the store."""
    client = http.Client(
        server.url,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {server.token}"},
        timeout=5.0,
        ssl_context=None,
    )
    try:
        return client.post("/v3/pipeline", json.dumps(body).encode())
    finally:
        client.close()


def still_open(server: SqldServer, baton: str) -> bool:
    """Whether the server still has the stream of ``baton`` (closing it, if so)."""
    return raw(server, {"baton": baton, "requests": [{"type": "close"}]}).status == 200


class Tap:
    """A store's sync client: each read's body and answer recorded, the answer altered by
    ``alter`` (a function of the answer's JSON), each baton's use checked sequential."""

    def __init__(self, real: Any, alter: Any = None) -> None:
        self.real = real
        self.alter = alter
        self.sent: list[dict[str, Any]] = []
        self.answers: list[dict[str, Any] | None] = []
        self.flying: set[str] = set()
        self.twice: list[str] = []
        self.lock = threading.Lock()

    def close(self) -> None:
        self.real.close()

    def _before(self, body: bytes) -> str | None:
        sent = json.loads(body)
        baton = sent.get("baton")
        with self.lock:
            self.sent.append(sent)
            if baton is not None:
                if baton in self.flying:
                    self.twice.append(baton)
                self.flying.add(baton)
        return baton

    def _after(self, baton: str | None, answer: http.Response) -> http.Response:
        with self.lock:
            self.flying.discard(baton)  # type: ignore[arg-type]
        reply = json.loads(answer.body) if answer.status == 200 else None
        with self.lock:
            self.answers.append(reply)
        if reply is not None and self.alter is not None:
            answer = http.Response(
                answer.status, answer.headers, json.dumps(self.alter(reply)).encode()
            )
        return answer

    def post(self, path: str, body: bytes) -> http.Response:
        baton = self._before(body)
        try:
            answer = self.real.post(path, body)
        except BaseException:
            with self.lock:
                self.flying.discard(baton)  # type: ignore[arg-type]
            raise
        return self._after(baton, answer)


class ATap(Tap):
    async def post(self, path: str, body: bytes) -> http.Response:  # type: ignore[override]
        baton = self._before(body)
        try:
            answer = await self.real.post(path, body)
        except BaseException:
            with self.lock:
                self.flying.discard(baton)  # type: ignore[arg-type]
            raise
        return self._after(baton, answer)


def tap(store: LibsqlStore, alter: Any = None) -> Tap:
    conn = conn_of(store)
    t = Tap(conn._client, alter)
    conn._client = t  # type: ignore[assignment]
    return t


def consistent(streams: hrana._Streams) -> None:
    """Nothing in use: every stream counted is idle, and at most STREAMS."""
    assert streams._open == len(streams._idle) <= hrana.STREAMS


def migrated_sqld(path: Path, port: int, *extra_args: str) -> Iterator[SqldServer]:
    """A sqld of the test's own on ``port``, migrated; killed after."""
    server = SqldServer(path, auth=True, port=port, extra_args=extra_args)
    server.start()
    LibsqlStore(server.url, auth_token=server.token, migrate=True).close()
    try:
        yield server
    finally:
        server.kill()


@pytest.fixture
def own_server(tmp_path: Path) -> Iterator[SqldServer]:
    """A sqld of the test's own (it is killed and started again), migrated."""
    yield from migrated_sqld(tmp_path / "own", free_port())


def pooled(store: LibsqlStore, proxy: Proxy, n: int, execution_id: str) -> None:
    """``n`` reads at once (the proxy holds each a while): ``n`` streams kept idle."""
    proxy.delay = 0.15
    try:
        threads = [threading.Thread(target=store.load, args=(execution_id,)) for _ in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        proxy.delay = 0
    assert len(conn_of(store)._streams._idle) == n


# --- a server restart: every pooled baton unknown at once ---


def test_a_read_after_a_server_restart_succeeds_whatever_the_pool_held(
    own_server: SqldServer,
) -> None:
    """sqld killed and started again: each kept baton is unknown to it (HTTP 400). The
    read's second try must go on a new stream; it takes the next pooled baton, refused too,
    and the read fails with HTTP 400."""
    with (
        Proxy(own_server.port or 0) as proxy,
        LibsqlStore(proxy.url(), auth_token=own_server.token) as store,
    ):
        store.save(Execution(id="r", definition_id="d"))
        pooled(store, proxy, 2, "r")
        own_server.kill()
        own_server.start()
        sent = tap(store)
        loaded = store.load("r")  # fails: HTTP 400 ... stream handle ... not found
        assert loaded is not None and loaded.version == 1
        assert sent.sent[-1]["baton"] is None  # the second try on a new stream
        consistent(conn_of(store)._streams)


def test_every_read_after_a_server_restart_succeeds(own_server: SqldServer) -> None:
    """Four kept streams, a restart: no read of the four after it may fail."""
    with (
        Proxy(own_server.port or 0) as proxy,
        LibsqlStore(proxy.url(), auth_token=own_server.token) as store,
    ):
        store.save(Execution(id="r4", definition_id="d"))
        pooled(store, proxy, hrana.STREAMS, "r4")
        own_server.kill()
        own_server.start()
        failed = []
        for _ in range(hrana.STREAMS):
            try:
                store.load("r4")
            except StoreError as exc:
                failed.append(str(exc)[:80])
        assert failed == []


# --- sticky sessions: sqld's answers name a base_url ---


@pytest.fixture
def sticky_server(tmp_path: Path) -> Iterator[SqldServer]:
    """A sqld run with --http-self-url (sticky sessions, as a fleet of servers behind one
    name has): every answer names it as its base_url."""
    port = free_port()
    yield from migrated_sqld(
        tmp_path / "sticky", port, "--http-self-url", f"http://127.0.0.1:{port}"
    )


def test_a_stream_not_kept_for_its_base_url_is_not_left_open_on_the_server(
    sticky_server: SqldServer,
) -> None:
    """A server naming a base_url (sticky sessions): the first answer that names it turns
    the keeping off; every read after goes on a stream it closes (as before streams were
    kept), and none of theirs is left open on the server."""
    with LibsqlStore(sticky_server.url, auth_token=sticky_server.token) as store:
        store.save(Execution(id="b", definition_id="d"))
        sent = tap(store)
        for _ in range(5):
            assert store.load("b") is not None
        reads = [
            (b, a)
            for b, a in zip(sent.sent, sent.answers, strict=True)
            if [r["type"] for r in b["requests"]] == ["execute", "close"]
        ]
        assert len(reads) == 5
        assert all(a is not None and a.get("base_url") for _, a in reads)  # sticky, indeed
        assert all(b["baton"] is None for b, _ in reads)
        left_open = [
            a["baton"] for _, a in reads if a["baton"] and still_open(sticky_server, a["baton"])
        ]
        assert left_open == []
        consistent(conn_of(store)._streams)


# --- the store closed: its kept streams ---


def test_closing_the_store_closes_its_kept_streams_on_the_server(server: SqldServer) -> None:
    """close() forgets the pooled batons without closing their streams: sqld keeps up to
    STREAMS database connections of a closed store until they expire (10 s)."""
    with Proxy(server.port or 0) as proxy:
        store = LibsqlStore(proxy.url(), auth_token=server.token)
        store.save(Execution(id="c", definition_id="d"))
        pooled(store, proxy, 3, "c")
        batons = [b for b, _ in conn_of(store)._streams._idle]
        store.close()
        assert [b for b in batons if still_open(server, b)] == []  # fails: all 3 open


def test_the_store_closed_as_a_thread_reads_is_a_store_error(server: SqldServer) -> None:
    """close() from another thread between the read's closed check and its post: the sync
    client raises its raw RuntimeError('closed') (the async path turns it into 'closed')."""
    store = LibsqlStore(server.url, auth_token=server.token)
    store.save(Execution(id="k", definition_id="d"))
    assert store.load("k") is not None
    conn = conn_of(store)
    real = conn._client

    class ClosingFirst:
        def close(self) -> None:
            real.close()

        def post(self, path: str, body: bytes) -> http.Response:
            store.close()  # as another thread would, just now
            return real.post(path, body)

    conn._client = ClosingFirst()  # type: ignore[assignment]
    with pytest.raises(StoreError, match="closed"):  # fails: RuntimeError('closed')
        store.load("k")
    consistent(conn._streams)


# --- things that held (each could have failed) ---


def test_a_reply_without_a_baton_is_a_clear_error_and_the_count_holds(server: SqldServer) -> None:
    def no_baton(reply: dict[str, Any]) -> dict[str, Any]:
        reply.pop("baton", None)
        return reply

    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="n", definition_id="d"))
        sent = tap(store, no_baton)
        for _ in range(3):
            try:
                loaded = store.load("n")
                assert loaded is not None
            except StoreError as exc:
                assert "baton" in str(exc) and server.token not in str(exc)
        streams = conn_of(store)._streams
        consistent(streams)
        assert streams._open == 0
        assert all(b["baton"] is None for b in sent.sent[1:])  # none kept


def test_a_kept_stream_refused_for_its_token_is_an_auth_error_and_the_count_holds(
    server: SqldServer,
) -> None:
    with (
        Proxy(server.port or 0) as proxy,
        LibsqlStore(proxy.url(), auth_token=server.token) as store,
    ):
        store.save(Execution(id="a", definition_id="d"))
        pooled(store, proxy, 3, "a")
        conn = conn_of(store)
        good = conn._client
        bad_token = server.foreign_token()
        conn._client = http.Client(
            proxy.url(),
            headers={
                "Content-Type": "application/json",
                "Authorization": f"Bearer {bad_token}",
            },
            timeout=5.0,
            ssl_context=None,
        )
        with pytest.raises(StoreError, match="authentication failed") as caught:
            store.load("a")
        assert bad_token not in str(caught.value) and server.token not in str(caught.value)
        conn._client.close()
        conn._client = good
        consistent(conn._streams)
        assert store.load("a") is not None
        consistent(conn._streams)


def test_a_timed_out_read_lets_its_stream_go_and_the_next_reads_work(server: SqldServer) -> None:
    with (
        Proxy(server.port or 0) as proxy,
        LibsqlStore(proxy.url(), auth_token=server.token, timeout=0.5) as store,
    ):
        store.save(Execution(id="t", definition_id="d"))
        assert store.load("t") is not None
        conn = conn_of(store)
        sent = tap(store)
        proxy.mode = "hang"
        with pytest.raises(StoreError, match="no answer"):
            store.load("t")
        proxy.mode = "forward"
        consistent(conn._streams)
        timed_out = sent.sent[-1]["baton"]
        assert timed_out is not None
        for _ in range(3):
            assert store.load("t") is not None
        assert [b["baton"] for b in sent.sent[1:]].count(timed_out) == 0  # never again


def test_cancelled_async_reads_let_their_streams_go(server: SqldServer) -> None:
    async def main() -> None:
        with Proxy(server.port or 0) as proxy:
            store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
            await store.save(Execution(id="x", definition_id="d"))
            await asyncio.gather(*(store.load("x") for _ in range(3)))
            remote = store._remote
            assert remote is not None
            atap = ATap(remote._aclient)
            remote._aclient = atap  # type: ignore[assignment]
            proxy.delay = 0.3
            tasks = [asyncio.create_task(store.load("x")) for _ in range(6)]
            await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            proxy.delay = 0
            consistent(remote._streams)
            cancelled = {b["baton"] for b in atap.sent} - {None}
            await asyncio.gather(*(store.load("x") for _ in range(6)))
            consistent(remote._streams)
            later = [b["baton"] for b in atap.sent[6:]]
            assert not cancelled & set(later)  # a cancelled read's baton never used again
            assert atap.twice == []
            await store.close()

    asyncio.run(main())


def test_threads_and_two_loops_reading_at_once_each_get_their_own_answer(
    server: SqldServer,
) -> None:
    """Threads and the tasks of two loops (in threads) read at once, each its own row:
    each gets its own; a baton is never in flight twice nor used twice."""
    with Proxy(server.port or 0) as proxy:
        store = LibsqlStore(proxy.url(), auth_token=server.token)
        ids = [f"e{i}" for i in range(8)]
        for i, eid in enumerate(ids):
            exe = Execution(id=eid, definition_id="d")
            store.save(exe)
            for _ in range(i):
                store.commit(exe, [])
        conn = conn_of(store)
        sync_tap = tap(store)
        async_tap = ATap(conn._aclient)
        conn._aclient = async_tap  # type: ignore[assignment]
        proxy.delay = 0.01
        wrong: list[str] = []
        errors: list[BaseException] = []

        def check(eid: str, loaded: Any) -> None:
            if loaded is None or loaded.id != eid or loaded.version != ids.index(eid) + 1:
                wrong.append(eid)

        def thread_reads(k: int) -> None:
            try:
                for n in range(6):
                    eid = ids[(k + n) % len(ids)]
                    check(eid, store.load(eid))
            except BaseException as exc:
                errors.append(exc)

        def loop_reads(k: int) -> None:
            astore = AsyncLibsqlStore(store)  # the same connection, from this loop

            async def one(eid: str) -> None:
                check(eid, await astore.load(eid))

            async def main() -> None:
                await asyncio.gather(*(one(ids[(k + n) % len(ids)]) for n in range(8)))

            try:
                asyncio.run(main())
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=thread_reads, args=(k,)) for k in range(4)]
        threads += [threading.Thread(target=loop_reads, args=(k,)) for k in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        proxy.delay = 0
        assert errors == [] and wrong == []
        assert sync_tap.twice == [] and async_tap.twice == []
        used = [b["baton"] for b in sync_tap.sent + async_tap.sent if b["baton"] is not None]
        assert len(used) == len(set(used))  # each baton once: Hrana's next one is new
        consistent(conn._streams)
        store.close()


def test_every_pooled_stream_sees_a_commit_made_after_it_was_opened(server: SqldServer) -> None:
    """STREAMS streams opened, a commit by another store, then STREAMS reads at once (so
    each goes on a different one of the older streams): each sees the commit."""
    with (
        Proxy(server.port or 0) as proxy,
        LibsqlStore(proxy.url(), auth_token=server.token) as reader,
        LibsqlStore(server.url, auth_token=server.token) as writer,
    ):
        exe = Execution(id="f", definition_id="d")
        writer.save(exe)
        for version in range(2, 5):
            pooled(reader, proxy, hrana.STREAMS, "f")
            writer.commit(exe, [])
            seen: list[int] = []
            sent = tap(reader)
            proxy.delay = 0.1

            def read(seen: list[int] = seen) -> None:
                loaded = reader.load("f")
                seen.append(loaded.version if loaded else -1)

            threads = [threading.Thread(target=read) for _ in range(hrana.STREAMS)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            proxy.delay = 0
            conn_of(reader)._client = sent.real  # type: ignore[assignment]
            assert seen == [version] * hrana.STREAMS
            assert all(b["baton"] is not None for b in sent.sent)


def test_an_answer_naming_another_server_is_not_kept_and_the_count_holds(
    server: SqldServer,
) -> None:
    def elsewhere(reply: dict[str, Any]) -> dict[str, Any]:
        reply["base_url"] = "http://elsewhere.invalid:1"
        return reply

    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="o", definition_id="d"))
        assert store.load("o") is not None
        sent = tap(store, elsewhere)
        for _ in range(3):
            assert store.load("o") is not None
        consistent(conn_of(store)._streams)
        assert conn_of(store)._streams._open == 0
        assert [b["baton"] for b in sent.sent][1:] == [None, None]


@pytest.mark.slow
def test_a_stream_used_now_and_then_outlives_the_servers_expiry(server: SqldServer) -> None:
    """A read every 4.5 s for 13.5 s, on the one kept stream: sqld's 10 s count from its
    last use, so it is never refused (no read sent twice)."""
    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="l", definition_id="d"))
        assert store.load("l") is not None
        sent = tap(store)
        for _ in range(3):
            time.sleep(4.5)
            assert store.load("l") is not None
        assert len(sent.sent) == 3 and all(b["baton"] for b in sent.sent)
        consistent(conn_of(store)._streams)


def test_a_5xx_or_a_garbled_answer_on_a_kept_stream_keeps_the_count(server: SqldServer) -> None:
    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="g", definition_id="d"))
        assert store.load("g") is not None
        conn = conn_of(store)
        real = conn._client
        answers = iter(
            [
                http.Response(503, {}, b"busy " + server.token.encode()),
                http.Response(200, {}, b"[1]"),
            ]
        )

        class Bad:
            def close(self) -> None:
                real.close()

            def post(self, path: str, body: bytes) -> http.Response:
                real.post(path, body)  # the server sees it; the store gets the bad answer
                return next(answers)

        conn._client = Bad()  # type: ignore[assignment]
        with pytest.raises(StoreError) as caught:
            store.load("g")  # 503 on the kept stream, then a garbled answer on a new one
        assert server.token not in str(caught.value)
        conn._client = real
        consistent(conn._streams)
        assert store.load("g") is not None
        consistent(conn._streams)
