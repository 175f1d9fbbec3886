"""The store against a real libSQL server (sqld): migrations there, replica visibility, auth,
an outage, an expired stream. The contract suite itself runs on sqld too (conftest kinds
``libsql-remote`` and ``libsql-replica``); these are what it cannot show.

Tests that stop the server or need their own auth setup start a ``SqldServer`` of their
own; the rest share the session's ``sqld`` and empty it first (``reset_remote``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import (
    Event,
    Execution,
    LibsqlStore,
    OutcomeUnknown,
    SchemaError,
    StoreError,
    TimerOp,
)
from harel_store.connection.http import ConnectFailed
from harel_store.schema import describe
from harel_store.sql import HEAD, MIGRATIONS
from tests.helpers import (
    ALEMBIC,
    ROWS_0003,
    check_0003_rows,
    rows_0003,
    stage_0003,
)
from tests.in_process import alembic_in_process
from tests.sqld import SqldServer

pytestmark = pytest.mark.sqld
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def own_server(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[SqldServer]:
    """A server of this test's own (it will be stopped, or must start empty); log on failure."""
    failed = request.session.testsfailed
    srv = SqldServer(tmp_path / "sqld", auth=True)
    srv.start()
    yield srv
    srv.stop()
    if request.session.testsfailed > failed:
        print(f"\nsqld log kept at {srv.log_path}:\n{srv.log_tail()}")


def primary(srv: SqldServer) -> LibsqlStore:
    return LibsqlStore(srv.url, auth_token=srv.token)


def replica(srv: SqldServer, path: Path, **kwargs: Any) -> LibsqlStore:
    return LibsqlStore(path, sync_url=srv.url, auth_token=srv.token, **kwargs)


def step(store: LibsqlStore, exe: Execution, n: int) -> None:
    """A typical commit: one emit, the dedupe marker, one timer, a trace step."""
    store.commit(
        exe,
        [(None, Event(name="tick", id=f"emit-{exe.id}-{n}"))],
        processed_event_id=f"in-{exe.id}-{n}",
        timers=[TimerOp.schedule("t", float(n))],
        trace={"n": n},
    )


# --- 1. URLs ---


@pytest.mark.parametrize("scheme", ["libsql", "https"])
def test_a_tls_url_is_taken_as_remote_and_fails_cleanly_against_plain_http(
    scheme: str, server: SqldServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"{scheme}://127.0.0.1:{server.port}"
    with pytest.raises(StoreError) as info:
        LibsqlStore(url, auth_token=server.token)
    # Not OutcomeUnknown: the TLS handshake failed, so nothing was sent.
    assert type(info.value) is StoreError and isinstance(info.value.__cause__, ConnectFailed)
    # It went remote, over TLS:
    assert str(info.value).startswith(f"cannot reach {url}: TLS handshake failed: [SSL")
    hint = f"for a plain-HTTP server use http://127.0.0.1:{server.port} or libsql://"
    assert "the server answered without TLS" in str(info.value) and hint in str(info.value)
    assert server.token not in "".join(traceback.format_exception(info.value))
    assert os.listdir(tmp_path) == []  # not opened as a local file named like the URL


# --- 2. migrations on the server ---


def alembic(srv: SqldServer, *args: str) -> str:
    url = f"sqlite+libsql://127.0.0.1:{srv.port}?secure=false"
    result = alembic_in_process(
        [*ALEMBIC, "-x", f"url={url}", *args],
        cwd=REPO,
        env={**os.environ, "HAREL_AUTH_TOKEN": srv.token},
    )
    assert result.returncode == 0, result.stderr
    assert srv.token not in result.stdout + result.stderr
    return result.stdout + result.stderr


def harel_tables(srv: SqldServer) -> set[str]:
    names = srv.rows("SELECT name FROM sqlite_master WHERE type = 'table'")
    return {n for (n,) in names if n.startswith("harel_")}


@pytest.mark.slow
def test_alembic_upgrades_downgrades_and_reupgrades_the_server(own_server: SqldServer) -> None:
    with pytest.raises(SchemaError, match=r"has no harel-store schema.*harel-store migrate"):
        primary(own_server)
    alembic(own_server, "upgrade", "head")
    assert own_server.rows("SELECT version_num FROM alembic_version") == [(HEAD,)]
    with primary(own_server) as store:
        step(store, Execution(id="a", definition_id="d"), 1)

    alembic(own_server, "downgrade", "-1")
    behind = MIGRATIONS[-2].revision
    with pytest.raises(SchemaError) as info:
        primary(own_server)
    message = str(info.value)
    assert f"is at {behind!r}, behind head {HEAD!r}" in message
    assert f"harel-store migrate --url {own_server.url}" in message
    assert own_server.token not in message

    alembic(own_server, "downgrade", "base")
    assert harel_tables(own_server) == set()
    alembic(own_server, "upgrade", "head")
    with primary(own_server) as store:
        assert store.schema_revision == HEAD
        step(store, Execution(id="a", definition_id="d"), 1)
        assert store.load("a").version == 1  # type: ignore[union-attr]


def test_the_store_migrates_a_server_through_0003_keeping_every_row(
    own_server: SqldServer,
) -> None:
    """0003 rebuilds three tables (create, copy, drop, rename) in the one batch of its
    migration; on sqld, rows and all."""
    import libsql

    alembic(own_server, "upgrade", "0002")
    conn = libsql.connect(own_server.url, auth_token=own_server.token)
    try:
        stage_0003(conn)
    finally:
        conn.close()
    with LibsqlStore(own_server.url, auth_token=own_server.token, migrate=True) as store:
        assert store.schema_revision == HEAD
        check_0003_rows(store)
    conn = libsql.connect(own_server.url, auth_token=own_server.token)
    try:
        tables = describe(conn)
    finally:
        conn.close()
    assert all(tables[table]["without_rowid"] for table in ROWS_0003)
    alembic(own_server, "downgrade", "0002")
    conn = libsql.connect(own_server.url, auth_token=own_server.token)
    try:
        rows = rows_0003(conn)
    finally:
        conn.close()
    staged = {table: sorted(rows) for table, rows in ROWS_0003.items()}
    staged["harel_trace"].append(("b", 8, '{"s":8}'))
    assert rows == staged


# --- 3. embedded replicas: own writes at once, others after sync or the interval ---


def test_replicas_read_their_own_writes_and_others_after_sync_or_interval(
    server: SqldServer, tmp_path: Path
) -> None:
    with (
        replica(server, tmp_path / "w.db") as writer,
        replica(server, tmp_path / "r.db") as reader,
        replica(server, tmp_path / "i.db", sync_interval=0.2) as polling,
    ):
        exe = Execution(id="x", definition_id="d")
        step(writer, exe, 1)
        assert writer.load("x").version == 1  # type: ignore[union-attr]
        assert writer.is_processed("x", "in-x-1")
        assert reader.load("x") is None  # a replica reads locally: stale until it syncs
        reader.sync()
        assert reader.load("x").version == 1  # type: ignore[union-attr]
        assert [e.event.id for e in reader.pending_outbox()] == ["emit-x-1"]

        step(writer, exe, 2)
        deadline = time.monotonic() + 30
        while (seen := polling.load("x")) is None or seen.version < 2:
            assert time.monotonic() < deadline, "the sync_interval never brought version 2"
            time.sleep(0.05)
        assert reader.load("x").version == 1  # type: ignore[union-attr]  # still no sync


# --- 5. auth ---


@pytest.mark.parametrize("which", ["missing", "foreign", "expired", "garbage"])
def test_a_refused_token_says_authentication_failed_and_never_shows_the_token(
    which: str, server: SqldServer
) -> None:
    token = {
        "missing": "",
        "foreign": SqldServer.foreign_token(),
        "expired": server.mint_token(expires_in=-3600),
        "garbage": "not-a-jwt-SECRET-5f0c1e",
    }[which]
    with pytest.raises(StoreError, match=r"^authentication failed") as info:
        LibsqlStore(server.url, auth_token=token)
    if token:
        assert token not in "".join(traceback.format_exception(info.value))
    with primary(server) as store:  # the right one works, and its repr keeps it to itself
        assert store.load("nothing") is None
        assert server.token not in repr(store)


def test_a_replica_with_a_refused_token_says_authentication_failed(
    server: SqldServer, tmp_path: Path
) -> None:
    token = SqldServer.foreign_token()
    with pytest.raises(StoreError, match=r"^authentication failed") as info:
        LibsqlStore(tmp_path / "r.db", sync_url=server.url, auth_token=token)
    assert token not in "".join(traceback.format_exception(info.value))


SILENT_REPLICA = """
import os, sys
from harel_store import Execution, LibsqlStore, StoreError
url, token, wrong, path = sys.argv[1:5]
with LibsqlStore(path, sync_url=url, auth_token=token) as store:
    assert "RUST_LOG" not in os.environ  # set only around the import: children never see it
    store.commit(Execution(id="quiet", definition_id="d"), [])
    store.sync()
    assert store.load("quiet").version == 1
try:
    LibsqlStore(path + "-2", sync_url=url, auth_token=wrong)
except StoreError as exc:
    print(repr(exc), file=sys.stderr)
"""


def test_a_replica_process_prints_nothing_and_logs_no_token(
    server: SqldServer, tmp_path: Path
) -> None:
    """libsql's Rust client logs to stdout unless RUST_LOG is set: the store imports it
    with RUST_LOG=off (unless the caller set RUST_LOG)."""
    wrong = SqldServer.foreign_token()
    env = {k: v for k, v in os.environ.items() if k != "RUST_LOG"}
    env["PYTHONPATH"] = str(REPO)
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            SILENT_REPLICA,
            server.url,
            server.token,
            wrong,
            str(tmp_path / "r.db"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert "authentication failed" in result.stderr
    for token in (server.token, wrong):
        assert token not in result.stdout + result.stderr
    log = server.log_path.read_text(errors="replace")
    assert "Using JWT-based authentication" in log  # sqld logged: the check below reads a log
    assert server.token not in log


# --- 6. faults: the primary goes away and comes back; an idle stream expires ---


def load_primary(srv: SqldServer, eid: str) -> Execution | None:
    with primary(srv) as store:
        return store.load(eid)


@pytest.mark.parametrize("mode", ["remote", "replica"])
def test_an_outage_fails_commits_cleanly_and_the_same_store_recovers(
    mode: str, own_server: SqldServer, tmp_path: Path
) -> None:
    """The server is killed at a random moment of a commit stream: a commit whose request
    was on its way raises OutcomeUnknown (the one in flight; or one sent on a kept-alive
    connection the kill had just reset), one that finds no server StoreError ("cannot
    reach"), and nothing lands half; once the server is back the same store object commits
    again and nothing committed is lost."""
    LibsqlStore(own_server.url, auth_token=own_server.token, migrate=True).close()
    store = primary(own_server) if mode == "remote" else replica(own_server, tmp_path / "r.db")
    exe = Execution(id="e", definition_id="d")
    landed = 0
    killer = threading.Timer(0.3, own_server.kill)
    killer.start()
    try:
        failures = 0
        while failures < 3:  # a few commits against the dead server, all clean failures
            try:
                step(store, exe, landed + 1)
                landed += 1
            except OutcomeUnknown:
                assert exe.version == landed
                failures += 1
            except StoreError as exc:
                assert type(exc) is StoreError, exc  # not a conflict: the server is gone
                assert str(exc).startswith("cannot reach")
                assert exe.version == landed
                failures += 1
        killer.join()
        if mode == "replica" and not store._conn.behind:  # type: ignore[attr-defined]
            assert store.load("e") is not None  # a replica still reads its local copy
        elif mode == "replica":
            # A write of its own landed just before the kill and the sync after it failed:
            # the replica will not answer from a copy that lacks it.
            with pytest.raises(StoreError, match=r"cannot sync with|did not catch up|no answer"):
                store.load("e")
        own_server.start()
        # The commit in flight at the kill either landed whole (its reply lost) or not at all.
        stored = load_primary(own_server, "e")
        assert stored is not None and stored.version in (landed, landed + 1)
        versions = stored.version
        dedupe = own_server.rows("SELECT event_id FROM harel_processed_events")
        assert sorted(dedupe) == sorted((f"in-e-{n}",) for n in range(1, versions + 1))
        outbox = own_server.rows("SELECT json_extract(event, '$.id') FROM harel_outbox")
        assert sorted(outbox) == sorted((f"emit-e-{n}",) for n in range(1, versions + 1))
        assert own_server.rows("SELECT fire_at FROM harel_timers") == [(float(versions),)]
        assert own_server.rows("SELECT count(*) FROM harel_trace") == [(versions,)]

        store.sync()  # a no-op on a remote store
        exe = store.load("e")  # the same store object, never reopened by the caller
        assert exe is not None and exe.version == versions
        step(store, exe, versions + 1)
        assert load_primary(own_server, "e").version == versions + 1  # type: ignore[union-attr]
    finally:
        killer.cancel()
        store.close()


def test_a_remote_store_survives_a_restart_after_a_read(own_server: SqldServer) -> None:
    """A read leaves the remote stream open; a restarted server no longer knows it
    ("invalid baton"): the store opens a new connection instead of failing for good."""
    LibsqlStore(own_server.url, auth_token=own_server.token, migrate=True).close()
    with primary(own_server) as store:
        exe = Execution(id="e", definition_id="d")
        step(store, exe, 1)
        assert store.load("e") is not None
        own_server.restart()
        assert store.load("e").version == 1  # type: ignore[union-attr]
        assert store.load("e") is not None
        own_server.restart()
        step(store, exe, 2)
        assert store.load("e").version == 2  # type: ignore[union-attr]


@pytest.mark.slow
def test_a_remote_store_idle_past_the_stream_expiry_still_works(server: SqldServer) -> None:
    """sqld expires a stream idle for ~10 s (no flag shortens it), after which every call on
    that connection fails; the store replaces the connection and carries on."""
    with primary(server) as store:
        exe = Execution(id="idle", definition_id="d")
        step(store, exe, 1)
        assert store.load("idle") is not None  # a read: leaves the stream open
        time.sleep(11)
        step(store, exe, 2)  # BEGIN meets the expired stream: retried on a new connection
        assert store.load("idle").version == 2  # type: ignore[union-attr]
