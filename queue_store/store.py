"""JobStore: every rule of the queue, one method per verb.

The store alone decides what the gateway works on next and guards it for the whole deployment;
flows call these methods and never see SQL. It must not import Prefect, httpx or anything from
`flows`. Arguments are checked in `validation` before the database is touched (FIX8), enqueue
decisions are pure (`rules`), the lease's SQL is in `lease`, places and ETAs in `places`: this
module holds the transactions that tie them together.

Concurrency: lease decisions (claim, renew, reap, settle, pause, recover) lock the one
`ai_job_gate` row first, then read the clock: one order, one clock. A worker's every write names
its claim's token in `holder` (FIX2). `enqueue` reads first and writes only when something
changes (FIX7), as a compare-and-swap on `revision`, which every write bumps (a heartbeat too).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import socket
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import (
    ColumnElement,
    Connection,
    Row,
    and_,
    bindparam,
    case,
    delete,
    func,
    insert,
    select,
    update,
)
from sqlalchemy.engine import Engine, make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from queue_store import bulk, lease, migrate, places, schema, tallies, validation
from queue_store.clock import Clock, ClockFunction, DatabaseClock, HostClock, InjectedClock
from queue_store.engine import SQLITE_BEGIN, create_store_engine, shown_url, wrap_database_error
from queue_store.errors import ClaimLost, DatabaseError, InvalidArgument, SchemaOutdated
from queue_store.models import (
    INTERACTIVE,
    PREFETCH,
    Claim,
    CutCause,
    EnqueueRequest,
    Failure,
    GateState,
    Hold,
    Job,
    JobState,
    Metrics,
    PauseKind,
    Position,
    QueueEntry,
    QueueView,
    Renewal,
    Result,
    Settlement,
    Status,
    Usage,
    Worker,
    job_id,
)
from queue_store.redact import Redactor
from queue_store.rules import decide, lapsed, queued_anew
from queue_store.schema import from_row
from queue_store.settings import Settings

jobs = schema.jobs
results = schema.results
gate = schema.gate
workers = schema.workers

# What a poll reads of the latest result before it knows whether to load it.
RESULT_META = (
    results.c.fingerprint.label("result_fingerprint"),
    results.c.produced_at.label("result_produced_at"),
)
# The statements of a poll, made once: SQLAlchemy then keys its cache on them for free.
JOB_AND_RESULT = (
    select(jobs, *RESULT_META)
    .outerjoin(results, results.c.job_id == jobs.c.id)
    .where(jobs.c.id == bindparam("jid"))
)
RESULT = select(results).where(results.c.job_id == bindparam("jid"))
GATE_ROW = select(gate).where(gate.c.id == schema.GATE_ROW_ID)
GATE_ROW_LOCKED = GATE_ROW.with_for_update()
WAITING_BY_PRIORITY = (
    select(jobs.c.priority, func.count(), func.min(jobs.c.queued_at))
    .where(jobs.c.status == Status.PENDING)
    .group_by(jobs.c.priority)
)
CONSUMER_SEEN = (
    select(workers.c.name)
    .where(workers.c.role == "consumer", workers.c.seen_at >= bindparam("after"))
    .limit(1)
)

# An enqueue that keeps losing its compare-and-swap is being raced by writers
# on the same key; a few rounds always settle it.
MAX_ENQUEUE_ROUNDS = 8
# Requests per transaction of `enqueue_many`; a user's run of requests may
# stretch a chunk up to the most.
BULK_CHUNK = 500
MAX_BULK_CHUNK = 2000
# Failed jobs shown by the queue view, and rows of tokens by user and kind.
RECENT_FAILURES = 20
USAGE_SHOWN = 20
# A worker not seen for this many leases is forgotten.
FORGET_WORKERS_AFTER_LEASES = 60

_MISSING: Any = object()


class JobStore:
    """The queue. Thread-safe; one instance per process is enough.

    `create`: a SQLite store whose file or schema is missing or behind is created or upgraded
    on first use (PostgreSQL needs `insight-queue db upgrade`); with `create=False` a missing
    SQLite file is an error and nothing is created (read-only commands)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        clock: ClockFunction | None = None,
        check_schema: bool = True,
        create: bool = True,
    ) -> None:
        self._settings = settings or Settings()
        target = url or self._settings.database_url
        self._is_sqlite = make_url(target).get_backend_name() == "sqlite"
        if self._is_sqlite and not create:
            _require_sqlite_file(target)
        self._engine = create_store_engine(target)
        self._clock: Clock
        if clock is not None:
            self._clock = InjectedClock(clock)
        elif self._is_sqlite:
            self._clock = HostClock()
        else:
            self._clock = DatabaseClock()
        self._redact = Redactor(self._settings.secrets())
        if check_schema:
            try:
                if create and self._is_sqlite and self._revision() != schema.SCHEMA_REVISION:
                    self.upgrade()
                self.check_schema()
            except BaseException:
                self._engine.dispose()
                raise

    # -- lifecycle ---------------------------------------------------------

    @property
    def settings(self) -> Settings:
        return self._settings

    @property
    def engine(self) -> Engine:
        """The store's SQLAlchemy engine (for its own events, in tests and benchmarks)."""
        return self._engine

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> JobStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _revision(self) -> str | None:
        try:
            return migrate.current_revision(self._engine)
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, "schema check") from exc

    def check_schema(self) -> None:
        revision = self._revision()
        if revision != schema.SCHEMA_REVISION:
            found = "no insight-queue schema" if revision is None else f"revision {revision}"
            raise SchemaOutdated(
                f"the database at {shown_url(self._engine.url)} has {found}; this version needs "
                f"revision {schema.SCHEMA_REVISION}. Run `insight-queue db upgrade` to upgrade it."
            )

    def upgrade(self) -> str | None:
        """Run the migrations on this store's database (what `db upgrade` does)."""
        return migrate.upgrade(self._engine)

    # -- plumbing ------------------------------------------------------------

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
        except (IntegrityError, InvalidArgument, ClaimLost, SchemaOutdated):
            raise
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, operation) from exc

    def _read(self, operation: str) -> Any:
        return self._transaction(operation, write=False)

    def _write(self, operation: str) -> Any:
        return self._transaction(operation, write=True)

    @contextmanager
    def _gated(self, operation: str) -> Iterator[tuple[Connection, dt.datetime, Row[Any]]]:
        """A write transaction holding the gate lock, with the clock read after it."""
        with self._write(operation) as connection:
            state = self._gate_row(connection, lock=True)
            self._clock.prepare(connection)
            now = self._clock.now(connection)
            yield connection, now, state

    def _gate_row(self, connection: Connection, *, lock: bool = False) -> Row[Any]:
        row = connection.execute(GATE_ROW_LOCKED if lock else GATE_ROW).one_or_none()
        if row is None:
            raise SchemaOutdated("the gate row is missing; run `insight-queue db upgrade`")
        return row

    def _now(self, connection: Connection) -> dt.datetime:
        return self._clock.now(connection)

    def _outlook(
        self, connection: Connection, now: dt.datetime, gate_row: Row[Any] | None = None
    ) -> places.Outlook:
        gate_row = gate_row if gate_row is not None else self._gate_row(connection)
        running = lease.running_rows(connection)
        return places.outlook(connection, self._settings, now, gate_row, running)

    def _error(self, value: object, name: str = "error") -> str:
        """An error text as stored: checked, cut, and with every secret removed (G5)."""
        return validation.error_text(self._redact(validation.error_text(value, name)), name)

    # -- R1-R6: enqueue ------------------------------------------------------

    def enqueue(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        priority: int = PREFETCH,
    ) -> Status:
        """Queue one generation, or promote it; returns the job's status after the call. A screen
        calls this on every poll: a call that changes nothing writes nothing."""
        user_id, kind, subject = validation.key(user_id, kind, subject)
        fingerprint = validation.fingerprint(fingerprint)
        priority = validation.priority(priority)
        jid = job_id(user_id, kind, subject)
        for _ in range(MAX_ENQUEUE_ROUNDS):
            with self._read("enqueue") as connection:
                row = connection.execute(select(jobs).where(jobs.c.id == jid)).one_or_none()
                now = self._now(connection)
            status = self._enqueue_round((user_id, kind, subject), fingerprint, priority, row, now)
            if status is not None:
                return status
        raise DatabaseError(f"enqueue: job {jid[:12]}… kept changing under this call; retry")

    def _enqueue_round(
        self,
        key: tuple[str, str, str],
        fingerprint: str | None,
        priority: int,
        row: Row[Any] | None,
        now: dt.datetime,
    ) -> Status | None:
        """Act on the row as read: the job's status afterwards, or None to read it again."""
        if row is None:
            try:
                with self._write("enqueue") as connection:
                    now = self._now(connection)
                    turn = places.next_turn(connection, self._settings, key[0], priority)
                    values = bulk.new_job(*key, fingerprint, priority, now, turn)
                    connection.execute(insert(jobs).values(values))
            except IntegrityError:
                return None  # another caller inserted it first: decide again
            return Status.PENDING
        decision = decide(row, fingerprint, priority, now, self._settings)
        if decision.reap_first:
            self._take_back(row.id)
            return None
        if decision.changes is None:
            return decision.status
        changes = dict(decision.changes)
        with self._write("enqueue") as connection:
            if "queued_at" in changes or changes.get("priority", row.priority) != row.priority:
                # Into the queue again, or promoted: a turn of its own (R8b).
                changes["turn"] = places.next_turn(
                    connection, self._settings, row.user_id, changes.get("priority", row.priority)
                )
            written = connection.execute(
                update(jobs)
                .where(jobs.c.id == row.id, jobs.c.revision == row.revision)
                .values(**changes, updated_at=now, revision=row.revision + 1)
            ).rowcount
        return decision.status if written == 1 else None

    def _take_back(self, jid: str) -> None:
        """Reap one job whose claim looked lapsed, if it still is (a lease decision)."""
        with self._gated("enqueue") as (connection, now, _state):
            query = select(jobs).where(jobs.c.id == jid, jobs.c.status == Status.RUNNING)
            row = connection.execute(query).one_or_none()
            if row is not None and lapsed(row, now, self._settings):
                lease.reap(connection, self._settings, now, [row])

    def enqueue_many(self, requests: Iterable[EnqueueRequest]) -> list[Status]:
        """`enqueue` (and `supersede` where asked) for many keys, for backfills (see `bulk`).

        Returns each request's status, in order, as the same `enqueue` calls would. Every
        request is checked before anything is written (FIX8); then one transaction per chunk
        of about `BULK_CHUNK`, a user's requests given together in one chunk."""
        checked = [_checked_request(r) for r in requests]
        statuses: list[Status] = []
        last: dt.datetime | None = None
        for chunk in bulk.chunks(checked, BULK_CHUNK, MAX_BULK_CHUNK):
            decided = self._enqueue_chunk(chunk, last)
            statuses += decided.statuses
            last = decided.last
        return statuses

    def _enqueue_chunk(
        self, chunk: Sequence[EnqueueRequest], after: dt.datetime | None
    ) -> bulk.Plan:
        for _ in range(MAX_ENQUEUE_ROUNDS):
            try:
                return self._try_chunk(chunk, after)
            except bulk.Raced:
                continue  # another writer got to one of its rows first: decide again
        raise DatabaseError("enqueue_many: its jobs kept changing under this call; retry")

    def _try_chunk(self, chunk: Sequence[EnqueueRequest], after: dt.datetime | None) -> bulk.Plan:
        # The read locks nothing. PostgreSQL writes in the same transaction (a chunk that writes
        # nothing commits nothing); SQLite takes the write lock in a transaction of its own, only
        # for a chunk that changes something: a read transaction cannot take it safely.
        with self._read("enqueue_many") as connection:
            now = self._now(connection)
            rows = bulk.read(connection, chunk)
            turns = bulk.Turns(connection, self._settings, {r.user_id for r in chunk})
            start = bulk.starting_after(now, after)
            decided = bulk.plan(chunk, rows, start, self._settings, turns)
            if decided.writes_nothing:
                return decided
            if not self._is_sqlite:
                bulk.write(connection, decided)
                return decided
        with self._write("enqueue_many") as connection:
            bulk.write(connection, decided)
        return decided

    def requeue(self, kinds: Sequence[str] | None = None) -> int:
        """Queue every finished job again (of these kinds, or all), after a prompt change: at
        prefetch priority (or their own, if more urgent), attempts 0; their results stay
        readable but are no longer fresh. Returns how many were queued."""
        checked = [validation.kind(k) for k in kinds] if kinds is not None else None
        finished: ColumnElement[bool] = jobs.c.status.in_([Status.DONE, Status.FAILED])
        if checked is not None:
            finished = and_(finished, jobs.c.kind.in_(checked))
        with self._write("requeue") as connection:
            priority = case((jobs.c.priority < PREFETCH, jobs.c.priority), else_=PREFETCH)
            return self._queue_anew(
                connection, finished, None, priority=priority, requested_at=None
            )

    def _queue_anew(
        self, connection: Connection, where: Any, user_id: str | None, **more: Any
    ) -> int:
        """Queue the jobs `where` picks again as if new (R5, R10), in turns dealt first."""
        now = self._now(connection)
        self._deal_turns(connection, where, user_id)
        values = queued_anew(now, **more, updated_at=now, revision=jobs.c.revision + 1)
        return int(connection.execute(update(jobs).where(where).values(**values)).rowcount)

    def _deal_turns(self, connection: Connection, where: Any, user_id: str | None) -> None:
        """Turns for the prefetch jobs `where` picks, about to be queued again together (R8b):
        each user's in their order, after the turn being served (and, for one user, after
        their jobs waiting already)."""
        if self._settings.order != "fair":
            return
        base = places.next_turn(connection, self._settings, user_id, PREFETCH) - 1 if user_id else 0
        if not user_id:
            base = connection.execute(
                select(gate.c.turn).where(gate.c.id == schema.GATE_ROW_ID)
            ).scalar_one()
        rank = func.row_number().over(partition_by=jobs.c.user_id, order_by=places.FIFO)
        dealt = (
            select(jobs.c.id, (rank + base).label("turn"))
            .where(where, jobs.c.priority > INTERACTIVE)
            .subquery()
        )
        connection.execute(update(jobs).where(jobs.c.id == dealt.c.id).values(turn=dealt.c.turn))

    # -- reads: one job, its state, a user's queue -------------------------------

    def job(self, user_id: str, kind: str, subject: str) -> Job | None:
        """The job of this key (R11), or None."""
        found = self.jobs([job_id(*validation.key(user_id, kind, subject))])
        return next(iter(found.values()), None)

    def jobs(self, ids: Iterable[str]) -> dict[str, Job]:
        """The jobs with these ids, by id, in one read (ids with no job are left out)."""
        wanted = sorted({validation.job_id(i) for i in ids})
        with self._read("jobs") as connection:
            rows = connection.execute(select(jobs).where(jobs.c.id.in_(wanted))).all()
        return {row.id: from_row(Job, row) for row in rows}

    def state(
        self, user_id: str, kind: str, subject: str, fingerprint: str | None = None
    ) -> JobState | None:
        """The job, its place and ETA, latest result and the gate, in one read; None if no job.
        `fresh` is judged against `fingerprint`, or the job's own without one."""
        user_id, kind, subject = validation.key(user_id, kind, subject)
        fingerprint = validation.fingerprint(fingerprint)
        with self._read("state") as connection:
            row = self._job_and_result(connection, job_id(user_id, kind, subject))
            if row is None:
                return None
            asked = fingerprint if fingerprint is not None else row.fingerprint
            return self._state(connection, row, self._now(connection), asked)

    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
    ) -> JobState:
        """A screen's poll: queue the job at the front (R1-R6), then its state (P1); one read
        transaction when nothing changes. While `known`, the version the screen has, still
        holds (and no run is needed), the result is not loaded: `unchanged`."""
        user_id, kind, subject = validation.key(user_id, kind, subject)
        fingerprint = validation.fingerprint(fingerprint)
        jid = job_id(user_id, kind, subject)
        for _ in range(MAX_ENQUEUE_ROUNDS):
            with self._read("poll") as connection:
                row = self._job_and_result(connection, jid)
                now = self._now(connection)
                if row is not None:
                    decision = decide(row, fingerprint, INTERACTIVE, now, self._settings)
                    if decision.changes is None and not decision.reap_first:
                        return self._state(connection, row, now, fingerprint, known)
            self._enqueue_round((user_id, kind, subject), fingerprint, INTERACTIVE, row, now)
        raise DatabaseError(f"poll: job {jid[:12]}… kept changing under this call; retry")

    def _job_and_result(self, connection: Connection, jid: str) -> Row[Any] | None:
        return connection.execute(JOB_AND_RESULT, {"jid": jid}).one_or_none()

    def _state(
        self,
        connection: Connection,
        row: Row[Any],
        now: dt.datetime,
        fingerprint: str | None,
        known: str | None = None,
    ) -> JobState:
        job = from_row(Job, row)
        gate_row = self._gate_row(connection)
        position: Position | None = None
        run_needed = False
        if job.status in (Status.RUNNING, Status.PENDING):  # a finished job has no place
            view = self._outlook(connection, now, gate_row)
            if job.status == Status.RUNNING:
                position = view.running(job, now)
            else:
                ahead = places.ahead_of(connection, self._settings, job)
                position = view.waiting(*ahead, job.kind)
                run_needed = view.in_flight == 0 and not self._consumer_alive(connection, now)
        produced = row.result_produced_at
        fresh = produced is not None and _fresh(row.result_fingerprint, produced, fingerprint, job)
        gate_state = _gate_state(gate_row, now)
        version = _version(job.status, position, fresh, produced, gate_state)
        if known == version and not run_needed:
            return JobState(job, position, None, fresh, gate_state, run_needed, version, True)
        result = None
        if produced is not None:
            full = connection.execute(RESULT, {"jid": job.id}).one()
            result = from_row(Result, full, size_bytes=full.size_bytes or 0)
        return JobState(job, position, result, fresh, gate_state, run_needed, version)

    def _consumer_alive(self, connection: Connection, now: dt.datetime) -> bool:
        alive_after = now - dt.timedelta(seconds=self._settings.lease_seconds)
        return connection.execute(CONSUMER_SEEN, {"after": alive_after}).first() is not None

    def list_jobs(self, user_id: str, limit: int = 60) -> list[dict[str, Any]]:
        """The user's queue in the order the worker will take it (R11): running, pending, failed,
        done; within each, the claim order. Pending and running entries carry place and ETA."""
        user_id = validation.user_id(user_id)
        limit = validation.limit(limit)
        order = case(
            (jobs.c.status == Status.RUNNING, 0),
            (jobs.c.status == Status.PENDING, 1),
            (jobs.c.status == Status.FAILED, 2),
            else_=3,
        )
        with self._read("list_jobs") as connection:
            now = self._now(connection)
            query = select(jobs).where(jobs.c.user_id == user_id)
            query = query.order_by(order, *places.order(self._settings)).limit(limit)
            listed = [from_row(Job, r) for r in connection.execute(query)]
            found = places.positions(connection, self._outlook(connection, now), now, listed)
        return [
            {
                **j.as_dict(self._settings.max_attempts),
                "interactive": j.interactive,
                **(found[j.id].as_dict() if j.id in found else {}),
            }
            for j in listed
        ]

    def pending_count(self, user_id: str | None = None) -> int:
        """Jobs pending or running, for one user or for everyone."""
        query = select(func.count()).select_from(jobs)
        query = query.where(jobs.c.status.in_([Status.PENDING, Status.RUNNING]))
        if user_id is not None:
            query = query.where(jobs.c.user_id == validation.user_id(user_id))
        with self._read("pending_count") as connection:
            return int(connection.execute(query).scalar_one())

    def has_work(self, *, or_running: bool = False) -> bool:
        """Whether a claim could find something: a queued job, or a lapsed claim (only a claim
        takes one back). Two indexed reads, never a write. `or_running`: any claim counts, for
        a drain that stays until every call is over (a live claim may be a dead worker's)."""
        with self._read("has_work") as connection:
            queued = select(jobs.c.id).where(jobs.c.status == Status.PENDING).limit(1)
            if connection.execute(queued).first() is not None:
                return True
            running = lease.running_rows(connection)
            if or_running:
                return bool(running)
            now = self._now(connection)
            return any(lapsed(row, now, self._settings) for row in running)

    def retry_failed(self, user_id: str) -> int:
        """Every failed job of the user back in the queue now (R10); returns how many."""
        user_id = validation.user_id(user_id)
        with self._write("retry_failed") as connection:
            failed = and_(jobs.c.user_id == user_id, jobs.c.status == Status.FAILED)
            return self._queue_anew(connection, failed, user_id)

    # -- R8, R9, FIX1, FIX6: claim -------------------------------------------

    def claim_next(self, worker: str) -> Claim:
        """Take the highest-priority runnable job, if the gateway guard allows a call now; its
        `holder` is a fresh token `<worker>/<nonce>`, for every later write about it."""
        worker = validation.worker(worker)
        with self._gated("claim_next") as (connection, now, state):
            return lease.claim(connection, self._settings, now, state, worker)

    # -- FIX2, FIX3, L3: the holder's writes ------------------------------------

    def heartbeat(self, jid: str, holder: str, *, calling: bool = False) -> Renewal:
        """Renew the claim. Anything but RENEWED means: stop the call now. `calling`: the
        gateway call starts right after this renewal (a cut call holds the gateway from then)."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        with self._gated("heartbeat") as (connection, now, _state):
            return lease.renew(connection, self._settings, now, jid, holder, calling=calling)

    def set_flow_run(self, jid: str, holder: str, flow_run_id: str) -> None:
        """Record which orchestrator run is working on the job (N4)."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        flow_run_id = validation.run_id(flow_run_id)
        with self._write("set_flow_run") as connection:
            written = connection.execute(
                update(jobs)
                .where(jobs.c.id == jid, jobs.c.holder == holder, jobs.c.status == Status.RUNNING)
                .values(flow_run_id=flow_run_id)
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
        flow_run_id: str | None = None,
        usage: Usage | None = None,
    ) -> Status:
        """Record the attempt's outcome; returns the job's status afterwards.

        A result marks it done and becomes the key's latest result (N1), with the tokens the
        answer said it used (`usage`; None: unknown, M2). An error is `fail(..., Failure.BUILD,
        ...)`. Raises `ClaimLost`, having changed nothing, if the claim was taken over."""
        if (result is _MISSING) == (error is None):
            raise InvalidArgument("result", "give exactly one of result= or error=")
        if error is not None:
            return self.fail(jid, holder, Failure.BUILD, error).status
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        output, size = validation.result(result, self._settings.max_result_bytes)
        if duration_seconds is not None:
            duration_seconds = validation.seconds("duration_seconds", duration_seconds)
        if flow_run_id is not None:
            flow_run_id = validation.run_id(flow_run_id)

        with self._gated("finish") as (connection, now, _state):
            row = lease.held_row(connection, jid, holder)
            if row is None:
                raise ClaimLost(jid, holder)
            if duration_seconds is None and row.claimed_at is not None:
                duration_seconds = (now - row.claimed_at).total_seconds()
            values = {
                "user_id": row.user_id,
                "kind": row.kind,
                "subject": row.subject,
                "fingerprint": row.fingerprint,
                "output": output,
                "produced_at": now,
                "duration_seconds": duration_seconds,
                "flow_run_id": flow_run_id,
                "size_bytes": size,
                "prompt_tokens": usage.prompt_tokens if usage else None,
                "completion_tokens": usage.completion_tokens if usage else None,
            }
            updated = connection.execute(
                update(results).where(results.c.job_id == row.id).values(**values)
            ).rowcount
            if not updated:
                connection.execute(insert(results).values(job_id=row.id, **values))
            if duration_seconds is not None:
                places.record_duration(connection, row.kind, duration_seconds)
            lease.settle_done(connection, now, row, flow_run_id)
            _tally(connection, row, "done", duration_seconds, usage or True)
        return Status.DONE

    def fail(
        self,
        jid: str,
        holder: str,
        failure: Failure,
        error: str,
        *,
        retry_after: float | None = None,
        flow_run_id: str | None = None,
        duration_seconds: float | None = None,
        answer: Usage | bool = False,
    ) -> Settlement:
        """Settle an attempt that ended without a result, by the rule for `failure`.

        The rules are in docs/rules.md (N2, G1-G4). Raises `ClaimLost`, having changed nothing,
        if the claim was taken over. `duration_seconds`: how long the call took, if one was
        made; `answer`: the tokens an answer said it used, True if one came that did not say."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        if not isinstance(failure, Failure):
            raise InvalidArgument("failure", f"must be a Failure, got {failure!r}")
        error = self._error(error)
        if retry_after is not None:
            retry_after = validation.seconds("retry_after", retry_after)
        if flow_run_id is not None:
            flow_run_id = validation.run_id(flow_run_id)
        if duration_seconds is not None:
            duration_seconds = validation.seconds("duration_seconds", duration_seconds)
        with self._gated("fail") as (connection, now, state):
            row = lease.held_row(connection, jid, holder)
            if row is None and failure is Failure.STOPPED:
                late = lease.late_stop(connection, self._settings, now, jid, holder, error)
                if late is not None:
                    return late
            if row is None:
                raise ClaimLost(jid, holder)
            if flow_run_id is not None:
                connection.execute(
                    update(jobs).where(jobs.c.id == jid).values(flow_run_id=flow_run_id)
                )
            settled = lease.settle_failure(
                connection, self._settings, now, state, row, failure, error, retry_after
            )
            _tally(connection, row, failure, duration_seconds, answer)
            return settled

    # -- N2, G1, G4: pauses, shared by every worker ------------------------------

    def gate_state(self) -> GateState:
        with self._read("gate_state") as connection:
            row = self._gate_row(connection)
            now = self._now(connection)
        return _gate_state(row, now)

    def pause(self, seconds: float, reason: str) -> dt.datetime:
        """Stop every worker from claiming for `seconds`; returns when claiming resumes."""
        seconds = validation.seconds("seconds", seconds)
        reason = self._error(reason, "reason")
        with self._gated("pause") as (connection, now, _state):
            lease.pause(connection, now, seconds, PauseKind.OPERATOR, reason)
        return now + dt.timedelta(seconds=seconds)

    def resume(self) -> None:
        """Lift any pause and forget the outage streak."""
        with self._gated("resume") as (connection, _now, _state):
            connection.execute(
                update(gate)
                .where(gate.c.id == schema.GATE_ROW_ID)
                .values(paused_until=None, pause_reason=None, pause_kind=None, outages_in_a_row=0)
            )

    # -- FIX5: recovery ------------------------------------------------------

    def recover(self, worker: str | None = None) -> list[Job]:
        """Take back dead claims, and this worker's own; never another's live claim (FIX5).
        `worker` is matched exactly (case-sensitive) against the worker part of each claim's
        token. Returns the jobs taken back, as they were."""
        if worker is not None:
            worker = validation.worker(worker)
        with self._gated("recover") as (connection, now, _state):
            rows = connection.execute(select(jobs).where(jobs.c.status == Status.RUNNING)).all()
            taken = [
                row
                for row in rows
                if lapsed(row, now, self._settings) or (worker is not None and row.worker == worker)
            ]
            lease.reap(connection, self._settings, now, taken)
        return [from_row(Job, row) for row in taken]

    # -- N1: results ------------------------------------------------------------

    def result_of(self, user_id: str, kind: str, subject: str) -> Result | None:
        """The latest output for the key, even while a newer one is being made."""
        user_id, kind, subject = validation.key(user_id, kind, subject)
        with self._read("result_of") as connection:
            query = select(results).where(results.c.job_id == job_id(user_id, kind, subject))
            row = connection.execute(query).one_or_none()
        return None if row is None else from_row(Result, row, size_bytes=row.size_bytes or 0)

    # -- N3: the whole queue ---------------------------------------------------------

    def queue_view(self, limit: int = 50) -> QueueView:
        """The whole queue: running calls, the first `limit` waiting jobs, recent failures."""
        limit = validation.limit(limit)
        with self._read("queue_view") as connection:
            now = self._now(connection)
            state = self._gate_row(connection)
            running = _listed(connection, Status.RUNNING, jobs.c.claimed_at)
            waiting = _listed(
                connection, Status.PENDING, *places.order(self._settings), limit=limit
            )
            counted = jobs.c.status.in_([Status.PENDING, Status.FAILED])
            query = select(jobs.c.status, func.count()).where(counted).group_by(jobs.c.status)
            counts = dict(connection.execute(query).all())
            failures = _listed(
                connection, Status.FAILED, jobs.c.finished_at.desc(), limit=RECENT_FAILURES
            )
            running_entries, waiting_entries = places.queue_entries(
                self._outlook(connection, now, state), now, running, waiting
            )
            present = self._workers(connection, now)
            usage = list(tallies.usage_rows(connection, USAGE_SHOWN))
            (usage_total,) = tallies.usage_by(connection)
            held = _holds(connection, now)
        return QueueView(
            now=now,
            gate=_gate_state(state, now),
            running=running_entries,
            waiting=waiting_entries,
            waiting_total=int(counts.get(Status.PENDING, 0)),
            recent_failures=[QueueEntry(j, None, None, None) for j in failures],
            failed_total=int(counts.get(Status.FAILED, 0)),
            workers=present,
            max_attempts=self._settings.max_attempts,
            concurrency=self._settings.concurrency,
            usage=usage,
            usage_total=usage_total,
            holds=held,
        )

    def metrics(self) -> Metrics:
        """What /metrics shows, in one read (M1): the waiting jobs by class and the oldest,
        the calls in flight, the gate, the tallies, and tokens by kind."""
        with self._read("metrics") as connection:
            now = self._now(connection)
            waiting: dict[str, tuple[int, dt.datetime | None]]
            waiting = dict.fromkeys(("interactive", "prefetch"), (0, None))
            # By priority, as the queue's index is ordered: one pass over its entries.
            for priority, count, oldest in connection.execute(WAITING_BY_PRIORITY):
                name = "interactive" if priority <= INTERACTIVE else "prefetch"
                before, since = waiting[name]
                first = min((t for t in (since, oldest) if t is not None), default=None)
                waiting[name] = (before + int(count), first)
            running = lease.running_rows(connection)
            return Metrics(
                gate=_gate_state(self._gate_row(connection), now),
                waiting=waiting,
                in_flight=sum(1 for r in running if not lapsed(r, now, self._settings)),
                tallies=tallies.read(connection),
                usage_by_kind=tallies.usage_by(connection, schema.usage.c.kind),
                holds=_holds(connection, now),
            )

    # -- presence of consumers ----------------------------------------------------

    def worker_seen(self, name: str, role: str, info: dict[str, Any] | None = None) -> None:
        """Say that this consumer is alive (call it every few seconds)."""
        name = validation.worker(name)
        role = validation.text("role", role, 32)
        host, pid = socket.gethostname()[:200], os.getpid()
        with self._write("worker_seen") as connection:
            now = self._now(connection)
            query = select(workers.c.host, workers.c.pid).where(workers.c.name == name)
            row = connection.execute(query).one_or_none()
            values: dict[str, Any] = {"seen_at": now, "info": info or {}}
            process = {"host": host, "pid": pid, "role": role, "started_at": now}
            if row is not None:
                if (row.host, row.pid) != (host, pid):
                    # A stable name taken up by a new process (serve restarted
                    # after a crash): the row describes the new one.
                    values |= process
                connection.execute(update(workers).where(workers.c.name == name).values(**values))
            else:
                connection.execute(insert(workers).values(name=name, **process, **values))
                kept = self._settings.lease_seconds * FORGET_WORKERS_AFTER_LEASES
                forget = now - dt.timedelta(seconds=kept)
                connection.execute(delete(workers).where(workers.c.seen_at < forget))

    def worker_gone(self, name: str) -> None:
        """This consumer stops: forget it at once."""
        name = validation.worker(name)
        with self._write("worker_gone") as connection:
            connection.execute(delete(workers).where(workers.c.name == name))

    def workers(self) -> list[Worker]:
        """Consumers that said they are alive, newest first; `alive` within one lease."""
        with self._read("workers") as connection:
            return self._workers(connection, self._now(connection))

    def _workers(self, connection: Connection, now: dt.datetime) -> list[Worker]:
        alive_after = now - dt.timedelta(seconds=self._settings.lease_seconds)
        return [
            from_row(Worker, row, alive=row.seen_at >= alive_after, info=row.info or {})
            for row in connection.execute(select(workers).order_by(workers.c.seen_at.desc()))
        ]


def _checked_request(request: object) -> EnqueueRequest:
    if not isinstance(request, EnqueueRequest):
        raise InvalidArgument(
            "requests", f"expected EnqueueRequest items, got {type(request).__name__}"
        )
    key = validation.key(request.user_id, request.kind, request.subject)
    fingerprint = validation.fingerprint(request.fingerprint)
    priority = validation.priority(request.priority)
    return EnqueueRequest(*key, fingerprint, priority, bool(request.supersede))


def _listed(
    connection: Connection, status: Status, *order: Any, limit: int | None = None
) -> list[Job]:
    """The jobs of one status in this order (the first `limit`)."""
    query = select(jobs).where(jobs.c.status == status).order_by(*order).limit(limit)
    return [from_row(Job, row) for row in connection.execute(query)]


def _tally(
    connection: Connection, row: Row[Any], outcome: str, seconds: float | None, answer: Usage | bool
) -> None:
    """Count a settled attempt, its call's time and its answer's tokens (M1, M2; `answer` as
    `fail` takes it)."""
    tallies.count(connection, tallies.ATTEMPTS, row.kind, str(outcome))
    if seconds is not None:
        tallies.count(connection, tallies.CALL_SECONDS, row.kind, str(outcome), seconds)
    if answer:
        used = answer if isinstance(answer, Usage) else None
        tallies.spent_tokens(connection, row.user_id, row.kind, used)


def _holds(connection: Connection, now: dt.datetime) -> list[Hold]:
    """The holds of cut calls in force (H1), earliest end first, with their jobs."""
    held = schema.holds
    query = (
        select(
            held.c.cause.label("hold_cause"),
            held.c.started_at.label("hold_started_at"),
            held.c.until.label("hold_until"),
            held.c.worker.label("hold_worker"),
            jobs,
        )
        .outerjoin(jobs, jobs.c.id == held.c.job_id)
        .where(held.c.until > now)
        .order_by(held.c.until)
    )
    return [
        Hold(
            CutCause(row.hold_cause),
            row.hold_started_at,
            row.hold_until,
            row.hold_worker,
            from_row(Job, row) if row.id is not None else None,
        )
        for row in connection.execute(query)
    ]


def _fresh(
    result_fingerprint: str | None, produced: dt.datetime, asked: str | None, job: Job
) -> bool:
    """Whether a result answers the data `asked` describes, with no newer request since."""
    if asked is not None and asked != result_fingerprint:
        return False
    return job.status == Status.DONE or produced >= job.queued_at


def _version(
    status: Status,
    position: Position | None,
    fresh: bool,
    produced: dt.datetime | None,
    gate: GateState,
) -> str:
    """A short tag of what a screen is shown, but for the ETA's countdown."""
    place = (position.ahead, position.ahead_exact, position.in_flight) if position else None
    pause = (gate.pause_kind, gate.pause_reason) if gate.paused else None
    shown = repr((str(status), place, fresh, produced and produced.isoformat(), pause))
    return hashlib.sha256(shown.encode()).hexdigest()[:20]


def _gate_state(row: Row[Any], now: dt.datetime) -> GateState:
    kind = PauseKind(row.pause_kind) if row.pause_kind else None
    return from_row(GateState, row, now=now, pause_kind=kind)


def _require_sqlite_file(url: str) -> None:
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        path = Path(database).expanduser()
        if not path.exists():
            raise SchemaOutdated(
                f"there is no queue at {path} yet: nothing has been queued there (the first "
                "enqueue, `insight-queue serve` or `insight-queue db upgrade` creates it)"
            )


__all__ = ["JobStore"]
