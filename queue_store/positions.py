"""Place in line and ETA (N3), and the operator's whole-queue view, one query each.

The worker takes pending jobs by priority, then age. A job's place is the
number of pending jobs before it in that order; its ETA adds, on the store's
clock, what is left of the calls in flight, the expected duration of every job
ahead (the moving mean per kind in `ai_job_kind_durations`), a gap after each
call, any pause or gap still running, and its own call.

Counting what lies ahead of a job deep in a 100k backlog reads the queue index
once, up to the last job asked about, and nothing else: the jobs asked about
cut the queue into stretches, each stretch is counted as a range of index
entries (with the work of its jobs summed from the per-kind means), and a
job's place is the sum of the stretches before it. However many jobs are
asked about, that is one statement.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
from collections.abc import Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Float,
    Integer,
    Row,
    String,
    and_,
    bindparam,
    case,
    func,
    literal_column,
    select,
    tuple_,
    union_all,
)

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

    # The listed jobs in claim order cut the queue into stretches: the first
    # job's place is the count of the first stretch, the next job's adds the
    # next stretch, and so on: one range of the queue index per priority spanned.
    wanted = sorted({j.id: j for j in waiting}.values(), key=_key)
    shape, values = _stretches(wanted)
    kinds = sorted(view.means.items())
    for n, (kind, mean) in enumerate(kinds):
        values[f"kind_{n}"] = kind
        values[f"mean_{n}"] = mean
    values["default_mean"] = view.default_seconds
    values["pending"] = Status.PENDING.value
    counted: dict[int, tuple[int, float]] = {}
    statement = _stretch_counts(shape, len(kinds), connection.dialect.name == "postgresql")
    for row in connection.execute(statement, values):
        ahead, work = counted.get(row.stretch, (0, 0.0))
        counted[row.stretch] = (ahead + int(row.ahead), work + float(row.work or 0.0))
    ahead, work = 0, 0.0
    for stretch, j in enumerate(wanted):
        more, more_work = counted.get(stretch, (0, 0.0))
        ahead += more
        work += more_work
        found[j.id] = Position(
            Status.PENDING, ahead, view.in_flight, _eta(settings, view, ahead, work, j.kind)
        )
    return found


Key = tuple[int, dt.datetime, str]

# How a part of a stretch bounds its range of the queue index.
BELOW = "below"  # a priority lower than the end's
UP_TO = "up_to"  # the end's priority, before the end's (age, id)
WITHIN = "within"  # one priority, from the start's (age, id) to the end's
FROM = "from"  # the start's priority, from the start's (age, id) on
BETWEEN = "between"  # priorities between the start's and the end's


def _key(job: Job) -> Key:
    return (job.priority, job.queued_at, job.id)


def _stretches(wanted: Sequence[Job]) -> tuple[tuple[tuple[int, str], ...], dict[str, Any]]:
    """The parts of each stretch before a wanted job (their shape), and their bounds.

    Stretch `n` holds the pending jobs at or after wanted job `n - 1` and
    before wanted job `n`, in claim order. It is counted as one index range
    per priority it spans, each starting on an equal priority: PostgreSQL
    reads a row comparison that starts on the priority as a range of whole
    priorities, and would walk every entry of them.
    """
    shape: list[tuple[int, str]] = []
    values: dict[str, Any] = {}

    def part(stretch: int, how: str, start: Key | None = None, end: Key | None = None) -> None:
        n = len(shape)
        shape.append((stretch, how))
        if start is not None:
            values.update({f"start_p_{n}": start[0], f"start_q_{n}": start[1]})
            values[f"start_id_{n}"] = start[2]
        if end is not None:
            values.update({f"end_p_{n}": end[0], f"end_q_{n}": end[1], f"end_id_{n}": end[2]})

    previous: Key | None = None
    for stretch, job in enumerate(wanted):
        key = _key(job)
        if previous is None:
            part(stretch, BELOW, end=key)
            part(stretch, UP_TO, end=key)
        elif previous[0] == key[0]:
            part(stretch, WITHIN, previous, key)
        else:
            part(stretch, FROM, start=previous)
            if key[0] - previous[0] > 1:
                part(stretch, BETWEEN, previous, key)
            part(stretch, UP_TO, end=key)
        previous = key
    return tuple(shape), values


@functools.lru_cache(maxsize=256)
def _stretch_counts(shape: tuple[tuple[int, str], ...], kinds: int, estimate: bool) -> Any:
    """One statement: per part of a stretch, its pending jobs and the sum of their means.

    Built once per shape, so that executing it again costs neither building
    nor SQLAlchemy's cache key; the bounds, kinds and means are parameters.
    `estimate`: add a plain comparison on the age beside each row comparison.
    It adds nothing to the row comparison but a row estimate: PostgreSQL puts
    a row comparison's at a third of the table, and would then scan the table
    rather than the index. (SQLite needs none, and would only check it on
    every row.)
    """
    mean: Any = bindparam("default_mean", type_=Float)
    if kinds:
        mean = case(
            *[
                (bindparam(f"kind_{n}", type_=String), bindparam(f"mean_{n}", type_=Float))
                for n in range(kinds)
            ],
            value=jobs.c.kind,
            else_=mean,
        )
    pending = jobs.c.status == bindparam("pending", type_=String)
    age = tuple_(jobs.c.queued_at, jobs.c.id)

    def bound(side: str, n: int) -> tuple[Any, Any, Any]:
        return (
            bindparam(f"{side}_p_{n}", type_=Integer),
            bindparam(f"{side}_q_{n}", type_=schema.UTCDateTime),
            bindparam(f"{side}_id_{n}", type_=String),
        )

    def after(n: int) -> Any:
        _, queued_at, jid = bound("start", n)
        condition = age >= tuple_(queued_at, jid)
        return and_(condition, jobs.c.queued_at >= queued_at) if estimate else condition

    def before(n: int) -> Any:
        _, queued_at, jid = bound("end", n)
        condition = age < tuple_(queued_at, jid)
        return and_(condition, jobs.c.queued_at <= queued_at) if estimate else condition

    parts = []
    for n, (stretch, how) in enumerate(shape):
        start, end = bound("start", n)[0], bound("end", n)[0]
        conditions = {
            BELOW: [jobs.c.priority < end],
            UP_TO: [jobs.c.priority == end, before(n)],
            WITHIN: [jobs.c.priority == start, after(n), before(n)],
            FROM: [jobs.c.priority == start, after(n)],
            BETWEEN: [jobs.c.priority > start, jobs.c.priority < end],
        }[how]
        parts.append(
            select(
                literal_column(str(stretch), Integer).label("stretch"),
                func.count().label("ahead"),
                func.sum(mean).label("work"),
            ).where(pending, *conditions)
        )
    return parts[0] if len(parts) == 1 else union_all(*parts)


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
