"""Driver errors translated in one place: the texts the drivers really produce (seen here)."""

from __future__ import annotations

import pytest

from harel_store.errors import StoreBusy, StoreConflict, StoreError, connection_lost, translate

HRANA = 'Hrana: `stream error: `Error {{ message: "{}", code: "{}" }}``'


@pytest.mark.parametrize(
    "text",
    [
        HRANA.format("SQLite error: interrupted", "SQLITE_INTERRUPT"),
        HRANA.format("stream has expired", "STREAM_EXPIRED"),
        'Hrana: `api error: `status=400 Bad Request, body={"message":"invalid baton"}``',
    ],
)
def test_a_stream_the_server_gave_up_on_means_a_new_connection(text: str) -> None:
    assert connection_lost(ValueError(text))
    assert not connection_lost(StoreError(text))  # already ours: never retried twice


@pytest.mark.parametrize(
    "text", ["database is locked", HRANA.format("SQLite error: no such table: x", "SQLITE_ERROR")]
)
def test_other_errors_keep_the_connection(text: str) -> None:
    assert not connection_lost(ValueError(text))


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
