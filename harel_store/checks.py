"""Argument checks and JSON codecs: everything is validated and serialized before the first
statement is sent, so bad input raises ValueError/TypeError and writes nothing."""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable
from typing import Any, TypeVar

from harel_store.errors import StoreError
from harel_store.models import Event, Execution

MAX_ID_LENGTH = 512

_T = TypeVar("_T")


def check_id(value: object, name: str, *, optional: bool = False) -> Any:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if not 0 < len(value) <= MAX_ID_LENGTH:
        raise ValueError(f"{name} must be 1 to {MAX_ID_LENGTH} characters, not {len(value)}")
    if "\x00" in value:  # SQLite TEXT ends at NUL for some drivers: a different key
        raise ValueError(f"{name} must not contain a NUL character")
    return value


def check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not -(2**63) <= value < 2**63:  # SQLite's INTEGER
        raise ValueError(f"{name} must fit in a signed 64-bit integer, not {value}")
    return value


def check_finite(value: object, name: str) -> float:
    """A time the store compares against: a real, finite number of epoch seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of epoch seconds, not {type(value).__name__}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, not {value!r}")
    return float(value)


def check_timeout(value: object, name: str) -> float:
    """A positive, finite number of seconds."""
    if check_finite(value, name) <= 0:
        raise ValueError(f"{name} must be > 0 seconds, not {value!r}")
    return float(value)  # type: ignore[arg-type]


# json.dumps with options builds a new encoder per call; one shared encoder is ~1 us cheaper.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def dumps(value: object, name: str) -> str:
    """Compact JSON of a dict, or a clear error: no NaN, nothing unserializable, no abyss."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, not {type(value).__name__}")
    try:
        return _ENCODER.encode(value)
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply to store as JSON") from None
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


def _reject_constant(token: str) -> None:
    raise ValueError(f"{token} is not a JSON number")


def dump_model(model: Execution | Event, name: str) -> str:
    try:
        data = model.model_dump_json()
        # The models write NaN/Infinity as bare tokens (not null); refuse them, as dumps does.
        if "NaN" in data or "Infinity" in data:
            json.loads(data, parse_constant=_reject_constant)
        return data
    except (ValueError, RecursionError) as exc:  # PydanticSerializationError is a ValueError
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


def loads_dict(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError(f"expected a JSON object, found {type(value).__name__}")
    return value


def stored(what: str, parse: Callable[[str], _T], text: str) -> _T:
    """Parse a stored JSON column; a corrupt one is a StoreError that names its row."""
    try:
        return parse(text)
    except (ValueError, TypeError) as exc:  # ValidationError, JSONDecodeError are ValueErrors
        raise StoreError(f"{what} has a corrupt stored record: {exc}") from exc


def encode_cursor(last_id: str) -> str:
    return base64.urlsafe_b64encode(json.dumps({"after": last_id}).encode()).decode()


def decode_cursor(cursor: str) -> str:
    if not isinstance(cursor, str):
        raise TypeError(f"cursor must be a string, not {type(cursor).__name__}")
    try:
        after = json.loads(base64.urlsafe_b64decode(cursor.encode("ascii")))["after"]
    except (UnicodeError, binascii.Error, ValueError, TypeError, KeyError):
        raise ValueError(f"not a cursor from list_executions: {cursor!r}") from None
    if not isinstance(after, str):
        raise ValueError(f"not a cursor from list_executions: {cursor!r}")
    return after


def prefix_upper(prefix: str) -> str | bytes:
    """The least string above every string that starts with ``prefix`` (bytes: none exists).

    SQLite orders TEXT by its UTF-8 bytes, which is code point order; an empty BLOB sorts
    after every TEXT value.
    """
    chars = list(prefix)
    while chars:
        code = ord(chars.pop()) + 1
        if 0xD800 <= code <= 0xDFFF:  # surrogates are not characters: skip past them
            code = 0xE000
        if code <= 0x10FFFF:
            return "".join(chars) + chr(code)
    return b""
