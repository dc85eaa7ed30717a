"""Health data kept no longer than it serves, and forgotten on request (D2, D3, D4): token usage
becomes daily (what was counted before is today's), and every user known gets a pseudonym."""

from __future__ import annotations

import datetime as dt
import secrets

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"

PSEUDONYM_BYTES = 12


def upgrade() -> None:
    people = op.create_table(
        "ai_job_people",
        sa.Column("user_id", sa.String(200), primary_key=True),
        sa.Column("pseudonym", sa.String(40), nullable=False, unique=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
    )
    op.create_table(
        "ai_job_erasures",
        sa.Column("pseudonym", sa.String(40), primary_key=True),
        sa.Column("forgotten_at", sa.DateTime(), nullable=False),
    )
    op.create_index("ix_ai_jobs_finished", "ai_jobs", ["status", "finished_at"])
    op.create_index("ix_ai_job_results_user", "ai_job_results", ["user_id"])
    days = op.create_table(
        "ai_job_usage_days",
        sa.Column("day", sa.Date(), primary_key=True),
        sa.Column("user_id", sa.String(200), primary_key=True),
        sa.Column("kind", sa.String(100), primary_key=True),
        sa.Column("answers", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("unknown", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("prompt_tokens", sa.BigInteger, nullable=False, server_default="0"),
        sa.Column("completion_tokens", sa.BigInteger, nullable=False, server_default="0"),
    )
    bind = op.get_bind()
    now = dt.datetime.now(dt.UTC).replace(tzinfo=None)
    counted = sa.text(
        "SELECT user_id, kind, answers, unknown, prompt_tokens, completion_tokens FROM ai_job_usage"
    )
    rows = [dict(row._mapping, day=now.date()) for row in bind.execute(counted)]
    if rows:
        op.bulk_insert(days, rows)
    op.drop_table("ai_job_usage")
    op.create_index("ix_ai_job_usage_days_user", "ai_job_usage_days", ["user_id"])
    users = sa.text(
        "SELECT user_id FROM ai_jobs UNION SELECT user_id FROM ai_job_results "
        "UNION SELECT user_id FROM ai_job_usage_days"
    )
    found = [row.user_id for row in bind.execute(users) if row.user_id]
    if found:
        op.bulk_insert(
            people,
            [{"user_id": user, "pseudonym": _pseudonym(), "created_at": now} for user in found],
        )


def _pseudonym() -> str:
    return "p-" + secrets.token_hex(PSEUDONYM_BYTES)
