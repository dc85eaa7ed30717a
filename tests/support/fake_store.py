"""A scripted stand-in for the worker's side of the store (`queue_store.WorkerStore`).

`FakeWorkerStore` remembers every call it gets, in order, and answers from a script the test
writes: renewals are RENEWED until the test says otherwise from the n-th on (LAPSED, LOST, or
a raised store error; by count, never by time); `finish` and `fail` take their answers from
queues the test fills, and otherwise answer as the store does by default. Its jobs come from
`claimed`, built as `claim_next` hands them out, each claim with a token of its own. A call
with a token the fake did not hand out, or once its claim was settled, finds the claim gone,
as on the real store (FIX2). Calls arrive from worker threads (`asyncio.to_thread`): every
method takes one lock.

Nothing here is the store's rules: `JobStore` itself is tested on SQLite and PostgreSQL in
tests/integration (test_store_rules.py, test_cut_calls.py).
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import threading
import time
from collections import deque
from typing import Any, TypeVar

from queue_store import (
    PREFETCH,
    Blocked,
    Claim,
    ClaimLost,
    Failure,
    Job,
    Renewal,
    Settings,
    Settlement,
    Status,
    StoreError,
    Usage,
    job_id,
    validation,
)

# docs/rules.md, "Attempts that end without a result": the failures that spend the attempt,
# and those that pause claiming.
SPENDS = frozenset({Failure.BUILD, Failure.REJECTED, Failure.PARSE, Failure.TIMEOUT})
PAUSES = frozenset({Failure.TIMEOUT, Failure.UNAVAILABLE, Failure.RATE_LIMITED, Failure.REFUSED})

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Call:
    """One call the fake got: its verb and arguments, when it came, and what it answered."""

    method: str  # heartbeat, finish, fail, claim_next, has_work, presence
    job_id: str | None = None
    holder: str | None = None
    at: float = 0.0  # time.monotonic() when the call came in
    reply: Any = None  # what the fake returned, or the error it raised
    calling: bool = False  # heartbeat: the gateway call starts right after it (H1)
    flow_run_id: str | None = None
    result: Any = None  # finish
    duration: float | None = None  # finish, fail: `duration_seconds`
    usage: Usage | None = None  # finish
    failure: Failure | None = None  # fail
    message: str | None = None  # fail: `error`
    retry_after: float | None = None  # fail
    answer: Usage | bool = False  # fail: an answer came (and the tokens it said it used)

    @property
    def renewal(self) -> bool:
        """A heartbeat that renews the claim (not one that only notes the attempt's run)."""
        return self.method == "heartbeat" and self.flow_run_id is None


@dataclasses.dataclass
class _Claim:
    holder: str
    attempts: int
    live: bool = True


class FakeWorkerStore:
    """The worker role of the store, answering from a script; see the module's docstring."""

    def __init__(
        self,
        *,
        max_attempts: int = 3,
        backoff_seconds: float = 15.0,
        backoff_max_seconds: float = 600.0,
        max_result_bytes: int = 1 << 20,
    ) -> None:
        self.max_attempts = max_attempts
        self.backoff_seconds = backoff_seconds
        self.backoff_max_seconds = backoff_max_seconds
        self.max_result_bytes = max_result_bytes
        self.renewed_at: list[float] = []  # time.monotonic() of each renewal confirmed
        self._calls: list[Call] = []
        self._claims: dict[str, _Claim] = {}
        self._tokens = 0
        self._renewals = 0
        self._renewal_script: tuple[int, Renewal | StoreError] | None = None
        self._finish_script: deque[Status | StoreError] = deque()
        self._fail_script: deque[Settlement | StoreError] = deque()
        self._lock = threading.Lock()

    @classmethod
    def of(cls, settings: Settings) -> FakeWorkerStore:
        """A fake with the numbers of these settings."""
        return cls(
            max_attempts=settings.max_attempts,
            backoff_seconds=settings.backoff_seconds,
            backoff_max_seconds=settings.backoff_max_seconds,
            max_result_bytes=settings.max_result_bytes,
        )

    # -- the script --------------------------------------------------------------------------

    def claimed(
        self,
        kind: str = "ok",
        subject: str = "d1",
        *,
        user_id: str = "u",
        attempts: int = 1,
        worker: str = "worker@host:1:fake",
    ) -> Job:
        """A running job as `claim_next` hands it out: its `attempts`-th attempt, under a new
        claim token (an earlier claim on the same job is gone)."""
        if attempts < 1:
            raise ValueError("attempts: a claim counts its own attempt, so at least 1")
        now = dt.datetime.now(dt.UTC)
        with self._lock:
            self._tokens += 1
            holder = f"{worker}/{self._tokens:012x}"
            job = Job(
                id=job_id(user_id, kind, subject),
                user_id=user_id,
                kind=kind,
                subject=subject,
                fingerprint=None,
                priority=PREFETCH,
                status=Status.RUNNING,
                attempts=attempts,
                error=None,
                holder=holder,
                worker=worker,
                claimed_at=now,
                heartbeat_at=now,
                queued_at=now,
                created_at=now,
                updated_at=now,
                finished_at=None,
                requested_at=None,
                unavailable_since=None,
                flow_run_id=None,
            )
            self._claims[job.id] = _Claim(holder, attempts)
        return job

    def script_renewals(self, answer: Renewal | StoreError, *, from_nth: int) -> None:
        """From the `from_nth` renewal on (the first is 1; every renewal counts, whichever
        job and however it ends), answer `answer`, or raise it."""
        if from_nth < 1:
            raise ValueError("from_nth: renewals are counted from 1")
        with self._lock:
            self._renewal_script = (from_nth, answer)

    def script_finish(self, *answers: Status | StoreError) -> None:
        """The next `finish` calls return, or raise, these in turn; then Status.DONE."""
        with self._lock:
            self._finish_script.extend(answers)

    def script_fail(self, *answers: Settlement | StoreError) -> None:
        """The next `fail` calls return, or raise, these in turn; then `default_settlement`."""
        with self._lock:
            self._fail_script.extend(answers)

    def default_settlement(
        self, attempts: int, failure: Failure, retry_after: float | None = None
    ) -> Settlement:
        """The store's documented rule for `failure` (docs/rules.md, table "Attempts that end
        without a result"), at its simplest: BUILD, REJECTED, PARSE and TIMEOUT spend the
        attempt (the job fails on the last allowed one); TIMEOUT, UNAVAILABLE, RATE_LIMITED
        and REFUSED pause claiming for the backoff, a rate limit for the time asked, capped
        (G1); STOPPED keeps the attempt and pauses nothing.

        No memory of earlier attempts: no doubling backoff (N2), no poisoned job (G2), no hold
        (H1). The real rules are tested against SQLite and PostgreSQL in
        tests/integration/test_store_rules.py; a test that needs one scripts its Settlement."""
        spent = failure in SPENDS
        status = Status.FAILED if spent and attempts >= self.max_attempts else Status.PENDING
        verdict = f"attempt {attempts} spent" if spent else "attempt kept"
        pause: float | None = None
        if failure in PAUSES:
            if failure is Failure.RATE_LIMITED and retry_after is not None:
                pause = min(retry_after, self.backoff_max_seconds)
            else:
                pause = self.backoff_seconds
            verdict += f"; claiming paused {pause:g} s"
        return Settlement(status, spent, pause, verdict)

    # -- what it was told ----------------------------------------------------------------------

    @property
    def calls(self) -> list[Call]:
        """Every call so far, in order."""
        with self._lock:
            return list(self._calls)

    def calls_to(self, *methods: str) -> list[Call]:
        """The calls to these verbs, in order."""
        return [call for call in self.calls if call.method in methods]

    def renewals(self) -> list[Call]:
        """The renewals, in order, whatever they were answered."""
        return [call for call in self.calls if call.renewal]

    def settlements(self) -> list[Call]:
        """The calls that settle an attempt (`finish` and `fail`), in order."""
        return self.calls_to("finish", "fail")

    # -- the worker role -------------------------------------------------------------------------

    def heartbeat(
        self, jid: str, holder: str, *, calling: bool = False, flow_run_id: str | None = None
    ) -> Renewal:
        at = time.monotonic()
        with self._lock:
            reply: Renewal | StoreError
            if flow_run_id is not None:  # the attempt's run is noted (N4), the lease not renewed
                reply = Renewal.RENEWED if self._held(jid, holder) else Renewal.LOST
            else:
                self._renewals += 1
                script = self._renewal_script
                if not self._held(jid, holder):
                    reply = Renewal.LOST
                elif script is not None and self._renewals >= script[0]:
                    reply = script[1]
                else:
                    reply = Renewal.RENEWED
                    self.renewed_at.append(at)
            self._record(
                "heartbeat", jid, holder, at, reply, calling=calling, flow_run_id=flow_run_id
            )
        return _answer(reply)

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
        at = time.monotonic()
        with self._lock:
            reply: Status | StoreError
            try:
                validation.result(result, self.max_result_bytes)  # the store's own refusal
            except StoreError as exc:
                reply = exc
            else:
                if not self._held(jid, holder):
                    reply = ClaimLost(jid, holder)
                else:
                    reply = self._finish_script.popleft() if self._finish_script else Status.DONE
                    self._settled(jid, reply)
            self._record(
                "finish",
                jid,
                holder,
                at,
                reply,
                result=result,
                duration=duration_seconds,
                flow_run_id=flow_run_id,
                usage=usage,
            )
        return _answer(reply)

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
        at = time.monotonic()
        with self._lock:
            reply: Settlement | StoreError
            if not self._held(jid, holder):
                reply = ClaimLost(jid, holder)
            else:
                attempts = self._claims[jid].attempts
                if self._fail_script:
                    reply = self._fail_script.popleft()
                else:
                    reply = self.default_settlement(attempts, failure, retry_after)
                self._settled(jid, reply)
            self._record(
                "fail",
                jid,
                holder,
                at,
                reply,
                failure=failure,
                message=error,
                retry_after=retry_after,
                flow_run_id=flow_run_id,
                duration=duration_seconds,
                answer=answer,
            )
        return _answer(reply)

    def claim_next(self, worker: str) -> Claim:
        """Nothing is queued in the fake: jobs come from `claimed`."""
        with self._lock:
            claim = Claim(None, Blocked.EMPTY)
            self._record("claim_next", None, None, time.monotonic(), claim)
        return claim

    def has_work(self, *, or_running: bool = False) -> bool:
        with self._lock:
            self._record("has_work", None, None, time.monotonic(), False)
        return False

    def presence(
        self, name: str, role: str, info: dict[str, Any] | None = None, *, leaving: bool = False
    ) -> None:
        with self._lock:
            self._record("presence", None, None, time.monotonic(), None)

    # -- inside ------------------------------------------------------------------------------

    def _held(self, jid: str, holder: str) -> bool:
        claim = self._claims.get(jid)
        return claim is not None and claim.live and claim.holder == holder

    def _settled(self, jid: str, reply: object) -> None:
        """A held claim's settlement ends it, and so does a scripted takeover; a store error
        (an outage, a refused argument) changes nothing."""
        if isinstance(reply, (Status, Settlement, ClaimLost)):
            self._claims[jid].live = False

    def _record(
        self,
        method: str,
        jid: str | None,
        holder: str | None,
        at: float,
        reply: object,
        **more: Any,
    ) -> None:
        self._calls.append(Call(method, jid, holder, at, reply, **more))


def _answer(reply: T | StoreError) -> T:
    """Return the answer, or raise it (afresh: a scripted error may be raised many times)."""
    if isinstance(reply, StoreError):
        raise reply.with_traceback(None)
    return reply
