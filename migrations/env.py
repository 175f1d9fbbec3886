"""Alembic environment: SQLite DDL is transactional, so every migration is one transaction.

A failure is one line in the store's words, the one `harel-store migrate` prints: Alembic's
command line shows a CommandError as ``FAILED: <message>``, with no traceback.
"""

from __future__ import annotations

import contextlib
import logging
import sqlite3
from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.util import CommandError
from sqlalchemy import Engine, create_engine, event, pool
from sqlalchemy.dialects import registry
from sqlalchemy.exc import DBAPIError
from sqlalchemy_libsql.libsql import SQLiteDialect_libsql

from harel_store.batch import drive
from harel_store.connection import open_libsql
from harel_store.connection.local import FileHold, hold_file, holder, import_libsql
from harel_store.connection.revision import revision
from harel_store.connection.url import (
    DEFAULT_DATABASE,
    DatabaseURL,
    alembic_url,
    database_from_env,
    parse_database,
    token_from_env,
)
from harel_store.errors import StoreError, scrub
from harel_store.migrate import (
    alembic_in_child,
    bounded_elsewhere,
    command_in_child,
    deadline,
    driver_failure,
    killed,
    migration_timeout,
    number_revision,
    refuse_unknown_revision,
    sqlalchemy_execute,
    timed_out,
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

options: dict[str, Any] = {"transactional_ddl": True}
# How long an upgrade of a local file waits for another process's upgrade (the driver's
# default is not to wait at all: "database is locked").
BUSY_TIMEOUT_MS = 60_000


class MigrationFailed(CommandError, StoreError):
    """A failure in the store's words, on one line and never with a token: Alembic's command
    line prints it as ``FAILED: ...`` (a CommandError), `harel-store migrate` as its own error
    line (a StoreError), neither with a traceback."""

    def __init__(self, text: str, database: DatabaseURL | None = None) -> None:
        secrets = (database.auth_token,) if database is not None else ()
        super().__init__(" ".join(scrub(text, secrets).split()))


def target() -> tuple[str, DatabaseURL]:
    """The database as given, and as read: `harel-store migrate` hands it over in
    config.attributes["url"]; else -x url=, else $HAREL_DATABASE_URL, $TURSO_DATABASE_URL,
    alembic.ini's sqlalchemy.url, harel.db. Any form the store reads; a token in it
    (authToken=) wins over the environment's."""
    try:
        given = database_from_env(
            config.attributes.get("url") or context.get_x_argument(as_dictionary=True).get("url"),
            default=config.get_main_option("sqlalchemy.url") or DEFAULT_DATABASE,
        )
        return given, parse_database(given, token_from_env())
    except (ValueError, TypeError) as exc:  # it names what is wrong, never a token
        raise MigrationFailed(str(exc)) from None


def server_timeout() -> float:
    """Seconds a run against a server may take: `harel-store migrate --timeout`
    (config.attributes["timeout"]), else -x timeout=, else $HAREL_TIMEOUT, else 30."""
    given = config.attributes.get("timeout") or context.get_x_argument(as_dictionary=True).get(
        "timeout"
    )
    try:
        return migration_timeout(given)
    except ValueError as exc:
        raise MigrationFailed(str(exc)) from None


def scripts_only() -> bool:
    """Whether Alembic runs env.py for its scripts alone (alembic.ini's revision_environment
    = true): `alembic revision`, from the command line or `command.revision`, `merge`, and
    `history` without --indicate-current. Such a run opens no database (`alembic revision`
    in a checkout would otherwise create harel.db and its version table)."""
    # Alembic keeps its command's options on the EnvironmentContext env.py runs in, which
    # `alembic.context` stands for; it has no public accessor.
    environment = getattr(context, "_proxy", None)
    if "revision_context" in getattr(environment, "context_opts", {}):
        return True
    cmd = getattr(config.cmd_opts, "cmd", None)
    name = getattr(cmd[0], "__name__", "") if cmd else ""
    return name == "merge" or (
        name == "history" and not getattr(config.cmd_opts, "indicate_current", False)
    )


def running_command() -> tuple[str, str, str | None] | None:
    """The upgrade or downgrade a program asked of Alembic's `command` (its name, revision
    and tag), which a child process can run again; None for any other command."""
    environment = getattr(context, "_proxy", None)  # as in scripts_only
    opts = getattr(environment, "context_opts", {})
    name = getattr(opts.get("fn"), "__name__", "")
    revision = opts.get("destination_rev")
    if name not in ("upgrade", "downgrade") or not isinstance(revision, str):
        return None
    return name, revision, context.get_tag_argument()


def run_for_scripts() -> None:
    """No database: Alembic's work function gets no revision, and `alembic revision` numbers
    the new revision after the head (`harel_store.migrate.number_revision`)."""
    chatter = logging.getLogger("alembic.runtime.migration")
    level = chatter.level
    chatter.setLevel(logging.WARNING)  # not "Generating static SQL": there is none
    try:
        context.configure(
            dialect_name="sqlite",
            as_sql=True,  # no connection: nothing is read, and nothing is printed
            process_revision_directives=number_revision,
            **options,
        )
    finally:
        chatter.setLevel(level)
    context.run_migrations()


def run_migrations_offline() -> None:
    _, database = target()
    context.configure(
        url=alembic_url(database), literal_binds=True, transaction_per_migration=True, **options
    )
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


def reach(given: str, database: DatabaseURL) -> None:
    """Read a server's revision through the store's own connection before Alembic's driver
    is given the server: one that cannot be reached, answers without TLS, or refuses the
    token is then the store's one line, the one `harel-store migrate` prints (with its hint:
    ``... the server answered without TLS: for a plain-HTTP server use http://host:port``),
    not the driver's traceback."""
    try:
        conn = open_libsql(given, auth_token=token_from_env())
        try:
            drive(conn.execute, revision())
        finally:
            conn.close()
    except (StoreError, ValueError) as exc:  # ValueError: a token that cannot be a header
        raise MigrationFailed(str(exc), database) from exc


def run_migrations_online() -> None:
    given, database = target()
    local = database.local is not None
    bound: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    try:
        bounded = local or bounded_elsewhere()  # a run's child: its parent bounds it
    except ValueError as exc:
        raise MigrationFailed(str(exc), database) from None
    if not bounded:
        seconds = server_timeout()
        if config.cmd_opts is not None:  # Alembic's command line: run again in a child
            status = alembic_in_child(config, seconds)
            if status is None:
                raise MigrationFailed(timed_out(database.where, seconds), database)
            if status < 0:  # a signal killed it (an OOM kill): it said nothing
                raise MigrationFailed(killed(database.where, status), database)
            if status != 0:
                raise SystemExit(status)  # the child said why
            return
        command = running_command()
        if command is not None:  # a program's own upgrade or downgrade: run again in a child
            failure = command_in_child(config, command, seconds, database.where)
            if failure is not None:
                raise MigrationFailed(failure, database)
            return
        # Any other command a program runs (stamp, current): a watchdog ends its process.
        bound = deadline(seconds, f"harel-store: error: {timed_out(database.where, seconds)}")
    if not local:
        reach(given, database)
    try:
        with bound:
            migrate_online(database)
    except CommandError:  # Alembic's own, or ours (MigrationFailed): one line already
        raise
    except StoreError as exc:  # the store's (a file another library holds, a schema error)
        raise MigrationFailed(str(exc), database) from exc
    except (ValueError, DBAPIError) as exc:  # the drivers': libsql raises ValueError
        cause = exc.orig if isinstance(exc, DBAPIError) and exc.orig is not None else exc
        secrets = (database.auth_token,) if database.auth_token else ()
        text = driver_failure(cause, database.where, local=local, secrets=secrets)
        raise MigrationFailed(text, database) from exc


def migrate_online(database: DatabaseURL) -> None:
    token = database.auth_token  # sqlalchemy-libsql 0.2.0 would not send one in the URL
    hold = None
    if database.local is not None and database.local != ":memory:":
        engine, hold = local_engine(database.local)
    else:
        engine = create_engine(
            alembic_url(database),
            poolclass=pool.NullPool,
            connect_args={"auth_token": token} if token else {},
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
                try:
                    context.run_migrations()
                except CommandError:
                    # Alembic's "Can't locate revision identified by '9999'": a database
                    # ahead of this code, said as the store says it (SchemaError).
                    refuse_unknown_revision(sqlalchemy_execute(connection), database.where)
                    raise
        engine.dispose()
    finally:
        if hold is not None:
            hold.release()


if scripts_only():
    run_for_scripts()
elif context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
