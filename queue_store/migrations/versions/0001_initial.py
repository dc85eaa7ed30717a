"""Create the store, or adopt the original queue's `ai_jobs` in place, keeping its rows (N5): its
text times become timestamps, and its running rows a heartbeat that lapses after one lease."""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from queue_store.errors import SchemaConflict

revision = "0001"
down_revision = None

ORIGINAL_COLUMNS = {
    "id",
    "user_id",
    "kind",
    "subject",
    "fingerprint",
    "priority",
    "status",
    "attempts",
    "error",
    "holder",
    "claimed_at",
    "created_at",
    "updated_at",
}
TIME_COLUMNS = ("claimed_at", "created_at", "updated_at")


def _time() -> sa.DateTime:
    return sa.DateTime()


def upgrade() -> None:
    bind = op.get_bind()
    inspector = sa.inspect(bind)
    if inspector.has_table("ai_jobs"):
        _adopt_original(bind, inspector)
    else:
        _create_jobs()

    op.create_index("ix_ai_jobs_queue", "ai_jobs", ["status", "priority", "queued_at", "kind"])
    op.create_index("ix_ai_jobs_user", "ai_jobs", ["user_id", "kind", "status"])

    op.create_table(
        "ai_job_results",
        sa.Column("job_id", sa.String(64), primary_key=True),
        sa.Column("user_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("subject", sa.String(500), nullable=False),
        sa.Column("fingerprint", sa.String(200)),
        sa.Column("output", sa.Text, nullable=False),  # JSON, kept as exact text
        sa.Column("produced_at", _time(), nullable=False),
        sa.Column("duration_seconds", sa.Float),
    )
    op.create_index("ix_ai_job_results_kind", "ai_job_results", ["kind", "produced_at"])

    gate = op.create_table(
        "ai_job_gate",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
        sa.Column("last_finished_at", _time()),
        sa.Column("paused_until", _time()),
        sa.Column("pause_reason", sa.Text),
        sa.Column("outages_in_a_row", sa.Integer, nullable=False, server_default="0"),
    )
    op.bulk_insert(gate, [{"id": 1, "outages_in_a_row": 0}])


def _create_jobs() -> None:
    op.create_table(
        "ai_jobs",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("user_id", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(100), nullable=False),
        sa.Column("subject", sa.String(500), nullable=False),
        sa.Column("fingerprint", sa.String(200)),
        sa.Column("priority", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("error", sa.Text),
        sa.Column("holder", sa.String(200)),
        sa.Column("claimed_at", _time()),
        sa.Column("heartbeat_at", _time()),
        sa.Column("queued_at", _time()),
        sa.Column("created_at", _time(), nullable=False),
        sa.Column("updated_at", _time(), nullable=False),
        sa.Column("finished_at", _time()),
        sa.Column("flow_run_id", sa.String(64)),
        sa.Column("revision", sa.Integer, nullable=False, server_default="0"),
    )


def _adopt_original(bind: sa.engine.Connection, inspector: sa.engine.Inspector) -> None:
    columns = {column["name"] for column in inspector.get_columns("ai_jobs")}
    missing = ORIGINAL_COLUMNS - columns
    if missing:
        raise SchemaConflict(
            "ai_jobs exists but is not the original queue's table "
            f"(missing columns: {', '.join(sorted(missing))}); refusing to touch it"
        )

    with op.batch_alter_table("ai_jobs") as batch:
        for name in ("heartbeat_at", "queued_at", "finished_at"):
            if name not in columns:
                batch.add_column(sa.Column(name, _time()))
        if "flow_run_id" not in columns:
            batch.add_column(sa.Column("flow_run_id", sa.String(64)))
        if "revision" not in columns:
            batch.add_column(sa.Column("revision", sa.Integer, nullable=False, server_default="0"))

    if bind.dialect.name == "postgresql":
        _times_to_timestamps_postgresql(bind, inspector)
    else:
        _times_to_canonical_text_sqlite()

    # Rows the original left behind: give every one an age for the claim
    # order, and running ones a heartbeat that will now lapse.
    op.execute(
        "UPDATE ai_jobs SET "
        "created_at = COALESCE(created_at, updated_at, CURRENT_TIMESTAMP), "
        "updated_at = COALESCE(updated_at, created_at, CURRENT_TIMESTAMP)"
    )
    op.execute("UPDATE ai_jobs SET queued_at = created_at WHERE queued_at IS NULL")
    op.execute(
        "UPDATE ai_jobs SET heartbeat_at = COALESCE(claimed_at, updated_at) "
        "WHERE status = 'running' AND heartbeat_at IS NULL"
    )
    op.execute(
        "UPDATE ai_jobs SET finished_at = updated_at "
        "WHERE status IN ('done', 'failed') AND finished_at IS NULL"
    )
    op.execute("UPDATE ai_jobs SET attempts = 0 WHERE attempts IS NULL")


def _times_to_timestamps_postgresql(
    bind: sa.engine.Connection, inspector: sa.engine.Inspector
) -> None:
    types = {column["name"]: column["type"] for column in inspector.get_columns("ai_jobs")}
    for name in TIME_COLUMNS:
        if isinstance(types[name], sa.String | sa.Text):
            op.execute(
                f"ALTER TABLE ai_jobs ALTER COLUMN {name} TYPE TIMESTAMP WITHOUT TIME ZONE "
                f"USING NULLIF(btrim({name}), '')::timestamp"
            )


def _times_to_canonical_text_sqlite() -> None:
    # SQLite keeps times as text either way; rewrite them in the one format the
    # store compares, or 'T'-separated values would sort after same-day ones.
    for name in TIME_COLUMNS:
        op.execute(
            f"UPDATE ai_jobs SET {name} = "
            f"strftime('%Y-%m-%d %H:%M:%f', {name}) || '000' WHERE {name} IS NOT NULL"
        )
