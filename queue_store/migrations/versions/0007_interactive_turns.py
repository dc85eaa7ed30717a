"""Screens take turns by user too (A3); interactive jobs already waiting keep turn 0, their place
by age anyway."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"


def upgrade() -> None:
    with op.batch_alter_table("ai_job_gate") as batch:
        batch.add_column(
            sa.Column("interactive_turn", sa.BigInteger, nullable=False, server_default="0")
        )
