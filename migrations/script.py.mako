"""${message}

Revision ID: ${up_revision}
Revises: ${down_revision | comma,n}
Create Date: ${create_date}

The body of this migration is plain SQL: write sql/migrations/${up_revision}_<name>.up.sql
and .down.sql, update sql/schema.sql to match, and name the files below. A migration must
work with the code before it and after it (both run during a rolling upgrade).
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = ${repr(up_revision)}
down_revision: str | None = ${repr(down_revision)}
branch_labels: str | None = ${repr(branch_labels)}
depends_on: str | None = ${repr(depends_on)}


def upgrade() -> None:
    run_sql("${up_revision}_NAME.up.sql")


def downgrade() -> None:
    run_sql("${up_revision}_NAME.down.sql")
