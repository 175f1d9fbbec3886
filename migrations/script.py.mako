<% name = context.get("migration_name", up_revision + "_NAME") %>\
"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

The body of this migration is plain SQL: sql/migrations/${name}.up.sql and .down.sql
(`alembic revision` made them, holding a comment). Write them, and update sql/schema.sql to
match. A migration must work with the code before it and after it (both run during a
rolling upgrade).
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | None = ${repr(branch_labels)}
depends_on: str | None = ${repr(depends_on)}


def upgrade() -> None:
    run_sql("${name}.up.sql")


def downgrade() -> None:
    run_sql("${name}.down.sql")
