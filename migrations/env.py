"""Alembic environment: SQLite DDL is transactional, so every migration is one transaction."""

from __future__ import annotations

import sqlite3
from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import Engine, create_engine, event, pool
from sqlalchemy.dialects import registry
from sqlalchemy_libsql.libsql import SQLiteDialect_libsql

from harel_store.connection.local import FileHold, hold_file, holder, import_libsql
from harel_store.connection.url import (
    DEFAULT_DATABASE,
    alembic_url,
    database_from_env,
    parse_database,
    token_from_env,
)

config = context.config
# Logging as the ini says, when it says anything: a minimal ini (only `script_location =
# harel_store:migrations`, as next to an installed wheel) has no logging sections.
if (
    config.config_file_name is not None
    and config.attributes.get("configure_logger", True)
    and config.file_config.has_section("formatters")
):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

# `harel-store migrate` hands the database over in config.attributes["url"]; else -x url=,
# else $HAREL_DATABASE_URL, $TURSO_DATABASE_URL, alembic.ini's sqlalchemy.url, harel.db.
# Any form the store reads; a token in it (authToken=) wins over the environment's.
database = parse_database(
    database_from_env(
        config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url"),
        default=config.get_main_option("sqlalchemy.url") or DEFAULT_DATABASE,
    ),
    token_from_env(),
)
url = alembic_url(database)
options: dict[str, Any] = {"transactional_ddl": True}
# How long an upgrade of a local file waits for another process's upgrade (the driver's
# default is not to wait at all: "database is locked").
BUSY_TIMEOUT_MS = 60_000


def run_migrations_offline() -> None:
    context.configure(url=url, literal_binds=True, transaction_per_migration=True, **options)
    with context.begin_transaction():
        context.run_migrations()


class StoreLibsql(SQLiteDialect_libsql):
    """sqlalchemy-libsql's dialect over the store's own libsql, not libsql-experimental."""

    supports_statement_cache = True

    @classmethod
    def import_dbapi(cls) -> Any:
        return import_libsql()

    def on_connect(self) -> None:  # SQLAlchemy's regexp() and floor(): libsql has no
        return None  # create_function, and no migration calls them


registry.impls["sqlite.harel_libsql"] = lambda: StoreLibsql


def local_engine(path: str) -> tuple[Engine, FileHold]:
    """A local file through the SQLite library this process already has it open with (a
    store's): libsql unless it is the stdlib's sqlite3. Another library's connection would
    delete the store's WAL when it closed (see `hold_file`), and sqlalchemy-libsql's own
    driver, libsql-experimental, is a third copy of SQLite. The file is held for that library
    until the upgrade is over."""
    library = holder(path) or "libsql"
    hold = hold_file(path, library)
    if library == "sqlite":
        # isolation_level=None: no BEGIN of the driver's own; _begin below issues ours.
        connect = lambda: sqlite3.connect(path, isolation_level=None)  # noqa: E731
        return create_engine("sqlite://", creator=connect, poolclass=pool.NullPool), hold
    connect = lambda: import_libsql().connect(path)  # noqa: E731
    return create_engine("sqlite+harel_libsql://", creator=connect, poolclass=pool.NullPool), hold


def run_migrations_online() -> None:
    token = database.auth_token  # sqlalchemy-libsql 0.2.0 would not send one in the URL
    hold = None
    if database.local is not None and database.local != ":memory:":
        engine, hold = local_engine(database.local)
    else:
        engine = create_engine(
            url, poolclass=pool.NullPool, connect_args={"auth_token": token} if token else {}
        )

    # The libsql driver never opens a transaction before DDL, so a failed migration would
    # leave its first tables behind; open one ourselves (SQLAlchemy's pysqlite recipe).
    # IMMEDIATE takes the write lock before Alembic reads the current revision, so a second
    # process running the same upgrade waits, then finds the work done. The whole upgrade is
    # ONE transaction: Alembic reads the revision once, so with a transaction per migration
    # another process could slip in between two of them, and both would apply the next one
    # (tests/test_migrate_concurrency.py). A kill or failure leaves the revision it started at.
    if database.local is not None:  # a local file: wait for another migrator

        @event.listens_for(engine, "connect")
        def _busy_timeout(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")

    @event.listens_for(engine, "begin")
    def _begin(conn: Any) -> None:
        conn.exec_driver_sql("BEGIN IMMEDIATE")

    try:
        with engine.connect() as connection:
            context.configure(connection=connection, **options)
            with context.begin_transaction():
                context.run_migrations()
        engine.dispose()
    finally:
        if hold is not None:
            hold.release()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
