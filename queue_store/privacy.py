"""What the store keeps of a person, for how long, and forgetting them (D2, D3).
Retention runs in chunks of `PRUNE_CHUNK` rows, one short transaction each and never under the gate
lock, so a claim waits for one chunk at most. Nothing here reads or writes Prefect."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from sqlalchemy import Connection, and_, delete, exists, func, insert, select, tuple_, update

from queue_store import lease, places, schema, tallies
from queue_store.models import CutCause, Forgotten, Status
from queue_store.people import pseudonym_of
from queue_store.schema import erasures, holds, jobs, people, results, usage

PRUNE_CHUNK = 500  # rows a prune transaction deletes at most
FINISHED = (Status.DONE, Status.FAILED)
NO_ONE = ""  # the user of usage totals past retention


@dataclasses.dataclass(frozen=True)
class Retention:
    """How long finished work is kept: `days` for every kind, but those in `by_kind`."""

    days: float
    by_kind: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def cutoffs(self, now: dt.datetime, kind: Any) -> list[tuple[list[Any], dt.datetime]]:
        """(conditions on the column `kind`, before when): the default, and each kind's own."""
        kinds = sorted(self.by_kind)
        found = [([kind.not_in(kinds)] if kinds else [], _before(now, self.days))]
        return found + [([kind == name], _before(now, self.by_kind[name])) for name in kinds]


def _before(now: dt.datetime, days: float) -> dt.datetime:
    return now - dt.timedelta(days=days)


def prune_jobs(
    connection: Connection, retention: Retention, now: dt.datetime, *, count_only: bool
) -> tuple[int, int]:
    """A chunk of finished jobs past retention, and their results: (jobs, results) deleted."""
    deleted_jobs = deleted_results = 0
    for kinds, cutoff in retention.cutoffs(now, jobs.c.kind):
        past = [jobs.c.status.in_(FINISHED), jobs.c.finished_at < cutoff, *kinds]
        if count_only:
            deleted_jobs += _count(connection, select(jobs.c.id).where(*past))
            theirs = select(results.c.job_id).join(jobs, jobs.c.id == results.c.job_id)
            deleted_results += _count(connection, theirs.where(*past))
            continue
        chosen = _chunk(connection, select(jobs.c.id).where(*past).order_by(jobs.c.finished_at))
        if not chosen:
            continue
        # Re-checked as they are deleted: a job queued again since is not finished any more.
        gone = delete(jobs).where(jobs.c.id.in_(chosen), *past).returning(jobs.c.id)
        ids = list(connection.execute(gone).scalars())
        deleted_jobs += len(ids)
        if ids:
            their_results = delete(results).where(results.c.job_id.in_(ids))
            deleted_results += _deleted(connection, their_results)
    return deleted_jobs, deleted_results


def prune_orphan_results(
    connection: Connection, retention: Retention, now: dt.datetime, *, count_only: bool
) -> int:
    """Results past retention whose job is gone (superseded)."""
    no_job = ~exists().where(jobs.c.id == results.c.job_id)
    found = 0
    for kinds, cutoff in retention.cutoffs(now, results.c.kind):
        past = [results.c.produced_at < cutoff, no_job, *kinds]
        found += _prune(connection, results.c.job_id, past, count_only)
    return found


def fold_usage(
    connection: Connection, retention: Retention, now: dt.datetime, *, count_only: bool
) -> int:
    """Users' daily token usage past retention, folded into the day's totals of no one (M2)."""
    cutoff = _before(now, retention.days).date()
    past = and_(usage.c.day < cutoff, usage.c.user_id != NO_ONE)
    if count_only:
        return _count(connection, select(usage.c.day).where(past))
    key = (usage.c.day, usage.c.user_id, usage.c.kind)
    query = select(*key).where(past).order_by(usage.c.day).limit(PRUNE_CHUNK)
    keys = [tuple(row) for row in connection.execute(_skip_locked(connection, query))]
    if not keys:
        return 0
    # What this transaction deleted is what it adds: a row another pruner took is not returned.
    gone = connection.execute(
        delete(usage)
        .where(tuple_(*key).in_(keys), past)
        .returning(usage.c.day, usage.c.kind, *(usage.c[name] for name in tallies.SUMMED))
    ).all()
    totals: dict[tuple[Any, str], Counter[str]] = defaultdict(Counter)
    for row in gone:
        totals[row.day, row.kind].update({name: int(row._mapping[name]) for name in tallies.SUMMED})
    for (day, kind), summed in sorted(totals.items()):
        statement = schema.upsert(connection, usage).values(
            day=day, user_id=NO_ONE, kind=kind, **{name: summed[name] for name in tallies.SUMMED}
        )
        added = {name: usage.c[name] + statement.excluded[name] for name in tallies.SUMMED}
        connection.execute(statement.on_conflict_do_update(index_elements=list(key), set_=added))
    return len(gone)


def prune_people(connection: Connection, *, count_only: bool) -> int:
    """People with nothing left in the store, no longer known (D2)."""
    nothing_left = and_(
        ~exists().where(jobs.c.user_id == people.c.user_id),
        ~exists().where(results.c.user_id == people.c.user_id),
        ~exists().where(usage.c.user_id == people.c.user_id),
    )
    return _prune(connection, people.c.user_id, [nothing_left], count_only)


def _prune(connection: Connection, key: Any, past: list[Any], count_only: bool) -> int:
    """A chunk of the rows `past` picks, deleted by `key` and re-checked as they go."""
    query = select(key).where(*past)
    if count_only:
        return _count(connection, query)
    chosen = _chunk(connection, query)
    if not chosen:
        return 0
    return _deleted(connection, delete(key.table).where(key.in_(chosen), *past))


def _chunk(connection: Connection, query: Any) -> list[Any]:
    """The first `PRUNE_CHUNK` keys of `query`, rows another pruner holds skipped."""
    return list(connection.execute(_skip_locked(connection, query.limit(PRUNE_CHUNK))).scalars())


def _skip_locked(connection: Connection, query: Any) -> Any:
    """`query` past rows another pruner holds (PostgreSQL: SQLite serialises its writers)."""
    if connection.dialect.name == "postgresql":
        return query.with_for_update(skip_locked=True)
    return query


def _count(connection: Connection, query: Any) -> int:
    return int(connection.execute(select(func.count()).select_from(query.subquery())).scalar_one())


def _deleted(connection: Connection, statement: Any) -> int:
    return int(connection.execute(statement).rowcount or 0)


def forget(tx: lease.Gated, user_id: str) -> Forgotten:
    """Every row of the user (D3)."""
    connection = tx.connection
    mine = jobs.c.user_id == user_id
    running = connection.execute(places.RUNNING.where(mine)).all()
    for row in running:
        lease.cut(tx, row, CutCause.CANCELLED, job_gone=True)
    ids = select(jobs.c.id).where(mine).scalar_subquery()
    connection.execute(update(holds).where(holds.c.job_id.in_(ids)).values(job_id=None))
    erased = Forgotten(
        user_id,
        jobs=_deleted(connection, delete(jobs).where(mine)),
        results=_deleted(connection, delete(results).where(results.c.user_id == user_id)),
        usage_rows=_deleted(connection, delete(usage).where(usage.c.user_id == user_id)),
        calls_cut=sum(1 for row in running if row.call_started_at is not None),
        pseudonym=pseudonym_of(connection, user_id),
    )
    if erased.pseudonym is not None:
        connection.execute(delete(people).where(people.c.user_id == user_id))
        connection.execute(insert(erasures).values(pseudonym=erased.pseudonym, forgotten_at=tx.now))
    return erased


def erasures_done(connection: Connection, pseudonyms: Iterable[str]) -> None:
    done = sorted(set(pseudonyms))
    if done:
        connection.execute(delete(erasures).where(erasures.c.pseudonym.in_(done)))


def pending_erasures(connection: Connection) -> list[tuple[str, dt.datetime]]:
    query = select(erasures.c.pseudonym, erasures.c.forgotten_at).order_by(erasures.c.forgotten_at)
    return [(str(p), at) for p, at in connection.execute(query)]
