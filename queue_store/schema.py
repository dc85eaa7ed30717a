"""The store's tables and the indexes its hot queries need.

`ai_jobs` keeps the original queue's table name and columns so an existing
database can be adopted in place (see `migrations/`). Times are stored as naive
UTC on every backend and handed out timezone-aware.
"""

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

# The migration this code expects; `JobStore` refuses an older database.
SCHEMA_REVISION = "0008"
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
    """JSON kept as text, an exact round trip on every backend: SQLite gives a column declared
    JSON numeric affinity and would turn a bare `1.0` result into `1`."""

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
    # The worker part of the token, for recovering exactly one worker's claims.
    Column("worker", String(150)),
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
    # When a screen asked for it while it waited: how long a user waits.
    Column("requested_at", UTCDateTime),
    # First "gateway unavailable" of its current streak: tells an outage from
    # a job the gateway keeps failing while it answers others (G2).
    Column("unavailable_since", UTCDateTime),
    # The job's turn in the fair order (R8b): users alternate within a priority.
    Column("turn", BigInteger, nullable=False, server_default=text("0")),
    # When the claim's call started (the store's clock at the renewal right
    # before it): a call cut on our side holds the gateway from here (H1).
    Column("call_started_at", UTCDateTime),
    # Claims lost with their worker since the job last entered the queue: a
    # lost claim spends no attempt (H2), but a job cannot lose them for ever.
    Column("losses", Integer, nullable=False, server_default=text("0")),
    # The token of the last claim that ended (settled, or taken over): its
    # worker's late word is still heard: a stop after a takeover (H2, whoever
    # writes first), or the run history's id arriving after the result.
    Column("last_holder", String(200)),
)

# The queue in claim order: status, priority, age, and the id that breaks ties.
# The claim takes the first pending entry; a place in line is a count of a
# range of entries, and every part of that count (the id included) is in the
# index, so neither touches the table. `kind` rides along for the ETA.
Index("ix_ai_jobs_queue", jobs.c.status, jobs.c.priority, jobs.c.queued_at, jobs.c.id, jobs.c.kind)
# The claim's liveness checks: only the few running rows, whatever the backlog.
Index(
    "ix_ai_jobs_running",
    jobs.c.status,
    jobs.c.heartbeat_at,
    jobs.c.claimed_at,
    sqlite_where=text("status = 'running'"),
    postgresql_where=text("status = 'running'"),
)
# The queue in the fair order (AI_JOB_ORDER=fair): priority, turn, then age.
Index(
    "ix_ai_jobs_fair",
    jobs.c.status,
    jobs.c.priority,
    jobs.c.turn,
    jobs.c.queued_at,
    jobs.c.id,
    jobs.c.kind,
)
# list_jobs, retry_failed, pending_count(user) and supersede.
Index("ix_ai_jobs_user", jobs.c.user_id, jobs.c.kind, jobs.c.status)
# Retention: the finished jobs past their time, oldest first, in bounded chunks.
Index("ix_ai_jobs_finished", jobs.c.status, jobs.c.finished_at)

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
    # The run history entry of the generation that produced it.
    Column("flow_run_id", String(64)),
    Column("size_bytes", Integer),
    # The answer's usage; NULL when the gateway sent none (unknown, never zero).
    Column("prompt_tokens", BigInteger),
    Column("completion_tokens", BigInteger),
)

# Recent durations per kind, for the ETA; a user's results, to forget them.
Index("ix_ai_job_results_kind", results.c.kind, results.c.produced_at)
Index("ix_ai_job_results_user", results.c.user_id)

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
    Column("pause_kind", String(16)),
    # Last time the gateway answered a call (any answer but unavailable,
    # rate-limited or refused): evidence that it is up (G2).
    Column("last_answer_at", UTCDateTime),
    # SQLite only: the anchor of the host's monotonic clock (see clock.py).
    Column("clock_boot_id", String(64)),
    Column("clock_anchor_wall", UTCDateTime),
    Column("clock_anchor_mono", Float),
    # The turn being served in the fair order: the last claimed job's, among prefetch jobs
    # and among interactive ones (screens take turns by user too).
    Column("turn", BigInteger, nullable=False, server_default=text("0")),
    Column("interactive_turn", BigInteger, nullable=False, server_default=text("0")),
)

# The mean call duration per kind, kept as a moving average by every finish:
# the ETA reads one small row per kind instead of scanning results.
kind_durations = Table(
    "ai_job_kind_durations",
    metadata,
    Column("kind", String(100), primary_key=True),
    Column("mean_seconds", Float, nullable=False),
    Column("samples", Integer, nullable=False),
)

# Tokens the gateway's answers used, per day, user and kind; `unknown` counts the answers that
# did not say. Past retention a user's rows become the day's totals (user_id "": no one's).
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

# Each user's pseudonym: all that the run history (Prefect) ever sees of them. Forgetting a
# user deletes the row, and with it who the pseudonym was.
people = Table(
    "ai_job_people",
    metadata,
    Column("user_id", String(200), primary_key=True),
    Column("pseudonym", String(40), nullable=False, unique=True),
    Column("created_at", UTCDateTime, nullable=False),
)

# Pseudonyms of forgotten users whose runs in the run history are still to be deleted (the
# history was away when they were forgotten).
erasures = Table(
    "ai_job_erasures",
    metadata,
    Column("pseudonym", String(40), primary_key=True),
    Column("forgotten_at", UTCDateTime, nullable=False),
)

# Counters and histograms for /metrics, kept by the writes that settle
# attempts and claim screens' jobs: every API process reads the same figures.
tallies = Table(
    "ai_job_tallies",
    metadata,
    Column("name", String(32), primary_key=True),
    Column("kind", String(100), primary_key=True),
    Column("outcome", String(32), primary_key=True),
    Column("count", BigInteger, nullable=False, server_default=text("0")),
    Column("total", Float, nullable=False, server_default=text("0")),
    # Cumulative counts per bound of the histogram, as JSON.
    Column("buckets", Text, nullable=False, server_default=text("'[]'")),
)

# Calls cut on our side that the gateway may still be working on (H1): each
# holds one unit of AI_JOB_CONCURRENCY until `until`, on the store's clock.
# `job_id` is only for showing which job; it is emptied when its user is forgotten.
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

# Consumers that said they are alive: the operator's view, and how a screen's
# trigger knows a warm consumer will take its job without a new run.
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
    """A dataclass of the store's from a row's columns of the same names; `values` win."""
    names = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    found = {name: value for name, value in row._mapping.items() if name in names}
    return cls(**{**found, **values})


def update_gate(connection: Connection, **values: Any) -> None:
    """Write these columns of the one gate row."""
    connection.execute(update(gate).where(gate.c.id == GATE_ROW_ID).values(**values))


def upsert(connection: Connection, table: Table) -> Any:
    """An INSERT into `table` in the connection's own dialect, which knows ON CONFLICT."""
    dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
    return dialect.insert(table)
