"""Bulk enqueue (`JobStore.enqueue_many`): the statuses and rows of the same `enqueue` calls made
one microsecond apart, worked out in memory per chunk from one read, written with one statement
per verb. The rows changed are locked (PostgreSQL: in id order) and checked unchanged since read;
if another writer got there first, the chunk is rolled back and worked out again (`Raced`)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import functools
import types
from collections.abc import Iterator, Sequence
from typing import Any

from sqlalchemy import (
    Connection,
    Select,
    String,
    bindparam,
    column,
    delete,
    func,
    select,
    text,
    true,
    union_all,
    update,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.engine import Dialect

from queue_store import people, places
from queue_store.models import INTERACTIVE, EnqueueRequest, Status, job_id
from queue_store.rules import decide
from queue_store.schema import jobs
from queue_store.settings import StoreConfig

# What an enqueue never changes on an existing row: its key, its creation, a settlement's columns.
KEPT_COLUMNS = ("id", "user_id", "kind", "subject", "created_at", "finished_at", "flow_run_id")
CHANGED_COLUMNS = tuple(column.name for column in jobs.columns if column.name not in KEPT_COLUMNS)
INSERTED = tuple(column.name for column in jobs.columns)
EMPTY_ROW: dict[str, Any] = dict.fromkeys(INSERTED)  # a new row's columns beyond `new_job`'s


@dataclasses.dataclass
class Plan:
    """What a chunk does: each request's status, and the rows to delete, insert and update."""

    statuses: list[Status]
    deletes: set[str]
    inserts: dict[str, dict[str, Any]]
    updates: dict[str, dict[str, Any]]
    revisions: dict[str, int]  # as read, of every existing row deleted or updated
    last: dt.datetime  # the time given to the last request: the next chunk starts after it

    @property
    def writes_nothing(self) -> bool:
        return not (self.deletes or self.inserts or self.updates)


class Turns:
    """The turns a chunk deals (R8b), read when the first is dealt."""

    def __init__(self, connection: Connection, settings: StoreConfig, users: set[str]) -> None:
        self._connection = connection
        self._settings = settings
        self._users = sorted(users)
        self._served: int | None = None
        self._last: dict[str, int] = {}

    def deal(self, user_id: str, priority: int) -> int:
        if self._settings.order != "fair":
            return 0
        if priority <= INTERACTIVE:  # a bulk of screens is rare: each user's turn is read
            key = f"interactive:{user_id}"
            served = places.next_turn(self._connection, self._settings, user_id, priority)
            turn = max(served, self._last.get(key, -1) + 1)
            self._last[key] = turn
            return turn
        if self._served is None:
            self._served = int(self._connection.execute(places.SERVED_TURN).scalar_one())
            statement = _last_turns(self._connection.dialect.name == "postgresql")
            rows = self._connection.execute(statement, {"users": self._users})
            self._last.update({str(user): int(turn) for user, turn in rows if turn is not None})
        turn = places.turn_after(self._served, self._last.get(user_id))
        self._last[user_id] = turn
        return turn


@functools.cache
def _last_turns(postgres: bool) -> Any:
    """Each user's last turn. PostgreSQL looks the users up one by one: before its first ANALYZE
    it takes `user_id = ANY(...)` for a large part of the table and scans all of it, per chunk."""
    if not postgres:
        return (
            select(jobs.c.user_id, places.LAST_TURN)
            .where(jobs.c.user_id.in_(bindparam("users", expanding=True)))
            .group_by(jobs.c.user_id)
        )
    users = (
        func.unnest(bindparam("users", type_=postgresql.ARRAY(String)))
        .table_valued(column("user_id", String))
        .render_derived()
    )
    last = select(places.LAST_TURN.label("turn")).where(jobs.c.user_id == users.c.user_id)
    found = last.offset(0).lateral()
    return select(users.c.user_id, found.c.turn).select_from(users).join(found, true())


class Raced(Exception):
    """Another writer changed a row this chunk is writing: work the chunk out again."""


def chunks(
    requests: Sequence[EnqueueRequest], size: int, most: int
) -> Iterator[Sequence[EnqueueRequest]]:
    """Runs of about `size` requests ending where a user's run ends; one over `most` is cut."""
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
    superseding = sorted({(r.user_id, r.kind) for r in chunk if r.supersede})
    values = {
        "ids": ids,
        "users": [user for user, _ in superseding],
        "kinds": [kind for _, kind in superseding],
    }
    statement = _read(connection.dialect.name == "postgresql", bool(superseding))
    wanted, pairs = set(ids), set(superseding)
    found = {}
    for row in connection.execute(statement, values):
        # SQLite reads users times kinds: more than the pairs superseded.
        if row.id in wanted or (row.user_id, row.kind) in pairs:
            found[row.id] = dict(row._mapping)
    return found


@functools.cache
def _read(postgres: bool, superseding: bool) -> Any:
    if postgres:
        by_id, by_kind = _by_id_one_by_one(*jobs.columns), _by_user_and_kind_one_by_one()
    else:
        by_id = select(jobs).where(jobs.c.id.in_(bindparam("ids", expanding=True)))
        by_kind = select(jobs).where(
            jobs.c.user_id.in_(bindparam("users", expanding=True)),
            jobs.c.kind.in_(bindparam("kinds", expanding=True)),
        )
    return union_all(by_id, by_kind) if superseding else by_id


def _by_user_and_kind_one_by_one() -> Select[Any]:
    """PostgreSQL: every job of each (user, kind) of the arrays, pair by pair in `ix_ai_jobs_user`.
    With `= ANY(...)`, a prepared statement (psycopg prepares after five runs) read slower and
    slower as a backfill grew the table. OFFSET 0 keeps the planner from merging the lookup."""
    pairs = (
        func.unnest(
            bindparam("users", type_=postgresql.ARRAY(String)),
            bindparam("kinds", type_=postgresql.ARRAY(String)),
        )
        .table_valued(column("user_id", String), column("kind", String))
        .render_derived()
    )
    found = (
        select(*jobs.columns)
        .where(jobs.c.user_id == pairs.c.user_id, jobs.c.kind == pairs.c.kind)
        .offset(0)
        .lateral()
    )
    return select(*found.c).select_from(pairs).join(found, true())


@functools.cache
def _by_id_one_by_one(*columns: Any, lock: bool = False) -> Select[Any]:
    """PostgreSQL: the rows of the array `ids`, each looked up in the primary key in the order
    given (the lock order). On a table grown since its last ANALYZE, `id = ANY(...)` scans it."""
    keys = (
        func.unnest(bindparam("ids", type_=postgresql.ARRAY(String)))
        .table_valued(column("id", String))
        .render_derived()
    )
    one = select(*columns).where(jobs.c.id == keys.c.id).limit(1)
    if lock:
        one = one.with_for_update()
    found = one.lateral()
    return select(*found.c).select_from(keys).join(found, true())


def plan(
    chunk: Sequence[EnqueueRequest],
    rows: dict[str, dict[str, Any]],
    start: dt.datetime,
    settings: StoreConfig,
    turns: Turns,
) -> Plan:
    """Decide every request in order, on the rows as the earlier ones left them."""
    # Every job as it stands after the requests so far; None once deleted.
    current: dict[str, types.SimpleNamespace | None] = {
        jid: types.SimpleNamespace(**row) for jid, row in rows.items()
    }
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
            turn = turns.deal(request.user_id, request.priority)
            job = types.SimpleNamespace(**{**EMPTY_ROW, **new_job(request, at, turn)})
            current[jid] = inserts[jid] = job
            by_kind.setdefault((request.user_id, request.kind), set()).add(jid)
            statuses.append(Status.PENDING)
        else:
            decision = decide(job, request.fingerprint, request.priority, at, settings)
            statuses.append(decision.status)
            # A lapsed claim is reported as it will be once the next lease decision takes it back.
            if decision.changes is not None and not decision.reap_first:
                changes = dict(decision.changes)
                priority = changes.get("priority", job.priority)
                if "queued_at" in changes or priority != job.priority:
                    changes["turn"] = turns.deal(request.user_id, priority)
                vars(job).update(changes, updated_at=at, revision=job.revision + 1)
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
    # A key deleted and queued again later is both deleted and inserted: the deletes run first.
    return Plan(
        statuses=statuses,
        deletes=deletes,
        inserts={jid: dict(vars(job)) for jid, job in inserts.items()},  # every column
        updates={
            jid: {name: getattr(current[jid], name) for name in CHANGED_COLUMNS} for jid in changed
        },
        revisions={jid: rows[jid]["revision"] for jid in deletes | changed},
        last=at,
    )


def write(connection: Connection, plan: Plan) -> None:
    """Apply the plan, or raise `Raced` (the caller's transaction rolls back)."""
    postgres = connection.dialect.name == "postgresql"
    if plan.revisions:
        ids = sorted(plan.revisions)
        if postgres:
            locking: Any = _by_id_one_by_one(jobs.c.id, jobs.c.revision, lock=True)
        else:  # the write transaction holds the database's one write lock already
            locking = select(jobs.c.id, jobs.c.revision).where(
                jobs.c.id.in_(bindparam("ids", expanding=True))
            )
        locked = connection.execute(locking, {"ids": ids})
        if {row.id: row.revision for row in locked} != plan.revisions:
            raise Raced
    if plan.deletes:
        connection.execute(delete(jobs).where(jobs.c.id.in_(sorted(plan.deletes))))
    if plan.inserts:
        rows = list(plan.inserts.values())
        if postgres:
            inserted = connection.execute(
                _pg_insert(connection.dialect),
                {name: [row[name] for row in rows] for name in INSERTED},
            ).all()
            written = len(inserted)
        else:
            written = connection.execute(_sqlite_insert(), rows).rowcount
        if written != len(rows):  # another caller inserted one first
            raise Raced
        people.pseudonymize(connection, {row["user_id"] for row in rows}, rows[0]["created_at"])
    if plan.updates:
        connection.execute(
            update(jobs).where(jobs.c.id == bindparam("job_id")),
            [{"job_id": jid, **values} for jid, values in plan.updates.items()],
        )


@functools.cache
def _sqlite_insert() -> Any:
    """One row per execution. Text: SQLAlchemy does not cache its INSERT ... ON CONFLICT."""
    return text(
        f"INSERT INTO ai_jobs ({', '.join(INSERTED)}) "
        f"VALUES ({', '.join(f':{name}' for name in INSERTED)}) ON CONFLICT (id) DO NOTHING"
    ).bindparams(*[bindparam(name, type_=jobs.c[name].type) for name in INSERTED])


@functools.cache
def _pg_insert(dialect: Dialect) -> Any:
    """INSERT ... SELECT FROM unnest(one array per column): one statement, one plan."""
    arrays = ", ".join(
        f"CAST(:{name} AS {jobs.c[name].type.compile(dialect=dialect)}[])" for name in INSERTED
    )
    return text(
        f"INSERT INTO ai_jobs ({', '.join(INSERTED)}) SELECT * FROM unnest({arrays}) "
        "ON CONFLICT (id) DO NOTHING RETURNING id"
    ).bindparams(*[bindparam(name, type_=postgresql.ARRAY(jobs.c[name].type)) for name in INSERTED])


def new_job(request: EnqueueRequest, now: dt.datetime, turn: int) -> dict[str, Any]:
    """A new key's row: pending, no attempts (R2), in its turn (R8b)."""
    return {
        "turn": turn,
        "id": job_id(request.user_id, request.kind, request.subject),
        "user_id": request.user_id,
        "kind": request.kind,
        "subject": request.subject,
        "fingerprint": request.fingerprint,
        "priority": request.priority,
        "status": Status.PENDING,
        "attempts": 0,
        "losses": 0,
        "revision": 0,
        "queued_at": now,
        "created_at": now,
        "updated_at": now,
        "requested_at": now if request.priority <= INTERACTIVE else None,
    }
