"""retention: the dedupe markers' time, the final roots' index

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-03 22:30:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0007_retention.up.sql")


def downgrade() -> None:
    run_sql("0007_retention.down.sql")
