"""Driver and server errors translated in one place, on the texts they really produce; and
arguments refused before anything is opened."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from harel_store import AsyncLibsqlStore, Execution, LibsqlStore, SqliteStore
from harel_store.connection import show
from harel_store.connection.hrana import ServerError
from harel_store.errors import (
    OutcomeUnknown,
    StoreBusy,
    StoreConflict,
    StoreError,
    is_driver_error,
    translate,
)
from harel_store.sql import HEAD


def test_translate_types_and_scrubs() -> None:
    token = "eyJ.secret.token"
    auth = translate(ValueError(f"HTTP 401 Unauthorized for token {token}"), (token,))
    assert str(auth).startswith("authentication failed") and token not in str(auth)
    assert isinstance(translate(ValueError("database is locked")), StoreBusy)
    other = translate(ValueError("no such table: x"))
    assert type(other) is StoreError and str(other) == "no such table: x"
    conflict = StoreConflict("e", expected=2, found=3)
    assert (conflict.execution_id, conflict.expected, conflict.found) == ("e", 2, 3)
    assert "version 3, not 2" in str(conflict)


def test_a_server_error_keeps_its_code_and_a_busy_one_is_typed() -> None:
    # As sqld 0.24.32 reports a lock held by another writer past its busy timeout.
    busy = ServerError("SQLite error: database is locked", "SQLITE_BUSY")
    assert isinstance(translate(busy), StoreBusy)
    refused = ServerError("SQLite error: spawn refused", "SQLITE_CONSTRAINT")
    assert str(refused) == "SQLite error: spawn refused (SQLITE_CONSTRAINT)"
    assert type(translate(refused)) is StoreError
    assert issubclass(OutcomeUnknown, StoreError)


# --- opening: bad arguments are refused before anything is opened or created ---


@pytest.mark.parametrize("opener", [LibsqlStore, SqliteStore], ids=["libsql", "sqlite"])
@pytest.mark.parametrize(
    ("database", "error"),
    [(None, TypeError), (123, TypeError), (b"x.db", TypeError), ("", ValueError)],
    ids=["None", "int", "bytes", "empty"],
)
def test_a_database_that_is_no_path_creates_no_file(
    opener: Any, database: Any, error: type[Exception], tmp_path: Path, monkeypatch: Any
) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(error):
        opener(database)
    assert list(tmp_path.iterdir()) == []


REPLICA = {"sync_url": "http://127.0.0.1:1"}


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"trace_max": -1}, ValueError),
        ({"trace_max": "3"}, TypeError),
        ({"trace_max": 2.5}, TypeError),
        ({"trace_max": True}, TypeError),
        ({"busy_timeout": 10**400}, ValueError),
        ({"busy_timeout": 1e300}, ValueError),
        ({"busy_timeout": -1}, ValueError),
        ({"timeout": 0}, ValueError),
        ({"timeout": 1e300}, ValueError),
        # each of these made libsql panic (pyo3's PanicException, a BaseException)
        ({**REPLICA, "sync_interval": -1.0}, ValueError),
        ({**REPLICA, "sync_interval": float("nan")}, ValueError),
        ({**REPLICA, "sync_interval": float("inf")}, ValueError),
        ({**REPLICA, "sync_interval": 1e300}, ValueError),
        ({**REPLICA, "sync_interval": "1"}, TypeError),
        ({"sync_url": 5}, TypeError),
    ],
    ids=repr,
)
def test_bad_options_are_refused_before_anything_opens(
    options: dict[str, Any], error: type[Exception], tmp_path: Path
) -> None:
    db = tmp_path / "state.db"
    with pytest.raises(error) as info:
        LibsqlStore(db, **options)
    assert not isinstance(info.value, StoreError) and str(info.value)
    with pytest.raises(error):
        asyncio.run(AsyncLibsqlStore.create(db, **options))
    if not {"sync_url", "timeout"} & options.keys():  # what SqliteStore takes too
        with pytest.raises(error):
            SqliteStore(db, **options)
    assert list(tmp_path.iterdir()) == []


def test_a_replica_needs_a_file() -> None:
    for database in (":memory:", "http://127.0.0.1:1"):
        with pytest.raises(ValueError, match="replica needs a local file"):
            LibsqlStore(database, sync_url="http://127.0.0.1:1")


def test_a_rust_panic_is_a_store_error() -> None:
    class PanicException(BaseException):  # as pyo3 names it
        pass

    panic = translate(PanicException("cannot convert float seconds to Duration"))
    assert type(panic) is StoreError and "panic" in str(panic)
    assert is_driver_error(PanicException()) and is_driver_error(ValueError())
    assert not is_driver_error(KeyboardInterrupt()) and not is_driver_error(SystemExit())


@pytest.mark.parametrize("opener", [LibsqlStore, SqliteStore], ids=["libsql", "sqlite"])
@pytest.mark.parametrize("name", ["401", "unauthorized", "authentication"])
def test_a_local_path_is_never_taken_for_a_refused_token(
    opener: Any, name: str, tmp_path: Path
) -> None:
    with pytest.raises(StoreError) as info:
        opener(tmp_path / name / "missing-folder" / "x.db")
    assert "authentication failed" not in str(info.value)


@pytest.mark.parametrize(
    "url",
    [
        "http://user:SECRET@127.0.0.1:1",
        "http://:SECRET@127.0.0.1:1/",
        "HTTP://SECRET@127.0.0.1:1",
        "libsql://user:SECRET@127.0.0.1:1?authToken=SECRET#SECRET",
        "http://127.0.0.1:1/?authToken=SECRET",
    ],
)
def test_a_token_in_a_url_is_never_shown(url: str) -> None:
    assert "SECRET" not in show(url)
    # A user name or password is refused (ValueError); a token in the query is used.
    with pytest.raises((StoreError, ValueError)) as info:
        LibsqlStore(url, timeout=2)
    assert "SECRET" not in str(info.value)


def test_a_token_in_a_url_stays_out_of_the_repr(sqld: Any) -> None:
    _, rest = sqld.url.split("://", 1)
    with LibsqlStore(f"http://{rest}/?authToken={sqld.token}", auth_token="SECRET") as store:
        assert "SECRET" not in repr(store) and sqld.token not in repr(store)
        assert store.schema_revision is not None
    with pytest.raises(ValueError) as info:
        LibsqlStore(f"http://user:SECRET@{rest}/?x=SECRET", auth_token=sqld.token)
    assert "SECRET" not in str(info.value) and sqld.token not in str(info.value)


@pytest.mark.parametrize("opener", [LibsqlStore, SqliteStore], ids=["libsql", "sqlite"])
def test_an_empty_revision_table_is_a_database_with_no_schema(opener: Any, tmp_path: Path) -> None:
    """What an interrupted first `alembic upgrade` can leave: the version table, no row."""
    db = tmp_path / "state.db"
    raw = sqlite3.connect(db)
    raw.execute(
        "CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
        "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"
    )
    raw.commit()
    raw.close()
    with opener(db) as store:
        assert store.schema_revision == HEAD
        store.save(Execution(id="e", definition_id="d"))
