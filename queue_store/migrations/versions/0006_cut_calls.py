"""A call cut on our side holds the gateway until the gateway is done with it (H1, H2)."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("ai_jobs") as batch:
        batch.add_column(sa.Column("call_started_at", sa.DateTime()))
        batch.add_column(sa.Column("losses", sa.Integer, nullable=False, server_default="0"))
        batch.add_column(sa.Column("last_holder", sa.String(200)))
    op.create_table(
        "ai_job_holds",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("job_id", sa.String(64)),
        sa.Column("worker", sa.String(150)),
        sa.Column("cause", sa.String(32), nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("until", sa.DateTime(), nullable=False),
    )
