"""A database's schema as plain data, the head schema, and a readable diff of two of them.

``describe`` reads SQLite's catalog pragmas (``pragma_table_xinfo``, ``pragma_index_list``,
``pragma_index_xinfo``, ``pragma_foreign_key_list``), never the raw ``CREATE TABLE`` text,
so two databases that differ only in formatting describe the same. It takes a DB-API
connection (``sqlite3``, ``libsql``) or a ``run(sql, params) -> rows`` callable, so the
store, the CLI and the migration test all use it.
"""

from __future__ import annotations

import re
import sqlite3
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from harel_store.sql import MIGRATIONS, QUERIES, SQL_DIR

Schema = dict[str, dict[str, Any]]
"""Table name -> {"without_rowid": bool, "columns": [...], "indexes": {...},
"foreign_keys": [...]}; views and
triggers sit under the keys ``"view <name>"`` / ``"trigger <name>"`` with their ``sql``."""

Run = Callable[[str, Sequence[Any]], Sequence[Sequence[Any]]]


class _Executes(Protocol):
    def execute(self, sql: str, parameters: Any = ..., /) -> Any: ...


def _normalize(sql: str) -> str:
    """SQL text with its layout removed: runs of whitespace become one space, and no space
    is kept next to a bracket or a comma."""
    text = re.sub(r"\s+", " ", sql).strip()
    return re.sub(r"\s*([(),])\s*", r"\1", text)


def _runner(db: _Executes | Run) -> Run:
    if hasattr(db, "execute"):
        conn: Any = db
        return lambda sql, params: list(conn.execute(sql, tuple(params)).fetchall())
    if callable(db):
        return db
    raise TypeError(f"expected a DB-API connection or a run(sql, params) callable, not {db!r}")


def describe(db: _Executes | Run) -> Schema:
    """The schema of a database as plain, comparable data (see ``Schema``).

    Ignores SQLite's own tables and ``alembic_version``. Whether a table is WITHOUT ROWID,
    column order, declared types (upper-cased), NOT NULL, defaults, primary-key position and
    hidden/generated flags are kept; indexes by name with their columns, uniqueness, origin
    and partial ``WHERE``.
    """
    run = _runner(db)

    def q(name: str, *params: Any) -> list[Sequence[Any]]:
        return list(run(QUERIES[name].sql, QUERIES[name].bind(params)))

    schema: Schema = {}
    for table, create in q("schema_tables"):
        # Table options follow the column list's closing bracket: "... ) WITHOUT ROWID".
        options = (create or "").rsplit(")", 1)[-1]
        without_rowid = re.search(r"\bWITHOUT\s+ROWID\b", options, re.IGNORECASE) is not None
        columns = [
            {
                "name": name,
                "type": (ctype or "").upper(),
                "notnull": bool(notnull),
                "default": default,
                "pk": pk,
                "hidden": hidden,
            }
            for name, ctype, notnull, default, pk, hidden in q("schema_columns", table)
        ]
        indexes = {}
        for name, unique, origin, partial, sql in q("schema_indexes", table):
            where = re.search(r"\bWHERE\b(.*)$", sql or "", re.IGNORECASE | re.DOTALL)
            indexes[name] = {
                "columns": [
                    f"{col or '<expression>'}{' DESC' if desc else ''}"
                    + ("" if coll in (None, "BINARY") else f" COLLATE {coll}")
                    for col, desc, coll in q("schema_index_columns", name)
                ],
                "unique": bool(unique),
                "origin": origin,
                "where": _normalize(where[1]) if partial and where else None,
            }
        foreign_keys = [
            {
                "id": fid,
                "seq": seq,
                "table": target,
                "from": src,
                "to": dst,
                "on_update": on_update,
                "on_delete": on_delete,
                "match": match,
            }
            for fid, seq, target, src, dst, on_update, on_delete, match in q(
                "schema_foreign_keys", table
            )
        ]
        schema[table] = {
            "without_rowid": without_rowid,
            "columns": columns,
            "indexes": indexes,
            "foreign_keys": foreign_keys,
        }
    for kind, name, sql in q("schema_others"):
        # Case folded: a server may write a view's text back with its own case for keywords
        # (sqld keeps `KEY` for `key`), and SQLite's keywords and names know no case.
        schema[f"{kind} {name}"] = {"sql": _normalize(sql or "").casefold()}
    return schema


def head_schema() -> Schema:
    """The schema at head: ``sql/schema.sql`` run into a fresh in-memory database."""
    conn = sqlite3.connect(":memory:")
    try:
        conn.executescript((SQL_DIR / "schema.sql").read_text(encoding="utf-8"))
        return describe(conn)
    finally:
        conn.close()


def schema_at(revision: str) -> Schema:
    """The schema a database at ``revision`` has: the migration chain up to it, run into a
    fresh in-memory database."""
    last = next(i for i, m in enumerate(MIGRATIONS) if m.revision == revision)
    conn = sqlite3.connect(":memory:")
    try:
        for migration in MIGRATIONS[: last + 1]:
            for statement in migration.statements("up"):
                conn.execute(statement)
        return describe(conn)
    finally:
        conn.close()


def _column(col: dict[str, Any]) -> str:
    text = f"{col['name']} {col['type']}".rstrip()
    if col["notnull"]:
        text += " NOT NULL"
    if col["default"] is not None:
        text += f" DEFAULT {col['default']}"
    if col["pk"]:
        text += f" PRIMARY KEY#{col['pk']}"
    if col["hidden"]:
        text += {1: " HIDDEN", 2: " GENERATED VIRTUAL", 3: " GENERATED STORED"}.get(
            col["hidden"], f" hidden={col['hidden']}"
        )
    return text


def _index(index: dict[str, Any]) -> str:
    text = f"{'UNIQUE ' if index['unique'] else ''}({', '.join(index['columns'])})"
    if index["origin"] != "c":
        text += {"pk": " from PRIMARY KEY", "u": " from UNIQUE"}.get(index["origin"], "")
    if index["where"]:
        text += f" WHERE {index['where']}"
    return text


def _foreign_key(fk: dict[str, Any]) -> str:
    return (
        f"({fk['from']}) REFERENCES {fk['table']}({fk['to']}) "
        f"ON UPDATE {fk['on_update']} ON DELETE {fk['on_delete']}"
    )


def diff(
    expected: Schema, actual: Schema, *, expected_name: str = "head", actual_name: str = "database"
) -> list[str]:
    """Readable lines saying how ``actual`` differs from ``expected`` (empty: the same)."""
    lines: list[str] = []
    for table in sorted(expected.keys() - actual.keys()):
        lines.append(f"{table}: in {expected_name}, missing from {actual_name}")
    for table in sorted(actual.keys() - expected.keys()):
        lines.append(f"{table}: in {actual_name}, not in {expected_name}")
    for table in sorted(expected.keys() & actual.keys()):
        want, got = expected[table], actual[table]
        if "sql" in want or "sql" in got:
            if want != got:
                lines.append(
                    f"{table}: {expected_name} has {want.get('sql')!r}, "
                    f"{actual_name} has {got.get('sql')!r}"
                )
            continue
        lines += _diff_table(table, want, got, expected_name, actual_name)
    return lines


def _diff_table(
    table: str, want: dict[str, Any], got: dict[str, Any], expected_name: str, actual_name: str
) -> list[str]:
    lines: list[str] = []
    if want["without_rowid"] != got["without_rowid"]:
        kind = {True: "a WITHOUT ROWID table", False: "a rowid table"}
        lines.append(
            f"{table}: {kind[want['without_rowid']]} in {expected_name}, "
            f"{kind[got['without_rowid']]} in {actual_name}"
        )
    want_cols = {c["name"]: c for c in want["columns"]}
    got_cols = {c["name"]: c for c in got["columns"]}
    for name, col in want_cols.items():
        if name not in got_cols:
            lines.append(f"{table}: column {_column(col)} missing from {actual_name}")
        elif got_cols[name] != col:
            lines.append(
                f"{table}: column {name} is {_column(col)} in {expected_name}, "
                f"{_column(got_cols[name])} in {actual_name}"
            )
    for name, col in got_cols.items():
        if name not in want_cols:
            lines.append(f"{table}: column {_column(col)} in {actual_name}, not in {expected_name}")
    shared = [n for n in want_cols if n in got_cols]
    if shared != [n for n in got_cols if n in want_cols]:
        lines.append(
            f"{table}: column order is {', '.join(want_cols)} in {expected_name}, "
            f"{', '.join(got_cols)} in {actual_name}"
        )
    want_idx, got_idx = want["indexes"], got["indexes"]
    for name, index in want_idx.items():
        if name not in got_idx:
            lines.append(f"{table}: index {name} {_index(index)} missing from {actual_name}")
        elif got_idx[name] != index:
            lines.append(
                f"{table}: index {name} is {_index(index)} in {expected_name}, "
                f"{_index(got_idx[name])} in {actual_name}"
            )
    for name, index in got_idx.items():
        if name not in want_idx:
            lines.append(
                f"{table}: index {name} {_index(index)} in {actual_name}, not in {expected_name}"
            )
    want_fks = [_foreign_key(fk) for fk in want["foreign_keys"]]
    got_fks = [_foreign_key(fk) for fk in got["foreign_keys"]]
    for fk in want_fks:
        if fk not in got_fks:
            lines.append(f"{table}: foreign key {fk} missing from {actual_name}")
    for fk in got_fks:
        if fk not in want_fks:
            lines.append(f"{table}: foreign key {fk} in {actual_name}, not in {expected_name}")
    return lines
