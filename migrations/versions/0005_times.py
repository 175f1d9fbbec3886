"""times: created_at and updated_at of executions, the source of outbox entries, the age of spawns

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0005_times.up.sql")


def downgrade() -> None:
    run_sql("0005_times.down.sql")
