"""Helpers shared by the tests."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore
from harel_store.batch import Batch
from harel_store.connection import HranaConnection, LocalConnection
from harel_store.store import Store
from tests.in_process import alembic_in_process

ROOT = Path(__file__).resolve().parent.parent
# The command line an operator runs, on the repository's alembic.ini.
ALEMBIC = [sys.executable, "-m", "alembic", "-c", str(ROOT / "alembic.ini")]


def alembic_steps(*steps: tuple[Path, str, str]) -> None:
    """Run ``alembic -x url=DB COMMAND TARGET`` for each (db, command, target), in order, in
    this process (`alembic_in_process`: each a command of its own, its own env.py run,
    engine and transaction); a step (db, "copy", path) copies the file db to path (no
    connection is open between two commands)."""
    for db, *step in steps:
        if step[0] == "copy":
            shutil.copyfile(db, step[1])
            continue
        done = alembic_in_process([*ALEMBIC, "-x", f"url={db}", *step])
        assert done.returncode == 0, f"alembic_steps{steps}:\n{done.stderr}"


class SyncFacade:
    """Drives an AsyncLibsqlStore from a sync test body, on one private event loop."""

    def __init__(self, store: AsyncLibsqlStore, loop: asyncio.AbstractEventLoop) -> None:
        object.__setattr__(self, "_store", store)
        object.__setattr__(self, "_loop", loop)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._store, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            return self._loop.run_until_complete(attr(*args, **kwargs))

        return call

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._store, name, value)

    @property
    def sync_store(self) -> Store:
        return self._store._s  # type: ignore[no-any-return]


def raw(store: Any) -> Any:
    """A DB-API connection to the store's database (to stage faults a caller could not
    cause): a local store's own; for a remote store or a replica, a libsql connection of
    the test's own to the primary, where the writes land."""
    inner = store.sync_store if hasattr(store, "sync_store") else store
    conn = inner._conn
    if isinstance(conn, LocalConnection):
        return conn.db
    primary = conn if isinstance(conn, HranaConnection) else conn._primary
    import libsql

    token = primary._secrets[0] if primary._secrets else ""
    return libsql.connect(primary.url, auth_token=token)


# Rows of the three tables migration 0003 rebuilds, as a database at 0002 holds them.
ROWS_0003: dict[str, list[tuple[Any, ...]]] = {
    "harel_processed_events": [("a", "ev-1"), ("a", "ev-2"), ("b", "ev-1")],
    "harel_timers": [("a", "t1", 10.5), ("b", "t1", 2.25), ("b", "t2", 1e9)],
    "harel_trace": [("a", 0, '{"s":0}'), ("a", 1, '{"s":1}'), ("b", 7, '{"s":7}')],
}


def stage_0003(conn: Any) -> None:
    """Write ROWS_0003 through a DB-API connection (sqlite3 or libsql) and commit."""
    for table, rows in ROWS_0003.items():
        for row in rows:
            marks = ", ".join("?" * len(row))
            conn.execute(f"INSERT INTO {table} VALUES ({marks})", row)
    conn.commit()


def rows_0003(conn: Any) -> dict[str, list[tuple[Any, ...]]]:
    """What the tables of ROWS_0003 hold in the columns staged, in primary-key order."""
    return {
        table: [
            tuple(r)[: len(rows[0])]
            for r in conn.execute(f"SELECT * FROM {table} ORDER BY 1, 2").fetchall()
        ]
        for table, rows in ROWS_0003.items()
    }


def check_0003_rows(store: Any) -> None:
    """The store reads the rows staged by stage_0003 after migrating them."""
    assert store.due_timers(11.0) == [("b", "t1", 2.25), ("a", "t1", 10.5)]
    assert store.is_processed("a", "ev-2") and not store.is_processed("b", "ev-2")
    assert store.read_trace("a") == [{"s": 0, "index": 0}, {"s": 1, "index": 1}]
    store.append_trace("b", {"s": 8})  # the ring goes on from the last index it holds
    assert store.read_trace("b") == [{"s": 7, "index": 7}, {"s": 8, "index": 8}]


# Tests that left SIGINT otherwise than they found it in the main thread (its handler, or
# blocked): put back after each by conftest, and named here (a test of interrupts says them).
SIGINT_LEFT: list[str] = []


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """Poll ``condition`` until it holds; fail naming ``what`` after 10 s."""
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.002)


def shell_env(*first: Path, **extra: str) -> dict[str, str]:
    """The environment a documented shell line runs in: this venv's commands on PATH (after
    ``first``), none of the caller's databases or tokens, then ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HAREL_", "TURSO_"))}
    path = [*map(str, first), str(Path(sys.executable).parent), env.get("PATH", "")]
    return {**env, "PATH": os.pathsep.join(path), **extra}


def refused_batch() -> Batch:
    """A write the database refuses (not a conflict): the remote guard's malformed JSON,
    raised since the statement before it changed no row."""
    batch = Batch()
    batch.add("cancel_timer", "nobody", "nothing")
    batch.add("guard_changed")
    return batch


_REFUSING: list[socket.socket] = []  # held to the end of the process


def refused_port() -> int:
    """A loopback port where a connection is refused, for as long as this process runs: bound
    here and never listened on. A port merely free a moment ago can be taken meanwhile by
    another test's server or a client's own ephemeral port (seen in CI: a proxy "closed the
    connection", a test server read a CONNECT), which this one cannot."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    _REFUSING.append(sock)
    port: int = sock.getsockname()[1]
    return port


Refusal = tuple[Callable[..., object], type[BaseException] | tuple[type[BaseException], ...]]


def raises_each(cases: list[Refusal], *args: Any, after: Callable[[], None] | None = None) -> None:
    """Each case's ``call(*args)`` raises its error (a subclass too, as `pytest.raises`), and
    ``after()`` then holds (nothing written, the store still usable); a failure says which
    case by its index. The cases of bad arguments run one after another on one store (of
    each kind): one store each cost a store's setup each, a server's or a replica's for six
    of the seven kinds, for a check made before any statement."""
    for i, (call, error) in enumerate(cases):
        try:
            with pytest.raises(error):
                call(*args)
            if after is not None:
                after()
        except BaseException as exc:
            exc.add_note(f"bad-argument case {i} of {len(cases)}, expecting {error}")
            raise
