"""Fixtures: one contract suite over every way the store can be opened."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import signal
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, LibsqlStore, SqliteStore
from harel_store.connection.local import import_libsql
from tests.helpers import SIGINT_LEFT, SyncFacade, raw

Opener = Callable[..., Any]

# Before any test module imports libsql itself: its Rust log stays off (a replica's background
# sync logs its handshakes otherwise), as the store arranges for its own import.
import_libsql()


def pytest_configure(config: pytest.Config) -> None:
    """With xdist (`-n 3`): a worker holds at most two tests at a time (``--maxschedchunk=1``
    unless given), so the slow tests, handed out first, spread over every worker instead of
    queueing on the first one's initial share. Set here rather than in addopts, which would
    break a run without the plugin (``-p no:xdist``)."""
    if config.pluginmanager.hasplugin("xdist") and config.getoption("maxschedchunk") is None:
        config.option.maxschedchunk = 1


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests marked slow first (each keeping its order): run in parallel, each starts
    while the many short ones run beside it, instead of a long one starting last and
    leaving the other workers idle while it ends."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _sigint_as_found(request: pytest.FixtureRequest) -> Iterator[None]:
    """SIGINT's handler and this thread's blocking of it, as the test found them, after it:
    a test of a KeyboardInterrupt relies on them (one lost its interrupt twice in CI)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    handler = signal.getsignal(signal.SIGINT)
    yield
    changed = []
    if signal.getsignal(signal.SIGINT) is not handler:
        changed.append(f"handler {signal.getsignal(signal.SIGINT)!r}")
        signal.signal(signal.SIGINT, handler)
    if signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []):
        changed.append("blocked")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
    if changed:
        SIGINT_LEFT.append(f"{request.node.nodeid}: {', '.join(changed)}")


def _async_opener(loop: asyncio.AbstractEventLoop) -> Opener:
    def open_async(database: str | Path = ":memory:", **kwargs: Any) -> SyncFacade:
        store = loop.run_until_complete(AsyncLibsqlStore.create(database, **kwargs))
        return SyncFacade(store, loop)

    return open_async


KINDS = [
    "libsql-memory",
    "libsql-file",
    "sqlite-file",
    "async-libsql-file",
    "libsql-remote",
    "libsql-replica",
    "async-libsql-remote",
]


@pytest.fixture(scope="session")
def sqld(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[Any]:
    """One real sqld (token auth on) on 127.0.0.1 for the session; its log is kept on failure."""
    from tests.sqld import SqldServer

    # A new replica's first sync pulls the server's whole replication log, which sqld
    # compacts only at --max-log-size (200 MB by default): late in a session every replica a
    # test opened pulled up to 200 MB of the tests before it (30 s and more, CI red). At 1 MB
    # (it takes whole MB) a replica's setup pulls at most that much of the log (beside the
    # snapshot a compaction left, the database's few pages between tests): the replica
    # tests alone took 72 s instead of 108 on 3 workers, their setups 62 s of worker time
    # instead of 139 (a compaction's window is retried: `replica_helper.RETRIED`).
    server = SqldServer(
        tmp_path_factory.mktemp("sqld"), auth=True, extra_args=["--max-log-size", "1"]
    )
    server.start()
    LibsqlStore(server.url, auth_token=server.token, migrate=True).close()
    yield server
    server.kill()  # a listen stream still lingering would hold a SIGTERM up for seconds
    if request.session.testsfailed:
        print(f"\nsqld log kept at {server.log_path}:\n{server.log_tail()}")


@pytest.fixture
def server(sqld: Any) -> Any:
    """The session's sqld, emptied."""
    reset_remote(sqld)
    return sqld


@pytest.fixture
def serve() -> Iterator[Any]:
    """Starts loopback HTTP test servers (`tests.test_http_client.Server`: each connection a
    handler's thread), closed after the test."""
    from tests.test_http_client import Server

    servers: list[Server] = []

    def start(handler: Any, **kw: Any) -> Server:
        servers.append(Server(handler, **kw))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def one_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop's writes one request at a time (as a thread's go): for the tests of what the
    writes that wait behind the request in flight become (`hrana.FLIGHTS`)."""
    from harel_store.connection import hrana

    monkeypatch.setattr(hrana, "FLIGHTS", 1)


@pytest.fixture
def proxy(server: Any) -> Iterator[Any]:
    """A loopback proxy in front of `server` (`tests.proxy`), to make the network misbehave."""
    from tests.proxy import Proxy

    with Proxy(server.port or 0) as p:
        yield p


@functools.cache
def schema_triggers() -> frozenset[str]:
    """The triggers a migrated database has: any other one is a test's."""
    with LibsqlStore(":memory:") as store:
        rows = raw(store).execute("SELECT name FROM sqlite_master WHERE type = 'trigger'")
        return frozenset(name for (name,) in rows.fetchall())


def reset_remote(server: Any) -> None:
    """Empty the server's database between tests (one server serves the whole session): its
    rows, and the triggers tests added (any the migrations did not make), dropped first, so
    that none of them fires on the deletes or the seed. It all goes as one transaction in
    one request (a request a statement cost a reset 2 to 3 times the server's and this
    process's CPU, and ~800 tests reset), then what it left is read back: libsql's
    executescript over a server says nothing of a statement that failed or of a request
    that did not arrive. When the read differs, the statements go again one at a time (each
    DROP commits alone, the deletes and the seed together), which raises the error there
    is, and what they left is read back again."""
    import libsql

    def quoted(name: str) -> str:
        return '"' + name.replace('"', '""') + '"'

    ours = ", ".join("'" + name.replace("'", "''") + "'" for name in sorted(schema_triggers()))
    conn = libsql.connect(server.url, auth_token=server.token)
    try:
        names = conn.execute(
            "SELECT type, name FROM sqlite_master WHERE "
            f"(type = 'trigger' AND name NOT IN ({ours})) "
            "OR (type = 'table' AND name LIKE 'harel_%') ORDER BY type = 'table'"
        ).fetchall()
        script = [
            f"DROP TRIGGER {quoted(n)}" if t == "trigger" else f"DELETE FROM {quoted(n)}"
            for t, n in names
        ]
        script += [
            "DELETE FROM sqlite_sequence",
            # The rows a migration seeds, as a fresh database has them (0011's flow clock).
            "INSERT INTO harel_flow_clock (kind, rank) VALUES ('outbox', 0), ('spawn', 0)",
        ]
        rows = " + ".join(
            f"(SELECT count(*) FROM {quoted(n)})"
            for t, n in names
            if t == "table" and n != "harel_flow_clock"
        )
        check = (
            f"SELECT {rows or 0} AS rows_left,"
            " (SELECT count(*) FROM harel_flow_clock WHERE rank = 0"
            "  AND kind IN ('outbox', 'spawn')) AS clock_seeded,"
            " (SELECT count(*) FROM harel_flow_clock) AS clock_rows,"
            " (SELECT count(*) FROM sqlite_master WHERE type = 'trigger'"
            f"  AND name NOT IN ({ours})) AS test_triggers,"
            " (SELECT count(*) FROM sqlite_sequence) AS sequences"
        )
        emptied = (0, 2, 2, 0, 0)
        conn.executescript(";\n".join(["BEGIN", *script, "COMMIT"]))
        if conn.execute(check).fetchone() != emptied:
            for statement in script:
                conn.execute(statement)
            conn.commit()
            kept = conn.execute(check).fetchone()
            assert kept == emptied, (
                "the session's sqld was not emptied (rows left, clock rows seeded, clock rows,"
                f" test triggers, sequences): {kept}"
            )
    finally:
        conn.close()


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def open_store(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Opener]:
    """A function that opens a store of this test's kind (same database on every call)."""
    opened: list[Any] = []
    database: str | Path = ":memory:" if kind.endswith("memory") else tmp_path / "state.db"
    options: dict[str, Any] = {}
    if kind.endswith(("-remote", "-replica")):
        server = request.getfixturevalue("sqld")
        reset_remote(server)
        options["auth_token"] = server.token
        if kind.endswith("-remote"):
            database = server.url
        else:
            options.update(sync_url=server.url, sync_interval=60.0)
    loop = asyncio.new_event_loop() if kind.startswith("async") else None
    make: Opener = (
        _async_opener(loop)
        if loop
        else {"libsql": LibsqlStore, "sqlite": SqliteStore}[kind.split("-")[0]]
    )

    def opener(**kwargs: Any) -> Any:
        store = make(database, **options, **kwargs)
        opened.append(store)
        return store

    yield opener
    for store in opened:
        with contextlib.suppress(Exception):
            store.close()
    if loop is not None:
        loop.close()


@pytest.fixture
def store(open_store: Opener) -> Any:
    return open_store()
