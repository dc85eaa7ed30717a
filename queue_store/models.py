"""Plain typed data the store hands out: jobs, claims, positions, results.

Nothing here talks to a database; these are the store's return values.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
from typing import Any

# Lower runs first.
INTERACTIVE = 0  # a screen the user has open right now
PREFETCH = 10  # backfill after a sync

MAX_ID_LENGTH = 200  # characters, for user_id
MAX_KIND_LENGTH = 100
MAX_SUBJECT_LENGTH = 500
MAX_FINGERPRINT_LENGTH = 200
MAX_HOLDER_LENGTH = 150
MAX_ERROR_LENGTH = 2000  # longer messages are cut, not refused: they come from failures
MAX_PRIORITY = 1_000_000


class Status(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


class Blocked(enum.StrEnum):
    """Why `claim_next` handed out nothing."""

    EMPTY = "empty"  # nothing is runnable
    CONCURRENCY = "concurrency"  # AI_JOB_CONCURRENCY calls are already in flight
    GAP = "gap"  # the global quiet period after the last call has not passed
    PAUSED = "paused"  # the circuit breaker paused claiming after an outage


def job_id(user_id: str, kind: str, subject: str) -> str:
    """The job's id: first 64 hex characters of sha256("user|kind|subject")."""
    return hashlib.sha256(f"{user_id}|{kind}|{subject}".encode()).hexdigest()[:64]


def priority_class(priority: int) -> str:
    return "interactive" if priority <= INTERACTIVE else "prefetch"


@dataclasses.dataclass(frozen=True)
class Job:
    id: str
    user_id: str
    kind: str
    subject: str
    fingerprint: str | None
    priority: int
    status: Status
    attempts: int
    error: str | None
    holder: str | None
    claimed_at: dt.datetime | None
    heartbeat_at: dt.datetime | None
    queued_at: dt.datetime
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None
    flow_run_id: str | None

    @property
    def interactive(self) -> bool:
        return self.priority <= INTERACTIVE

    @property
    def run_name(self) -> str:
        """How the job is named in run history: `kind:subject`."""
        return f"{self.kind}:{self.subject}"


@dataclasses.dataclass(frozen=True)
class Claim:
    """What `claim_next` returns: a job, or why none and how long to wait."""

    job: Job | None
    blocked: Blocked | None = None
    retry_in: float | None = None  # seconds until a claim could succeed; None: unknown

    def __bool__(self) -> bool:
        return self.job is not None


@dataclasses.dataclass(frozen=True)
class Position:
    """Where a job stands in line, for a screen that is waiting on it."""

    status: Status
    ahead: int  # queued jobs that will be taken before this one
    in_flight: int  # calls running now (this job included when it is running)
    eta_seconds: float  # expected seconds until this job's result is ready

    def as_dict(self) -> dict[str, Any]:
        return {
            "status": str(self.status),
            "ahead": self.ahead,
            "inFlight": self.in_flight,
            "etaSeconds": round(self.eta_seconds, 1),
        }


@dataclasses.dataclass(frozen=True)
class Result:
    """The latest finished generation for a key (N1)."""

    user_id: str
    kind: str
    subject: str
    fingerprint: str | None
    output: Any
    produced_at: dt.datetime
    duration_seconds: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "output": self.output,
            "producedAt": self.produced_at.isoformat(timespec="seconds"),
            "durationSeconds": self.duration_seconds,
        }


@dataclasses.dataclass(frozen=True)
class GateState:
    """The deployment-wide guard of the gateway: last call's end, and any pause."""

    last_finished_at: dt.datetime | None
    paused_until: dt.datetime | None
    pause_reason: str | None
    outages_in_a_row: int
