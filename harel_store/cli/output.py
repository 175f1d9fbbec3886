"""What the CLI prints: colour, escaping of stored text, JSON, times, ages, tables, and
the one-line error with every secret scrubbed."""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
from collections.abc import Sequence
from typing import Any, TextIO

from harel_store.connection.url import TOKEN_ENV, show

PROG = "harel-store"
COLOURS = {"running": "33", "finished": "32", "failed": "31", "cancelled": "90"}


class Failure(Exception):
    """Print the message as one line and exit 1."""


def colour_on(stream: TextIO) -> bool:
    isatty = getattr(stream, "isatty", None)
    return (
        bool(isatty and isatty())
        and not os.environ.get("NO_COLOR")  # set and empty counts as unset (no-color.org)
        and (os.environ.get("TERM") != "dumb")
    )


def paint(text: str, code: str | None, on: bool) -> str:
    return f"\x1b[{code}m{text}\x1b[0m" if on and code else text


# What a terminal may act on (C0, DEL, C1) and what no output encoding holds (lone surrogates).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\ud800-\udfff]")
_JSON_UNSAFE = re.compile("[\x7f-\x9f\ud800-\udfff]")  # JSON escapes C0 itself


def plain(text: str) -> str:
    """Stored text fit for a terminal: each control character as its escape (``\\x1b``)."""
    return _CONTROL.sub(lambda m: repr(m[0])[1:-1], text)


def to_json(value: Any, **options: Any) -> str:
    """JSON of ``value`` that is safe on a terminal and in any UTF-8 stream."""
    text = json.dumps(value, ensure_ascii=False, **options)
    return _JSON_UNSAFE.sub(lambda m: f"\\u{ord(m[0]):04x}", text)


def when(epoch: float | None) -> str:
    """An epoch time as UTC ISO 8601, or as its number when no datetime can hold it."""
    if epoch is None:
        return ""
    try:
        moment = datetime.datetime.fromtimestamp(epoch, tz=datetime.timezone.utc)
    except (ValueError, OverflowError, OSError):  # epoch milliseconds, 1e308, inf
        return str(epoch)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def since(at: float, start: float) -> str:
    """The offset of a trace step from the first one."""
    try:
        return f"+{at - start:.3f}s"
    except OverflowError:  # an int past the largest float
        return ""


def age(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days}d {hours}h"
    return f"{hours}h {minutes}m" if hours else f"{minutes}m {secs}s"


def table(
    columns: Sequence[str], rows: Sequence[Sequence[str]], on: bool, widths: list[int] | None = None
) -> list[int]:
    """Print ``rows`` (already plain text) under a bold header, each column as wide as its
    widest cell; pass the returned widths back to stream later rows under the same header
    (None: print the header)."""
    if widths is None:
        every = [list(columns), *rows]
        widths = [max(len(r[c]) for r in every) for c in range(len(columns))]
        header = "  ".join(h.ljust(w) for h, w in zip(columns, widths, strict=True))
        print(paint(header.rstrip(), "1", on))
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return widths


# A URL (its user info, query and fragment are where a token may ride along: show() drops them).
_URL = re.compile(r"(?i)\b[a-z][a-z0-9+.-]*://[^\s'\"`]*")


def scrub(text: str) -> str:
    """One line, with no auth token in it (neither ours nor one carried in a URL) and no
    control character."""
    for secret in filter(None, map(os.environ.get, TOKEN_ENV)):
        text = text.replace(secret, "***")
    text = _URL.sub(lambda m: show(m[0]), text)  # any URL, ours or a library's
    text = re.sub(r"(?i)(auth_?token=)[^&\s'\"]*", r"\1***", text)
    return plain(" ".join(text.split()))


def fail(message: str, code: int) -> int:
    label = paint("error", "31", colour_on(sys.stderr))
    print(f"{PROG}: {label}: {scrub(message)}", file=sys.stderr)
    return code
