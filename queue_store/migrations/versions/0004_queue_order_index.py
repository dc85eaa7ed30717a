"""Put the id, the claim order's tie-break, in the queue index.

A job's place in line is the number of pending jobs before it in claim order (priority, age,
id). Without the id in `ix_ai_jobs_queue`, counting the jobs before one read each of them from
the table (SQLite) or sorted them again (PostgreSQL); with it, they are a range of index
entries, counted in place, and the queue's head comes out of the index in order. The claim takes
the first entry, as before.

Revision ID: 0004
Revises: 0003
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.drop_index("ix_ai_jobs_queue", table_name="ai_jobs")
    op.create_index(
        "ix_ai_jobs_queue", "ai_jobs", ["status", "priority", "queued_at", "id", "kind"]
    )


def downgrade() -> None:
    op.drop_index("ix_ai_jobs_queue", table_name="ai_jobs")
    op.create_index("ix_ai_jobs_queue", "ai_jobs", ["status", "priority", "queued_at", "kind"])
