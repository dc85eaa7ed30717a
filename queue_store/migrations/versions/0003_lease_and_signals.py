"""Leases on one clock, the gateway's signals, results with their run, worker presence
(`schema.py` says what each column is for). Running rows keep their claim."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    with op.batch_alter_table("ai_jobs") as batch:
        batch.add_column(sa.Column("worker", sa.String(150)))
        batch.add_column(sa.Column("requested_at", sa.DateTime()))
        batch.add_column(sa.Column("unavailable_since", sa.DateTime()))
    jobs = sa.table("ai_jobs", sa.column("worker", sa.String), sa.column("holder", sa.String))
    bind = op.get_bind()
    rows = bind.execute(
        sa.select(jobs.c.holder).where(jobs.c.holder.is_not(None), jobs.c.holder.contains("/"))
    ).all()
    for (holder,) in rows:
        worker = holder.rpartition("/")[0][:150]
        bind.execute(sa.update(jobs).where(jobs.c.holder == holder).values(worker=worker))

    with op.batch_alter_table("ai_job_results") as batch:
        batch.add_column(sa.Column("flow_run_id", sa.String(64)))
        batch.add_column(sa.Column("size_bytes", sa.Integer))

    with op.batch_alter_table("ai_job_gate") as batch:
        batch.add_column(sa.Column("pause_kind", sa.String(16)))
        batch.add_column(sa.Column("last_answer_at", sa.DateTime()))
        batch.add_column(sa.Column("clock_boot_id", sa.String(64)))
        batch.add_column(sa.Column("clock_anchor_wall", sa.DateTime()))
        batch.add_column(sa.Column("clock_anchor_mono", sa.Float))
    gate = sa.table("ai_job_gate", sa.column("pause_reason", sa.Text), sa.column("pause_kind"))
    bind.execute(
        sa.update(gate).where(gate.c.pause_reason.is_not(None)).values(pause_kind="operator")
    )

    op.create_table(
        "ai_job_kind_durations",
        sa.Column("kind", sa.String(100), primary_key=True),
        sa.Column("mean_seconds", sa.Float, nullable=False),
        sa.Column("samples", sa.Integer, nullable=False),
    )
    # Seed the averages from the results kept so far.
    bind.execute(
        sa.text(
            "INSERT INTO ai_job_kind_durations (kind, mean_seconds, samples) "
            "SELECT kind, AVG(duration_seconds), COUNT(*) FROM ai_job_results "
            "WHERE duration_seconds IS NOT NULL GROUP BY kind"
        )
    )

    op.create_table(
        "ai_job_workers",
        sa.Column("name", sa.String(150), primary_key=True),
        sa.Column("role", sa.String(32), nullable=False),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("pid", sa.Integer, nullable=False),
        sa.Column("started_at", sa.DateTime(), nullable=False),
        sa.Column("seen_at", sa.DateTime(), nullable=False),
        sa.Column("info", sa.Text),
    )
