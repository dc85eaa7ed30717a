"""Users take turns (R8b), token usage is kept (M2), and the store keeps what metrics read (M1).
Jobs already queued keep their place: their turn is 0, before any new one."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    with op.batch_alter_table("ai_jobs") as batch:
        batch.add_column(sa.Column("turn", sa.BigInteger, nullable=False, server_default="0"))
    op.create_index(
        "ix_ai_jobs_fair", "ai_jobs", ["status", "priority", "turn", "queued_at", "id", "kind"]
    )
    with op.batch_alter_table("ai_job_gate") as batch:
        batch.add_column(sa.Column("turn", sa.BigInteger, nullable=False, server_default="0"))
    with op.batch_alter_table("ai_job_results") as batch:
        batch.add_column(sa.Column("prompt_tokens", sa.BigInteger))
        batch.add_column(sa.Column("completion_tokens", sa.BigInteger))
    op.create_table(
        "ai_job_usage",
        sa.Column("user_id", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(100), primary_key=True),
        sa.Column("answers", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("unknown", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )
    op.create_table(
        "ai_job_tallies",
        sa.Column("name", sa.String(32), primary_key=True),
        sa.Column("kind", sa.String(100), primary_key=True),
        sa.Column("outcome", sa.String(32), primary_key=True),
        sa.Column("count", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("total", sa.Float, nullable=False, server_default="0"),
        sa.Column("buckets", sa.Text, nullable=False, server_default="[]"),
    )
