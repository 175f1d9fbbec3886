"""Driver and server errors translated in one place, on the texts they really produce."""

from __future__ import annotations

from harel_store.connection.hrana import ServerError
from harel_store.errors import OutcomeUnknown, StoreBusy, StoreConflict, StoreError, translate


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
