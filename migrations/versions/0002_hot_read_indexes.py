"""hot read indexes: execution summary columns, listing/timer/relay indexes, outbox created_at

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02 12:00:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0002_hot_read_indexes.up.sql")


def downgrade() -> None:
    run_sql("0002_hot_read_indexes.down.sql")
