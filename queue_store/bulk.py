"""Bulk enqueue (`JobStore.enqueue_many`): many `enqueue` calls, one transaction per chunk.

Each request is decided by the rule `enqueue` applies (`rules.decide`), in
the order given, on the row as the requests before it in the call left it;
`supersede` drops the user's other pending jobs of that kind at that point of
the sequence (R7). So a call gives the statuses and rows of the same sequence
of `enqueue` (and `supersede`) calls, made one microsecond apart: the queue
takes the jobs it adds in the order they were given.

A chunk is worked out in memory from one read of the rows it can touch, then
written with one statement per verb (the deletes, the inserts, the updates),
however many rows. Like `enqueue` (FIX7), a chunk that changes nothing writes
nothing and locks nothing. The rows a chunk changes are locked first
(PostgreSQL `SELECT ... FOR UPDATE`, in id order; SQLite holds the write
lock) and checked unchanged since they were read; if another writer got there
first, or inserted one of the new keys, the whole chunk is rolled back and
worked out again. A claim skips rows locked here (`SKIP LOCKED`), and an
`enqueue` of a locked row waits and then finds its revision gone and decides
again: nothing is lost either way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import types
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import Connection, bindparam, delete, select, update
from sqlalchemy.dialects import postgresql, sqlite

from queue_store import schema
from queue_store.models import INTERACTIVE, EnqueueRequest, Status, job_id
from queue_store.rules import decide
from queue_store.settings import Settings

jobs = schema.jobs

# The columns an enqueue can change on an existing row (`rules.decide`), and
# the two every write sets.
CHANGED_COLUMNS = (
    "status",
    "holder",
    "worker",
    "claimed_at",
    "heartbeat_at",
    "priority",
    "fingerprint",
    "attempts",
    "error",
    "unavailable_since",
    "queued_at",
    "requested_at",
    "updated_at",
    "revision",
)


# Every column, empty: what a new row holds beyond `new_job`'s values.
EMPTY_ROW: dict[str, Any] = {column.name: None for column in jobs.columns}


@dataclasses.dataclass
class Plan:
    """What a chunk does: each request's status, and the rows to delete, insert and update."""

    statuses: list[Status]
    deletes: set[str]
    inserts: dict[str, dict[str, Any]]
    updates: dict[str, dict[str, Any]]
    # The revision read of every existing row that is deleted or updated.
    revisions: dict[str, int]
    # The time given to the last request: the next chunk starts after it.
    last: dt.datetime

    @property
    def writes_nothing(self) -> bool:
        return not (self.deletes or self.inserts or self.updates)


class Raced(Exception):
    """Another writer changed a row this chunk is writing: work the chunk out again."""


def chunks(
    requests: Sequence[EnqueueRequest], size: int, most: int
) -> Iterator[Sequence[EnqueueRequest]]:
    """Runs of about `size` requests that end where a user's run of requests ends.

    A user's scopes, given together, are queued in one transaction; only a run
    longer than `most` is cut.
    """
    start = 0
    while start < len(requests):
        end = min(start + size, len(requests))
        while (
            end < len(requests)
            and end - start < most
            and requests[end].user_id == requests[end - 1].user_id
        ):
            end += 1
        yield requests[start:end]
        start = end


def read(connection: Connection, chunk: Sequence[EnqueueRequest]) -> dict[str, dict[str, Any]]:
    """The rows the chunk can touch: its keys, and every job of a (user, kind) it supersedes."""
    ids = sorted({job_id(r.user_id, r.kind, r.subject) for r in chunk})
    found = {
        row.id: dict(row._mapping)
        for row in connection.execute(select(jobs).where(jobs.c.id.in_(ids)))
    }
    superseding = {(r.user_id, r.kind) for r in chunk if r.supersede}
    if superseding:
        users = sorted({user for user, _ in superseding})
        kinds = sorted({kind for _, kind in superseding})
        for row in connection.execute(
            select(jobs).where(jobs.c.user_id.in_(users), jobs.c.kind.in_(kinds))
        ):
            if (row.user_id, row.kind) in superseding:
                found[row.id] = dict(row._mapping)
    return found


def plan(
    chunk: Sequence[EnqueueRequest],
    rows: dict[str, dict[str, Any]],
    start: dt.datetime,
    settings: Settings,
) -> Plan:
    """Decide every request of the chunk in order, on the rows as the earlier ones left them.

    Request `n` is decided at `start` plus `n` microseconds.
    """
    # Every job as it stands after the requests so far; None once deleted.
    current: dict[str, types.SimpleNamespace | None] = {
        jid: types.SimpleNamespace(**row) for jid, row in rows.items()
    }
    # Jobs by (user, kind), for supersede.
    by_kind: dict[tuple[str, str], set[str]] = {}
    for jid, row in rows.items():
        by_kind.setdefault((row["user_id"], row["kind"]), set()).add(jid)
    statuses: list[Status] = []
    deletes: set[str] = set()
    inserts: dict[str, types.SimpleNamespace] = {}
    changed: set[str] = set()
    at = start
    for n, request in enumerate(chunk):
        at = start + dt.timedelta(microseconds=n)
        jid = job_id(request.user_id, request.kind, request.subject)
        job = current.get(jid)
        if job is None:  # new, or deleted by a supersede earlier in the call: R2
            job = types.SimpleNamespace(**EMPTY_ROW)
            vars(job).update(
                new_job(
                    request.user_id,
                    request.kind,
                    request.subject,
                    request.fingerprint,
                    request.priority,
                    at,
                )
            )
            current[jid] = inserts[jid] = job
            by_kind.setdefault((request.user_id, request.kind), set()).add(jid)
            statuses.append(Status.PENDING)
        else:
            decision = decide(job, request.fingerprint, request.priority, at, settings)
            statuses.append(decision.status)
            # A lapsed claim is reported as it will be once taken back, and
            # left to the next lease decision to take back (under the gate lock).
            if decision.changes is not None and not decision.reap_first:
                vars(job).update(decision.changes, updated_at=at, revision=job.revision + 1)
                if jid not in inserts:
                    changed.add(jid)
        if request.supersede:  # R7
            for other in sorted(by_kind.get((request.user_id, request.kind), ())):
                job = current.get(other)
                if job is None or job.subject == request.subject or job.status != Status.PENDING:
                    continue
                current[other] = None
                if other in inserts:
                    del inserts[other]
                else:
                    deletes.add(other)
                    changed.discard(other)
    # A key deleted from the table and queued again later in the call is both
    # deleted and inserted: the deletes run first.
    return Plan(
        statuses=statuses,
        deletes=deletes,
        inserts={
            jid: {c.name: getattr(job, c.name) for c in jobs.columns}
            for jid, job in inserts.items()
        },
        updates={
            jid: {name: getattr(current[jid], name) for name in CHANGED_COLUMNS} for jid in changed
        },
        revisions={jid: rows[jid]["revision"] for jid in deletes | changed},
        last=at,
    )


def write(connection: Connection, plan: Plan) -> None:
    """Apply the plan, or raise `Raced` (the caller's transaction rolls back)."""
    if plan.revisions:
        locked = connection.execute(
            select(jobs.c.id, jobs.c.revision)
            .where(jobs.c.id.in_(sorted(plan.revisions)))
            .order_by(jobs.c.id)
            .with_for_update()
        ).all()
        if {row.id: row.revision for row in locked} != plan.revisions:
            raise Raced
    if plan.deletes:
        connection.execute(delete(jobs).where(jobs.c.id.in_(sorted(plan.deletes))))
    if plan.inserts:
        dialect = postgresql if connection.dialect.name == "postgresql" else sqlite
        inserted = connection.execute(
            dialect.insert(jobs)
            .on_conflict_do_nothing(index_elements=[jobs.c.id])
            .returning(jobs.c.id),
            list(plan.inserts.values()),
        ).all()
        if len(inserted) != len(plan.inserts):  # another caller inserted one first
            raise Raced
    if plan.updates:
        connection.execute(
            update(jobs).where(jobs.c.id == bindparam("job_id")),
            [{"job_id": jid, **values} for jid, values in plan.updates.items()],
        )


def new_job(
    user_id: str,
    kind: str,
    subject: str,
    fingerprint: str | None,
    priority: int,
    now: dt.datetime,
) -> dict[str, Any]:
    """A new key's row: pending, no attempts (R2)."""
    return {
        "id": job_id(user_id, kind, subject),
        "user_id": user_id,
        "kind": kind,
        "subject": subject,
        "fingerprint": fingerprint,
        "priority": priority,
        "status": Status.PENDING,
        "attempts": 0,
        "queued_at": now,
        "created_at": now,
        "updated_at": now,
        "requested_at": now if priority <= INTERACTIVE else None,
        "revision": 0,
    }


def starting_after(now: dt.datetime, previous: dt.datetime | None) -> dt.datetime:
    """A chunk's first time: now, but never at or before the previous chunk's last."""
    if previous is None or now > previous:
        return now
    return previous + dt.timedelta(microseconds=1)
