"""Items know their database (issue 39): a relay item claimed or listed from one database
and handed to another database's store is refused, nothing written, on every kind of store
(its seq would name another row there); an item built by hand, of no known origin, is taken
as ever; another store of the same database takes it."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from harel_store import Event, Execution, LibsqlStore, OutboxEntry, TimerOp
from harel_store.connection import open_libsql
from tests.conftest import reset_remote


def seed(store: Any, name: str) -> Execution:
    exe = Execution(id="e1", definition_id="d")
    store.commit(
        exe,
        [("t", Event(name=name, id=f"ev-{name}"))],
        timers=[TimerOp.schedule("tick", 1.0)],
        spawns=[("e1.c", "r", {})],
    )
    return exe


def remaining(store: Any) -> tuple[int, int, int]:
    return len(store.pending_outbox()), len(store.pending_spawns()), len(store.due_timers(2.0))


def test_an_item_from_another_database_is_refused_with_nothing_written(
    store: Any, tmp_path: Path
) -> None:
    exe = seed(store, "here")
    with LibsqlStore(tmp_path / "other.db") as other:
        seed(other, "there")  # the same seqs and timer keys as the store's own rows
        claimed = other.claim_work("w", 2.0, lease=60.0)
        items = [item for _, item in claimed.items()]
        listed = [*other.pending_outbox(), *other.pending_spawns(), *other.due_timers(2.0)]
        calls = [
            lambda item: store.ack([item]),
            lambda item: store.fail("w", [item], error="no"),
            lambda item: store.extend("w", [item], lease=5.0),
            lambda item: store.revive([item]),
            lambda item: store.release("w", [item]),
            lambda item: store.attempts_of([item]),
            lambda item: store.commit(exe, [], acks=[item]),
        ]
        for foreign in [*items, *listed]:
            for call in calls:
                with pytest.raises(ValueError, match=r"was read from .*other\.db"):
                    call(foreign)
        assert exe.version == 1  # the refused commit restored it
        assert remaining(store) == (1, 1, 1)
        # Its own store (another object on the same file too) takes them.
        with LibsqlStore(tmp_path / "other.db") as again:
            assert again.ack(items[:1]) == 1
        assert other.ack(items[1:]) == 2
        assert remaining(other) == (0, 0, 0)
    # A hand-built item names no database: taken as before, by seq.
    (mine,) = store.pending_outbox()
    assert store.ack([OutboxEntry(mine.seq, mine.target_id, mine.event)]) == 1


def test_origin_survives_a_copy_and_is_kept_out_of_the_tuple(tmp_path: Path) -> None:
    with LibsqlStore(tmp_path / "a.db") as a, LibsqlStore(tmp_path / "b.db") as b:
        seed(a, "a")
        seed(b, "b")
        (entry,) = a.claim_outbox("w")
        copied = pickle.loads(pickle.dumps(entry))
        assert copied == entry and tuple(copied) == tuple(entry) and len(entry) == 3
        assert repr(entry).startswith("OutboxEntry(seq=1, ")
        with pytest.raises(ValueError, match="outbox entry 1 was read from"):
            b.ack([copied])
        assert a.ack([copied]) == 1


# --- issue 48 class 15: one server, however its URL is spelled, is one database ---

SAME = [
    ("http://h:8080", "http://h:8080/"),
    ("http://h:8080", "HTTP://H:8080"),
    ("http://h:8080/db", "http://h:8080/db/"),
    ("http://h:80", "http://h"),
    ("http://h:80/", "http://h"),
    ("https://h:443", "https://h"),
    ("libsql://h", "https://h:443/"),
    ("libsql://H:8080?tls=0", "http://h:8080"),
    ("ws://h", "http://h:80"),
    ("sqlite+libsql://h:80?secure=false", "http://h"),
    ("http://[::1]:80", "http://[::1]"),
    ("http://[::1]:8080/", "http://[0:0:0:0:0:0:0:1]:8080"),
]
OTHER = [
    ("http://h:8080", "https://h:8080"),
    ("http://h:8080", "http://h:8081"),
    ("http://h:8080/a", "http://h:8080/b"),
    ("http://h:8080/a", "http://h:8080"),
    ("http://h:443", "https://h"),
]


def key_of(url: str) -> str:
    conn = open_libsql(url)  # a remote connection does no I/O until it is used
    try:
        return conn.key
    finally:
        conn.close()


@pytest.mark.parametrize(("one", "other"), SAME)
def test_the_spellings_of_one_server_have_one_key(one: str, other: str) -> None:
    assert key_of(one) == key_of(other)


@pytest.mark.parametrize(("one", "other"), OTHER)
def test_other_servers_have_other_keys(one: str, other: str) -> None:
    assert key_of(one) != key_of(other)


@pytest.mark.sqld
def test_an_item_read_through_one_spelling_is_taken_through_another(server: Any) -> None:
    """The origin check and the in-process wake-ups go by the key: a trailing slash, an
    upper-case scheme or host name is no other database."""
    port = server.port
    spellings = [
        (f"http://127.0.0.1:{port}", f"HTTP://127.0.0.1:{port}/"),
        (f"http://localhost:{port}/", f"http://LocalHost:{port}"),
    ]
    for one, other in spellings:
        reset_remote(server)
        with (
            LibsqlStore(one, auth_token=server.token) as a,
            LibsqlStore(other, auth_token=server.token) as b,
        ):
            assert a.database_key == b.database_key
            seed(a, "here")
            (entry,) = a.claim_outbox("w")
            assert b.ack([entry]) == 1
