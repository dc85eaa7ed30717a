"""The store's reads for people: a job's state for its screen, a user's queue, the whole queue.
Each runs in a transaction the store opened; nothing here writes."""

from __future__ import annotations

import datetime as dt
import hashlib
from typing import Any

from sqlalchemy import Connection, Row, bindparam, case, func, select

from queue_store import lease, places, privacy, schema, tallies
from queue_store.models import (
    CutCause,
    GateState,
    Hold,
    Job,
    JobState,
    ListedJob,
    PauseKind,
    Position,
    QueueEntry,
    QueueView,
    Result,
    Status,
    Worker,
    priority_class,
)
from queue_store.schema import from_row, holds, jobs, people, results, workers
from queue_store.settings import StoreConfig

# What a poll reads of the latest result before it knows whether to load it.
RESULT_META = (
    results.c.fingerprint.label("result_fingerprint"),
    results.c.produced_at.label("result_produced_at"),
)
WITH_PSEUDONYM = select(jobs, people.c.pseudonym).outerjoin(
    people, people.c.user_id == jobs.c.user_id
)
# The statements of a poll, made once: SQLAlchemy then keys its cache on them for free.
JOB_AND_RESULT = (
    select(jobs, people.c.pseudonym, *RESULT_META)
    .outerjoin(results, results.c.job_id == jobs.c.id)
    .outerjoin(people, people.c.user_id == jobs.c.user_id)
    .where(jobs.c.id == bindparam("jid"))
)
RESULT = select(results).where(results.c.job_id == bindparam("jid"))
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
WORKERS_ALIVE = select(workers.c.name, workers.c.role).where(
    workers.c.seen_at >= bindparam("after")
)
HELD = (
    select(
        holds.c.cause.label("hold_cause"),
        holds.c.started_at.label("hold_started_at"),
        holds.c.until.label("hold_until"),
        holds.c.worker.label("hold_worker"),
        jobs,
    )
    .outerjoin(jobs, jobs.c.id == holds.c.job_id)
    .where(holds.c.until > bindparam("now"))
    .order_by(holds.c.until)
)
RECENT_FAILURES = 20  # failed jobs the queue view shows
USAGE_SHOWN = 20  # rows of tokens by user and kind


def gate_state(row: Row[Any], now: dt.datetime, alive: dict[str, str] | None = None) -> GateState:
    kind = PauseKind(row.pause_kind) if row.pause_kind else None
    return from_row(GateState, row, now=now, pause_kind=kind, workers=alive or {})


def workers_alive(
    connection: Connection, settings: StoreConfig, now: dt.datetime
) -> dict[str, str]:
    after = now - dt.timedelta(seconds=settings.lease_seconds)  # alive: seen within a lease (W1)
    return {name: role for name, role in connection.execute(WORKERS_ALIVE, {"after": after})}


def job_state(
    connection: Connection,
    settings: StoreConfig,
    row: Row[Any],
    now: dt.datetime,
    fingerprint: str | None,
    known: str | None = None,
) -> JobState:
    """A job as its screen sees it (P1); its result is not loaded while `known` still holds."""
    job = from_row(Job, row)
    state_row = lease.gate_row(connection)
    position: Position | None = None
    run_needed = False
    if job.status in (Status.RUNNING, Status.PENDING):  # a finished job has no place
        view = places.outlook(connection, settings, now, state_row)
        if job.status == Status.RUNNING:
            position = view.running(job, now)
        else:
            ahead = places.ahead_of(connection, settings, job)
            position = view.waiting(*ahead, job.kind)
            if view.in_flight == 0:  # and no consumer standing by
                since = {"after": now - dt.timedelta(seconds=settings.lease_seconds)}
                run_needed = connection.execute(CONSUMER_SEEN, since).first() is None
    produced = row.result_produced_at
    # Fresh: it answers the data asked about, and no newer request came since (N1).
    fresh = (
        produced is not None
        and fingerprint in (None, row.result_fingerprint)
        and (job.status == Status.DONE or produced >= job.queued_at)
    )
    gate_now = gate_state(state_row, now)
    # The version: what the screen is shown, but for the ETA's countdown.
    place = (position.ahead, position.ahead_exact, position.in_flight) if position else None
    pause = (gate_now.pause_kind, gate_now.pause_reason) if gate_now.paused else None
    shown = repr((str(job.status), place, fresh, produced and produced.isoformat(), pause))
    version = hashlib.sha256(shown.encode()).hexdigest()[:20]
    if known == version and not run_needed:
        return JobState(job, position, None, fresh, gate_now, run_needed, version, True)
    result = None
    if produced is not None:
        full = connection.execute(RESULT, {"jid": job.id}).one()
        result = from_row(Result, full, size_bytes=full.size_bytes or 0)
    return JobState(job, position, result, fresh, gate_now, run_needed, version)


def user_jobs(
    connection: Connection, settings: StoreConfig, now: dt.datetime, user_id: str, limit: int
) -> list[ListedJob]:
    by_status = case(
        (jobs.c.status == Status.RUNNING, 0),
        (jobs.c.status == Status.PENDING, 1),
        (jobs.c.status == Status.FAILED, 2),
        else_=3,
    )
    query = WITH_PSEUDONYM.where(jobs.c.user_id == user_id)
    query = query.order_by(by_status, *places.order(settings)).limit(limit)
    listed = [from_row(Job, r) for r in connection.execute(query)]
    view = places.outlook(connection, settings, now, lease.gate_row(connection))
    found = places.positions(connection, view, now, listed)
    return [ListedJob(j, found.get(j.id)) for j in listed]


def queue_view(
    connection: Connection, settings: StoreConfig, now: dt.datetime, limit: int
) -> QueueView:
    """The whole queue (N3) and what /metrics shows (M1), in one read."""
    state = lease.gate_row(connection)
    running = _listed(connection, Status.RUNNING, jobs.c.claimed_at)
    waiting = _listed(connection, Status.PENDING, *places.order(settings), limit=limit)
    failed = select(func.count()).select_from(jobs).where(jobs.c.status == Status.FAILED)
    failed_total = connection.execute(failed).scalar_one()
    failures = _listed(connection, Status.FAILED, jobs.c.finished_at.desc(), limit=RECENT_FAILURES)
    view = places.outlook(connection, settings, now, state)
    running_entries, waiting_entries = places.queue_entries(view, now, running, waiting)
    after = now - dt.timedelta(seconds=settings.lease_seconds)
    present = [
        from_row(Worker, row, alive=row.seen_at >= after, info=row.info or {})
        for row in connection.execute(select(workers).order_by(workers.c.seen_at.desc()))
    ]
    (usage_total,) = tallies.usage_by(connection)
    alive = {w.name: w.role for w in present if w.alive}
    holding = held(connection, now)
    return QueueView(
        now=now,
        gate=gate_state(state, now, alive),
        running=running_entries,
        waiting=waiting_entries,
        waiting_by_class=_waiting_by_class(connection),
        recent_failures=[QueueEntry(j, None, None, None) for j in failures],
        failed_total=int(failed_total),
        workers=present,
        max_attempts=settings.max_attempts,
        concurrency=settings.concurrency,
        in_flight=view.in_flight - len(holding),
        usage=tallies.usage_rows(connection, USAGE_SHOWN),
        usage_total=usage_total,
        usage_by_kind=tallies.usage_by(connection, schema.usage.c.kind),
        tallies=tallies.read(connection),
        holds=holding,
        erasures_pending=privacy.pending_erasures(connection),
    )


def _waiting_by_class(connection: Connection) -> dict[str, tuple[int, dt.datetime | None]]:
    """Pending jobs by class and the oldest's time, in one pass over the queue index."""
    waiting: dict[str, tuple[int, dt.datetime | None]]
    waiting = dict.fromkeys(("interactive", "prefetch"), (0, None))
    for priority, count, oldest in connection.execute(WAITING_BY_PRIORITY):
        name = priority_class(priority)
        before, since = waiting[name]
        first = min((t for t in (since, oldest) if t is not None), default=None)
        waiting[name] = (before + int(count), first)
    return waiting


def _listed(
    connection: Connection, status: Status, *order: Any, limit: int | None = None
) -> list[Job]:
    query = WITH_PSEUDONYM.where(jobs.c.status == status).order_by(*order).limit(limit)
    return [from_row(Job, row) for row in connection.execute(query)]


def held(connection: Connection, now: dt.datetime) -> list[Hold]:
    return [
        Hold(
            CutCause(row.hold_cause),
            row.hold_started_at,
            row.hold_until,
            row.hold_worker,
            from_row(Job, row) if row.id is not None else None,
        )
        for row in connection.execute(HELD, {"now": now})
    ]
