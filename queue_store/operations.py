"""The operator's verbs (`OperatorStore`): the queue at a glance, pauses, retries, recovery,
retention and forgetting; a mixin of `JobStore` over `StoreBase`'s transactions."""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy import ColumnElement, Connection, and_, case, func, select, update

from queue_store import lease, places, privacy, schema, validation, views
from queue_store.base import StoreBase
from queue_store.models import (
    INTERACTIVE,
    PREFETCH,
    Forgotten,
    GateState,
    Job,
    ListedJob,
    PauseKind,
    Pruned,
    QueueView,
    Requeued,
    Status,
)
from queue_store.rules import lapsed, queued_anew
from queue_store.schema import from_row, jobs


class OperatorActions(StoreBase):
    def list_jobs(self, user_id: str, limit: int = 60) -> list[ListedJob]:
        """The user's queue in worker order, with places and ETAs (R11)."""
        user_id = validation.user_id(user_id)
        limit = validation.limit(limit)
        with self._read("list_jobs") as connection:
            now = self._now(connection)
            return views.user_jobs(connection, self._settings, now, user_id, limit)

    def retry_failed(self, user_id: str) -> Requeued:
        """Every failed job of the user back in the queue now (R10)."""
        user_id = validation.user_id(user_id)
        with self._write("retry_failed") as connection:
            failed = and_(jobs.c.user_id == user_id, jobs.c.status == Status.FAILED)
            retried = self._queue_anew(connection, failed, user_id)
            places.cap_interactive(connection, self._settings, user_id, self._now(connection))
            waiting = jobs.c.status.in_([Status.PENDING, Status.RUNNING])
            count = select(func.count()).where(jobs.c.user_id == user_id, waiting)
            pending = connection.execute(count).scalar_one()
        return Requeued(user_id, retried, int(pending))

    def requeue(self, kinds: Sequence[str] | None = None) -> int:
        """Queue every finished job (of these kinds) again, after a prompt change."""
        finished: ColumnElement[bool] = jobs.c.status.in_([Status.DONE, Status.FAILED])
        if kinds is not None:
            finished = and_(finished, jobs.c.kind.in_([validation.kind(k) for k in kinds]))
        with self._write("requeue") as connection:
            urgent = case((jobs.c.priority < PREFETCH, jobs.c.priority), else_=PREFETCH)
            queued = self._queue_anew(
                connection, finished, None, priority=urgent, requested_at=None
            )
            self._cap_screens(connection)
            return queued

    def _queue_anew(
        self, connection: Connection, where: Any, user_id: str | None, **more: Any
    ) -> int:
        """Queue the jobs `where` picks again as if new (R5, R10), in turns dealt first."""
        now = self._now(connection)
        self._deal_turns(connection, where, user_id)
        values = queued_anew(now, **more, updated_at=now, revision=jobs.c.revision + 1)
        return int(connection.execute(update(jobs).where(where).values(**values)).rowcount)

    def _deal_turns(self, connection: Connection, where: Any, user_id: str | None) -> None:
        """Turns for the jobs `where` picks, queued again together: each user's in order (R8b)."""
        if self._settings.order != "fair":
            return
        for priority, of_class, served in (
            (PREFETCH, jobs.c.priority > INTERACTIVE, places.SERVED_TURN),
            (INTERACTIVE, jobs.c.priority <= INTERACTIVE, places.SERVED_INTERACTIVE_TURN),
        ):
            if user_id:
                base = places.next_turn(connection, self._settings, user_id, priority) - 1
            else:
                base = connection.execute(served).scalar_one()
            rank = func.row_number().over(partition_by=jobs.c.user_id, order_by=places.FIFO)
            dealt = select(jobs.c.id, (rank + base).label("turn")).where(where, of_class).subquery()
            connection.execute(
                update(jobs).where(jobs.c.id == dealt.c.id).values(turn=dealt.c.turn)
            )

    def _cap_screens(self, connection: Connection) -> None:
        """At most `max_interactive` waiting screens for every user (A3)."""
        now = self._now(connection)
        over = connection.execute(
            select(jobs.c.user_id)
            .where(jobs.c.status == Status.PENDING, jobs.c.priority <= INTERACTIVE)
            .group_by(jobs.c.user_id)
            .having(func.count() > self._settings.max_interactive)
        ).scalars()
        for user in list(over):
            places.cap_interactive(connection, self._settings, user, now)

    def gate_state(self) -> GateState:
        with self._read("gate_state") as connection:
            row = lease.gate_row(connection)
            now = self._now(connection)
            return views.gate_state(row, now, views.workers_alive(connection, self._settings, now))

    def pause(self, seconds: float, reason: str) -> GateState:
        """Stop every worker from claiming for `seconds`."""
        seconds = validation.seconds("seconds", seconds)
        reason = self._error(reason, "reason")
        with self._gated("pause") as tx:
            lease.pause(tx, seconds, PauseKind.OPERATOR, reason)
            return views.gate_state(lease.gate_row(tx.connection), tx.now)

    def resume(self) -> GateState:
        """Lift any pause and forget the outage streak."""
        with self._gated("resume") as tx:
            schema.update_gate(
                tx.connection,
                paused_until=None,
                pause_reason=None,
                pause_kind=None,
                outages_in_a_row=0,
            )
            return views.gate_state(lease.gate_row(tx.connection), tx.now)

    def recover(self, worker: str | None = None) -> list[Job]:
        """Take back dead claims and this worker's own, never another's live claim (FIX5)."""
        if worker is not None:
            worker = validation.worker(worker)
        with self._gated("recover") as tx:
            rows = tx.connection.execute(select(jobs).where(jobs.c.status == Status.RUNNING))
            taken = [
                row
                for row in rows.all()
                if lapsed(row, tx.now, self._settings)
                or (worker is not None and row.worker == worker)
            ]
            lease.reap(tx, taken)
        return [from_row(Job, row) for row in taken]

    def queue_view(self, limit: int = 50) -> QueueView:
        """The whole queue (N3, M1) with the first `limit` waiting jobs, in one read."""
        limit = validation.limit(limit, minimum=0)
        with self._read("queue_view") as connection:
            now = self._now(connection)
            return views.queue_view(connection, self._settings, now, limit)

    def prune(
        self,
        *,
        retention_days: float | None = None,
        by_kind: Mapping[str, float] | None = None,
        dry_run: bool = False,
    ) -> Pruned:
        """Delete what is past retention (D2); `dry_run` counts, and changes nothing."""
        days = self._settings.retention_days if retention_days is None else retention_days
        days = validation.seconds("retention_days", days)
        kinds = {
            validation.kind(kind): validation.seconds("by_kind", kept)
            for kind, kept in (by_kind or {}).items()
        }
        retention = privacy.Retention(days, kinds)
        jobs_gone = results_gone = 0
        while True:
            with self._chunk(dry_run) as connection:
                found = privacy.prune_jobs(
                    connection, retention, self._now(connection), count_only=dry_run
                )
            jobs_gone, results_gone = jobs_gone + found[0], results_gone + found[1]
            if dry_run or not any(found):
                break
        orphans = self._until_done(
            dry_run,
            lambda c, now: privacy.prune_orphan_results(c, retention, now, count_only=dry_run),
        )
        folded = self._until_done(
            dry_run, lambda c, now: privacy.fold_usage(c, retention, now, count_only=dry_run)
        )
        people = self._until_done(
            dry_run, lambda c, now: privacy.prune_people(c, count_only=dry_run)
        )
        return Pruned(jobs_gone, results_gone + orphans, folded, people, days, dry_run)

    def _chunk(self, dry_run: bool) -> Any:
        return self._read("prune") if dry_run else self._write("prune")

    def _until_done(self, dry_run: bool, step: Callable[[Connection, dt.datetime], int]) -> int:
        """Run one chunk of `step` after another until one finds nothing (a dry run: once)."""
        total = 0
        while True:
            with self._chunk(dry_run) as connection:
                found = step(connection, self._now(connection))
            total += found
            if dry_run or not found:
                return total

    def forget(self, user_id: str | None = None, *, erased: Iterable[str] = ()) -> Forgotten:
        """Remove every row of the user (D3); `erased`: pseudonyms gone from the run history."""
        if user_id is not None:
            user_id = validation.user_id(user_id)
        done = [validation.text("erased", p, 40) for p in erased]
        removed = Forgotten("", 0, 0, 0, 0, None)  # no user named: only the erasures below
        with self._gated("forget") as tx:
            if user_id is not None:
                removed = privacy.forget(tx, user_id)
            privacy.erasures_done(tx.connection, done)
            pending = tuple(p for p, _ in privacy.pending_erasures(tx.connection))
        self._checkpoint()
        return dataclasses.replace(removed, history_pending=pending)
