"""Alembic environment: SQLite DDL is transactional, so every migration is one transaction."""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from sqlalchemy import create_engine, event, pool

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


def run_migrations_online() -> None:
    token = database.auth_token  # sqlalchemy-libsql 0.2.0 would not send one in the URL
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

    with engine.connect() as connection:
        context.configure(connection=connection, **options)
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
