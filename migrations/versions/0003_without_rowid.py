"""without rowid: dedupe markers, timers and trace ring keyed by their primary key alone

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02 20:00:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0003_without_rowid.up.sql")


def downgrade() -> None:
    run_sql("0003_without_rowid.down.sql")
