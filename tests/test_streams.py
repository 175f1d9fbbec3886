"""Reads on the server's streams kept open (`hrana._Streams`, issue 51): a read goes on a
stream an earlier read left open (its Hrana baton), which saves sqld a database connection
a request; never a stale read, an expired stream read again anew, at most `STREAMS` kept.
Against the session's real sqld, the client's requests recorded on their way."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore
from harel_store.connection import hrana, http
from tests.proxy import Proxy
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld


class Recorded:
    """The store's sync client, each request's body and answer's status recorded."""

    def __init__(self, real: http.Client) -> None:
        self.real = real
        self.sent: list[dict[str, Any]] = []
        self.statuses: list[int] = []

    def close(self) -> None:
        self.real.close()

    def post(self, path: str, body: bytes) -> http.Response:
        self.sent.append(json.loads(body))
        answer = self.real.post(path, body)
        self.statuses.append(answer.status)
        return answer


def recorded(store: LibsqlStore) -> Recorded:
    conn = store._conn
    assert isinstance(conn, hrana.HranaConnection)
    recorder = Recorded(conn._client)
    conn._client = recorder  # type: ignore[assignment]
    return recorder


def kinds(body: dict[str, Any]) -> list[str]:
    return [r["type"] for r in body["requests"]]


def test_reads_go_on_one_stream_and_writes_on_their_own(server: SqldServer) -> None:
    with LibsqlStore(server.url, auth_token=server.token) as store:
        exe = Execution(id="s", definition_id="d")
        store.save(exe)
        sent = recorded(store)
        for _ in range(3):
            loaded = store.load("s")
            assert loaded is not None and loaded.version == 1
        store.commit(exe, [])
        reads = [b for b in sent.sent if kinds(b) == ["execute"]]
        assert len(reads) == 3  # no close: the stream is kept
        batons = [b["baton"] for b in reads]  # the one the store's opening reads left
        assert None not in batons and len(set(batons)) == 3  # each answer's own baton
        assert kinds(sent.sent[-1]) == ["batch", "close"]  # a write: a stream of its own


def test_a_read_on_a_kept_stream_sees_every_commit_made_before_it(server: SqldServer) -> None:
    """The stream was opened before the commits (of this store and of another): its next
    read sees them (no snapshot is held between reads)."""
    with (
        LibsqlStore(server.url, auth_token=server.token) as reader,
        LibsqlStore(server.url, auth_token=server.token) as writer,
    ):
        exe = Execution(id="fresh", definition_id="d")
        writer.save(exe)
        sent = recorded(reader)
        for version in range(1, 4):
            loaded = reader.load("fresh")
            assert loaded is not None and loaded.version == version
            writer.commit(exe, [])
            reader.commit(Execution(id=f"r-{version}", definition_id="d"), [])
            assert reader.load(f"r-{version}") is not None
        assert all(b["baton"] is not None for b in sent.sent[1:] if kinds(b) == ["execute"])


def test_a_stream_the_server_let_go_is_read_again_anew(server: SqldServer) -> None:
    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="x", definition_id="d"))
        assert store.load("x") is not None
        streams = store._conn._streams  # type: ignore[attr-defined]
        assert [baton for baton, _ in streams._idle]
        streams._idle = [("not-a-baton", since) for _, since in streams._idle]
        sent = recorded(store)
        loaded = store.load("x")
        assert loaded is not None and loaded.version == 1
        assert sent.statuses == [400, 200]  # refused, then on a new stream
        assert [b["baton"] for b in sent.sent] == ["not-a-baton", None]
        assert store.load("x") is not None and sent.sent[-1]["baton"] not in (None, "not-a-baton")


def test_a_stream_idle_too_long_is_let_go(
    server: SqldServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hrana, "STREAM_IDLE", 0.0)
    with LibsqlStore(server.url, auth_token=server.token) as store:
        store.save(Execution(id="i", definition_id="d"))
        sent = recorded(store)
        assert store.load("i") is not None and store.load("i") is not None
        assert [b["baton"] for b in sent.sent] == [None, None]  # each on a new stream
        assert store._conn._streams._open == 1  # type: ignore[attr-defined]


def test_at_most_streams_are_kept_the_other_reads_close_theirs(
    proxy: Proxy, server: SqldServer
) -> None:
    async def main() -> None:
        store = await AsyncLibsqlStore.create(proxy.url(), auth_token=server.token)
        await store.save(Execution(id="m", definition_id="d"))
        proxy.delay = 0.1  # the reads are in flight together
        loaded = await asyncio.gather(*(store.load("m") for _ in range(3 * hrana.STREAMS)))
        assert all(e is not None and e.version == 1 for e in loaded)
        streams = store._remote._streams  # type: ignore[union-attr]
        assert streams._open == len(streams._idle) == hrana.STREAMS
        proxy.delay = 0
        await store.close()

    asyncio.run(main())
