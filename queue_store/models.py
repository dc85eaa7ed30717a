"""The store's arguments and return values as plain typed data; nothing here talks to a database.
Every `as_dict()` speaks one JSON vocabulary: snake_case keys, ISO 8601 UTC times, seconds."""

from __future__ import annotations

import dataclasses
import datetime as dt
import enum
import hashlib
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

INTERACTIVE = 0  # a screen the user has open right now; lower runs first
PREFETCH = 10  # backfill after a sync

MAX_ID_LENGTH = 200  # characters, for user_id
MAX_KIND_LENGTH = 100
MAX_SUBJECT_LENGTH = 500
MAX_FINGERPRINT_LENGTH = 200
MAX_WORKER_LENGTH = 150
HOLDER_NONCE_HEX = 12  # hex characters after "<worker>/" in a claim's token
MAX_HOLDER_LENGTH = MAX_WORKER_LENGTH + 1 + HOLDER_NONCE_HEX
MAX_ERROR_LENGTH = 2000  # longer messages are cut, not refused: they come from failures
MAX_PRIORITY = 1_000_000
MAX_RUN_ID_LENGTH = 64


class Status(enum.StrEnum):
    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    UNKNOWN = "unknown"  # only ever reported, never stored: the store was down


class Blocked(enum.StrEnum):  # why `claim_next` handed out nothing
    EMPTY = "empty"  # nothing is runnable
    CONCURRENCY = "concurrency"  # AI_JOB_CONCURRENCY calls are already in flight
    GAP = "gap"  # the global quiet period after the last call has not passed
    PAUSED = "paused"  # claiming is paused (operator, outage, rate limit, refused credentials)


class PauseKind(enum.StrEnum):
    OPERATOR = "operator"
    OUTAGE = "outage"  # the gateway was unreachable (G2: not a poisoned job)
    TIMEOUT = "timeout"  # a call got no complete answer in time; the gateway may still be busy
    RATE_LIMIT = "rate_limit"  # the gateway asked everyone to slow down (G1)
    REFUSED = "refused"  # the gateway refused our credentials or redirected us (G4)


class Failure(enum.StrEnum):  # how an attempt ended without a result
    BUILD = "build"  # the prompt could not be built; no call was made (spends the attempt)
    REJECTED = "rejected"  # the gateway answered with something unusable (spends)
    PARSE = "parse"  # the answer could not be turned into a result (spends)
    TIMEOUT = "timeout"  # no complete answer in time (spends, and pauses)
    UNAVAILABLE = "unavailable"  # connect error, 502/503/504, cut mid-answer (G2)
    RATE_LIMITED = "rate_limited"  # 429, or 503 with Retry-After (G1: refund, pause)
    REFUSED = "refused"  # 401/403 or a redirect (G4: refund, stop the line)
    STOPPED = "stopped"  # this side stopped the call: shutdown, lease (refund, no pause)


class CutCause(enum.StrEnum):
    """Why a call ended on our side while the gateway may still be working on it (H1)."""

    WORKER_LOST = "worker_lost"  # its claim lapsed: the worker died, stalled or was cut off
    STOPPED = "stopped"  # its worker stopped it: a graceful stop, or its lease at risk (L2, L4)
    TIMEOUT = "timeout"  # no complete answer within our deadline (G3)
    CANCELLED = "cancelled"  # the job was withdrawn while its call ran (its user forgotten)

    @property
    def described(self) -> str:
        return {
            CutCause.WORKER_LOST: "its worker was lost mid-call",
            CutCause.STOPPED: "its worker stopped it",
            CutCause.TIMEOUT: "our deadline passed",
            CutCause.CANCELLED: "its job was withdrawn",
        }[self]


class Renewal(enum.StrEnum):  # what a heartbeat found
    RENEWED = "renewed"
    LAPSED = "lapsed"  # not renewed in time: the claim is dead and cannot be revived
    LOST = "lost"  # another worker took the job over, or it was settled

    def __bool__(self) -> bool:  # `if store.heartbeat(...)` reads as "still ours"
        return self is Renewal.RENEWED


def job_id(user_id: str, kind: str, subject: str) -> str:
    return hashlib.sha256(f"{user_id}|{kind}|{subject}".encode()).hexdigest()[:64]


def priority_class(priority: int) -> str:
    return "interactive" if priority <= INTERACTIVE else "prefetch"


def _tenths(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds, 1)


def iso(value: dt.datetime | None) -> str | None:
    return None if value is None else value.astimezone(dt.UTC).isoformat(timespec="seconds")


def _shown(value: Any) -> Any:
    """A value in the JSON vocabulary: times in ISO 8601 UTC, enums as text, records as dicts."""
    if isinstance(value, dt.datetime):
        return iso(value)
    if isinstance(value, enum.Enum):
        return str(value)
    if isinstance(value, Record):
        return value.as_dict()
    return value  # a result's output and a worker's info are JSON already, kept as they are


class Record:
    """A dataclass whose `as_dict` is its fields (those in `SHOWN`, if given), in order."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    SHOWN: ClassVar[Sequence[str]] = ()

    def as_dict(self) -> dict[str, Any]:
        names = self.SHOWN or [field.name for field in dataclasses.fields(self)]
        return {name: _shown(getattr(self, name)) for name in names}


@dataclasses.dataclass(frozen=True)
class EnqueueRequest:
    """One entry of `JobStore.enqueue_many`: what `enqueue` takes, plus `supersede` (R7)."""

    user_id: str
    kind: str
    subject: str
    fingerprint: str | None = None
    priority: int = PREFETCH
    supersede: bool = False


@dataclasses.dataclass(frozen=True)
class Job(Record):
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
    worker: str | None
    claimed_at: dt.datetime | None
    heartbeat_at: dt.datetime | None
    queued_at: dt.datetime
    created_at: dt.datetime
    updated_at: dt.datetime
    finished_at: dt.datetime | None
    requested_at: dt.datetime | None  # when a screen last asked for it while it waited
    unavailable_since: dt.datetime | None  # first "unavailable" of its current streak (G2)
    flow_run_id: str | None
    turn: int = 0  # its turn in the fair order (R8b); 0 for interactive jobs and under fifo
    call_started_at: dt.datetime | None = None  # when the claim's call started (H1)
    losses: int = 0  # claims lost with their worker since it last entered the queue (H2)
    last_holder: str | None = None  # the token of the last claim that ended
    pseudonym: str | None = None  # the run history's name for the user (D4), if read with it

    SHOWN = (
        "id",
        "user_id",
        "pseudonym",
        "kind",
        "subject",
        "status",
        "priority",
        "priority_class",
        "attempts",
        "error",
        "fingerprint",
        "worker",
        "queued_at",
        "claimed_at",
        "finished_at",
        "updated_at",
        "requested_at",
        "flow_run_id",
    )

    def __post_init__(self) -> None:
        # Rows hand over the status as text, and the original's rows may lack `queued_at`.
        object.__setattr__(self, "status", Status(self.status))
        if self.queued_at is None:
            object.__setattr__(self, "queued_at", self.created_at)

    @property
    def interactive(self) -> bool:
        return self.priority <= INTERACTIVE

    @property
    def priority_class(self) -> str:
        return priority_class(self.priority)

    @property
    def run_name(self) -> str:
        return f"{self.kind}:{self.subject}"

    def as_dict(self, max_attempts: int | None = None) -> dict[str, Any]:
        shown = super().as_dict()
        if max_attempts is not None:
            shown["max_attempts"] = max_attempts
        return shown


@dataclasses.dataclass(frozen=True)
class Usage(Record):
    """The tokens one answer says it used (M2); an answer that says nothing has none: unknown."""

    prompt_tokens: int
    completion_tokens: int


@dataclasses.dataclass(frozen=True)
class UsageRow(Record):
    user_id: str
    kind: str
    answers: int
    unknown: int  # answers that did not say
    prompt_tokens: int
    completion_tokens: int

    def described(self) -> str:
        if not self.answers:
            return "no answer yet"
        if self.unknown == self.answers:
            return "unknown"
        total = f"{self.prompt_tokens + self.completion_tokens:,}"
        detail = f" ({self.prompt_tokens:,} prompt + {self.completion_tokens:,} completion)"
        unknown = f"; {self.unknown} answer(s) did not say" if self.unknown else ""
        return total + detail + unknown


@dataclasses.dataclass(frozen=True)
class Tally:
    name: str
    kind: str
    outcome: str
    count: int
    total: float
    buckets: tuple[int, ...]  # cumulative counts per upper bound


@dataclasses.dataclass(frozen=True)
class Claim:
    job: Job | None
    blocked: Blocked | None = None
    retry_in: float | None = None  # seconds until a claim could succeed; None: unknown
    pause_kind: PauseKind | None = None  # while PAUSED: who or what paused claiming
    pause_reason: str | None = None

    def __bool__(self) -> bool:
        return self.job is not None


@dataclasses.dataclass(frozen=True)
class Settlement:
    """What the store did with an attempt that ended without a result."""

    status: Status  # the job's status afterwards
    attempt_spent: bool
    pause_seconds: float | None = None  # claiming paused for this long, if it was
    verdict: str = ""  # one line: why the store chose this, for logs and run history


@dataclasses.dataclass(frozen=True)
class Position(Record):
    status: Status
    ahead: int  # queued jobs that will be taken before this one (at most the bound)
    in_flight: int  # calls running now (this job included when it is running)
    eta_seconds: float  # expected seconds until this job's result is ready
    ahead_exact: bool = True  # False: more are ahead, and the ETA counts only `ahead` (P2)

    SHOWN = ("ahead", "ahead_exact", "in_flight", "eta_seconds")

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {"eta_seconds": round(self.eta_seconds, 1)}


@dataclasses.dataclass(frozen=True)
class Result(Record):  # the latest finished generation for a key (N1)
    job_id: str
    user_id: str
    kind: str
    subject: str
    fingerprint: str | None
    output: Any
    produced_at: dt.datetime
    duration_seconds: float | None
    flow_run_id: str | None
    size_bytes: int
    prompt_tokens: int | None = None  # None: the gateway did not say (unknown, never zero)
    completion_tokens: int | None = None

    SHOWN = ("fingerprint", "output", "produced_at", "duration_seconds", "flow_run_id", "usage")

    @property
    def usage(self) -> Usage | None:
        if self.prompt_tokens is None or self.completion_tokens is None:
            return None
        return Usage(self.prompt_tokens, self.completion_tokens)


@dataclasses.dataclass(frozen=True)
class JobState:
    """One job as a screen, the CLI and the API see it."""

    job: Job
    position: Position | None  # for a pending or running job
    result: Result | None
    fresh: bool  # the latest result answers the fingerprint asked about
    gate: GateState
    run_needed: bool  # queued, with no consumer standing by and no call in flight
    version: str  # changes with anything shown but the ETA's countdown
    unchanged: bool = False  # the caller's version still holds: `result` was not loaded

    @property
    def status(self) -> Status:
        return self.job.status

    @property
    def paused(self) -> str | None:
        gate = self.gate
        if not gate.paused:
            return None
        return f"{gate.pause_kind} for {gate.pause_seconds_left:.0f} s: {gate.pause_reason}"

    def as_dict(self, max_attempts: int) -> dict[str, Any]:
        place = self.position.as_dict() if self.position else dict.fromkeys(Position.SHOWN)
        return {
            **self.job.as_dict(max_attempts),
            **place,
            "result": self.result.as_dict() if self.result else None,
            "fresh": self.fresh,
            "paused": self.gate.as_dict() if self.gate.paused else None,
        }


@dataclasses.dataclass(frozen=True)
class GateState:
    """The deployment-wide guard of the gateway: last call's end, any pause, the outage streak."""

    now: dt.datetime  # the store's clock when this was read
    last_finished_at: dt.datetime | None
    paused_until: dt.datetime | None
    pause_kind: PauseKind | None
    pause_reason: str | None
    outages_in_a_row: int
    last_answer_at: dt.datetime | None
    # Workers alive within a lease, name: role. Not in `as_dict`: screens never see hosts.
    workers: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def standing_by(self) -> list[str]:
        """The consumers that take queued work without a new run."""
        return [name for name, role in self.workers.items() if role == "consumer"]

    @property
    def paused(self) -> bool:
        return self.paused_until is not None and self.paused_until > self.now

    @property
    def pause_seconds_left(self) -> float:
        if self.paused_until is None:
            return 0.0
        return max(0.0, (self.paused_until - self.now).total_seconds())

    def as_dict(self) -> dict[str, Any]:
        return {
            "paused": self.paused,
            "paused_until": iso(self.paused_until) if self.paused else None,
            "pause_seconds_left": round(self.pause_seconds_left, 1),
            "pause_kind": str(self.pause_kind) if self.paused and self.pause_kind else None,
            "pause_reason": self.pause_reason if self.paused else None,
            "outages_in_a_row": self.outages_in_a_row,
            "last_finished_at": iso(self.last_finished_at),
            "last_answer_at": iso(self.last_answer_at),
        }


@dataclasses.dataclass(frozen=True)
class Hold:
    """A call cut on our side that still holds one unit of AI_JOB_CONCURRENCY (H1)."""

    cause: CutCause
    started_at: dt.datetime  # when the cut call started
    until: dt.datetime  # when the gateway can be assumed done with it
    worker: str | None
    job: Job | None  # the job whose call it was (None once its user is forgotten)

    def seconds_left(self, now: dt.datetime) -> float:
        return max(0.0, (self.until - now).total_seconds())

    def as_dict(self) -> dict[str, Any]:
        return {
            "cause": str(self.cause),
            "why": self.cause.described,
            "started_at": iso(self.started_at),
            "until": iso(self.until),
            "worker": self.worker,
            "job": self.job.run_name if self.job else None,
            "user_id": self.job.user_id if self.job else None,
        }


@dataclasses.dataclass(frozen=True)
class Worker(Record):  # a consumer process that said it is alive (W1)
    name: str
    role: str
    host: str
    pid: int
    started_at: dt.datetime
    seen_at: dt.datetime
    alive: bool
    info: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        shown = super().as_dict()
        if not self.info:
            del shown["info"]
        return shown


@dataclasses.dataclass(frozen=True)
class QueueEntry:
    job: Job
    place: int | None  # 1 = next to be claimed; None for running and finished jobs
    eta_seconds: float | None
    running_seconds: float | None  # how long its call has been in flight

    def as_dict(self, max_attempts: int) -> dict[str, Any]:
        return {
            **self.job.as_dict(max_attempts),
            "place": self.place,
            "eta_seconds": _tenths(self.eta_seconds),
            "running_seconds": _tenths(self.running_seconds),
        }


@dataclasses.dataclass(frozen=True)
class ListedJob:  # one job of a user's queue (R11)
    job: Job
    position: Position | None

    def as_dict(self, max_attempts: int) -> dict[str, Any]:
        place = self.position.as_dict() if self.position else {}
        return {**self.job.as_dict(max_attempts), "interactive": self.job.interactive, **place}


@dataclasses.dataclass(frozen=True)
class Requeued(Record):  # what `retry_failed` did (R10)
    user_id: str
    retried: int
    pending: int  # the user's jobs waiting or running afterwards


@dataclasses.dataclass(frozen=True)
class Forgotten(Record):
    """What `forget` removed of one user (D3), and the run history's part still to do."""

    user_id: str
    jobs: int
    results: int
    usage_rows: int
    calls_cut: int  # calls of the user in flight that were cut (they hold the gateway, H1)
    pseudonym: str | None  # what the run history knew the user as; None: never seen there
    history_pending: tuple[str, ...] = ()  # forgotten users' pseudonyms the history still holds

    def as_dict(self) -> dict[str, Any]:
        return super().as_dict() | {"history_pending": len(self.history_pending)}


@dataclasses.dataclass(frozen=True)
class Pruned(Record):
    """What retention removed (D2), or with `dry_run` would remove."""

    jobs: int
    results: int
    usage_rows: int  # a user's daily usage rows folded into the day's totals of no one
    people: int  # people with nothing left, no longer known
    retention_days: float
    dry_run: bool = False


@dataclasses.dataclass(frozen=True)
class QueueView:
    """The whole queue at a glance, read in one transaction, with the figures /metrics shows."""

    now: dt.datetime
    gate: GateState
    running: list[QueueEntry]
    waiting: list[QueueEntry]
    waiting_by_class: dict[str, tuple[int, dt.datetime | None]]  # count, oldest queued_at
    recent_failures: list[QueueEntry]
    failed_total: int
    workers: list[Worker]
    max_attempts: int
    concurrency: int
    in_flight: int  # live calls (cut calls still held are `holds`)
    usage: list[UsageRow]  # tokens by user and kind, the most first (a few)
    usage_total: UsageRow  # every user's and kind's (user_id and kind "")
    usage_by_kind: list[UsageRow]  # user_id ""
    tallies: list[Tally]
    holds: list[Hold] = dataclasses.field(default_factory=list)  # cut calls still held (H1)
    # Forgotten users whose runs the run history still holds: (pseudonym, when forgotten).
    erasures_pending: list[tuple[str, dt.datetime]] = dataclasses.field(default_factory=list)

    @property
    def waiting_total(self) -> int:
        return sum(count for count, _ in self.waiting_by_class.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "now": iso(self.now),
            "concurrency": self.concurrency,
            "gate": self.gate.as_dict(),
            "holds": [h.as_dict() for h in self.holds],
            "running": [e.as_dict(self.max_attempts) for e in self.running],
            "waiting": [e.as_dict(self.max_attempts) for e in self.waiting],
            "waiting_total": self.waiting_total,
            "recent_failures": [e.as_dict(self.max_attempts) for e in self.recent_failures],
            "failed_total": self.failed_total,
            "workers": [w.as_dict() for w in self.workers],
            "usage": {
                "total": self.usage_total.as_dict(),
                "by_user_and_kind": [u.as_dict() for u in self.usage],
            },
            "erasures_pending": [
                {"pseudonym": p, "forgotten_at": iso(at)} for p, at in self.erasures_pending
            ],
        }
