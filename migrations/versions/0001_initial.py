"""initial: the seven tables of the store

Revision ID: 0001
Revises:
Create Date: 2026-12-02 10:30:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0001_initial.up.sql")


def downgrade() -> None:
    run_sql("0001_initial.down.sql")
