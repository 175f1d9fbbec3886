"""trace times: when each trace step was recorded

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-04 18:10:00
"""

from __future__ import annotations

from harel_store.migrate import run_sql

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | None = None
depends_on: str | None = None


def upgrade() -> None:
    run_sql("0008_trace_times.up.sql")


def downgrade() -> None:
    run_sql("0008_trace_times.down.sql")
