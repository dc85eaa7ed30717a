"""The enqueue rules (R1-R6, FIX4, FIX7) as a pure decision over one row: no database, so every
rule can be read, and tested, as a table."""

from __future__ import annotations

import dataclasses
import datetime as dt
from typing import Any

from queue_store.models import INTERACTIVE, Status
from queue_store.settings import StoreConfig

WORKER_LOST = (
    "worker lost: its claim lapsed on the last allowed attempt "
    "(the worker crashed, stalled or was cut off from the database)"
)

# A claim that ends empties its token, worker and lease times; with no claim at all (every way
# back into the queue), `claimed_at` is empty too.
CLAIM_ENDED: dict[str, Any] = dict.fromkeys(("holder", "worker", "heartbeat_at", "call_started_at"))
UNCLAIMED: dict[str, Any] = {**CLAIM_ENDED, "claimed_at": None}


def queued_anew(now: dt.datetime, **more: Any) -> dict[str, Any]:
    """A finished job back in the queue as if new (R5, R10)."""
    return {
        "status": Status.PENDING,
        **UNCLAIMED,
        "attempts": 0,
        "losses": 0,
        "last_holder": None,
        "error": None,
        "unavailable_since": None,
        "queued_at": now,
        **more,
    }


@dataclasses.dataclass(frozen=True)
class Decision:
    status: Status  # what `enqueue` returns
    changes: dict[str, Any] | None = None  # columns to write; None writes nothing
    reap_first: bool = False  # a lapsed claim must be taken back under the gate lock first


def lapsed(row: Any, now: dt.datetime, settings: StoreConfig) -> bool:
    """A running row whose claim is dead (FIX3); a missing `heartbeat_at` or `claimed_at` is."""
    if row.heartbeat_at is None or row.claimed_at is None:
        return True
    renewed: dt.datetime = row.heartbeat_at
    claimed: dt.datetime = row.claimed_at
    return now - renewed > dt.timedelta(seconds=settings.lease_seconds) or now - claimed > (
        dt.timedelta(seconds=settings.claim_timeout_seconds)
    )


def decide(
    row: Any, fingerprint: str | None, priority: int, now: dt.datetime, settings: StoreConfig
) -> Decision:
    """What an enqueue of an existing job does (R3-R6): its status, and the changes to write."""
    stale = fingerprint is not None and fingerprint != row.fingerprint
    # Given up: its attempts spent, or its claims lost with their worker too often (H2).
    exhausted = row.attempts >= settings.max_attempts or row.losses >= settings.max_attempts
    promoted = min(priority, row.priority)
    asked_now = priority <= INTERACTIVE

    if row.status == Status.RUNNING:
        if not lapsed(row, now, settings):
            return Decision(Status.RUNNING)  # R3: promoting it would not speed it up
        # R6 for a dead claim (FIX4 on its last attempt): taking it back is a lease decision (L3).
        fails = exhausted or row.losses + 1 >= settings.max_attempts
        return Decision(Status.FAILED if fails and not stale else Status.PENDING, reap_first=True)

    if row.status == Status.DONE and not stale:
        return Decision(Status.DONE)  # R4

    requeue: dict[str, Any] = {
        "status": Status.PENDING,
        **UNCLAIMED,
        "priority": promoted,
        "fingerprint": fingerprint or row.fingerprint,
    }
    if row.status == Status.FAILED and exhausted and not stale:
        gave_up = row.finished_at or row.updated_at
        if now - gave_up < dt.timedelta(seconds=settings.retry_after_seconds):
            return Decision(Status.FAILED)  # R5: still cooling down
        requested = now if asked_now else None
        return Decision(Status.PENDING, queued_anew(now, **requeue, requested_at=requested))

    changes = {**requeue, "attempts": 0 if stale else row.attempts}  # R6: promote, never demote
    if stale:
        changes["losses"] = 0
    if row.status in (Status.DONE, Status.FAILED):
        changes["queued_at"] = now
        changes["requested_at"] = now if asked_now else None
        if stale:
            changes["error"] = None
    elif asked_now and row.requested_at is None:
        changes["requested_at"] = now  # a screen opened on a job that was waiting
    if row.status == Status.PENDING and all(
        getattr(row, name) == value for name, value in changes.items()
    ):
        return Decision(Status.PENDING)  # FIX7: an unchanged poll writes nothing
    return Decision(Status.PENDING, changes)
