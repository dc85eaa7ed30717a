"""Screens take turns by user too (A3).

Adds `ai_job_gate.interactive_turn`, the turn being served among interactive jobs (what
`ai_job_gate.turn` is for prefetch jobs). Interactive jobs already waiting keep turn 0: they
go before any screen that asks from now on, which is their place by age anyway.

Revision ID: 0007
Revises: 0006
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("ai_job_gate") as batch:
        batch.add_column(
            sa.Column("interactive_turn", sa.BigInteger, nullable=False, server_default="0")
        )


def downgrade() -> None:
    with op.batch_alter_table("ai_job_gate") as batch:
        batch.drop_column("interactive_turn")
