"""JobStore: the screens' and workers' verbs, as transactions over `rules`, `lease`, `bulk` and
`views`. Flows call these and never see SQL; it must not import Prefect, httpx or `flows`."""

from __future__ import annotations

import datetime as dt
import os
import socket
from collections.abc import Iterable, Sequence
from typing import Any, Literal, overload

from sqlalchemy import Connection, Row, delete, insert, select, update
from sqlalchemy.exc import IntegrityError

from queue_store import bulk, lease, people, places, schema, validation, views
from queue_store.errors import ClaimLost, DatabaseError, InvalidArgument
from queue_store.models import (
    INTERACTIVE,
    PREFETCH,
    Claim,
    EnqueueRequest,
    Failure,
    Job,
    JobState,
    Renewal,
    Settlement,
    Status,
    Usage,
    job_id,
)
from queue_store.operations import OperatorActions
from queue_store.redact import Redactor
from queue_store.rules import decide, lapsed
from queue_store.schema import from_row, jobs, results, workers
from queue_store.tallies import tally_attempt

MAX_ENQUEUE_ROUNDS = 8  # compare-and-swaps (FIX7) lost to a race on the key; a few settle it
BULK_CHUNK = 500  # requests per transaction of `enqueue_many`
MAX_BULK_CHUNK = 2000  # a user's run of requests may stretch a chunk up to this
FORGET_WORKERS_AFTER_LEASES = 60  # a worker not seen for this many leases is forgotten


class JobStore(OperatorActions):
    """The queue, thread-safe: one per process. It plays every role of `ports`."""

    def enqueue(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        priority: int = PREFETCH,
    ) -> Status:
        """Queue one generation, or promote it (R1-R6); returns the job's status after the call."""
        request = _checked_request(EnqueueRequest(user_id, kind, subject, fingerprint, priority))
        jid = job_id(request.user_id, request.kind, request.subject)
        for _ in range(MAX_ENQUEUE_ROUNDS):
            with self._read("enqueue") as connection:
                row = connection.execute(select(jobs).where(jobs.c.id == jid)).one_or_none()
                now = self._now(connection)
            status = self._enqueue_round(request, row, now)
            if status is not None:
                return status
        raise DatabaseError(f"enqueue: job {jid[:12]}… kept changing under this call; retry")

    def _enqueue_round(
        self, request: EnqueueRequest, row: Row[Any] | None, now: dt.datetime
    ) -> Status | None:
        """The job's status after acting on the row as read, or None to read it again."""
        user_id, priority = request.user_id, request.priority
        if row is None:
            try:
                with self._write("enqueue") as connection:
                    now = self._now(connection)
                    turn = places.next_turn(connection, self._settings, user_id, priority)
                    connection.execute(insert(jobs).values(bulk.new_job(request, now, turn)))
                    people.pseudonymize(connection, [user_id], now)
                    if priority <= INTERACTIVE:
                        places.cap_interactive(connection, self._settings, user_id, now)
            except IntegrityError:
                return None  # another caller inserted it first: decide again
            return Status.PENDING
        decision = decide(row, request.fingerprint, priority, now, self._settings)
        if decision.reap_first:
            self._take_back(row.id)
            return None
        if decision.changes is None:
            return decision.status
        changes = dict(decision.changes)
        promoted = changes.get("priority", row.priority)
        with self._write("enqueue") as connection:
            if "queued_at" in changes or promoted != row.priority:
                # Into the queue again, or promoted: a turn of its own (R8b).
                changes["turn"] = places.next_turn(
                    connection, self._settings, row.user_id, promoted
                )
            written = connection.execute(
                update(jobs)
                .where(jobs.c.id == row.id, jobs.c.revision == row.revision)
                .values(**changes, updated_at=now, revision=row.revision + 1)
            ).rowcount
            if written == 1 and promoted <= INTERACTIVE:
                places.cap_interactive(connection, self._settings, row.user_id, now)
        return decision.status if written == 1 else None

    def _take_back(self, jid: str) -> None:
        """Reap one job whose claim looked lapsed, if it still is."""
        with self._gated("enqueue") as tx:
            query = select(jobs).where(jobs.c.id == jid, jobs.c.status == Status.RUNNING)
            row = tx.connection.execute(query).one_or_none()
            if row is not None and lapsed(row, tx.now, self._settings):
                lease.reap(tx, [row])

    def enqueue_many(self, requests: Iterable[EnqueueRequest]) -> list[Status]:
        """`enqueue` (and `supersede`, R7) for many keys, all checked before anything is written."""
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
        # The read locks nothing. PostgreSQL writes in the same transaction; SQLite takes the write
        # lock in one of its own, only to change something: a read transaction cannot take it.
        with self._read("enqueue_many") as connection:
            now = self._now(connection)
            rows = bulk.read(connection, chunk)
            turns = bulk.Turns(connection, self._settings, {r.user_id for r in chunk})
            # A chunk's first time: now, but never at or before the previous chunk's last.
            start = now if after is None or now > after else after + dt.timedelta(microseconds=1)
            decided = bulk.plan(chunk, rows, start, self._settings, turns)
            if decided.writes_nothing:
                return decided
            if not self._is_sqlite:
                self._write_chunk(connection, chunk, decided)
                return decided
        with self._write("enqueue_many") as connection:
            self._write_chunk(connection, chunk, decided)
        return decided

    def _write_chunk(
        self, connection: Connection, chunk: Sequence[EnqueueRequest], decided: bulk.Plan
    ) -> None:
        """Write a chunk's plan; its users' screens stay within their number (A3)."""
        bulk.write(connection, decided)
        now = self._now(connection)
        for user in sorted({r.user_id for r in chunk if r.priority <= INTERACTIVE}):
            places.cap_interactive(connection, self._settings, user, now)

    def jobs(self, ids: Iterable[str]) -> dict[str, Job]:
        wanted = sorted({validation.job_id(i) for i in ids})
        with self._read("jobs") as connection:
            rows = connection.execute(views.WITH_PSEUDONYM.where(jobs.c.id.in_(wanted))).all()
        return {row.id: from_row(Job, row) for row in rows}

    def user_of(self, pseudonym: str) -> str | None:
        """The user a pseudonym of the run history stands for; None once forgotten (D4)."""
        pseudonym = validation.text("pseudonym", pseudonym, people.MAX_PSEUDONYM_LENGTH)
        with self._read("user_of") as connection:
            return people.user_of(connection, pseudonym)

    @overload
    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
        queue: Literal[True] = True,
    ) -> JobState: ...

    @overload
    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
        queue: Literal[False],
    ) -> JobState | None: ...

    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
        queue: bool = True,
    ) -> JobState | None:
        """A screen's poll (P1). `queue=False` only reads: None without a job, and `fresh` is judged
        against `fingerprint`, or the job's own without one."""
        request = _checked_request(EnqueueRequest(user_id, kind, subject, fingerprint, INTERACTIVE))
        fingerprint = request.fingerprint
        jid = job_id(request.user_id, request.kind, request.subject)
        for _ in range(MAX_ENQUEUE_ROUNDS):
            with self._read("poll") as connection:
                row = connection.execute(views.JOB_AND_RESULT, {"jid": jid}).one_or_none()
                now = self._now(connection)
                if row is None and not queue:
                    return None
                if row is not None and not queue:
                    asked = fingerprint if fingerprint is not None else row.fingerprint
                    return views.job_state(connection, self._settings, row, now, asked)
                if row is not None:
                    decision = decide(row, fingerprint, INTERACTIVE, now, self._settings)
                    if decision.changes is None and not decision.reap_first:
                        return views.job_state(
                            connection, self._settings, row, now, fingerprint, known
                        )
            self._enqueue_round(request, row, now)
        raise DatabaseError(f"poll: job {jid[:12]}… kept changing under this call; retry")

    def has_work(self, *, or_running: bool = False) -> bool:
        """Whether a claim could find work; `or_running`: any claim counts (W2)."""
        with self._read("has_work") as connection:
            queued = select(jobs.c.id).where(jobs.c.status == Status.PENDING).limit(1)
            if connection.execute(queued).first() is not None:
                return True
            running = places.running_rows(connection)
            if or_running:
                return bool(running)
            now = self._now(connection)
            return any(lapsed(row, now, self._settings) for row in running)

    def claim_next(self, worker: str) -> Claim:
        """The next job, if the gate allows a call now (R8, R9, FIX1, FIX6)."""
        worker = validation.worker(worker)
        with self._gated("claim_next") as tx:
            return lease.claim(tx, worker)

    def heartbeat(
        self, jid: str, holder: str, *, calling: bool = False, flow_run_id: str | None = None
    ) -> Renewal:
        """Renew the claim (FIX3); anything but RENEWED means: stop the call now."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        flow_run_id = None if flow_run_id is None else validation.run_id(flow_run_id)
        with self._gated("heartbeat") as tx:
            return lease.renew(tx, jid, holder, calling=calling, flow_run_id=flow_run_id)

    def finish(
        self,
        jid: str,
        holder: str,
        *,
        result: Any,
        duration_seconds: float | None = None,
        flow_run_id: str | None = None,
        usage: Usage | None = None,
    ) -> Status:
        """The job is done and its result the key's latest (N1), or `ClaimLost` (FIX2)."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        most = self._settings.max_result_bytes
        output, _ = validation.result(result, most)
        # An answer may quote our secrets (a gateway echoing its token): stored without (G5).
        output, size = validation.result(_redacted(output, self._redact), most)
        if duration_seconds is not None:
            duration_seconds = validation.seconds("duration_seconds", duration_seconds)
        flow_run_id = None if flow_run_id is None else validation.run_id(flow_run_id)

        with self._gated("finish") as tx:
            connection, now = tx.connection, tx.now
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
            lease.settle_done(tx, row, flow_run_id)
            tally_attempt(connection, now, row, "done", duration_seconds, usage or True)
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
        """Settle an attempt that ended without a result (N2, G1-G4), or raise `ClaimLost`."""
        jid = validation.job_id(jid)
        holder = validation.holder(holder)
        if not isinstance(failure, Failure):
            raise InvalidArgument("failure", f"must be a Failure, got {failure!r}")
        error = self._error(error)
        if retry_after is not None:
            retry_after = validation.seconds("retry_after", retry_after)
        flow_run_id = None if flow_run_id is None else validation.run_id(flow_run_id)
        if duration_seconds is not None:
            duration_seconds = validation.seconds("duration_seconds", duration_seconds)
        with self._gated("fail") as tx:
            row = lease.held_row(tx.connection, jid, holder)
            if row is None and failure is Failure.STOPPED:
                late = lease.late_stop(tx, jid, holder, error)
                if late is not None:
                    return late
            if row is None:
                raise ClaimLost(jid, holder)
            if flow_run_id is not None:
                schema.update_job(tx.connection, jid, flow_run_id=flow_run_id)
            settled = lease.settle_failure(tx, row, failure, error, retry_after)
            tally_attempt(tx.connection, tx.now, row, failure, duration_seconds, answer)
            return settled

    def presence(
        self, name: str, role: str, info: dict[str, Any] | None = None, *, leaving: bool = False
    ) -> None:
        """Say that this consumer is alive (W1), or, `leaving`, that it stops."""
        name = validation.worker(name)
        role = validation.text("role", role, 32)
        mine = workers.c.name == name
        with self._write("presence") as connection:
            if leaving:
                connection.execute(delete(workers).where(mine))
                return
            host, pid = socket.gethostname()[:200], os.getpid()
            now = self._now(connection)
            query = select(workers.c.host, workers.c.pid).where(mine)
            row = connection.execute(query).one_or_none()
            values: dict[str, Any] = {"seen_at": now, "info": info or {}}
            process = {"host": host, "pid": pid, "role": role, "started_at": now}
            if row is not None:
                if (row.host, row.pid) != (host, pid):  # a new process took up the name
                    values |= process
                connection.execute(update(workers).where(mine).values(**values))
            else:
                connection.execute(insert(workers).values(name=name, **process, **values))
                kept = self._settings.lease_seconds * FORGET_WORKERS_AFTER_LEASES
                forget = now - dt.timedelta(seconds=kept)
                connection.execute(delete(workers).where(workers.c.seen_at < forget))


def _redacted(value: Any, redact: Redactor) -> Any:
    """A JSON value with every secret removed from its texts (keys too)."""
    if isinstance(value, str):
        return redact(value)
    if isinstance(value, list):
        return [_redacted(item, redact) for item in value]
    if isinstance(value, dict):
        return {redact(str(k)): _redacted(v, redact) for k, v in value.items()}
    return value


def _checked_request(request: object) -> EnqueueRequest:
    if not isinstance(request, EnqueueRequest):
        raise InvalidArgument(
            "requests", f"expected EnqueueRequest items, got {type(request).__name__}"
        )
    key = validation.key(request.user_id, request.kind, request.subject)
    fingerprint = validation.fingerprint(request.fingerprint)
    priority = validation.priority(request.priority)
    return EnqueueRequest(*key, fingerprint, priority, bool(request.supersede))
