"""Alembic glue: the revisions run the same ``.sql`` files the store applies itself."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

from harel_store.connection.url import (
    DEFAULT_DATABASE,
    alembic_url,
    database_from_env,
    migration_hint,
    parse_database,
    token_from_env,
)
from harel_store.sql import SQL_DIR, resource, split_statements

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "DEFAULT_DATABASE",
    "MIGRATIONS_DIR",
    "alembic_config",
    "database_from_env",
    "migration_hint",
    "parse_database",
    "run_sql",
    "sqlalchemy_url",
    "token_from_env",
]

MIGRATIONS_DIR = resource("migrations")


def run_sql(filename: str) -> None:
    """Run ``sql/migrations/<filename>`` statement by statement inside Alembic's transaction.

    Statements are literal (no bound parameters), so ``alembic upgrade head --sql`` prints a
    script fit for review.
    """
    from alembic import op
    from sqlalchemy import text

    script = (SQL_DIR / "migrations" / filename).read_text(encoding="utf-8")
    for statement in split_statements(script):
        op.execute(text(re.sub(r"(?<!\\):", r"\\:", statement)))  # a ':' is never a bind


def alembic_config(database: str) -> Config:
    """An Alembic configuration over the packaged migrations (a checkout's or a wheel's),
    for ``database`` (any form `harel_store.connection.url` reads; the token is its
    ``authToken=``, else $HAREL_AUTH_TOKEN, else $TURSO_AUTH_TOKEN)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["url"] = database
    return config


sqlalchemy_url = alembic_url  # its older name
