"""Place in line and ETA (N3), and the operator's whole-queue view, one query each.

The worker takes pending jobs by priority, then age. A job's place is the
number of pending jobs before it in that order; its ETA adds, on the store's
clock, what is left of the calls in flight, the expected duration of every job
ahead (the moving mean per kind in `ai_job_kind_durations`), a gap after each
call, any pause or gap still running, and its own call.

Counting what lies ahead of a job deep in a 100k backlog is one pass over the
queue index: a window over the pending rows up to the last job asked about,
with the per-kind means joined in. However many jobs are asked about, that is
one statement.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, func, literal, select, tuple_

from queue_store import schema
from queue_store.models import Job, Position, QueueEntry, Status
from queue_store.rules import lapsed
from queue_store.settings import Settings

jobs = schema.jobs
durations = schema.kind_durations

# Weight of the newest sample in a kind's moving mean, once it has this many.
DURATION_WINDOW = 20


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What every ETA starts from: the calls in flight and how long claiming is held back."""

    in_flight: int
    remaining_seconds: float  # of the calls in flight, summed
    held_back_seconds: float  # pause or gap still running before the next claim
    means: dict[str, float]  # mean call seconds per kind
    default_seconds: float

    def duration(self, kind: str) -> float:
        return self.means.get(kind, self.default_seconds)


def record_duration(connection: Connection, kind: str, seconds: float) -> None:
    """Fold one call's duration into the kind's moving mean."""
    row = connection.execute(
        select(durations.c.mean_seconds, durations.c.samples).where(durations.c.kind == kind)
    ).one_or_none()
    if row is None:
        connection.execute(durations.insert().values(kind=kind, mean_seconds=seconds, samples=1))
        return
    samples = row.samples + 1
    mean = row.mean_seconds + (seconds - row.mean_seconds) / min(samples, DURATION_WINDOW)
    connection.execute(
        durations.update()
        .where(durations.c.kind == kind)
        .values(mean_seconds=mean, samples=samples)
    )


def outlook(
    connection: Connection, settings: Settings, now: dt.datetime, state: Row[Any]
) -> Outlook:
    means = {
        kind: float(mean)
        for kind, mean in connection.execute(select(durations.c.kind, durations.c.mean_seconds))
    }
    default = settings.default_duration_seconds
    running = connection.execute(
        select(jobs.c.kind, jobs.c.claimed_at, jobs.c.heartbeat_at).where(
            jobs.c.status == Status.RUNNING
        )
    ).all()
    live = [row for row in running if not lapsed(row, now, settings)]
    remaining = sum(
        max(means.get(row.kind, default) - (now - row.claimed_at).total_seconds(), 0.0)
        for row in live
    )
    held_back = 0.0
    if state.paused_until is not None and state.paused_until > now:
        held_back = (state.paused_until - now).total_seconds()
    if not live and state.last_finished_at is not None:
        quiet_until = state.last_finished_at + dt.timedelta(seconds=settings.gap_seconds)
        held_back = max(held_back, (quiet_until - now).total_seconds())
    return Outlook(len(live), remaining, held_back, means, default)


def _eta(settings: Settings, view: Outlook, ahead: int, work_ahead: float, kind: str) -> float:
    gaps = settings.gap_seconds * (ahead + view.in_flight)
    return (
        view.held_back_seconds
        + (view.remaining_seconds + work_ahead + gaps) / settings.concurrency
        + view.duration(kind)
    )


def _order() -> Any:
    return tuple_(jobs.c.priority, jobs.c.queued_at, jobs.c.id)


def positions(
    connection: Connection,
    settings: Settings,
    now: dt.datetime,
    state: Row[Any],
    listed: Sequence[Job],
) -> dict[str, Position]:
    """Positions of the listed jobs that are pending or running, by job id."""
    waiting = [j for j in listed if j.status == Status.PENDING]
    running = [j for j in listed if j.status == Status.RUNNING]
    if not waiting and not running:
        return {}
    view = outlook(connection, settings, now, state)
    found: dict[str, Position] = {}
    for j in running:
        elapsed = (now - j.claimed_at).total_seconds() if j.claimed_at else 0.0
        found[j.id] = Position(
            Status.RUNNING, 0, view.in_flight, max(view.duration(j.kind) - elapsed, 0.0)
        )
    if not waiting:
        return found

    last = max(waiting, key=lambda j: (j.priority, j.queued_at, j.id))
    bound = tuple_(
        literal(last.priority), literal(last.queued_at, schema.UTCDateTime), literal(last.id)
    )
    mean = func.coalesce(durations.c.mean_seconds, view.default_seconds)
    order = (jobs.c.priority, jobs.c.queued_at, jobs.c.id)
    ahead = (
        select(
            jobs.c.id,
            jobs.c.kind,
            (func.count().over(order_by=order, rows=(None, 0)) - 1).label("ahead"),
            (func.sum(mean).over(order_by=order, rows=(None, 0)) - mean).label("work"),
        )
        .select_from(jobs.outerjoin(durations, durations.c.kind == jobs.c.kind))
        .where(jobs.c.status == Status.PENDING, _order() <= bound)
        .subquery()
    )
    wanted = [j.id for j in waiting]
    for row in connection.execute(select(ahead).where(ahead.c.id.in_(wanted))):
        found[row.id] = Position(
            Status.PENDING,
            int(row.ahead),
            view.in_flight,
            _eta(settings, view, int(row.ahead), float(row.work or 0.0), row.kind),
        )
    return found


def queue_entries(
    connection: Connection,
    settings: Settings,
    now: dt.datetime,
    state: Row[Any],
    running: Sequence[Job],
    waiting: Sequence[Job],
) -> tuple[list[QueueEntry], list[QueueEntry]]:
    """Running and the first waiting jobs (already in worker order) with place and ETA."""
    view = outlook(connection, settings, now, state)
    running_entries = [
        QueueEntry(
            j,
            None,
            max(view.duration(j.kind) - (now - j.claimed_at).total_seconds(), 0.0)
            if j.claimed_at
            else None,
            (now - j.claimed_at).total_seconds() if j.claimed_at else None,
        )
        for j in running
    ]
    waiting_entries = []
    work = 0.0
    for place, j in enumerate(waiting, start=1):
        waiting_entries.append(
            QueueEntry(j, place, _eta(settings, view, place - 1, work, j.kind), None)
        )
        work += view.duration(j.kind)
    return running_entries, waiting_entries
