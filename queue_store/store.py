"""JobStore: every rule of the queue, one method per verb.

The store alone decides what the gateway works on next (priority, promotion,
fingerprints, attempts, cooldowns) and guards the gateway for the whole
deployment (concurrency, gap, pause). Flows call these methods and never see
SQL. It must not import Prefect, httpx or anything from `flows`.

Concurrency model:
- `claim_next` serialises on the single `ai_job_gate` row (PostgreSQL:
  `SELECT … FOR UPDATE`; SQLite: `BEGIN IMMEDIATE`), so counting the calls in
  flight, checking the gap and taking a job are one atomic step.
- Every write a worker makes about its job names the claim's token in
  `holder`; a worker whose claim was taken over changes nothing.
- `enqueue` reads first and writes only when something changes; its write is
  a compare-and-swap on `revision`, retried if another writer got there first.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime as dt
import json
import math
import secrets
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import (
    Connection,
    Row,
    case,
    delete,
    func,
    insert,
    literal,
    select,
    tuple_,
    update,
)
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from queue_store import migrate, schema
from queue_store.engine import (
    SQLITE_BEGIN,
    create_store_engine,
    shown_url,
    wrap_database_error,
)
from queue_store.errors import ClaimLost, DatabaseError, InvalidArgument, SchemaOutdated
from queue_store.models import (
    INTERACTIVE,
    MAX_ERROR_LENGTH,
    MAX_FINGERPRINT_LENGTH,
    MAX_HOLDER_LENGTH,
    MAX_ID_LENGTH,
    MAX_KIND_LENGTH,
    MAX_PRIORITY,
    MAX_SUBJECT_LENGTH,
    PREFETCH,
    Blocked,
    Claim,
    GateState,
    Job,
    Position,
    Result,
    Status,
    job_id,
)
from queue_store.schema import UTCDateTime
from queue_store.settings import Settings

jobs = schema.jobs
results = schema.results
gate = schema.gate

Clock = Callable[[], dt.datetime]

MAX_LIST_LIMIT = 1000
MAX_SECONDS = 10 * 365 * 24 * 3600.0  # longest pause or duration the store accepts
# An enqueue that keeps losing its compare-and-swap is being raced by writers
# on the same key; a few rounds always settle it.
MAX_ENQUEUE_ROUNDS = 8
# How many recent results per kind the ETA averages.
DURATION_SAMPLE = 20

WORKER_LOST = "worker lost: its claim lapsed on the last allowed attempt"

_MISSING: Any = object()


def utcnow() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


def _iso(value: dt.datetime | None) -> str | None:
    return value.isoformat(timespec="seconds") if value else None


# ---------------------------------------------------------------------------
# Input checks: every public argument is checked before the database is touched.


def _text(name: str, value: object, max_length: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(name, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(name, "must not be empty")
    if len(value) > max_length:
        raise InvalidArgument(name, f"is {len(value)} characters; at most {max_length}")
    if "\x00" in value:
        raise InvalidArgument(name, "must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(name, "is not valid Unicode text (lone surrogate)") from None
    return value


def _key(user_id: object, kind: object, subject: object) -> tuple[str, str, str]:
    user_id = _text("user_id", user_id, MAX_ID_LENGTH)
    kind = _text("kind", kind, MAX_KIND_LENGTH)
    # The id hashes "user|kind|subject": a "|" in the first two parts would let
    # two different keys (and two users) share one job.
    for name, value in (("user_id", user_id), ("kind", kind)):
        if "|" in value:
            raise InvalidArgument(name, "must not contain '|'")
    return user_id, kind, _text("subject", subject, MAX_SUBJECT_LENGTH)


def check_user_id(value: object) -> str:
    """A user id as the store accepts it, or `InvalidArgument` naming `user_id`.

    For callers that take a user id before anything reaches the store (the
    post-sync trigger), so they refuse what the store would refuse.
    """
    user_id = _text("user_id", value, MAX_ID_LENGTH)
    if "|" in user_id:
        raise InvalidArgument("user_id", "must not contain '|'")
    return user_id


def _fingerprint(value: object) -> str | None:
    # An empty fingerprint means "none given", as it did in the original.
    if value is None or value == "":
        return None
    return _text("fingerprint", value, MAX_FINGERPRINT_LENGTH)


def _priority(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument("priority", f"must be an int, got {type(value).__name__}")
    if not 0 <= value <= MAX_PRIORITY:
        raise InvalidArgument("priority", f"must be between 0 and {MAX_PRIORITY}, got {value}")
    return value


def _positive_int(name: str, value: object, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an int, got {type(value).__name__}")
    if not 1 <= value <= maximum:
        raise InvalidArgument(name, f"must be between 1 and {maximum}, got {value}")
    return value


def _seconds(name: str, value: object, maximum: float = MAX_SECONDS) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(name, f"must be a number of seconds, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        raise InvalidArgument(name, "is too large") from None
    if not math.isfinite(seconds) or not 0 <= seconds <= maximum:
        raise InvalidArgument(name, f"must be between 0 and {maximum:.0f} seconds; got {value}")
    return seconds


def _job_id(value: object) -> str:
    text = _text("job_id", value, 64)
    if len(text) != 64 or any(c not in "0123456789abcdef" for c in text):
        raise InvalidArgument("job_id", "must be 64 lowercase hex characters")
    return text


def _output(value: object) -> Any:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument("result", f"must be JSON-serialisable ({exc})") from None
    return value


def _error_text(value: object, name: str = "error") -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(name, "must be a non-empty string")
    cleaned = value.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    return cleaned[:MAX_ERROR_LENGTH]


# ---------------------------------------------------------------------------


class JobStore:
    """The queue. Thread-safe; one instance per process is enough."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        clock: Clock | None = None,
        check_schema: bool = True,
    ) -> None:
        self._settings = settings or Settings.from_env()
        self._engine = create_store_engine(url or self._settings.database_url)
        self._clock = clock or utcnow
        self._is_sqlite = self._engine.dialect.name == "sqlite"
        if check_schema:
            self.check_schema()

    # -- lifecycle ---------------------------------------------------------

    @property
    def settings_object(self) -> Settings:
        return self._settings

    @property
    def url(self) -> str:
        return shown_url(self._engine.url)

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def check_schema(self) -> None:
        try:
            revision = migrate.current_revision(self._engine)
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, "schema check") from exc
        if revision != schema.SCHEMA_REVISION:
            found = "no insight-queue schema" if revision is None else f"revision {revision}"
            raise SchemaOutdated(
                f"the database at {self.url} has {found}; this version needs revision "
                f"{schema.SCHEMA_REVISION}. Run `insight-queue db upgrade` to upgrade it."
            )

    def upgrade(self) -> str | None:
        """Run the migrations on this store's database (what `db upgrade` does)."""
        return migrate.upgrade(self._engine)

    # -- plumbing ------------------------------------------------------------

    def _now(self) -> dt.datetime:
        now = self._clock()
        if now.tzinfo is None:
            raise InvalidArgument("clock", "must return timezone-aware UTC times")
        return now.astimezone(dt.UTC)

    @contextmanager
    def _transaction(self, operation: str, *, write: bool) -> Iterator[Connection]:
        try:
            with self._engine.connect() as connection:
                if self._is_sqlite:
                    connection = connection.execution_options(
                        **{SQLITE_BEGIN: "IMMEDIATE" if write else "DEFERRED"}
                    )
                with connection.begin():
                    yield connection
        except IntegrityError:
            raise
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, operation) from exc

    def _read(self, operation: str) -> Any:
        return self._transaction(operation, write=False)

    def _write(self, operation: str) -> Any:
        return self._transaction(operation, write=True)

    def _lock_gate(self, connection: Connection) -> Row[Any]:
        # On SQLite the IMMEDIATE transaction already holds the write lock.
        row = connection.execute(
            select(gate).where(gate.c.id == schema.GATE_ROW_ID).with_for_update()
        ).one_or_none()
        if row is None:
            raise SchemaOutdated("the gate row is missing; run `insight-queue db upgrade`")
        return row

    def _live_claim(self, now: dt.datetime) -> Any:
        """SQL condition: a running job whose claim is still live (FIX3)."""
        s = self._settings
        return (
            (jobs.c.status == Status.RUNNING)
            & (jobs.c.heartbeat_at >= now - dt.timedelta(seconds=s.lease_seconds))
            & (jobs.c.claimed_at >= now - dt.timedelta(seconds=s.claim_timeout_seconds))
        )

    def _is_live(self, row: Row[Any], now: dt.datetime) -> bool:
        s = self._settings
        return (
            row.status == Status.RUNNING
            and row.heartbeat_at is not None
            and row.claimed_at is not None
            and now - row.heartbeat_at <= dt.timedelta(seconds=s.lease_seconds)
            and now - row.claimed_at <= dt.timedelta(seconds=s.claim_timeout_seconds)
        )

    # -- R1-R6: enqueue ------------------------------------------------------

    def enqueue(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        priority: int = PREFETCH,
    ) -> str:
        """Queue one generation, or promote it; returns the job's status after the call.

        Idempotent: a screen calls this on every poll, so a call that changes
        nothing writes nothing.
        """
        user_id, kind, subject = _key(user_id, kind, subject)
        fingerprint = _fingerprint(fingerprint)
        priority = _priority(priority)
        jid = job_id(user_id, kind, subject)

        for _ in range(MAX_ENQUEUE_ROUNDS):
            now = self._now()
            with self._read("enqueue") as connection:
                row = connection.execute(select(jobs).where(jobs.c.id == jid)).one_or_none()
            if row is None:
                try:
                    with self._write("enqueue") as connection:
                        connection.execute(
                            insert(jobs).values(
                                id=jid,
                                user_id=user_id,
                                kind=kind,
                                subject=subject,
                                fingerprint=fingerprint,
                                priority=priority,
                                status=Status.PENDING,
                                attempts=0,
                                queued_at=now,
                                created_at=now,
                                updated_at=now,
                                revision=0,
                            )
                        )
                    return Status.PENDING.value
                except IntegrityError:
                    continue  # another caller inserted it first: decide again
            status, changes = self._decide(row, fingerprint, priority, now)
            if changes is None:
                return status
            with self._write("enqueue") as connection:
                written = connection.execute(
                    update(jobs)
                    .where(jobs.c.id == jid, jobs.c.revision == row.revision)
                    .values(**changes, updated_at=now, revision=row.revision + 1)
                ).rowcount
            if written == 1:
                return status
        raise DatabaseError(f"enqueue: job {jid[:12]}… kept changing under this call; retry")

    def _decide(
        self, row: Row[Any], fingerprint: str | None, priority: int, now: dt.datetime
    ) -> tuple[str, dict[str, Any] | None]:
        s = self._settings
        stale = fingerprint is not None and fingerprint != row.fingerprint
        exhausted = row.attempts >= s.max_attempts
        requeue: dict[str, Any] = {
            "status": Status.PENDING,
            "holder": None,
            "claimed_at": None,
            "heartbeat_at": None,
        }

        if row.status == Status.RUNNING:
            if self._is_live(row, now):
                return Status.RUNNING.value, None  # R3: promoting it would not speed it up
            if exhausted and not stale:
                # FIX4: the last allowed attempt died with its worker.
                return Status.FAILED.value, {
                    "status": Status.FAILED,
                    "error": WORKER_LOST,
                    "holder": None,
                    "finished_at": now,
                }
        elif row.status == Status.DONE and not stale:
            return Status.DONE.value, None  # R4
        elif row.status == Status.FAILED and exhausted and not stale:
            gave_up = row.finished_at or row.updated_at
            if now - gave_up < dt.timedelta(seconds=s.retry_after_seconds):
                return Status.FAILED.value, None  # R5: still cooling down
            return Status.PENDING.value, {
                **requeue,
                "attempts": 0,
                "error": None,
                "priority": min(priority, row.priority),
                "fingerprint": fingerprint or row.fingerprint,
                "queued_at": now,
            }

        # R6: (re-)queue; promote, never demote.
        changes = {
            **requeue,
            "priority": min(priority, row.priority),
            "fingerprint": fingerprint or row.fingerprint,
            "attempts": 0 if stale else row.attempts,
        }
        if row.status in (Status.DONE, Status.FAILED):
            changes["queued_at"] = now
        if row.status == Status.PENDING and all(
            getattr(row, name) == value for name, value in changes.items()
        ):
            return Status.PENDING.value, None  # FIX7: an unchanged poll writes nothing
        return Status.PENDING.value, changes

    # -- R7, R10, R11: the user's queue ------------------------------------

    def supersede(self, user_id: str, kind: str, subject: str) -> int:
        """Drop the user's pending jobs of `kind` for any other subject; returns how many."""
        user_id, kind, subject = _key(user_id, kind, subject)
        with self._write("supersede") as connection:
            return int(
                connection.execute(
                    delete(jobs).where(
                        jobs.c.user_id == user_id,
                        jobs.c.kind == kind,
                        jobs.c.subject != subject,
                        jobs.c.status == Status.PENDING,
                    )
                ).rowcount
            )

    def job(self, user_id: str, kind: str, subject: str) -> Job | None:
        user_id, kind, subject = _key(user_id, kind, subject)
        return self.get(job_id(user_id, kind, subject))

    def get(self, jid: str) -> Job | None:
        jid = _job_id(jid)
        with self._read("get") as connection:
            row = connection.execute(select(jobs).where(jobs.c.id == jid)).one_or_none()
        return _job(row) if row is not None else None

    def status_of(self, user_id: str, kind: str, subject: str) -> dict[str, Any] | None:
        found = self.job(user_id, kind, subject)
        if found is None:
            return None
        return {
            "status": found.status.value,
            "priority": found.priority,
            "attempts": found.attempts,
            "error": found.error,
            "updatedAt": _iso(found.updated_at),
            "fingerprint": found.fingerprint,
            "flowRunId": found.flow_run_id,
        }

    def list_jobs(self, user_id: str, limit: int = 60) -> list[dict[str, Any]]:
        """The user's queue in the order the worker will take it.

        Running, then pending, then failed, then done; within each, priority
        then age. Pending and running entries carry their place in line and ETA.
        """
        user_id = _text("user_id", user_id, MAX_ID_LENGTH)
        limit = _positive_int("limit", limit, MAX_LIST_LIMIT)
        order = case(
            (jobs.c.status == Status.RUNNING, 0),
            (jobs.c.status == Status.PENDING, 1),
            (jobs.c.status == Status.FAILED, 2),
            else_=3,
        )
        with self._read("list_jobs") as connection:
            now = self._now()
            rows = connection.execute(
                select(jobs)
                .where(jobs.c.user_id == user_id)
                .order_by(order, jobs.c.priority, jobs.c.queued_at, jobs.c.id)
                .limit(limit)
            ).all()
            positions = self._positions(connection, [_job(r) for r in rows], now)
        listed = []
        for row in rows:
            entry = {
                "kind": row.kind,
                "subject": row.subject,
                "status": row.status,
                "priority": row.priority,
                "interactive": row.priority <= INTERACTIVE,
                "attempts": row.attempts,
                "maxAttempts": self._settings.max_attempts,
                "error": row.error,
                "updatedAt": _iso(row.updated_at),
            }
            position = positions.get(row.id)
            if position is not None:
                entry.update(position.as_dict())
            listed.append(entry)
        return listed

    def pending_count(self, user_id: str | None = None) -> int:
        """Jobs pending or running, for one user or for everyone."""
        query = select(func.count()).select_from(jobs)
        query = query.where(jobs.c.status.in_([Status.PENDING, Status.RUNNING]))
        if user_id is not None:
            query = query.where(jobs.c.user_id == _text("user_id", user_id, MAX_ID_LENGTH))
        with self._read("pending_count") as connection:
            return int(connection.execute(query).scalar_one())

    def has_pending(self) -> bool:
        """Whether any job is queued: the cheapest question a standing-by consumer can ask."""
        with self._read("has_pending") as connection:
            found = connection.execute(
                select(jobs.c.id).where(jobs.c.status == Status.PENDING).limit(1)
            ).first()
        return found is not None

    def calls_in_flight(self) -> int:
        """Running jobs whose claim is live: gateway calls under way right now."""
        with self._read("calls_in_flight") as connection:
            now = self._now()
            return int(
                connection.execute(
                    select(func.count()).select_from(jobs).where(self._live_claim(now))
                ).scalar_one()
            )

    def retry_failed(self, user_id: str) -> int:
        """Every failed job of the user back in the queue now; returns the pending count."""
        user_id = _text("user_id", user_id, MAX_ID_LENGTH)
        now = self._now()
        with self._write("retry_failed") as connection:
            connection.execute(
                update(jobs)
                .where(jobs.c.user_id == user_id, jobs.c.status == Status.FAILED)
                .values(
                    status=Status.PENDING,
                    attempts=0,
                    error=None,
                    holder=None,
                    claimed_at=None,
                    heartbeat_at=None,
                    queued_at=now,
                    updated_at=now,
                    revision=jobs.c.revision + 1,
                )
            )
        return self.pending_count(user_id)

    def settings(self) -> dict[str, Any]:
        """What the consumer is configured to do."""
        s = self._settings
        return {
            "enabled": s.enabled,
            "concurrency": s.concurrency,
            "gapSeconds": s.gap_seconds,
            "maxAttempts": s.max_attempts,
            "retryAfterSeconds": s.retry_after_seconds,
            "claimTimeoutSeconds": s.claim_timeout_seconds,
            "leaseSeconds": s.lease_seconds,
            "heartbeatSeconds": s.heartbeat_seconds,
        }

    # -- R8, R9, FIX1, FIX6: claim -------------------------------------------

    def claim_next(self, holder: str) -> Claim:
        """Take the highest-priority runnable job, if the gateway guard allows one.

        `holder` names the worker; the claimed job's `holder` is a fresh token
        built from it, which every later write about the job must present.
        """
        holder = _text("holder", holder, MAX_HOLDER_LENGTH)
        s = self._settings
        with self._write("claim_next") as connection:
            state = self._lock_gate(connection)
            now = self._now()
            # The few running rows tell both how many calls are in flight and
            # whether any claim died; the reap's writes happen only then.
            running = connection.execute(
                select(jobs.c.status, jobs.c.holder, jobs.c.heartbeat_at, jobs.c.claimed_at).where(
                    jobs.c.status == Status.RUNNING
                )
            ).all()
            in_flight = sum(1 for row in running if self._is_live(row, now))
            if in_flight < len(running):
                self._reap(connection, now)

            if state.paused_until is not None and state.paused_until > now:
                wait = (state.paused_until - now).total_seconds()
                return Claim(None, Blocked.PAUSED, wait)
            if in_flight >= s.concurrency:
                return Claim(None, Blocked.CONCURRENCY, None)
            if state.last_finished_at is not None:
                quiet_until = state.last_finished_at + dt.timedelta(seconds=s.gap_seconds)
                if quiet_until > now:
                    return Claim(None, Blocked.GAP, (quiet_until - now).total_seconds())

            while True:
                candidate = connection.execute(
                    select(jobs)
                    .where(jobs.c.status == Status.PENDING)
                    .order_by(jobs.c.priority, jobs.c.queued_at)
                    .limit(1)
                    .with_for_update(skip_locked=True)
                ).one_or_none()
                if candidate is None:
                    return Claim(None, Blocked.EMPTY, None)
                if candidate.attempts >= s.max_attempts:
                    # Only reachable if AI_JOB_MAX_ATTEMPTS was lowered: give up
                    # on it rather than let it block the head of the queue.
                    connection.execute(
                        update(jobs)
                        .where(jobs.c.id == candidate.id)
                        .values(
                            status=Status.FAILED,
                            error=f"attempts exhausted: AI_JOB_MAX_ATTEMPTS is {s.max_attempts}",
                            finished_at=now,
                            updated_at=now,
                            revision=jobs.c.revision + 1,
                        )
                    )
                    continue
                claimed = {
                    "status": Status.RUNNING,
                    "holder": f"{holder}/{secrets.token_hex(6)}",
                    "claimed_at": now,
                    "heartbeat_at": now,
                    "attempts": candidate.attempts + 1,
                    "updated_at": now,
                }
                connection.execute(
                    update(jobs)
                    .where(jobs.c.id == candidate.id)
                    .values(**claimed, revision=candidate.revision + 1)
                )
                return Claim(dataclasses.replace(_job(candidate), **claimed))

    def _reap(self, connection: Connection, now: dt.datetime, worker: str | None = None) -> int:
        """Release dead claims (FIX3/FIX5); the last attempt's death fails the job (FIX4).

        With `worker`, that worker's own claims are released too: it is
        starting up, so whatever it held before belongs to a dead process.
        """
        s = self._settings
        dead = (jobs.c.status == Status.RUNNING) & ~self._live_claim(now)
        # Rows written by another tool may lack a heartbeat; NULL is not live.
        dead = dead | ((jobs.c.status == Status.RUNNING) & (jobs.c.heartbeat_at.is_(None)))
        if worker is not None:
            mine = (jobs.c.status == Status.RUNNING) & jobs.c.holder.startswith(
                f"{worker}/", autoescape=True
            )
            dead = dead | mine
        lost = connection.execute(
            update(jobs)
            .where(dead, jobs.c.attempts >= s.max_attempts)
            .values(
                status=Status.FAILED,
                error=WORKER_LOST,
                holder=None,
                finished_at=now,
                updated_at=now,
                revision=jobs.c.revision + 1,
            )
        ).rowcount
        released = connection.execute(
            update(jobs)
            .where(dead)
            .values(
                status=Status.PENDING,
                holder=None,
                claimed_at=None,
                heartbeat_at=None,
                updated_at=now,
                revision=jobs.c.revision + 1,
            )
        ).rowcount
        return int(lost + released)

    def recover(self, worker: str | None = None) -> int:
        """Start-up recovery: release dead claims and this worker's own, never live ones."""
        if worker is not None:
            worker = _text("worker", worker, MAX_HOLDER_LENGTH)
        with self._write("recover") as connection:
            self._lock_gate(connection)
            return self._reap(connection, self._now(), worker)

    # -- FIX2: fenced writes by the holder ------------------------------------

    def _held(self, jid: str, holder: str) -> Any:
        return (jobs.c.id == jid) & (jobs.c.holder == holder) & (jobs.c.status == Status.RUNNING)

    def heartbeat(self, jid: str, holder: str) -> bool:
        """Renew the claim; False means it was lost and the call must be abandoned."""
        jid = _job_id(jid)
        holder = _text("holder", holder, MAX_HOLDER_LENGTH + 13)
        now = self._now()
        timeout = dt.timedelta(seconds=self._settings.claim_timeout_seconds)
        with self._write("heartbeat") as connection:
            return bool(
                connection.execute(
                    update(jobs)
                    .where(self._held(jid, holder), jobs.c.claimed_at >= now - timeout)
                    .values(heartbeat_at=now)
                ).rowcount
            )

    def set_flow_run(self, jid: str, holder: str, flow_run_id: str) -> None:
        """Record which orchestrator run is working on the job (N4)."""
        jid = _job_id(jid)
        holder = _text("holder", holder, MAX_HOLDER_LENGTH + 13)
        flow_run_id = _text("flow_run_id", flow_run_id, 64)
        with self._write("set_flow_run") as connection:
            written = connection.execute(
                update(jobs).where(self._held(jid, holder)).values(flow_run_id=flow_run_id)
            ).rowcount
        if not written:
            raise ClaimLost(jid, holder)

    def finish(
        self,
        jid: str,
        holder: str,
        *,
        result: Any = _MISSING,
        error: str | None = None,
        duration_seconds: float | None = None,
    ) -> Status:
        """Record the attempt's outcome; returns the job's status afterwards.

        A result marks it done and becomes the key's latest result (N1). An
        error spends the attempt: below the limit the job is queued again in
        its old place, at the limit it is failed. Raises `ClaimLost` if the
        claim was taken over, having changed nothing.
        """
        jid = _job_id(jid)
        holder = _text("holder", holder, MAX_HOLDER_LENGTH + 13)
        if (result is _MISSING) == (error is None):
            raise InvalidArgument("result", "give exactly one of result= or error=")
        if result is not _MISSING:
            result = _output(result)
        else:
            error = _error_text(error)
        if duration_seconds is not None:
            duration_seconds = _seconds("duration_seconds", duration_seconds)

        with self._write("finish") as connection:
            now = self._now()
            row = connection.execute(
                select(jobs).where(self._held(jid, holder)).with_for_update()
            ).one_or_none()
            if row is None:
                raise ClaimLost(jid, holder)
            if error is not None:
                status = (
                    Status.FAILED if row.attempts >= self._settings.max_attempts else Status.PENDING
                )
                changes: dict[str, Any] = {"status": status, "error": error}
            else:
                status = Status.DONE
                changes = {"status": status, "error": None}
                if duration_seconds is None and row.claimed_at is not None:
                    duration_seconds = (now - row.claimed_at).total_seconds()
                self._save_result(connection, row, result, now, duration_seconds)
            connection.execute(
                update(jobs)
                .where(jobs.c.id == jid)
                .values(
                    **changes,
                    holder=None,
                    heartbeat_at=None,
                    finished_at=now,
                    updated_at=now,
                    revision=row.revision + 1,
                )
            )
            gate_changes: dict[str, Any] = {"last_finished_at": now}
            if error is None:
                gate_changes["outages_in_a_row"] = 0  # the gateway answered
            connection.execute(
                update(gate).where(gate.c.id == schema.GATE_ROW_ID).values(**gate_changes)
            )
        return status

    def _save_result(
        self,
        connection: Connection,
        row: Row[Any],
        output: Any,
        now: dt.datetime,
        duration_seconds: float | None,
    ) -> None:
        values = {
            "user_id": row.user_id,
            "kind": row.kind,
            "subject": row.subject,
            "fingerprint": row.fingerprint,
            "output": output,
            "produced_at": now,
            "duration_seconds": duration_seconds,
        }
        updated = connection.execute(
            update(results).where(results.c.job_id == row.id).values(**values)
        ).rowcount
        if not updated:
            connection.execute(insert(results).values(job_id=row.id, **values))

    def release(self, jid: str, holder: str, *, error: str | None = None) -> None:
        """Hand the job back without spending its attempt (shutdown, gateway outage: N2).

        It goes back to its old place in the queue. Raises `ClaimLost` if the
        claim was taken over, having changed nothing.
        """
        jid = _job_id(jid)
        holder = _text("holder", holder, MAX_HOLDER_LENGTH + 13)
        if error is not None:
            error = _error_text(error)
        now = self._now()
        with self._write("release") as connection:
            written = connection.execute(
                update(jobs)
                .where(self._held(jid, holder))
                .values(
                    status=Status.PENDING,
                    attempts=func.max(jobs.c.attempts - 1, 0)
                    if self._is_sqlite
                    else func.greatest(jobs.c.attempts - 1, 0),
                    error=error,
                    holder=None,
                    claimed_at=None,
                    heartbeat_at=None,
                    updated_at=now,
                    revision=jobs.c.revision + 1,
                )
            ).rowcount
        if not written:
            raise ClaimLost(jid, holder)

    # -- N2: the circuit breaker's state, shared by every worker ----------------

    def gate_state(self) -> GateState:
        with self._read("gate_state") as connection:
            row = connection.execute(
                select(gate).where(gate.c.id == schema.GATE_ROW_ID)
            ).one_or_none()
        if row is None:
            raise SchemaOutdated("the gate row is missing; run `insight-queue db upgrade`")
        return GateState(
            last_finished_at=row.last_finished_at,
            paused_until=row.paused_until,
            pause_reason=row.pause_reason,
            outages_in_a_row=row.outages_in_a_row,
        )

    def pause(self, seconds: float, reason: str) -> dt.datetime:
        """Stop every worker from claiming for `seconds`; returns when claiming resumes."""
        seconds = _seconds("seconds", seconds)
        reason = _error_text(reason, "reason")
        with self._write("pause") as connection:
            self._lock_gate(connection)
            until = self._now() + dt.timedelta(seconds=seconds)
            connection.execute(
                update(gate)
                .where(gate.c.id == schema.GATE_ROW_ID)
                .values(paused_until=until, pause_reason=reason)
            )
        return until

    def resume(self) -> None:
        """Lift any pause and forget the outage streak."""
        with self._write("resume") as connection:
            connection.execute(
                update(gate)
                .where(gate.c.id == schema.GATE_ROW_ID)
                .values(paused_until=None, pause_reason=None, outages_in_a_row=0)
            )

    def report_outage(self, reason: str) -> float:
        """The gateway is unreachable: pause claiming with a growing backoff.

        Returns the seconds until claiming resumes. While a pause is already
        running, further reports (other workers seeing the same outage) only
        read it: the streak grows once per pause, not once per worker.
        """
        reason = _error_text(reason, "reason")
        s = self._settings
        with self._write("report_outage") as connection:
            state = self._lock_gate(connection)
            now = self._now()
            if state.paused_until is not None and state.paused_until > now:
                return float((state.paused_until - now).total_seconds())
            streak = state.outages_in_a_row + 1
            pause = min(s.backoff_seconds * 2 ** min(streak - 1, 30), s.backoff_max_seconds)
            connection.execute(
                update(gate)
                .where(gate.c.id == schema.GATE_ROW_ID)
                .values(
                    paused_until=now + dt.timedelta(seconds=pause),
                    pause_reason=reason,
                    outages_in_a_row=streak,
                    last_finished_at=now,
                )
            )
        return float(pause)

    # -- N1: results ------------------------------------------------------------

    def result_of(self, user_id: str, kind: str, subject: str) -> Result | None:
        """The latest output for the key, even while a newer one is being made."""
        user_id, kind, subject = _key(user_id, kind, subject)
        with self._read("result_of") as connection:
            row = connection.execute(
                select(results).where(results.c.job_id == job_id(user_id, kind, subject))
            ).one_or_none()
        if row is None:
            return None
        return Result(
            user_id=row.user_id,
            kind=row.kind,
            subject=row.subject,
            fingerprint=row.fingerprint,
            output=row.output,
            produced_at=row.produced_at,
            duration_seconds=row.duration_seconds,
        )

    # -- N3: position and ETA -----------------------------------------------------

    def position(self, user_id: str, kind: str, subject: str) -> Position | None:
        """Place in line and expected wait, for a pending or running job; else None."""
        found = self.job(user_id, kind, subject)
        if found is None:
            return None
        with self._read("position") as connection:
            return self._positions(connection, [found], self._now()).get(found.id)

    def _positions(
        self, connection: Connection, listed: Sequence[Job], now: dt.datetime
    ) -> dict[str, Position]:
        waiting = sorted(
            (j for j in listed if j.status == Status.PENDING),
            key=lambda j: (j.priority, j.queued_at),
        )
        running_jobs = [j for j in listed if j.status == Status.RUNNING]
        if not waiting and not running_jobs:
            return {}
        s = self._settings
        durations = _DurationCache(connection, s.default_duration_seconds)
        in_flight = connection.execute(
            select(jobs.c.kind, jobs.c.claimed_at).where(self._live_claim(now))
        ).all()

        positions: dict[str, Position] = {}
        for j in running_jobs:
            elapsed = (now - j.claimed_at).total_seconds() if j.claimed_at else 0.0
            positions[j.id] = Position(
                Status.RUNNING, 0, len(in_flight), max(durations.of(j.kind) - elapsed, 0.0)
            )
        if not waiting:
            return positions

        remaining = sum(
            max(durations.of(kind) - (now - claimed_at).total_seconds(), 0.0)
            for kind, claimed_at in in_flight
        )
        state = connection.execute(select(gate).where(gate.c.id == schema.GATE_ROW_ID)).one()
        held_back = 0.0
        if state.paused_until is not None and state.paused_until > now:
            held_back = (state.paused_until - now).total_seconds()
        if not in_flight and state.last_finished_at is not None:
            quiet_until = state.last_finished_at + dt.timedelta(seconds=s.gap_seconds)
            held_back = max(held_back, (quiet_until - now).total_seconds())

        # Walk the user's waiting jobs in queue order, counting what lies
        # between one and the next: one pass over the queue, however many.
        ahead: collections.Counter[str] = collections.Counter()
        previous: Job | None = None
        for j in waiting:
            ahead.update(self._count_between(connection, previous, j))
            if previous is not None:
                ahead[previous.kind] += 1
            count = sum(ahead.values())
            work = remaining + sum(n * durations.of(kind) for kind, n in ahead.items())
            gaps = s.gap_seconds * (count + len(in_flight))
            eta = held_back + (work + gaps) / s.concurrency + durations.of(j.kind)
            positions[j.id] = Position(Status.PENDING, count, len(in_flight), eta)
            previous = j
        return positions

    def _count_between(
        self, connection: Connection, after: Job | None, before: Job
    ) -> Mapping[str, int]:
        order = tuple_(jobs.c.priority, jobs.c.queued_at)
        query = (
            select(jobs.c.kind, func.count())
            .where(jobs.c.status == Status.PENDING)
            .where(order < tuple_(literal(before.priority), literal(before.queued_at, UTCDateTime)))
            .group_by(jobs.c.kind)
        )
        if after is not None:
            bound = tuple_(literal(after.priority), literal(after.queued_at, UTCDateTime))
            query = query.where(order > bound)
        return {kind: int(n) for kind, n in connection.execute(query).all()}


class _DurationCache:
    """Recent call durations per kind, read once per kind per query."""

    def __init__(self, connection: Connection, default: float) -> None:
        self._connection = connection
        self._default = default
        self._seen: dict[str, float] = {}

    def of(self, kind: str) -> float:
        if kind not in self._seen:
            recent = (
                select(results.c.duration_seconds)
                .where(results.c.kind == kind, results.c.duration_seconds.is_not(None))
                .order_by(results.c.produced_at.desc())
                .limit(DURATION_SAMPLE)
                .subquery()
            )
            mean = self._connection.execute(select(func.avg(recent.c.duration_seconds))).scalar()
            self._seen[kind] = float(mean) if mean is not None else self._default
        return self._seen[kind]


def _job(row: Row[Any]) -> Job:
    return Job(
        id=row.id,
        user_id=row.user_id,
        kind=row.kind,
        subject=row.subject,
        fingerprint=row.fingerprint,
        priority=row.priority,
        status=Status(row.status),
        attempts=row.attempts,
        error=row.error,
        holder=row.holder,
        claimed_at=row.claimed_at,
        heartbeat_at=row.heartbeat_at,
        queued_at=row.queued_at or row.created_at,
        created_at=row.created_at,
        updated_at=row.updated_at,
        finished_at=row.finished_at,
        flow_run_id=row.flow_run_id,
    )


__all__ = ["JobStore", "check_user_id", "utcnow"]
