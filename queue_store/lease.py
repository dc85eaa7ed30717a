"""The SQL of the gateway lease: claim, renew, reap and settle (FIX1-FIX6, L1-L3, G1-G4, H1, H2),
each in a `Gated` transaction."""

from __future__ import annotations

import datetime as dt
import secrets
from typing import Any, NamedTuple

from sqlalchemy import Connection, Row, and_, delete, func, insert, select, update

from queue_store import people, places, schema, tallies
from queue_store.errors import SchemaOutdated
from queue_store.models import (
    HOLDER_NONCE_HEX,
    INTERACTIVE,
    Blocked,
    Claim,
    CutCause,
    Failure,
    Job,
    PauseKind,
    Renewal,
    Settlement,
    Status,
)
from queue_store.rules import CLAIM_ENDED, WORKER_LOST, lapsed
from queue_store.schema import gate, holds, jobs, results
from queue_store.settings import StoreConfig

MAX_BACKOFF_DOUBLINGS = 30


def worker_lost_again(losses: int) -> str:
    """H2 spends no attempt on a lost claim: a job that kills its worker fails with this. A late
    stop knows such a failure by this text, so it is written in this one place."""
    return f"worker lost {losses} times in a row: the job may be what stops its worker"


GATE_ROW = select(gate).where(gate.c.id == schema.GATE_ROW_ID)
GATE_ROW_LOCKED = GATE_ROW.with_for_update()


class Gated(NamedTuple):
    """A write transaction holding the gate lock, the clock read after it: no step interleaves."""

    connection: Connection
    now: dt.datetime
    state: Row[Any]  # the gate row, as locked
    settings: StoreConfig


def gate_row(connection: Connection, *, lock: bool = False) -> Row[Any]:
    """The one gate row (locked for the transaction with `lock`: every lease decision)."""
    row = connection.execute(GATE_ROW_LOCKED if lock else GATE_ROW).one_or_none()
    if row is None:
        raise SchemaOutdated("the gate row is missing; run `insight-queue db upgrade`")
    return row


def reap(tx: Gated, dead: list[Row[Any]]) -> int:
    """Take back the jobs of these dead claims (FIX3-FIX5, H1, H2); the gap counts from now (L3)."""
    if not dead:
        return 0
    connection, now, _, settings = tx
    for row in dead:
        cut(tx, row, CutCause.WORKER_LOST)
        losses = row.losses + 1
        changes: dict[str, Any] = {
            **CLAIM_ENDED,
            "last_holder": row.holder,
            "losses": losses,
            "updated_at": now,
            "revision": jobs.c.revision + 1,
        }
        if row.attempts >= settings.max_attempts:
            error: str | None = WORKER_LOST
        else:
            changes["attempts"] = max(row.attempts - 1, 0)
            error = worker_lost_again(losses) if losses >= settings.max_attempts else None
        if error is None:
            changes |= {"status": Status.PENDING, "claimed_at": None}
        else:
            changes |= {"status": Status.FAILED, "error": error, "finished_at": now}
        same_claim = (jobs.c.id == row.id, jobs.c.holder.is_not_distinct_from(row.holder))
        connection.execute(update(jobs).where(*same_claim).values(**changes))
    _ended_call(tx)
    return len(dead)


def cut(tx: Gated, row: Any, cause: CutCause, *, job_gone: bool = False) -> None:
    """The claim's call, if it started, was cut on our side: it holds the gateway a while (H1)."""
    started = row.call_started_at
    if started is None:
        return
    until = started + dt.timedelta(seconds=tx.settings.cut_hold)
    if until > tx.now:
        shown = None if job_gone else row.id
        values = {"job_id": shown, "worker": row.worker, "cause": cause, "started_at": started}
        tx.connection.execute(insert(holds).values(**values, until=until))


def _release_holds(tx: Gated) -> dt.datetime | None:
    """Holds that are over become calls that ended at their end; returns the last call's end."""
    connection, now = tx.connection, tx.now
    last: dt.datetime | None = tx.state.last_finished_at
    ended = connection.execute(select(func.max(holds.c.until)).where(holds.c.until <= now))
    latest: dt.datetime | None = ended.scalar_one_or_none()
    if latest is None:
        return last
    connection.execute(delete(holds).where(holds.c.until <= now))
    if last is None or latest > last:
        schema.update_gate(connection, last_finished_at=latest)
        return latest
    return last


def _ended_call(tx: Gated, **more: Any) -> None:
    """A call ended (settled, or taken over): the gap counts from now (FIX6)."""
    schema.update_gate(tx.connection, last_finished_at=tx.now, **more)


def claim(tx: Gated, worker: str) -> Claim:
    """Take the highest-priority runnable job if the gate allows a call now (R8, R9, FIX1, FIX6)."""
    connection, now, state, settings = tx
    running = places.running_rows(connection)
    dead = [row for row in running if lapsed(row, now, settings)]
    last_finished = _release_holds(tx)
    if dead:
        reap(tx, dead)
        last_finished = now
    in_force = select(holds).where(holds.c.until > now).order_by(holds.c.until)
    holding = connection.execute(in_force).all()
    in_flight = len(running) - len(dead) + len(holding)

    if state.paused_until is not None and state.paused_until > now:
        return Claim(None, Blocked.PAUSED, (state.paused_until - now).total_seconds())
    if in_flight >= settings.concurrency:
        # A hold ends at a known time; a live call's end is unknown.
        first_end = (holding[0].until - now).total_seconds() if holding else None
        return Claim(None, Blocked.CONCURRENCY, first_end)
    if last_finished is not None:
        quiet_until = last_finished + dt.timedelta(seconds=settings.gap_seconds)
        if quiet_until > now:
            return Claim(None, Blocked.GAP, (quiet_until - now).total_seconds())

    probing = state.outages_in_a_row > 0  # probe with a job not failing so: no poisoned job (G2)
    while True:
        candidate = _first_pending(tx, avoid_suspects=probing)
        if candidate is None:
            return Claim(None, Blocked.EMPTY, None)
        if candidate.attempts >= settings.max_attempts:
            # Only if AI_JOB_MAX_ATTEMPTS was lowered: give up rather than block the queue's head.
            error = f"attempts exhausted: AI_JOB_MAX_ATTEMPTS is {settings.max_attempts}"
            given_up = {
                "status": Status.FAILED,
                "error": error,
                "finished_at": now,
                "updated_at": now,
            }
            schema.update_job(connection, candidate.id, **given_up, revision=jobs.c.revision + 1)
            continue
        claimed = {
            "status": Status.RUNNING,
            "holder": f"{worker}/{secrets.token_hex(HOLDER_NONCE_HEX // 2)}",
            "worker": worker,
            "claimed_at": now,
            "heartbeat_at": now,
            "call_started_at": None,
            "attempts": candidate.attempts + 1,
            "updated_at": now,
        }
        schema.update_job(connection, candidate.id, **claimed, revision=candidate.revision + 1)
        if candidate.requested_at is not None:  # a screen asked: how long it waited
            waited = (now - candidate.requested_at).total_seconds()
            tallies.count(connection, tallies.SCREEN_WAIT_SECONDS, candidate.kind, "", waited)
        # The turn being served in the job's class moves on (R8b, A3).
        served = "interactive_turn" if candidate.priority <= INTERACTIVE else "turn"
        if candidate.turn > getattr(state, served):
            schema.update_gate(connection, **{served: candidate.turn})
        # Its name in the run history, if it has none yet (D4).
        people.pseudonymize(connection, [candidate.user_id], now)
        pseudonym = people.pseudonym_of(connection, candidate.user_id)
        return Claim(schema.from_row(Job, candidate, **claimed, pseudonym=pseudonym))


def _first_pending(tx: Gated, *, avoid_suspects: bool) -> Row[Any] | None:
    pending = select(jobs).where(jobs.c.status == Status.PENDING)
    probes = [pending.where(jobs.c.unavailable_since.is_(None))] if avoid_suspects else []
    for query in (*probes, pending):
        head = query.order_by(*places.order(tx.settings)).limit(1).with_for_update(skip_locked=True)
        row = tx.connection.execute(head).one_or_none()
        if row is not None:
            return row
    return None


def held_row(connection: Connection, job_id: str, holder: str) -> Row[Any] | None:
    """The job's row if `holder` still holds its claim (FIX2), locked for the settlement."""
    return connection.execute(
        select(jobs)
        .where(jobs.c.id == job_id, jobs.c.holder == holder, jobs.c.status == Status.RUNNING)
        .with_for_update()
    ).one_or_none()


def renew(
    tx: Gated, job_id: str, holder: str, *, calling: bool = False, flow_run_id: str | None = None
) -> Renewal:
    """Extend a live claim; a lapsed one stays dead (L3). A run id is kept even after it ended."""
    connection, now, _, settings = tx
    row = held_row(connection, job_id, holder)
    if row is None:
        if flow_run_id is not None:
            _note_run_after(connection, job_id, holder, flow_run_id)
        return Renewal.LOST
    if lapsed(row, now, settings):
        return Renewal.LAPSED
    more: dict[str, Any] = {"call_started_at": now} if calling else {}
    if flow_run_id is not None:
        more["flow_run_id"] = flow_run_id
    schema.update_job(connection, job_id, heartbeat_at=now, revision=row.revision + 1, **more)
    return Renewal.RENEWED


def _note_run_after(connection: Connection, job_id: str, holder: str, flow_run_id: str) -> None:
    """The run of an ended claim goes on its job and the result it produced, not a newer claim's."""
    ended = and_(jobs.c.id == job_id, jobs.c.last_holder == holder, jobs.c.status != Status.RUNNING)
    row = connection.execute(select(jobs.c.claimed_at).where(ended)).one_or_none()
    if row is None:
        return
    connection.execute(update(jobs).where(ended).values(flow_run_id=flow_run_id))
    if row.claimed_at is not None:
        unnamed = (results.c.job_id == job_id, results.c.flow_run_id.is_(None))
        since = results.c.produced_at >= row.claimed_at
        connection.execute(update(results).where(*unnamed, since).values(flow_run_id=flow_run_id))


def _settle_row(tx: Gated, row: Row[Any], *, answered: bool = False, **changes: Any) -> None:
    """End the claim with `changes`, and with it the call; `answered`: the gateway answered."""
    values = {**CLAIM_ENDED, "last_holder": row.holder, "finished_at": tx.now, "updated_at": tx.now}
    values |= {"revision": row.revision + 1, **changes}
    schema.update_job(tx.connection, row.id, **values)
    gateway_up = {"last_answer_at": tx.now, "outages_in_a_row": 0} if answered else {}
    _ended_call(tx, **gateway_up)


def _backoff(settings: StoreConfig, streak: int) -> float:
    """The pause after `streak` troubles in a row: doubling from the base, capped."""
    doublings = min(max(streak - 1, 0), MAX_BACKOFF_DOUBLINGS)
    return float(min(settings.backoff_seconds * 2**doublings, settings.backoff_max_seconds))


def pause(tx: Gated, seconds: float, kind: PauseKind, reason: str, **more: Any) -> None:
    until = tx.now + dt.timedelta(seconds=seconds)
    schema.update_gate(
        tx.connection, paused_until=until, pause_kind=kind, pause_reason=reason, **more
    )


def settle_failure(
    tx: Gated, row: Row[Any], failure: Failure, error: str, retry_after: float | None
) -> Settlement:
    """Apply the store's rule for an attempt that ended without a result (N2, G1-G4)."""
    _, now, state, settings = tx
    spent = Status.FAILED if row.attempts >= settings.max_attempts else Status.PENDING
    streak = state.outages_in_a_row + 1  # if this failure is one more trouble in a row
    backoff = _backoff(settings, streak)

    if failure in (Failure.BUILD, Failure.REJECTED, Failure.PARSE):
        answered = failure is not Failure.BUILD  # rejected or unparsed, it was an answer
        _settle_row(tx, row, answered=answered, status=spent, error=error, unavailable_since=None)
        return Settlement(spent, True, None, f"attempt {row.attempts} spent")

    if failure is Failure.TIMEOUT:
        cut(tx, row, CutCause.TIMEOUT)
        _settle_row(tx, row, status=spent, error=error)
        pause(tx, backoff, PauseKind.TIMEOUT, error, outages_in_a_row=streak)
        why = f"claiming paused {backoff:g} s in case the gateway is still working on it"
        return Settlement(spent, True, backoff, f"attempt {row.attempts} spent; {why}")

    if failure is Failure.UNAVAILABLE:
        since = row.unavailable_since
        turn = places.next_turn(tx.connection, settings, row.user_id, row.priority)
        behind: dict[str, Any] = {"queued_at": now, "turn": turn}
        if since is not None and state.last_answer_at is not None and state.last_answer_at > since:
            # The gateway answered others since this job began failing: the job is the problem.
            text = f"the gateway answers other calls but keeps failing this one: {error}"
            _settle_row(tx, row, status=spent, error=text, **behind)
            why = "not an outage, this job"
            return Settlement(spent, True, None, f"attempt {row.attempts} spent: {why}")
        # An outage: keep the attempt, go behind the jobs of its priority, pause with a backoff.
        kept = {"attempts": max(row.attempts - 1, 0), "claimed_at": None}
        outage = {"status": Status.PENDING, "unavailable_since": since or now, **kept, **behind}
        _settle_row(tx, row, error=error, **outage)
        pause(tx, backoff, PauseKind.OUTAGE, error, outages_in_a_row=streak)
        why = f"gateway unavailable; claiming paused {backoff:g} s"
        return Settlement(Status.PENDING, False, backoff, why)

    if failure is Failure.RATE_LIMITED:
        seconds = backoff if retry_after is None else min(retry_after, settings.backoff_max_seconds)
        _refund(tx, row, error)
        # 429s without a time to wait pause longer each time; a wait the gateway names is its own.
        more = {"outages_in_a_row": streak} if retry_after is None else {}
        pause(tx, seconds, PauseKind.RATE_LIMIT, error, **more)
        why = f"rate limited; claiming paused {seconds:g} s"
        return Settlement(Status.PENDING, False, seconds, why)

    if failure is Failure.REFUSED:
        _refund(tx, row, error)
        pause(tx, backoff, PauseKind.REFUSED, error, outages_in_a_row=streak)
        why = f"the gateway refused us; claiming stopped for {backoff:g} s until it is fixed"
        return Settlement(Status.PENDING, False, backoff, why)

    cut(tx, row, CutCause.STOPPED)  # STOPPED: this side stopped the call (shutdown, lease at risk)
    _refund(tx, row, error)
    return Settlement(Status.PENDING, False, None, "handed back; the attempt is not spent")


def late_stop(tx: Gated, job_id: str, holder: str, error: str) -> Settlement | None:
    """A stop reported after a takeover gave the job up as lost (FIX4) puts it back (H2)."""
    connection, now, _, settings = tx
    row = connection.execute(
        select(jobs)
        .where(jobs.c.id == job_id, jobs.c.last_holder == holder, jobs.c.status == Status.FAILED)
        .with_for_update()
    ).one_or_none()
    if row is None or row.error not in (WORKER_LOST, worker_lost_again(row.losses)):
        return None
    attempts = row.attempts - 1 if row.attempts >= settings.max_attempts else row.attempts
    back = {"status": Status.PENDING, "error": error, "attempts": attempts, "updated_at": now}
    back |= dict.fromkeys(("last_holder", "finished_at", "claimed_at"))
    losses = max(row.losses - 1, 0)
    schema.update_job(connection, job_id, **back, losses=losses, revision=row.revision + 1)
    return Settlement(Status.PENDING, False, None, "stopped, and taken over first: kept")


def _refund(tx: Gated, row: Row[Any], error: str) -> None:
    """Back to the queue in its old place, as if the attempt had not been made."""
    kept = {
        "attempts": max(row.attempts - 1, 0),
        "claimed_at": None,
        "finished_at": row.finished_at,
    }
    _settle_row(tx, row, status=Status.PENDING, error=error, **kept)


def settle_done(tx: Gated, row: Row[Any], flow_run_id: str | None = None) -> None:
    """The attempt produced a result (N1, N4)."""
    more: dict[str, Any] = {} if flow_run_id is None else {"flow_run_id": flow_run_id}
    done = {"status": Status.DONE, "error": None, "unavailable_since": None, "requested_at": None}
    _settle_row(tx, row, answered=True, **done, losses=0, **more)
