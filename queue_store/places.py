"""The queue's order (R8, R8b, A3), and place in line and ETA (N3, P2).
Each order is an index; a place counts its entries from the head, at most `PLACE_BOUND + 1`, so it
costs the same at any backlog."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Row, and_, bindparam, case, func, select, tuple_

from queue_store import schema
from queue_store.models import INTERACTIVE, PREFETCH, Job, Position, QueueEntry, Status
from queue_store.rules import lapsed
from queue_store.schema import gate, holds, jobs
from queue_store.schema import kind_durations as durations
from queue_store.settings import StoreConfig

PLACE_BOUND = 1000  # jobs counted ahead of one before its place becomes "more than"
DURATION_WINDOW = 20  # a kind's moving mean weighs its newest sample 1/20 once it has 20
FIFO = (jobs.c.priority, jobs.c.queued_at, jobs.c.id)  # ix_ai_jobs_queue
FAIR = (jobs.c.priority, jobs.c.turn, jobs.c.queued_at, jobs.c.id)  # ix_ai_jobs_fair
MEANS = select(durations.c.kind, durations.c.mean_seconds)
HOLD_ENDS = select(holds.c.until)
# What liveness checks and ETAs read of the running jobs.
RUNNING = select(
    jobs.c.id,
    jobs.c.kind,
    jobs.c.holder,
    jobs.c.worker,
    jobs.c.attempts,
    jobs.c.losses,
    jobs.c.heartbeat_at,
    jobs.c.claimed_at,
    jobs.c.call_started_at,
).where(jobs.c.status == Status.RUNNING)


def order(settings: StoreConfig) -> tuple[Any, ...]:
    return FAIR if settings.order == "fair" else FIFO


def order_key(job: Job, settings: StoreConfig) -> tuple[Any, ...]:
    return tuple(getattr(job, column.name) for column in order(settings))


def _last_turn(interactive: bool) -> Any:
    """A user's last turn among their waiting jobs of one class."""
    # The filter sits inside the aggregate so that the user is the only condition an index can
    # serve: with them in the WHERE, a planner without statistics walks the fair index.
    of_class = jobs.c.priority <= INTERACTIVE if interactive else jobs.c.priority > INTERACTIVE
    return func.max(case((and_(jobs.c.status == Status.PENDING, of_class), jobs.c.turn)))


LAST_TURN = _last_turn(interactive=False)
LAST_INTERACTIVE_TURN = _last_turn(interactive=True)
SERVED_TURN = select(gate.c.turn).where(gate.c.id == schema.GATE_ROW_ID)
SERVED_INTERACTIVE_TURN = select(gate.c.interactive_turn).where(gate.c.id == schema.GATE_ROW_ID)


def next_turn(connection: Connection, settings: StoreConfig, user_id: str, priority: int) -> int:
    """The turn of a job entering the queue now (R8b, A3); 0 under fifo."""
    if settings.order != "fair":
        return 0
    interactive = priority <= INTERACTIVE
    last = LAST_INTERACTIVE_TURN if interactive else LAST_TURN
    served = SERVED_INTERACTIVE_TURN if interactive else SERVED_TURN
    mine = select(last).where(jobs.c.user_id == user_id).scalar_subquery()
    turn, latest = connection.execute(served.add_columns(mine)).one()
    return turn_after(int(turn), latest)


def cap_interactive(
    connection: Connection, settings: StoreConfig, user_id: str, now: dt.datetime
) -> None:
    """At most `max_interactive` waiting screens per user (A3): the oldest fall back."""
    waiting = connection.execute(
        select(jobs.c.id, jobs.c.revision)
        .where(
            jobs.c.user_id == user_id,
            jobs.c.status == Status.PENDING,
            jobs.c.priority <= INTERACTIVE,
        )
        .order_by(func.coalesce(jobs.c.requested_at, jobs.c.queued_at).desc(), jobs.c.id.desc())
    ).all()
    for row in waiting[settings.max_interactive :]:
        turn = next_turn(connection, settings, user_id, PREFETCH)
        fallen = {"priority": PREFETCH, "turn": turn, "requested_at": None, "updated_at": now}
        schema.update_job(connection, row.id, **fallen, revision=row.revision + 1)


def turn_after(served: int, last: int | None) -> int:
    return served if last is None else max(served, int(last) + 1)


@dataclasses.dataclass(frozen=True)
class Outlook:
    """What every ETA starts from: the calls in flight and how long claiming is held back."""

    in_flight: int
    remaining_seconds: float  # of the calls in flight, summed
    held_back_seconds: float  # pause or gap still running before the next claim
    means: dict[str, float]  # mean call seconds per kind
    settings: StoreConfig

    def duration(self, kind: str) -> float:
        return self.means.get(kind, self.settings.default_duration_seconds)

    def eta(self, ahead: int, work_ahead: float, kind: str) -> float:
        gaps = self.settings.gap_seconds * (ahead + self.in_flight)
        parallel = (self.remaining_seconds + work_ahead + gaps) / self.settings.concurrency
        return self.held_back_seconds + parallel + self.duration(kind)

    def running(self, job: Job, now: dt.datetime) -> Position:
        elapsed = (now - job.claimed_at).total_seconds() if job.claimed_at else 0.0
        left = max(self.duration(job.kind) - elapsed, 0.0)
        return Position(Status.RUNNING, 0, self.in_flight, left)

    def waiting(self, ahead: int, kinds_ahead: dict[str, int], kind: str) -> Position:
        exact = ahead <= PLACE_BOUND
        counted = min(ahead, PLACE_BOUND)
        work = sum(self.duration(k) * n for k, n in kinds_ahead.items())
        eta = self.eta(counted, work, kind)
        return Position(Status.PENDING, counted, self.in_flight, eta, exact)


def record_duration(connection: Connection, kind: str, seconds: float) -> None:
    """Fold one call's duration into the kind's moving mean."""
    of_kind = durations.c.kind == kind
    kept = select(durations.c.mean_seconds, durations.c.samples).where(of_kind)
    row = connection.execute(kept).one_or_none()
    if row is None:
        connection.execute(durations.insert().values(kind=kind, mean_seconds=seconds, samples=1))
        return
    samples = row.samples + 1
    mean = row.mean_seconds + (seconds - row.mean_seconds) / min(samples, DURATION_WINDOW)
    connection.execute(durations.update().where(of_kind).values(mean_seconds=mean, samples=samples))


def running_rows(connection: Connection) -> list[Row[Any]]:
    return list(connection.execute(RUNNING).all())


def outlook(
    connection: Connection, settings: StoreConfig, now: dt.datetime, gate: Row[Any]
) -> Outlook:
    """A hold of a cut call counts as a call in flight until its end (H1)."""
    means = {k: float(m) for k, m in connection.execute(MEANS)}
    default = settings.default_duration_seconds
    live = [row for row in running_rows(connection) if not lapsed(row, now, settings)]
    remaining = sum(
        max(means.get(row.kind, default) - (now - row.claimed_at).total_seconds(), 0.0)
        for row in live
    )
    ends = list(connection.execute(HOLD_ENDS).scalars())
    holding = [end for end in ends if end > now]
    remaining += sum((end - now).total_seconds() for end in holding)
    held_back = 0.0
    if gate.paused_until is not None and gate.paused_until > now:
        held_back = (gate.paused_until - now).total_seconds()
    # A hold that is over is a call that ended then: the gap counts from it.
    ended = [t for t in (gate.last_finished_at, *(e for e in ends if e <= now)) if t is not None]
    if not live and not holding and ended:
        quiet_until = max(ended) + dt.timedelta(seconds=settings.gap_seconds)
        held_back = max(held_back, (quiet_until - now).total_seconds())
    return Outlook(len(live) + len(holding), remaining, held_back, means, settings)


def _pending_before(columns: tuple[Any, ...], key: tuple[Any, ...]) -> Any:
    """The pending jobs before `key` in the order of `columns`, head first."""
    # The plain comparison on the priority gives a row estimate that keeps PostgreSQL on the index.
    return (
        select(jobs.c.id, jobs.c.kind)
        .where(jobs.c.status == Status.PENDING)
        .where(tuple_(*columns) < tuple_(*key), jobs.c.priority <= key[0])
        .order_by(*columns)
    )


def _kinds_ahead(columns: tuple[Any, ...]) -> Any:
    """The kinds of the pending jobs before a key given as `k0`, `k1`, ..., bounded."""
    key = tuple(bindparam(f"k{n}", type_=c.type) for n, c in enumerate(columns))
    ahead = _pending_before(columns, key).limit(PLACE_BOUND + 1).subquery()
    return select(ahead.c.kind, func.count()).group_by(ahead.c.kind)


# Made once per order: a poll asks for a place every time.
KINDS_AHEAD = {"fifo": _kinds_ahead(FIFO), "fair": _kinds_ahead(FAIR)}


def ahead_of(connection: Connection, settings: StoreConfig, job: Job) -> tuple[int, dict[str, int]]:
    """How many pending jobs are before `job` (up to the bound plus one), and their kinds."""
    key = {f"k{n}": value for n, value in enumerate(order_key(job, settings))}
    counted = connection.execute(KINDS_AHEAD[settings.order], key)
    kinds = {str(kind): int(count) for kind, count in counted}
    return sum(kinds.values()), kinds


def positions(
    connection: Connection, view: Outlook, now: dt.datetime, listed: Sequence[Job]
) -> dict[str, Position]:
    """Positions of the listed jobs that wait or run, by id: one bounded read."""
    found = {j.id: view.running(j, now) for j in listed if j.status == Status.RUNNING}
    settings = view.settings
    pending = [j for j in listed if j.status == Status.PENDING]
    waiting = sorted(pending, key=lambda j: order_key(j, settings))
    if not waiting:
        return found
    last = order_key(waiting[-1], settings)  # the head, up to the last job asked about
    head = connection.execute(_pending_before(order(settings), last).limit(PLACE_BOUND + 1)).all()
    index = {row.id: n for n, row in enumerate(head)}
    kinds: dict[str, int] = {}
    counted = 0
    for job in waiting:
        place = index.get(job.id, len(head))  # else the last one asked about, or past the bound
        for row in head[counted : min(place, PLACE_BOUND)]:
            kinds[row.kind] = kinds.get(row.kind, 0) + 1
        counted = max(counted, min(place, PLACE_BOUND))
        found[job.id] = view.waiting(place, dict(kinds), job.kind)
    return found


def queue_entries(
    view: Outlook, now: dt.datetime, running: Sequence[Job], waiting: Sequence[Job]
) -> tuple[list[QueueEntry], list[QueueEntry]]:
    """Running and the first waiting jobs (in worker order) with place and ETA."""
    running_entries = []
    for j in running:
        elapsed = (now - j.claimed_at).total_seconds() if j.claimed_at else None
        running_entries.append(QueueEntry(j, None, view.running(j, now).eta_seconds, elapsed))
    waiting_entries = []
    work = 0.0
    for place, j in enumerate(waiting, start=1):
        waiting_entries.append(QueueEntry(j, place, view.eta(place - 1, work, j.kind), None))
        work += view.duration(j.kind)
    return running_entries, waiting_entries
