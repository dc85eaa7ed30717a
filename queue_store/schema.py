"""The store's tables and the indexes its hot queries need.

`ai_jobs` keeps the original queue's table name and columns so an existing
database can be adopted in place (see `migrations/`). Times are stored as naive
UTC on every backend and handed out timezone-aware.
"""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import (
    Column,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    TypeDecorator,
    text,
)

# The migration this code expects; `JobStore` refuses an older database.
SCHEMA_REVISION = "0002"
VERSION_TABLE = "insight_queue_version"

GATE_ROW_ID = 1


class UTCDateTime(TypeDecorator[dt.datetime]):
    """Naive UTC in the database, aware UTC in Python."""

    impl = DateTime
    cache_ok = True

    def process_bind_param(self, value: dt.datetime | None, dialect: Dialect) -> Any:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError("naive datetimes are ambiguous; pass an aware UTC time")
        return value.astimezone(dt.UTC).replace(tzinfo=None)

    def process_result_value(self, value: Any, dialect: Dialect) -> dt.datetime | None:
        if value is None:
            return None
        if isinstance(value, str):  # a row written by another tool, as ISO text
            value = dt.datetime.fromisoformat(value)
        if not isinstance(value, dt.datetime):
            raise TypeError(f"expected a datetime from the database, got {type(value).__name__}")
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value


class JSONText(TypeDecorator[Any]):
    """JSON kept as text: an exact round trip on every backend.

    SQLite gives a column declared JSON numeric affinity and would turn a bare
    `1.0` result into `1`; text keeps what was written.
    """

    impl = Text
    cache_ok = True

    def process_bind_param(self, value: Any, dialect: Dialect) -> str:
        return json.dumps(value, ensure_ascii=True, allow_nan=False)

    def process_result_value(self, value: Any, dialect: Dialect) -> Any:
        return None if value is None else json.loads(value)


metadata = MetaData()

jobs = Table(
    "ai_jobs",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("user_id", String(200), nullable=False),
    Column("kind", String(100), nullable=False),
    Column("subject", String(500), nullable=False),
    Column("fingerprint", String(200)),
    Column("priority", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("attempts", Integer, nullable=False, server_default=text("0")),
    Column("error", Text),
    # The claim's fencing token: every write a worker makes about its job names
    # it, so a worker whose claim was taken over changes nothing.
    Column("holder", String(200)),
    Column("claimed_at", UTCDateTime),
    Column("heartbeat_at", UTCDateTime),
    # When the job last entered the queue: its age for the claim order.
    Column("queued_at", UTCDateTime),
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    # When the last attempt ended; the failed cooldown counts from here.
    Column("finished_at", UTCDateTime),
    Column("flow_run_id", String(64)),
    # Bumped by every write; an enqueue writes only if nobody wrote in between.
    Column("revision", Integer, nullable=False, server_default=text("0")),
)

# The claim: the first pending job by priority then age, found in the index
# without touching the table; `kind` rides along for position and ETA counts.
Index("ix_ai_jobs_queue", jobs.c.status, jobs.c.priority, jobs.c.queued_at, jobs.c.kind)
# The claim's liveness checks: only the few running rows, whatever the backlog.
Index(
    "ix_ai_jobs_running",
    jobs.c.status,
    jobs.c.heartbeat_at,
    jobs.c.claimed_at,
    sqlite_where=text("status = 'running'"),
    postgresql_where=text("status = 'running'"),
)
# list_jobs, retry_failed, pending_count(user) and supersede.
Index("ix_ai_jobs_user", jobs.c.user_id, jobs.c.kind, jobs.c.status)

results = Table(
    "ai_job_results",
    metadata,
    Column("job_id", String(64), primary_key=True),
    Column("user_id", String(200), nullable=False),
    Column("kind", String(100), nullable=False),
    Column("subject", String(500), nullable=False),
    Column("fingerprint", String(200)),
    Column("output", JSONText, nullable=False),
    Column("produced_at", UTCDateTime, nullable=False),
    Column("duration_seconds", Float),
)

# Recent durations per kind, for the ETA.
Index("ix_ai_job_results_kind", results.c.kind, results.c.produced_at)

# One row: the deployment-wide guard of the gateway. Claims lock it, so the
# concurrency count and the claim are one atomic step on every backend.
gate = Table(
    "ai_job_gate",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("last_finished_at", UTCDateTime),
    Column("paused_until", UTCDateTime),
    Column("pause_reason", Text),
    Column("outages_in_a_row", Integer, nullable=False, server_default=text("0")),
)
