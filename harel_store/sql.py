"""The SQL the store runs, read once from the package's ``sql/`` folder.

``queries.sql`` holds named blocks (``-- name: load_execution^``); the suffix of a name says
what a call returns (see the file's header). Migrations are ``sql/migrations/NNNN_name.up.sql``
and ``.down.sql``, run statement by statement inside the caller's transaction.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from operator import itemgetter
from pathlib import Path
from typing import Any

_HERE = Path(__file__).resolve().parent


def resource(name: str) -> Path:
    """A folder shipped with the package: inside it in a wheel, beside it in a checkout."""
    installed = _HERE / name
    return installed if installed.exists() else _HERE.parent / name


SQL_DIR = resource("sql")

_NAME = re.compile(r"^-- name: (?P<name>\w+)(?P<kind>[$^=!]?)\s*$", re.MULTILINE)


_NUMBERED = re.compile(r"\?(\d+)")
_ROW = re.compile(r"^\s*-- row: (?P<cols>.*)$", re.MULTILINE)
_COLUMN = re.compile(r"^(?P<name>\w+) (?P<type>int|real|text|any)(?P<null>\??)$")

# What each declared column type accepts from a driver (a REAL value may come back as an
# int from an expression: it is made a float).
_ACCEPTS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "real": (float, int),
    "text": (str,),
}
_NAMES = {"int": "an integer", "real": "a number", "text": "a text"}


class RowError(ValueError):
    """A row of a reply that does not fit its query's declared row (see `Query.check`): a
    remote connection takes it for a garbled reply (`OutcomeUnknown` for a write), a local
    one makes it a StoreError."""


def _cut(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _key(values: Sequence[Any]) -> str:
    """The row's key (its first cell), for an error about the row."""
    return f"; row {_cut(values[0])}" if values else ""


def _kind_of(value: Any) -> str:
    return {int: "integer", float: "real", str: "text", bytes: "blob"}.get(
        type(value), "null" if value is None else type(value).__name__
    )


@dataclass(frozen=True)
class Query:
    name: str
    kind: str  # "" rows, "^" one row or None, "=" exactly one row, "$" one value, "!" rowcount
    sql: str  # with plain `?` placeholders only
    order: tuple[int, ...] = ()  # for a block written with `?N`: the argument each `?` takes
    # The row it returns, declared by a `-- row: id text, fire_at real, at real?` line
    # (`?`: may be NULL; `any`: not checked); () when undeclared.
    row: tuple[tuple[str, str, bool], ...] = ()

    pick: Callable[[Sequence[Any]], Sequence[Any]] | None = field(
        default=None, init=False, repr=False, compare=False
    )
    # The cells' exact types when the row declares no NULL, no REAL and no `any` (an
    # integer key, say): such a row is checked by one comparison.
    plain: tuple[type, ...] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # Every statement of a commit is bound: one C call (itemgetter), not a generator.
        pick = None
        if len(self.order) == 1:
            (only,) = self.order
            pick = lambda params: (params[only],)  # noqa: E731
        elif self.order:
            pick = itemgetter(*self.order)
        object.__setattr__(self, "pick", pick)
        if self.row and all(kind in ("int", "text") and not null for _, kind, null in self.row):
            object.__setattr__(self, "plain", tuple(_ACCEPTS[kind][0] for _, kind, _ in self.row))

    def check(self, rows: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """``rows`` as declared, a REAL column's ints made floats; RowError when one does
        not fit (its width, or a cell's type), naming the column and the row's key."""
        row = self.row
        if not row:
            return rows
        plain = self.plain
        if plain is not None:
            for values in rows:
                if tuple(map(type, values)) != plain:
                    break
            else:
                return rows
        width = len(row)
        out = rows
        for index, values in enumerate(rows):
            if len(values) != width:
                raise RowError(
                    f"the database returned a row of {self.name} that does not fit "
                    f"({len(values)} columns, not {width}{_key(values)})"
                )
            fixed = None
            for i, (name, kind, null) in enumerate(row):
                value = values[i]
                if kind == "any" or (value is None and null):
                    continue
                accepts = _ACCEPTS[kind]
                if type(value) not in accepts:
                    raise RowError(
                        f"the database returned a row of {self.name} that does not fit "
                        f"({name}: {_kind_of(value)} {_cut(value)}, not {_NAMES[kind]}"
                        f"{_key(values)})"
                    )
                if kind == "real" and type(value) is int:
                    fixed = fixed or list(values)
                    fixed[i] = float(value)
            if fixed is not None:
                if out is rows:
                    out = list(rows)
                out[index] = tuple(fixed)
        return out

    def bind(self, params: Sequence[Any]) -> Sequence[Any]:
        """The parameters for ``sql``, given those of the block as written in queries.sql."""
        return params if self.pick is None else self.pick(params)


def _row(name: str, body: str) -> tuple[tuple[str, str, bool], ...]:
    match = _ROW.search(body)
    if match is None:
        return ()
    columns = []
    for column in match["cols"].split(","):
        declared = _COLUMN.match(column.strip())
        if declared is None:
            raise ValueError(f"queries.sql: block {name!r} declares a row column {column!r}")
        columns.append((declared["name"], declared["type"], bool(declared["null"])))
    return tuple(columns)


def parse_queries(text: str) -> dict[str, Query]:
    """Split ``queries.sql`` into its named blocks; comment lines inside a block are dropped."""
    heads = list(_NAME.finditer(text))
    queries: dict[str, Query] = {}
    for head, nxt in zip(heads, [*heads[1:], None], strict=True):
        body = text[head.end() : nxt.start() if nxt else len(text)]
        lines = [ln for ln in body.splitlines() if ln.strip() and not ln.lstrip().startswith("--")]
        sql = "\n".join(lines).strip().rstrip(";")
        name = head["name"]
        if not sql or name in queries:
            raise ValueError(f"queries.sql: block {name!r} is empty or defined twice")
        # `?N` reads well and names a reused argument once, but Python's sqlite3 takes it for
        # a named parameter (deprecated with a sequence since 3.12, an error from 3.14), so
        # each block runs with plain `?` and its arguments laid out in order.
        order = tuple(int(n) - 1 for n in _NUMBERED.findall(sql))
        if order and "?" in _NUMBERED.sub("", sql):
            raise ValueError(f"queries.sql: block {name!r} mixes `?` and `?N`")
        queries[name] = Query(name, head["kind"], _NUMBERED.sub("?", sql), order, _row(name, body))
    return queries


QUERIES = parse_queries((SQL_DIR / "queries.sql").read_text(encoding="utf-8"))


def split_statements(script: str) -> Iterator[str]:
    """The complete statements of a script, one at a time, comments-only chunks skipped."""
    chunk = ""
    for line in script.splitlines(keepends=True):
        chunk += line
        if sqlite3.complete_statement(chunk):
            body = "\n".join(
                ln for ln in chunk.splitlines() if ln.strip() and not ln.lstrip().startswith("--")
            ).strip()
            if body:
                yield body.rstrip(";")
            chunk = ""
    if chunk.strip() and any(
        ln.strip() and not ln.lstrip().startswith("--") for ln in chunk.splitlines()
    ):
        raise ValueError(f"incomplete SQL statement at the end of the script: {chunk.strip()!r}")


@dataclass(frozen=True)
class Migration:
    revision: str  # "0001"
    name: str  # "0001_initial"
    down_revision: str | None

    def statements(self, direction: str = "up") -> list[str]:
        path = SQL_DIR / "migrations" / f"{self.name}.{direction}.sql"
        return list(split_statements(path.read_text(encoding="utf-8")))


_MIGRATION_FILE = re.compile(r"^(?P<rev>\d{4})_[a-z0-9_]+\.up\.sql$")


def load_migrations() -> list[Migration]:
    """The migration chain, in order, from the ``.up.sql`` file names."""
    names = sorted(p.name for p in (SQL_DIR / "migrations").glob("*.up.sql"))
    chain: list[Migration] = []
    for file in names:
        m = _MIGRATION_FILE.match(file)
        if m is None:
            raise ValueError(f"sql/migrations/{file}: name must look like 0001_initial.up.sql")
        down = chain[-1].revision if chain else None
        chain.append(Migration(m["rev"], file.removesuffix(".up.sql"), down))
    return chain


MIGRATIONS = load_migrations()
HEAD = MIGRATIONS[-1].revision
