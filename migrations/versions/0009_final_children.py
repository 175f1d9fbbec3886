"""final children: the index that finds orphaned final executions

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-05 10:05:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0009_final_children.up.sql")


def downgrade() -> None:
    run_sql("0009_final_children.down.sql")
