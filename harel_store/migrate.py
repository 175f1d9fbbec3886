"""Alembic glue: the revisions run the same ``.sql`` files the store applies itself."""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

from harel_store.sql import SQL_DIR, resource, split_statements

if TYPE_CHECKING:
    from alembic.config import Config

DEFAULT_DATABASE = "harel.db"
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
    for ``database`` (a path or a store-style URL; the token comes from $HAREL_AUTH_TOKEN)."""
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS_DIR).replace("%", "%%"))
    config.attributes["url"] = database
    return config


def database_from_env(url: str | None = None) -> str:
    """The database to use: the argument, else ``HAREL_DATABASE_URL``, else ``harel.db``."""
    return url or os.environ.get("HAREL_DATABASE_URL") or DEFAULT_DATABASE


def sqlalchemy_url(database: str) -> str:
    """A store-style database (path, ``http://``, ``https://``, ``libsql://``) as a
    sqlalchemy-libsql URL; a ``sqlite...://`` URL is returned as it is."""
    if database.startswith("sqlite"):
        return database
    parts = urlsplit(database)
    if parts.scheme in ("http", "https", "libsql", "ws", "wss"):
        secure = "false" if parts.scheme in ("http", "ws") else "true"
        query = f"{parts.query}&" if parts.query else ""
        return f"sqlite+libsql://{parts.netloc}{parts.path}?{query}secure={secure}"
    return f"sqlite+libsql:///{database}"
