"""Put the id, the claim order's tie-break, in the queue index: a place in line is then a range of
index entries counted in place, not rows read from the table (SQLite) or sorted (PostgreSQL)."""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"


def upgrade() -> None:
    op.drop_index("ix_ai_jobs_queue", table_name="ai_jobs")
    op.create_index(
        "ix_ai_jobs_queue", "ai_jobs", ["status", "priority", "queued_at", "id", "kind"]
    )
