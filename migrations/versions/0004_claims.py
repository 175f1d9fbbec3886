"""claims: outbox entries, spawns and timers claimable by one worker for a lease

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-02 23:00:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0004_claims.up.sql")


def downgrade() -> None:
    run_sql("0004_claims.down.sql")
