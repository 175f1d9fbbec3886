"""The store's exceptions: one root, driver errors translated in one place (`translate`)."""

from __future__ import annotations

import re


class StoreError(Exception):
    """Root of every error the store raises; a driver's error is kept as ``__cause__``."""


class StoreConflict(StoreError):
    """The version CAS failed: another writer moved the execution first (or it is gone)."""

    def __init__(self, execution_id: str, expected: int, found: int | None) -> None:
        super().__init__(
            f"execution {execution_id!r} is at version {found}, not {expected}"
            if found is not None
            else f"execution {execution_id!r} does not exist (expected version {expected})"
        )
        self.execution_id = execution_id
        self.expected = expected
        self.found = found


class StoreBusy(StoreError):
    """The database stayed locked by another connection past the busy timeout; retry."""


class SchemaError(StoreError):
    """The database's schema is missing, behind or ahead of this code."""


_BUSY = re.compile(r"database is (locked|busy)|SQLITE_BUSY", re.IGNORECASE)
_AUTH = re.compile(r"\b401\b|unauthori[sz]ed|authenticat", re.IGNORECASE)


# The server has given up on the connection's stream: every later call on it fails the same
# way, rollback included (sqld: a stream idle ~10 s, a server restarted mid-transaction). sqld
# also interrupts a stream's statement now and then under load (SQLITE_INTERRUPT, seen once
# in ~10 CI runs on a read): the same cure, a fresh connection, and a read runs again.
_LOST = re.compile(
    r"STREAM_EXPIRED|stream has expired|invalid baton|SQLITE_INTERRUPT", re.IGNORECASE
)


def connection_lost(exc: BaseException) -> bool:
    """Whether a driver error means the connection is dead and a new one is needed."""
    return not isinstance(exc, StoreError) and bool(_LOST.search(str(exc)))


def translate(exc: BaseException, secrets: tuple[str, ...] = ()) -> StoreError:
    """Turn a driver error into the store's own, never repeating a secret it may quote."""
    text = str(exc) or type(exc).__name__
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    if _AUTH.search(text):
        return StoreError(f"authentication failed: the server refused the auth token ({text})")
    if _BUSY.search(text):
        return StoreBusy(f"database is locked by another connection past the busy timeout: {text}")
    return StoreError(text)
