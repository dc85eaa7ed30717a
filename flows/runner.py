"""Running one claimed job under a self-fencing lease (L2), and telling the store what happened.

The whole attempt (prompt, call, parsing) runs in one cancel scope that ends at the lease's
deadline; ending it cancels the call and closes its socket. No Prefect here.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Self

from flows.gateway import Completion, GatewayClient, GatewayError
from flows.ledger import Ledger, LedgerEntry, NullLedger, Outcome, Report
from flows.registry import Registry
from queue_store import (
    ClaimLost,
    Failure,
    InvalidArgument,
    Job,
    Redactor,
    Renewal,
    Settings,
    Settlement,
    Status,
    StoreError,
    Usage,
    WorkerStore,
)

logger = logging.getLogger(__name__)

# A result must reach the store even through a short database outage: the
# call behind it cost minutes of a shared gateway. Waits between tries, seconds.
RECORD_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0)
STOP_RUN_ID_WAIT_SECONDS = 5.0  # a stopped attempt's wait for its history entry's id
# The job row waits this long for its attempt's history entry: past the attempt's end, so an
# entry a slow Prefect writes late is still linked.
RUN_ID_NOTE_SECONDS = 120.0
MIN_CALL_SECONDS = 1.0  # less than this left before the deadline: no call starts


@dataclasses.dataclass(frozen=True)
class LeaseConfig:
    """What the runner reads of the settings, under the settings' names."""

    heartbeat_seconds: float
    lease_seconds: float
    lease_margin: float
    claim_timeout_seconds: float
    backoff_max_seconds: float

    @classmethod
    def of(cls, settings: Settings) -> Self:
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


class LeaseEnded(Exception):
    """The attempt must stop: the claim is gone, or can no longer be vouched for."""


class LeaseKeeper:
    """Renews a claim in the background and ends the attempt's scope before it could lapse.

    The deadline, on this process's monotonic clock, is the time the last confirmed renewal was
    *sent* plus the lease minus the margin: the store counts its lease from no earlier, so this
    side stops first however long the renewal took. A refused renewal ends the scope at once;
    failing ones let the deadline come."""

    def __init__(
        self, store: WorkerStore, job: Job, settings: LeaseConfig, claim_sent: float
    ) -> None:
        if not job.holder:
            raise ValueError("job: a claimed job carries its holder token")
        self._store = store
        self._job = job
        self._holder = job.holder
        self._settings = settings
        self._budget = settings.lease_seconds - settings.lease_margin
        self.hard_deadline = claim_sent + settings.claim_timeout_seconds - settings.lease_margin
        self.deadline = min(claim_sent + self._budget, self.hard_deadline)
        self.renewal: Renewal | None = None  # set when a renewal was refused
        self.store_error: str | None = None  # the last renewal that failed to reach the store
        self.unconfirmed: str | None = None  # the store error of the renewal before the call
        self._scope: asyncio.Timeout | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Self:
        self._task = asyncio.create_task(self._beat(), name=f"heartbeat-{self._job.id[:8]}")
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def scope(self) -> asyncio.Timeout:
        self._scope = asyncio.timeout_at(self.deadline)
        return self._scope

    def ended(self) -> bool:
        return self._scope is not None and self._scope.expired()

    async def confirm(self) -> None:
        """Renew now, marking the call as started (H1); raise `LeaseEnded` unless the claim
        is live with time for a call."""
        loop = asyncio.get_running_loop()
        sent = loop.time()
        # A short lease (tests) leaves a short budget: ask for half of it at most. A renewal
        # always leaves the whole budget, so only the attempt's own limit can be too close.
        left = self.hard_deadline - sent
        if left < min(MIN_CALL_SECONDS, self._budget / 2):
            raise LeaseEnded(
                f"only {left:.1f} s left of the attempt (AI_JOB_CLAIM_TIMEOUT); no call started"
            )
        try:
            renewal = await asyncio.to_thread(
                self._store.heartbeat, self._job.id, self._holder, calling=True
            )
        except StoreError as exc:
            self.store_error = self.unconfirmed = str(exc)
            raise LeaseEnded(f"the claim could not be renewed: {exc}") from exc
        if not renewal:
            self.renewal = renewal
            raise LeaseEnded(f"the claim was {renewal} before the call could start")
        self._renewed(sent)

    def _renewed(self, sent: float) -> None:
        self.deadline = min(sent + self._budget, self.hard_deadline)
        self._end_at(self.deadline)

    def _end_at(self, when: float) -> None:
        if self._scope is not None and not self._scope.expired():
            self._scope.reschedule(when)

    async def _beat(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(self._settings.heartbeat_seconds)
            sent = loop.time()
            try:
                renewal = await asyncio.to_thread(self._store.heartbeat, self._job.id, self._holder)
            except StoreError as exc:
                # The database may be restarting: keep trying. If it stays away, the deadline
                # comes and the attempt stops before the claim could lapse in anyone else's view.
                self.store_error = str(exc)
                logger.warning("renewing the claim on %s failed: %s", self._job.run_name, exc)
                continue
            if renewal:
                self.store_error = None
                self._renewed(sent)
                continue
            self.renewal = renewal
            logger.warning("the claim on %s was %s; stopping at once", self._job.run_name, renewal)
            self._end_at(loop.time())
            return

    def why_ended(self, phase: str, started: float) -> tuple[Failure | None, str]:
        """The verdict on an attempt whose scope ended in `phase`; None: nothing to record."""
        held = time.monotonic() - started
        if self.renewal is Renewal.LOST:
            return None, "the claim was taken over by another worker"
        if self.unconfirmed is not None:
            # The store could not be reached right before the call: no call
            # started, and this side stopped, so the attempt is not spent.
            return Failure.STOPPED, (
                "no call started: the claim could not be renewed right before it "
                f"({self.unconfirmed})"
            )
        if phase in ("build", "parse"):
            what = "prompt building" if phase == "build" else "turning the answer into a result"
            return Failure.BUILD if phase == "build" else Failure.PARSE, (
                f"{what} ran past the attempt's deadline ({held:.1f} s after the claim; "
                "AI_JOB_LEASE_SECONDS minus AI_JOB_LEASE_MARGIN_SECONDS without a renewal, "
                "or AI_JOB_CLAIM_TIMEOUT)"
            )
        if self.renewal is Renewal.LAPSED:
            return Failure.STOPPED, "stopped the call: the claim lapsed before it could be renewed"
        if asyncio.get_running_loop().time() >= self.hard_deadline - 0.001:
            return Failure.TIMEOUT, (
                f"no complete answer within the attempt's limit ({held:.0f} s, "
                "AI_JOB_CLAIM_TIMEOUT)"
            )
        cause = f" ({self.store_error})" if self.store_error else ""
        return Failure.STOPPED, (
            "stopped the call before its claim could lapse: the claim could not be renewed "
            f"for {self._budget:g} s{cause}"
        )


class JobRunner:
    """Runs claimed jobs for one worker: generator, gateway, store, and the run history."""

    def __init__(
        self,
        store: WorkerStore,
        lease: LeaseConfig,
        registry: Registry,
        client: GatewayClient,
        *,
        redactor: Redactor,
        ledger: Ledger | None = None,
    ) -> None:
        self._store = store
        self._settings = lease
        self._registry = registry
        self._client = client
        self.ledger = ledger or NullLedger()
        self._notes: set[asyncio.Task[None]] = set()
        self._redact = redactor

    async def run(self, job: Job, claim_sent: float) -> Report:
        """Make the job's call under its lease (whose first deadline counts from `claim_sent`, the
        loop's time just before the claim was asked for) and record what happened. Cancelling
        this stops the call, hands the job back with its attempt and re-raises; an outcome in
        hand is recorded to its end regardless."""
        attempt = _Attempt(job, self.ledger.open(job))
        noted = asyncio.create_task(self._note_run(attempt))
        keeper = LeaseKeeper(self._store, job, self._settings, claim_sent)
        recording: Coroutine[Any, Any, Report]
        try:
            result = await self._attempt(attempt, keeper)
        except asyncio.CancelledError:
            stopped = "stopped: the consumer is shutting down; the job was handed back"
            await self._close(attempt, noted, self._settle(attempt, Failure.STOPPED, stopped))
            raise
        except LeaseEnded as ended:
            recording = self._lease_ended(attempt, keeper, ended)
        except GatewayError as exc:
            retry_after = exc.retry_after
            if retry_after is not None:
                # The store pauses at most this long (G1) and refuses absurd waits.
                retry_after = min(retry_after, self._settings.backoff_max_seconds)
            recording = self._settle(attempt, exc.failure, str(exc), retry_after, exc.excerpt)
        except Exception as exc:  # noqa: BLE001 - a bad generator fails its job only
            building = attempt.phase == "build"
            failure = Failure.BUILD if building else Failure.PARSE
            where = "building the prompt" if building else "parsing the answer"
            message = f"generator {job.kind!r} failed {where}: {type(exc).__name__}: {exc}"
            recording = self._settle(attempt, failure, message, quoted=str(exc))
        else:
            recording = self._finish(attempt, result)
        return await self._close(attempt, noted, recording)

    async def _attempt(self, attempt: _Attempt, keeper: LeaseKeeper) -> Any:
        job, entry = attempt.job, attempt.entry
        async with keeper:
            try:
                async with keeper.scope():
                    generator = self._registry.generator_for(job.kind)
                    messages = await asyncio.to_thread(generator.build, job.user_id, job.subject)
                    await keeper.confirm()
                    attempt.phase = "call"
                    attempt.call_started, attempt.call_clock = time.time(), time.monotonic()
                    entry.call_started(attempt.call_started)
                    timeout = keeper.hard_deadline - asyncio.get_running_loop().time()
                    answer = await self._client.complete(
                        messages, job=job.run_name, timeout=timeout, **generator.options
                    )
                    attempt.phase, attempt.answer = "parse", answer
                    entry.note(
                        f"the gateway answered in {answer.elapsed_seconds:.1f} s "
                        f"({answer.size_bytes:,} bytes; {_tokens(answer.usage)})"
                    )
                    return await asyncio.to_thread(generator.parse, answer)
            except TimeoutError:
                if not keeper.ended():
                    raise
                raise LeaseEnded("the attempt's deadline passed") from None

    async def _lease_ended(
        self, attempt: _Attempt, keeper: LeaseKeeper, ended: LeaseEnded
    ) -> Report:
        failure, message = keeper.why_ended(attempt.phase, attempt.started)
        if failure is None:
            report = self._report(attempt, Outcome.LOST, message)
        else:
            report = await self._settle(attempt, failure, message)
        logger.warning("%s: %s (%s)", attempt.job.run_name, report.public_message, ended)
        return report

    async def _close(
        self, attempt: _Attempt, noted: asyncio.Task[None], recording: Coroutine[Any, Any, Report]
    ) -> Report:
        """Record the outcome to its end, even through a stop; then close the history entry."""

        async def record() -> Report:
            report = await recording
            attempt.entry.close(report)
            return report

        try:
            report: Report = await _shielded(record())
        except asyncio.CancelledError:
            noted.cancel()
            raise
        # The history entry may still be on its way: `_note_run` links it when it comes.
        self._notes.add(noted)
        noted.add_done_callback(self._notes.discard)
        return report

    async def _note_run(self, attempt: _Attempt) -> None:
        """Once the attempt's history entry exists, the job row points at it (N4)."""
        run_id = await attempt.entry.run_id(RUN_ID_NOTE_SECONDS)
        if run_id is None:
            return
        job = attempt.job
        with contextlib.suppress(StoreError):
            await asyncio.to_thread(
                self._store.heartbeat, job.id, job.holder or "", flow_run_id=run_id
            )

    async def _finish(self, attempt: _Attempt, result: Any) -> Report:
        job, answer = attempt.job, attempt.answer
        run_id = await attempt.entry.run_id()
        try:
            status = await self._record(
                job,
                self._store.finish,
                result=result,
                duration_seconds=answer.elapsed_seconds if answer else None,
                flow_run_id=run_id,
                usage=answer.usage if answer else None,
            )
        except ClaimLost:
            taken = "the claim was taken over before the result was recorded"
            return self._report(attempt, Outcome.LOST, taken)
        except Exception as exc:  # noqa: BLE001 - an unstorable result fails its job only
            if isinstance(exc, StoreError) and not isinstance(exc, InvalidArgument):
                unrecorded = f"the result could not be recorded: {exc}"
                return self._report(attempt, Outcome.UNRECORDED, unrecorded)
            # Too large, or not JSON (InvalidArgument): this result never fits.
            stored = f"the result could not be stored: {exc}"
            return await self._settle(attempt, Failure.PARSE, stored)
        assert status is Status.DONE
        return self._report(attempt, Outcome.DONE, "done", flow_run_id=run_id)

    async def _settle(
        self,
        attempt: _Attempt,
        failure: Failure,
        message: str,
        retry_after: float | None = None,
        quoted: str = "",
    ) -> Report:
        """Tell the store; `quoted`: what of `message` is the gateway's or the generator's own
        words (the store keeps them; the history and the logs do not, D4)."""
        job, answer = attempt.job, attempt.answer
        message = self._redact(" ".join(message.split()))
        quoted = self._redact(" ".join(quoted.split()))
        # A stop can afford to wait a little longer for the history entry: the
        # job row then points at the run that says it was stopped.
        wait = STOP_RUN_ID_WAIT_SECONDS if failure is Failure.STOPPED else None
        run_id = await attempt.entry.run_id(wait)
        settled: dict[str, Any] = {}
        try:
            settlement: Settlement = await self._record(
                job,
                self._store.fail,
                failure,
                message,
                retry_after=retry_after,
                flow_run_id=run_id,
                duration_seconds=attempt.call_seconds,
                answer=(answer.usage or True) if answer is not None else False,
            )
        except ClaimLost:
            outcome = Outcome.LOST
            message += " (the claim had been taken over; nothing recorded)"
        except StoreError as exc:
            outcome, message = Outcome.UNRECORDED, f"{message} (not recorded: {exc})"
        else:
            settled = {"settlement": settlement, "flow_run_id": run_id}
            if not settlement.attempt_spent:
                outcome = Outcome.RELEASED
            elif settlement.status is Status.FAILED:
                outcome = Outcome.FAILED
            else:
                outcome = Outcome.REQUEUED
            if settlement.pause_seconds:
                logger.warning("%s: %s", job.run_name, settlement.verdict)
        return self._report(attempt, outcome, message, failure=failure, quoted=quoted, **settled)

    async def _record(self, job: Job, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`write(job.id, job.holder, ...)`, riding out a short store outage; `ClaimLost` and
        `InvalidArgument` are final."""
        for attempt, pause in enumerate((*RECORD_BACKOFF_SECONDS, None), start=1):
            try:
                return await _shielded(
                    asyncio.to_thread(write, job.id, job.holder or "", *args, **kwargs)
                )
            except (ClaimLost, InvalidArgument):
                raise  # the same write would be refused again
            except StoreError as exc:
                if pause is None:
                    raise
                logger.warning(
                    "recording %s failed (try %d: %s); retrying", job.run_name, attempt, exc
                )
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    def _report(self, attempt: _Attempt, outcome: Outcome, message: str, **more: Any) -> Report:
        answer = attempt.answer
        return Report(
            job=attempt.job,
            outcome=outcome,
            message=self._redact(message),
            called=attempt.call_started is not None,
            call_started_at=attempt.call_started,
            call_seconds=attempt.call_seconds,
            seconds=round(time.monotonic() - attempt.started, 3),
            answered=answer is not None,
            usage=answer.usage if answer is not None else None,
            **more,
        )


@dataclasses.dataclass
class _Attempt:
    job: Job
    entry: LedgerEntry
    started: float = dataclasses.field(default_factory=time.monotonic)
    phase: str = "build"  # build, call, parse
    call_started: float | None = None  # wall-clock time the call began
    call_clock: float | None = None  # the same moment on the monotonic clock
    answer: Completion | None = None

    @property
    def call_seconds(self) -> float | None:
        return None if self.call_clock is None else round(time.monotonic() - self.call_clock, 3)


def _tokens(usage: Usage | None) -> str:
    if usage is None:
        return "tokens unknown: the answer did not say"
    return f"{usage.prompt_tokens:,} prompt + {usage.completion_tokens:,} completion tokens"


async def _shielded(awaitable: Awaitable[Any]) -> Any:
    """Await what must complete even if this task is cancelled (then re-raised once it has)."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise
