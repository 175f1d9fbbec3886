"""dead letters: attempts, last errors and dead letters of outbox entries, spawns and timers

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-03 12:00:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0006_dead_letters.up.sql")


def downgrade() -> None:
    run_sql("0006_dead_letters.down.sql")
