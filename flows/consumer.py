"""The consumer: take a gateway slot, claim the most urgent job, run it; again, in
`AI_JOB_CONCURRENCY` lanes. A warm one (`standby=True`: `serve`, `consume`) never stops on its own;
a flow's drains until nothing is runnable (W2). What runs next is the store's choice, never its."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any, Self

from flows.guard import Guard, GuardUnavailable, Held, NullGuard
from flows.ledger import Outcome, Report
from flows.runner import JobRunner
from queue_store import Blocked, Failure, PauseKind, Settings, StoreError, WorkerStore

logger = logging.getLogger(__name__)

STANDBY_POLL_SECONDS = 0.2  # how often a consumer standing by looks for work (a read-only query)
MAX_WAIT_SECONDS = 5.0  # longest sleep through a gap or a pause: a `resume` is noticed soon
STORE_OUTAGE_SECONDS = 60.0  # a draining consumer stops after the store or guard is away so long


def worker_name(role: str = "consumer") -> str:
    """A fresh worker name for this process: role, host, pid and a nonce (no '/')."""
    return f"{role}@{short_hostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def short_hostname() -> str:
    return "".join(c if c.isalnum() or c in ".-" else "-" for c in socket.gethostname())[:60]


@dataclasses.dataclass(frozen=True)
class ConsumerConfig:
    """What a consumer reads of the settings, under the settings' names."""

    enabled: bool  # AI_JOBS: false makes `run` return at once
    concurrency: int  # lanes, each with at most one slot and one claim
    poll_seconds: float  # how often to look again after a miss
    heartbeat_seconds: float  # how often to say it is alive

    @classmethod
    def of(cls, settings: Settings) -> Self:
        return cls(**{f.name: getattr(settings, f.name) for f in dataclasses.fields(cls)})


@dataclasses.dataclass
class Summary:
    reports: list[Report] = dataclasses.field(default_factory=list)
    stopped_because: str = ""

    @property
    def ran(self) -> int:
        return len(self.reports)

    def as_dict(self) -> dict[str, Any]:
        outcomes = collections.Counter(str(report.outcome) for report in self.reports)
        return {
            "ran": self.ran,
            "outcomes": dict(outcomes),
            "stopped_because": self.stopped_because,
        }


class Consumer:
    def __init__(
        self,
        store: WorkerStore,
        settings: ConsumerConfig,
        runner: JobRunner,
        *,
        worker: str,
        guard: Guard | None = None,
        standby: bool = False,
        max_jobs: int | None = None,
        hold_slot_when_idle: bool = False,
        role: str = "consumer",
    ) -> None:
        self._store = store
        self._settings = settings
        self._runner = runner
        self._guard = guard or NullGuard()
        self.worker = worker
        self._standby = standby
        self._max_jobs = max_jobs
        self._hold_slot = hold_slot_when_idle and standby
        self._role = role
        self.summary = Summary()
        self._stopping = asyncio.Event()  # made anew by each `run`
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lanes: list[asyncio.Task[None]] = []
        self._busy: dict[int, str] = {}  # lane -> the job it runs, as `kind:subject`
        self._store_down_since: float | None = None
        self._guard_down_since: float | None = None

    def stop(self, reason: str = "stopped") -> None:
        """Stop: cancel the calls in flight (their jobs are handed back). Thread-safe."""
        self._in_loop(self._stop_now, reason)

    def finish_current(self, reason: str = "asked to finish") -> None:
        """Stop after the calls in flight end; claim nothing new. Thread-safe."""
        self._in_loop(self._finished, reason)

    def _in_loop(self, callback: Callable[[str], object], reason: str) -> None:
        loop = self._loop
        if loop is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                loop.call_soon_threadsafe(callback, reason)

    def _stop_now(self, reason: str) -> None:
        if not self._stopping.is_set():
            self._finished(reason)
            for lane in self._lanes:
                lane.cancel()

    async def run(self) -> Summary:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        if not self._settings.enabled:
            self.summary.stopped_because = "disabled by AI_JOBS"
            return self.summary
        presence = asyncio.create_task(self._say_alive())
        self._lanes = [
            asyncio.create_task(self._lane(n), name=f"lane-{n}")
            for n in range(self._settings.concurrency)
        ]
        try:
            await asyncio.gather(*self._lanes, return_exceptions=True)
        finally:
            presence.cancel()
            await asyncio.gather(presence, return_exceptions=True)
            self._runner.ledger.stopped(self.worker)
            with contextlib.suppress(StoreError):
                await asyncio.to_thread(self._store.presence, self.worker, self._role, leaving=True)
        for lane in self._lanes:
            if not lane.cancelled() and (error := lane.exception()) is not None:
                raise error
        return self.summary

    def _finished(self, reason: str) -> None:
        if not self.summary.stopped_because:
            self.summary.stopped_because = reason
        self._stopping.set()

    async def _lane(self, lane: int) -> None:
        slot = contextlib.AsyncExitStack()
        held: Held | None = None  # while the lane holds a gateway slot
        try:
            while not self._stopping.is_set():
                if self._max_jobs is not None and self.summary.ran >= self._max_jobs:
                    self._finished("max_jobs")
                    return
                if held is None and not await self._work_waiting():
                    if not self._standby:
                        self._finished("empty")
                        return
                    await self._pause(STANDBY_POLL_SECONDS)
                    continue
                if held is None or held.lost:
                    await slot.aclose()  # an idle slot the guard took back is let go first
                    try:
                        held = await slot.enter_async_context(self._guard.slot())
                    except GuardUnavailable as exc:
                        held = None
                        await self._pause(self._no_slot(exc))
                        continue
                    self._guard_down_since = None
                wait = await self._claim_and_run(lane)
                if not self._hold_slot:
                    await slot.aclose()
                    held = None
                if wait:
                    await self._pause(wait)
        finally:
            await asyncio.shield(slot.aclose())

    async def _claim_and_run(self, lane: int) -> float:
        """One claim (and its job, if any); returns seconds to wait before the next, 0: none."""
        claim_sent = asyncio.get_running_loop().time()
        try:
            claim = await asyncio.to_thread(self._store.claim_next, self.worker)
        except StoreError as exc:
            self._store_down_since = self._store_down_since or time.monotonic()
            if wait := self._away(self._store_down_since, exc, "store unavailable", "store error"):
                logger.warning("claim failed, retrying: %s", exc)
            return wait
        self._store_down_since = None
        job = claim.job
        if job is None:
            refused = claim.pause_reason if claim.pause_kind is PauseKind.REFUSED else None
            if claim.blocked is Blocked.PAUSED and not self._standby and refused is not None:
                self._stop_refused(refused)
                return 0.0
            if claim.blocked in (Blocked.GAP, Blocked.PAUSED):
                return min(claim.retry_in or self._settings.poll_seconds, MAX_WAIT_SECONDS)
            if claim.blocked is Blocked.CONCURRENCY:
                # Another consumer is mid-call; a drain stays too: it may be a dead machine's (W2).
                return self._settings.poll_seconds
            return STANDBY_POLL_SECONDS
        self._busy[lane] = job.run_name
        try:
            report = await self._runner.run(job, claim_sent)
        finally:
            self._busy.pop(lane, None)
        self.summary.reports.append(report)
        log = logger.info if report.outcome is Outcome.DONE else logger.warning
        log("%s: %s (%s)", job.run_name, report.outcome, report.public_message)
        if report.failure is Failure.REFUSED and not self._standby:
            self._stop_refused(report.message)
        return 0.0

    def _stop_refused(self, reason: str) -> None:
        # Only a fixed token or a `resume` ends such a pause: a drain stops instead of probing.
        logger.error("the gateway refuses us, stopping: %s", reason)
        self._finished(f"refused: {reason}")

    def _no_slot(self, exc: GuardUnavailable) -> float:
        """Prefect is away: no slot, so no call starts; seconds to wait before asking again."""
        if self._guard_down_since is None:
            logger.warning("%s; no call starts until one can", exc)
            self._guard_down_since = time.monotonic()
        return self._away(
            self._guard_down_since, exc, "no gateway slot", "gateway slot unavailable"
        )

    def _away(self, since: float, exc: Exception, what: str, reason: str) -> float:
        """Seconds to wait for `what` (the store, a slot), away since `since`; 0: a drain stops."""
        down = time.monotonic() - since
        if self._standby or down <= STORE_OUTAGE_SECONDS:
            return self._settings.poll_seconds
        logger.error("%s for %.0f s, stopping: %s", what, down, exc)
        self._finished(f"{reason}: {exc}")
        return 0.0

    async def _work_waiting(self) -> bool:
        """Whether a claim could find something; a drain waits for anyone's call in flight (W2)."""
        try:
            return await asyncio.to_thread(self._store.has_work, or_running=not self._standby)
        except StoreError:
            return True  # let the claim find out, and ride out the outage there

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _say_alive(self) -> None:
        """Say, in the store and in the run history, that this consumer is alive (W1)."""
        while True:
            doing = {"busy": list(self._busy.values()), "lanes": self._settings.concurrency}
            try:
                await asyncio.to_thread(self._store.presence, self.worker, self._role, doing)
            except StoreError as exc:
                logger.debug("could not say the consumer is alive: %s", exc)
            self._runner.ledger.alive(self.worker, self._role)
            await asyncio.sleep(self._settings.heartbeat_seconds)
