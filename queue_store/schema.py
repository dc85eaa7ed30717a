"""The store's tables and the indexes its hot queries need. `ai_jobs` keeps the original queue's
name and columns, so its database is adopted in place (N5)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
from typing import Any, TypeVar

from sqlalchemy import (
    BigInteger,
    Column,
    Connection,
    Date,
    DateTime,
    Dialect,
    Float,
    Index,
    Integer,
    MetaData,
    Row,
    String,
    Table,
    Text,
    TypeDecorator,
    text,
    update,
)
from sqlalchemy.dialects import postgresql, sqlite

SCHEMA_REVISION = "0008"  # the migration this code expects; `JobStore` refuses an older database
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
    """JSON as text, an exact round trip: SQLite gives JSON columns numeric affinity (1.0 -> 1)."""

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
    Column("holder", String(200)),  # the claim's fencing token, named by every write (FIX2)
    Column("worker", String(150)),  # the token's worker part, to recover one worker's claims
    Column("claimed_at", UTCDateTime),
    Column("heartbeat_at", UTCDateTime),
    Column("queued_at", UTCDateTime),  # when it last entered the queue: its age in claim order
    Column("created_at", UTCDateTime, nullable=False),
    Column("updated_at", UTCDateTime, nullable=False),
    Column("finished_at", UTCDateTime),  # the last attempt's end; R5's cooldown counts from it
    Column("flow_run_id", String(64)),
    # Bumped by every write; an enqueue writes only if nobody wrote in between (FIX7).
    Column("revision", Integer, nullable=False, server_default=text("0")),
    Column("requested_at", UTCDateTime),  # when a screen asked for it while it waited
    Column("unavailable_since", UTCDateTime),  # first "unavailable" of its streak (G2)
    Column("turn", BigInteger, nullable=False, server_default=text("0")),  # fair order (R8b)
    Column("call_started_at", UTCDateTime),  # a call cut on our side holds from here (H1)
    # Claims lost with their worker since it last entered the queue (H2, FIX4).
    Column("losses", Integer, nullable=False, server_default=text("0")),
    # The token of the last claim that ended: its worker's late stop (H2) or run id (N4) is heard.
    Column("last_holder", String(200)),
)

# The queue in claim order (FIFO). The claim takes the first pending entry and a place counts a
# range of entries, so neither touches the table; `kind` rides along for the ETA.
Index("ix_ai_jobs_queue", jobs.c.status, jobs.c.priority, jobs.c.queued_at, jobs.c.id, jobs.c.kind)
# The claim's liveness checks read only the few running rows, whatever the backlog.
Index(
    "ix_ai_jobs_running",
    jobs.c.status,
    jobs.c.heartbeat_at,
    jobs.c.claimed_at,
    sqlite_where=text("status = 'running'"),
    postgresql_where=text("status = 'running'"),
)
Index(  # the queue in the fair order (R8b)
    "ix_ai_jobs_fair",
    jobs.c.status,
    jobs.c.priority,
    jobs.c.turn,
    jobs.c.queued_at,
    jobs.c.id,
    jobs.c.kind,
)
Index("ix_ai_jobs_user", jobs.c.user_id, jobs.c.kind, jobs.c.status)  # list_jobs, supersede
Index("ix_ai_jobs_finished", jobs.c.status, jobs.c.finished_at)  # retention, oldest first

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
    Column("flow_run_id", String(64)),  # the run that produced it
    Column("size_bytes", Integer),
    Column("prompt_tokens", BigInteger),  # NULL: the gateway did not say (unknown, never zero)
    Column("completion_tokens", BigInteger),
)

Index("ix_ai_job_results_kind", results.c.kind, results.c.produced_at)
Index("ix_ai_job_results_user", results.c.user_id)  # to forget a user

# One row, the deployment-wide guard of the gateway: claims lock it (FIX1).
gate = Table(
    "ai_job_gate",
    metadata,
    Column("id", Integer, primary_key=True),
    Column("last_finished_at", UTCDateTime),
    Column("paused_until", UTCDateTime),
    Column("pause_reason", Text),
    Column("outages_in_a_row", Integer, nullable=False, server_default=text("0")),
    Column("pause_kind", String(16)),
    Column("last_answer_at", UTCDateTime),  # the gateway's last answer: it is up (G2)
    Column("clock_boot_id", String(64)),  # SQLite only: the host clock's anchor (`clock`)
    Column("clock_anchor_wall", UTCDateTime),
    Column("clock_anchor_mono", Float),
    # The turn being served in the fair order, among prefetch and among interactive jobs (R8b).
    Column("turn", BigInteger, nullable=False, server_default=text("0")),
    Column("interactive_turn", BigInteger, nullable=False, server_default=text("0")),
)

# The mean call duration per kind, kept by every finish: ETAs read it instead of the results.
kind_durations = Table(
    "ai_job_kind_durations",
    metadata,
    Column("kind", String(100), primary_key=True),
    Column("mean_seconds", Float, nullable=False),
    Column("samples", Integer, nullable=False),
)

# Tokens the answers used per day, user and kind (M2); past retention, no one's (user_id "").
usage = Table(
    "ai_job_usage_days",
    metadata,
    Column("day", Date, primary_key=True),
    Column("user_id", String(200), primary_key=True),
    Column("kind", String(100), primary_key=True),
    Column("answers", BigInteger, nullable=False, server_default=text("0")),
    Column("unknown", BigInteger, nullable=False, server_default=text("0")),
    Column("prompt_tokens", BigInteger, nullable=False, server_default=text("0")),
    Column("completion_tokens", BigInteger, nullable=False, server_default=text("0")),
)
Index("ix_ai_job_usage_days_user", usage.c.user_id)

# Each user's pseudonym, all the run history ever sees of them (D4).
people = Table(
    "ai_job_people",
    metadata,
    Column("user_id", String(200), primary_key=True),
    Column("pseudonym", String(40), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
)

# Pseudonyms of forgotten users whose runs the run history still holds (D3).
erasures = Table(
    "ai_job_erasures",
    metadata,
    Column("pseudonym", String(40), primary_key=True),
    Column("forgotten_at", UTCDateTime, nullable=False),
)

# Counters and histograms for /metrics (M1, `queue_store.tallies`).
tallies = Table(
    "ai_job_tallies",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("kind", String(100), primary_key=True),
    Column("outcome", String(32), primary_key=True),
    Column("count", BigInteger, nullable=False, server_default=text("0")),
    Column("total", Float, nullable=False, server_default=text("0")),
    Column("buckets", Text, nullable=False, server_default=text("'[]'")),
)

# Calls cut on our side that the gateway may still be working on (H1); `job_id` is only shown.
holds = Table(
    "ai_job_holds",
    metadata,
    Column("id", Integer, primary_key=True, autoincrement=True),
    Column("job_id", String(64)),
    Column("worker", String(150)),
    Column("cause", String(32), nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("until", UTCDateTime, nullable=False),
)

# Consumers that said they are alive (W1): a screen's trigger starts no run if one stands by.
workers = Table(
    "ai_job_workers",
    metadata,
    Column("name", String(150), primary_key=True),
    Column("role", String(32), nullable=False),
    Column("host", String(200), nullable=False),
    Column("pid", Integer, nullable=False),
    Column("started_at", UTCDateTime, nullable=False),
    Column("seen_at", UTCDateTime, nullable=False),
    Column("info", JSONText),
)


T = TypeVar("T")


def from_row(cls: type[T], row: Row[Any], **values: Any) -> T:
    """A dataclass from a row's columns of the same names; `values` win."""
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    found = {name: value for name, value in row._mapping.items() if name in names}
    return cls(**{**found, **values})


def update_gate(connection: Connection, **values: Any) -> None:
    connection.execute(update(gate).where(gate.c.id == GATE_ROW_ID).values(**values))


def update_job(connection: Connection, job_id: str, **values: Any) -> None:
    connection.execute(update(jobs).where(jobs.c.id == job_id).values(**values))


def upsert(connection: Connection, table: Table) -> Any:
    """An INSERT in the connection's own dialect, which knows ON CONFLICT."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)
