"""Argument checks and JSON codecs: everything is validated and serialized before the first
statement is sent, so bad input raises ValueError/TypeError and writes nothing."""

from __future__ import annotations

import base64
import binascii
import json
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from harel_store.errors import CorruptRecord
from harel_store.models import STATUSES, DefinitionRecord, Event, Execution

MAX_ID_LENGTH = 512
INT64 = range(-(2**63), 2**63)  # SQLite's INTEGER
_SURROGATE = re.compile("[\ud800-\udfff]")

_T = TypeVar("_T")


def check_id(value: object, name: str, *, optional: bool = False) -> Any:
    # The common case first, in one expression: every commit checks several ids.
    if (
        type(value) is str
        and 0 < len(value) <= MAX_ID_LENGTH
        and value.isascii()
        and "\x00" not in value
    ):
        return value
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a string, not {type(value).__name__}")
    if not 0 < len(value) <= MAX_ID_LENGTH:
        raise ValueError(f"{name} must be 1 to {MAX_ID_LENGTH} characters, not {len(value)}")
    return check_column_text(value, name)  # a NUL would make it a different key


def check_text(value: str, name: str) -> str:
    """A string UTF-8 can hold: no lone surrogate (which no database text can keep)."""
    if not value.isascii() and _SURROGATE.search(value):
        raise ValueError(f"{name} holds a lone surrogate, which UTF-8 cannot encode: {value!r:.80}")
    return value


def check_int(value: object, name: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    # Compared, not `in INT64`: range's `in` walks the range for an int subclass (an IntEnum
    # member), holding the GIL for ever.
    if not INT64.start <= value < INT64.stop:
        raise ValueError(f"{name} must fit in a signed 64-bit integer, not {value}")
    return value


def check_finite(value: object, name: str) -> float:
    """A time the store compares against: a real, finite number of epoch seconds."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of epoch seconds, not {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:  # an int past the largest float
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, not {value!r:.40}")
    return number


MAX_SECONDS = 365 * 86400  # the longest timeout or interval: past it, a clock's overflow


def check_timeout(value: object, name: str) -> float:
    """A positive number of seconds, at most a year."""
    seconds = check_finite(value, name)
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"{name} must be > 0 and at most {MAX_SECONDS} seconds, not {value!r:.40}")
    return seconds


def check_max_attempts(value: object) -> int | None:
    """A claim's max_attempts: None (no limit) or an int >= 1."""
    if value is not None and check_int(value, "max_attempts") < 1:
        raise ValueError(f"max_attempts must be >= 1 (or None: no limit), not {value}")
    return value  # type: ignore[return-value]


def check_delay(value: object, name: str) -> float:
    """A wait from now: 0 to a year of seconds."""
    seconds = check_finite(value, name)
    if not 0 <= seconds <= MAX_SECONDS:
        raise ValueError(f"{name} must be 0 to {MAX_SECONDS} seconds, not {value!r:.40}")
    return seconds


MAX_ERROR = 2000  # characters of a worker's error text a row keeps
# The deepest a JSON document nests (its own dict the first level): as deep as pydantic reads
# back an execution's context or an event's payload (its JSON parser stops at 200 levels, the
# record's own the first), so that no document commits that a load then calls corrupt, and
# no spawn's context (a child's to be) or trace step is one those could not hold.
MAX_DEPTH = 199


def error_text(value: object) -> str:
    """A worker's error as a row keeps it: at most MAX_ERROR characters (the cut said), with
    a NUL or a lone surrogate (which no database text keeps as given) escaped."""
    if not isinstance(value, str):
        raise TypeError(f"error must be a string, not {type(value).__name__}")
    text = value
    if "\x00" in text:
        text = text.replace("\x00", "\\x00")
    if not text.isascii() and _SURROGATE.search(text):
        text = text.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(text) > MAX_ERROR:
        kept = MAX_ERROR - 40  # room for the note below
        text = f"{text[:kept]}... ({len(text) - kept} more characters)"
    return text


# json.dumps with options builds a new encoder per call; one shared encoder is ~1 us cheaper.
_ENCODER = json.JSONEncoder(allow_nan=False, separators=(",", ":"))


def check_json(value: object, name: str) -> None:
    """A JSON value the store gives back exactly, or ValueError naming what is not.

    JSON's own types only: dicts with string keys (``json`` would turn a key 1 into "1",
    which may collide with another), lists (tuples too, read back as lists), strings,
    ints, finite floats, bools and None; no string with a lone surrogate (UTF-8 has none).
    """
    try:
        _check_json(value, 1)
    except RecursionError:
        raise ValueError(
            f"{name} is nested too deeply to store as JSON (at most {MAX_DEPTH} levels)"
        ) from None
    except ValueError as exc:
        raise ValueError(f"{name} is not JSON the store can give back as given: {exc}") from None


def _check_json(value: object, depth: int) -> None:
    # Scalars are checked inline, by exact type first: this runs on every document of every
    # commit, and a call per value would cost more than the rest of the check.
    if depth > MAX_DEPTH and isinstance(value, (dict, list, tuple)):
        raise RecursionError  # check_json's "nested too deeply"
    if isinstance(value, dict):
        if type(value) is not dict:  # a subclass: as its items() says, as JSON encodes it
            value = dict(value.items())
        for key in value:
            if type(key) is not str and not isinstance(key, str):
                raise ValueError(f"the key {key!r:.60} is not a string")
            if not key.isascii() and _SURROGATE.search(key):
                raise ValueError(f"the key {key!r:.60} holds a lone surrogate")
        items: Iterable[Any] = value.values()
    elif isinstance(value, (list, tuple)):
        items = value
    else:  # a scalar the loop below did not take: at the top, or of a subclass
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                raise ValueError(f"the string {value!r:.60} holds a lone surrogate")
        elif isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"{value!r} is not a JSON number")
        elif value is not None and not isinstance(value, int):  # bool is an int
            raise ValueError(f"a {type(value).__name__} is not a JSON value")
        return
    for item in items:
        kind = type(item)
        if kind is str:
            if not item.isascii() and _SURROGATE.search(item):
                raise ValueError(f"the string {item!r:.60} holds a lone surrogate")
        elif kind is float:
            if not math.isfinite(item):
                raise ValueError(f"{item!r} is not a JSON number")
        elif kind is not int and kind is not bool and item is not None:
            _check_json(item, depth + 1)


def dumps(value: object, name: str) -> str:
    """Compact JSON of a dict the store can give back exactly (`check_json`), or a clear
    error."""
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, not {type(value).__name__}")
    check_json(value, name)
    try:
        return _ENCODER.encode(value)
    except RecursionError:
        raise ValueError(f"{name} is nested too deeply to store as JSON") from None
    except ValueError as exc:  # an int past Python's digit limit
        raise ValueError(f"{name} is not JSON-serializable: {exc}") from None


def check_execution(exe: Execution) -> None:
    """Every field of ``exe`` as validation leaves it: ``model_construct`` skips validation,
    and validation lets through documents JSON would not give back as given."""
    check_id(exe.id, "execution id")
    check_id(exe.definition_id, "execution definition_id")
    version = check_int(exe.version, "execution version")
    if not 0 <= version < 2**63 - 1:
        raise ValueError(f"execution version must be 0 to 2**63 - 2, not {version}")
    if exe.status not in STATUSES:
        raise ValueError(f"unknown status {exe.status!r}: expected one of {', '.join(STATUSES)}")
    _check_text_or_none(exe.outcome, "execution outcome")
    _check_text_or_none(exe.active_path, "execution active_path")
    if exe.parent_id is not None:
        check_id(exe.parent_id, "execution parent_id")
    if exe.finished_at is not None:
        check_finite(exe.finished_at, "execution finished_at")
    if not isinstance(exe.context, dict):
        raise TypeError(f"execution context must be a dict, not {type(exe.context).__name__}")
    check_json(exe.context, "execution context")
    if exe.__pydantic_extra__:
        check_json(exe.__pydantic_extra__, "execution's extra fields")


def _check_text_or_none(value: object, name: str) -> None:
    if value is not None:
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, not {value!r:.40}")
        check_column_text(value, name)


def check_column_text(value: str, name: str) -> str:
    """Text bound to a column of its own (not inside a JSON document): as `check_text`,
    and no NUL, at which a driver's text ends (libsql keeps only what comes before)."""
    if "\x00" in value:
        raise ValueError(f"{name} must not contain a NUL character")
    return check_text(value, name)


def check_event(event: Event) -> None:
    """As `check_execution`, for an emitted event."""
    if not isinstance(event.name, str) or not 0 < len(event.name) <= MAX_ID_LENGTH:
        raise ValueError(f"event name must be a string of 1 to {MAX_ID_LENGTH} characters")
    check_text(event.name, "event name")
    check_id(event.id, "event id")
    if not isinstance(event.payload, dict):
        raise TypeError(f"event payload must be a dict, not {type(event.payload).__name__}")
    if event.payload:
        check_json(event.payload, "event payload")
    if event.__pydantic_extra__:
        check_json(event.__pydantic_extra__, "event's extra fields")


def check_definition(record: DefinitionRecord) -> None:
    """As `check_execution`, for a definition record (its source is checked by `dumps`)."""
    check_id(record.definition_id, "definition_id")
    if check_int(record.version, "definition version") < 0:
        raise ValueError(f"definition version must be >= 0, not {record.version}")
    if not isinstance(record.digest, str) or not 0 < len(record.digest) <= MAX_ID_LENGTH:
        raise ValueError(f"definition digest must be a string of 1 to {MAX_ID_LENGTH} characters")
    check_column_text(record.digest, "definition digest")
    if record.published_at is not None:
        check_finite(record.published_at, "definition published_at")


def check_trace_max(value: object) -> int | None:
    """How many trace steps an execution keeps: None or 0 (every step), else a positive int."""
    if value is None:
        return None
    if check_int(value, "trace_max") < 0:
        raise ValueError(f"trace_max must be >= 0 (0 or None: keep every step), not {value}")
    return value  # type: ignore[return-value]


def dump_model(model: Execution | Event, name: str) -> str:
    """The JSON of a model `check_execution` or `check_event` passed."""
    try:
        if type(model) is Execution or type(model) is Event:
            # The store's own models (no alias, no override): their serializer itself, as
            # model_dump_json's keyword plumbing costs as much again.
            return type(model).__pydantic_serializer__.to_json(model).decode()
        return model.model_dump_json()  # a subclass's own (its aliases, its override)
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
        raise CorruptRecord(f"{what} has a corrupt stored record: {exc}") from exc


ORDERS = ("id", "newest", "oldest")  # a listing's order: by id, or by (updated_at, id)


def encode_cursor(last_id: str, order: str = "id", at: float | None = None) -> str:
    """A listing's cursor: the last row's id and, for an order by update time, its time."""
    body: dict[str, Any] = {"after": last_id}
    if order != "id":
        body.update(order=order, at=at)
    return base64.urlsafe_b64encode(json.dumps(body).encode()).decode()


def decode_cursor(cursor: str, order: str = "id") -> tuple[str, float | None]:
    """The (id, time) a cursor of a listing in ``order`` holds; ValueError for a cursor that
    `encode_cursor` did not make or made for another order."""
    if not isinstance(cursor, str):
        raise TypeError(f"cursor must be a string, not {type(cursor).__name__}")
    try:
        body = json.loads(base64.urlsafe_b64decode(cursor.encode("ascii")))
        after, made_for, at = body["after"], body.get("order", "id"), body.get("at")
    except (UnicodeError, binascii.Error, ValueError, TypeError, KeyError, AttributeError):
        raise ValueError(f"not a cursor from list_executions: {cursor!r:.80}") from None
    timed = isinstance(at, (int, float)) and not isinstance(at, bool) and _finite(at)
    if (
        not isinstance(after, str)
        or _SURROGATE.search(after)
        or made_for not in ORDERS
        or (made_for == "id" and at is not None)
        or (made_for == "newest" and at is not None and not timed)
        or (made_for == "oldest" and not timed)
    ):
        raise ValueError(f"not a cursor from list_executions: {cursor!r:.80}")
    if made_for != order:
        raise ValueError(
            f"this cursor pages a listing in {made_for} order, not {order} order: pass it with "
            "the newest_first and updated_after/updated_before of the listing it came from"
        )
    return after, None if at is None else float(at)


def _finite(number: float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an int past the largest float
        return False


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
