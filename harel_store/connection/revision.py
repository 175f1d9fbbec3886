"""The database's schema revision (the ``alembic_version`` row), read and moved to head.

These are plans (see `harel_store.batch`), so the sync store, the async twin and the CLI
run the same steps over any connection.
"""

from __future__ import annotations

import shlex

from harel_store.batch import Batch, Conflicted, Plan, statement
from harel_store.connection.url import migration_hint
from harel_store.errors import SchemaError, StoreError
from harel_store.sql import HEAD, MIGRATIONS, Migration, Query

KNOWN = [m.revision for m in MIGRATIONS]


def revision() -> Plan[str | None]:
    """The revision the database is at; None where it has none."""
    if not (yield statement("version_table_exists")):
        return None
    current: str | None = yield statement("schema_revision")
    return current


def migration_batch(migration: Migration, current: str | None) -> Batch:
    """One migration in one transaction, guarded by the revision it starts from: of two
    processes applying it at once, the second conflicts before its first DDL statement."""
    batch = Batch()
    if current is None:
        batch.add("create_version_table")
        batch.guard("claim_revision", migration.revision)
    else:
        batch.guard("update_revision", migration.revision, current)
    for number, sql in enumerate(migration.statements("up"), 1):
        batch.steps.append((Query(f"{migration.name}#{number}", "!", sql), ()))
    return batch


def unknown_revision(where: str, current: str) -> str:
    """What a database at a revision this version does not know is told (a newer
    harel-store migrated it)."""
    return (
        f"{where} is at schema revision {current!r}, which this version of "
        f"harel-store does not know (its head is {HEAD!r}): upgrade harel-store"
    )


def ensure_schema(where: str, migrate: bool) -> Plan[None]:
    """Check the database is at head, or bring it there when ``migrate``; SchemaError if not."""
    current = yield from revision()
    if current is not None and current not in KNOWN:
        raise SchemaError(unknown_revision(where, current))
    if current != HEAD and not migrate:
        state = "has no harel-store schema" if current is None else f"is at {current!r}"
        raise SchemaError(
            f"{where} {state}, behind head {HEAD!r}: run "
            f"`harel-store migrate --url {shlex.quote(where)}` (or `{migration_hint(where)}`), "
            "or open the store with migrate=True"
        )
    while current != HEAD:
        migration = MIGRATIONS[KNOWN.index(current) + 1 if current else 0]
        try:
            yield migration_batch(migration, current)
            current = migration.revision
        except Conflicted:  # another process moved the revision first: carry on from there
            current = yield from revision()
            if current is not None and current not in KNOWN:
                raise SchemaError(f"{where} moved to an unknown revision {current!r}") from None
        except StoreError as exc:
            raise SchemaError(f"migration {migration.name} failed, nothing applied: {exc}") from exc
