"""Running one claimed job under a self-fencing lease (L2), and telling the store what happened.
The whole attempt (prompt, call, parsing) runs in one cancel scope that ends at the lease's
deadline, which cancels the call and closes its socket. No Prefect here."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
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
    WorkerStore,
)

logger = logging.getLogger(__name__)

# Waits (s) to record an outcome through a short store outage: its call cost minutes.
RECORD_BACKOFF_SECONDS = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 15.0, 15.0)
STOP_RUN_ID_WAIT_SECONDS = 5.0  # a stopped attempt's wait for its history entry's id
RUN_ID_NOTE_SECONDS = 120.0  # the job row's: past the attempt's end, for a slow Prefect
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
    """Renews a claim in the background and ends the attempt's scope before it could lapse."""

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
        self.renewal: Renewal | None = None  # set when a renewal was refused
        self.store_error: str | None = None  # the last renewal that failed to reach the store
        self.unconfirmed: str | None = None  # the store error of the renewal before the call
        self._scope = asyncio.timeout_at(min(claim_sent + self._budget, self.hard_deadline))

    @contextlib.asynccontextmanager
    async def held(self) -> AsyncIterator[None]:
        """Renew the claim while the block runs, and end it at the deadline (`LeaseEnded`)."""
        beat = asyncio.create_task(self._beat(), name=f"heartbeat-{self._job.id[:8]}")
        try:
            async with self._scope:
                yield
        except TimeoutError:
            if not self._scope.expired():
                raise
            raise LeaseEnded("the attempt's deadline passed") from None
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def confirm(self) -> None:
        """Renew, marking the call as started (H1); `LeaseEnded` unless there is time for a call."""
        # A short lease (tests) leaves a short budget: ask for half of it at most. A renewal
        # always leaves the whole budget, so only the attempt's own limit can be too close.
        left = self.hard_deadline - asyncio.get_running_loop().time()
        if left < min(MIN_CALL_SECONDS, self._budget / 2):
            raise LeaseEnded(
                f"only {left:.1f} s left of the attempt (AI_JOB_CLAIM_TIMEOUT); no call started"
            )
        try:
            renewal = await self._renew(calling=True)
        except StoreError as exc:
            self.store_error = self.unconfirmed = str(exc)
            raise LeaseEnded(f"the claim could not be renewed: {exc}") from exc
        if not renewal:
            raise LeaseEnded(f"the claim was {renewal} before the call could start")

    async def _renew(self, calling: bool = False) -> Renewal:
        sent = asyncio.get_running_loop().time()
        renewal = await asyncio.to_thread(
            self._store.heartbeat, self._job.id, self._holder, calling=calling
        )
        if not renewal:
            self.renewal = renewal
            return renewal
        # From the renewal's *send* time: the store counts the lease from no earlier, so this
        # side stops first however long the renewal took to confirm.
        self._end_at(min(sent + self._budget, self.hard_deadline))
        return renewal

    def _end_at(self, when: float) -> None:
        if not self._scope.expired():
            self._scope.reschedule(when)

    async def _beat(self) -> None:
        name = self._job.run_name
        while True:
            await asyncio.sleep(self._settings.heartbeat_seconds)
            try:
                renewal = await self._renew()
            except StoreError as exc:
                # The database may be restarting: keep trying until the deadline (L2).
                self.store_error = str(exc)
                logger.warning("renewing the claim on %s failed: %s", name, exc)
                continue
            if not renewal:
                logger.warning("the claim on %s was %s; stopping at once", name, renewal)
                self._end_at(asyncio.get_running_loop().time())
                return
            self.store_error = None

    def why_ended(self, phase: str, started: float) -> tuple[Failure | None, str]:
        """The verdict on an attempt whose scope ended in `phase`; None: nothing to record."""
        held = time.monotonic() - started
        if self.renewal is Renewal.LOST:
            return None, "the claim was taken over by another worker"
        if self.unconfirmed is not None:  # no call started, and this side stopped: not spent
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
        """Call under a lease counted from `claim_sent`; record what happened, even if cancelled."""
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
            # The store pauses at most this long (G1) and refuses absurd waits.
            asked, most = exc.retry_after, self._settings.backoff_max_seconds
            retry_after = None if asked is None else min(asked, most)
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
        async with keeper.held():
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
            tokens = "tokens unknown: the answer did not say"
            if (used := answer.usage) is not None:
                tokens = (
                    f"{used.prompt_tokens:,} prompt + {used.completion_tokens:,} completion tokens"
                )
            entry.note(
                f"the gateway answered in {answer.elapsed_seconds:.1f} s "
                f"({answer.size_bytes:,} bytes; {tokens})"
            )
            return await asyncio.to_thread(generator.parse, answer)

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
        """Record the outcome to its end, even through a stop."""
        try:
            report: Report = await _shielded(recording)
        except asyncio.CancelledError:
            noted.cancel()
            raise
        # The history entry may still be on its way: `_note_run` links it when it comes.
        self._notes.add(noted)
        noted.add_done_callback(self._notes.discard)
        return report

    async def _note_run(self, attempt: _Attempt) -> None:
        """Once the attempt's history entry exists, the job row points at it (N4)."""
        job = attempt.job
        if (run_id := await attempt.entry.run_id(RUN_ID_NOTE_SECONDS)) is not None:
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
        """Tell the store; `quoted`: the gateway's or a generator's words in `message` (D4)."""
        job, answer = attempt.job, attempt.answer
        message = self._redact(" ".join(message.split()))
        quoted = self._redact(" ".join(quoted.split()))
        # A stop can wait longer: the job row then points at the run that says it was stopped.
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
            if settlement.attempt_spent:
                outcome = Outcome.FAILED if settlement.status is Status.FAILED else Outcome.REQUEUED
            else:
                outcome = Outcome.RELEASED
            if settlement.pause_seconds:
                logger.warning("%s: %s", job.run_name, settlement.verdict)
        return self._report(attempt, outcome, message, failure=failure, quoted=quoted, **settled)

    async def _record(self, job: Job, write: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """`write(job.id, job.holder, ...)`, riding out a short store outage."""
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
        """The attempt's one report, with which its history entry closes."""
        answer = attempt.answer
        report = Report(
            job=attempt.job,
            outcome=outcome,
            message=self._redact(message),
            called=attempt.call_started is not None,
            call_started_at=attempt.call_started,
            call_seconds=attempt.call_seconds,
            answered=answer is not None,
            usage=answer.usage if answer is not None else None,
            **more,
        )
        attempt.entry.close(report)
        return report


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


async def _shielded(awaitable: Awaitable[Any]) -> Any:
    """Await what must complete even if this task is cancelled (then re-raised once it has)."""
    task = asyncio.ensure_future(awaitable)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        await asyncio.gather(task, return_exceptions=True)
        raise
