"""The store's exceptions: one root, driver errors translated in one place (`translate`)."""

from __future__ import annotations

import json
import re
from urllib.parse import quote


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


class CorruptRecord(StoreError):
    """A stored JSON column the store cannot read (edited by hand, say): the error names
    its row."""


class StoreBusy(StoreError):
    """The database stayed locked by another connection past the busy timeout; retry."""


class OutcomeUnknown(StoreError):
    """A write was sent to the server and no complete answer came back.

    It may or may not have landed; ``exe.version`` is left as it was. Reload to learn which:
    the version CAS makes a retry on the reloaded execution safe.
    """


class SchemaError(StoreError):
    """The database's schema is missing, behind or ahead of this code."""


_BUSY = re.compile(r"database is (locked|busy)|SQLITE_BUSY", re.IGNORECASE)
_AUTH = re.compile(r"\b401\b|unauthori[sz]ed|authenticat", re.IGNORECASE)


def scrub(text: str, secrets: tuple[str, ...]) -> str:
    """``text`` with every secret in it replaced by ``***``: as is, as JSON or a URL would
    escape it, and a tail of the text that is the start of one (a cut-off echo)."""
    for secret in secrets:
        if not secret:
            continue
        for form in {secret, json.dumps(secret)[1:-1], quote(secret, safe="")}:
            text = text.replace(form, "***")
        for n in range(min(len(secret), len(text)), 7, -1):  # 8 characters or more
            if text.endswith(secret[:n]):
                text = text[:-n] + "***"
                break
    return text


def is_driver_error(exc: BaseException) -> bool:
    """Whether ``exc`` is a driver's failure the store translates: an Exception, or a Rust
    panic (pyo3's PanicException is a BaseException), but never KeyboardInterrupt and kin."""
    return isinstance(exc, Exception) or _is_panic(exc)


def _is_panic(exc: BaseException) -> bool:
    return type(exc).__name__ == "PanicException"


def translate(exc: BaseException, secrets: tuple[str, ...] = (), *, quoted: str = "") -> StoreError:
    """Turn a driver's or a server's error into the store's own, never repeating a secret
    it may quote. ``quoted`` (a path the error may repeat) is not read for its meaning: a
    file named "401" is no refused token."""
    text = scrub(str(exc) or type(exc).__name__, secrets)
    meaning = text.replace(quoted, "") if quoted else text
    if _is_panic(exc):
        return StoreError(f"the libsql driver failed (a panic): {text}")
    if _AUTH.search(meaning):
        return StoreError(f"authentication failed: the server refused the auth token ({text})")
    if _BUSY.search(meaning):
        return StoreBusy(f"database is locked by another connection past the busy timeout: {text}")
    return StoreError(text)
