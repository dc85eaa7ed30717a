"""Running one claimed job: heartbeat, gateway call, and recording the outcome.

Plain Python, no Prefect: the flows wrap these calls in tasks, and tests can
drive them directly. The store decides everything about the job; this module
only reports to it what happened:

- an answer: `finish(result=...)`, the job is done;
- the gateway unreachable (N2): `release` (the attempt is not spent) and
  `report_outage`, which pauses claiming for every worker with a growing
  backoff;
- any other failure (timeout, rejection, generator error, unknown kind):
  `finish(error=...)`, which spends the attempt and re-queues below the limit;
  a timeout also pauses claiming like an outage, because the gateway may
  still be working on the call we gave up on;
- the claim lost (taken over after a stall): nothing, the job is someone
  else's now.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

from flows.gateway import (
    Completion,
    GatewayClient,
    GatewayError,
    is_abandoned,
    is_timeout,
    is_unavailable,
)
from flows.registry import generator_for
from queue_store import ClaimLost, Job, JobStore, Settings, Status, StoreError

logger = logging.getLogger(__name__)

# A result must reach the store even through a short database outage: the
# call behind it cost minutes of a shared gateway.
RECORD_RETRIES = 5
RECORD_BACKOFF_SECONDS = 1.0


class Outcome(enum.StrEnum):
    DONE = "done"
    REQUEUED = "requeued"  # failed below the attempt limit: queued again
    FAILED = "failed"  # failed on the last allowed attempt
    RELEASED = "released"  # gateway unreachable: handed back, attempt kept
    LOST = "lost"  # the claim was taken over; nothing recorded


@dataclasses.dataclass(frozen=True)
class JobReport:
    job_id: str
    run_name: str
    outcome: Outcome
    error: str | None = None
    seconds: float = 0.0
    pause_seconds: float | None = None


class Heartbeat:
    """Renews a claim in the background until stopped; notices when it is lost.

    Runs from the moment of the claim (through any wait for the Prefect
    `gateway` slot) to the moment the outcome is recorded.
    """

    def __init__(self, store: JobStore, job: Job, interval_seconds: float) -> None:
        if not job.holder:
            raise ValueError("job: a claimed job carries its holder token")
        self._store = store
        self._job = job
        self._holder = job.holder
        self._interval = interval_seconds
        self._stop = threading.Event()
        self.lost = threading.Event()
        # Set by the runner before it writes the outcome: from then on a refused
        # renewal means our own write ended the claim, not that it was taken over.
        self.recording = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"heartbeat-{job.id[:8]}", daemon=True
        )

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._interval + 5)

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                still_ours = self._store.heartbeat(self._job.id, self._holder)
            except Exception as exc:  # noqa: BLE001 - the heartbeat must outlive any failure
                # The database may be restarting: keep trying. If it stays
                # away past the lease, the claim lapses and the next renewal
                # says so.
                logger.warning("heartbeat for %s failed: %s", self._job.run_name, exc)
                continue
            if not still_ours:
                if self.recording.is_set():
                    return
                logger.warning("lost the claim on %s; abandoning it", self._job.run_name)
                self.lost.set()
                return


def _call_in_thread(
    call: Callable[[], Completion], stop_waiting: threading.Event, deadline: float
) -> Completion:
    """Run the gateway call in a thread we can walk away from.

    Returns its answer or raises its error; raises `_Abandoned` when the claim
    is lost or the attempt's deadline passes first.
    """
    box: dict[str, Any] = {}
    finished = threading.Event()

    def target() -> None:
        try:
            box["answer"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = exc
        finally:
            finished.set()

    threading.Thread(target=target, name="gateway-call", daemon=True).start()
    while not finished.wait(0.2):
        if stop_waiting.is_set():
            raise _Abandoned("claim lost")
        if time.monotonic() >= deadline:
            raise _Abandoned("attempt exceeded AI_JOB_CLAIM_TIMEOUT")
    if "error" in box:
        raise box["error"]
    answer: Completion = box["answer"]
    return answer


class _Abandoned(Exception):
    pass


class JobRunner:
    """Runs claimed jobs against one gateway for one store."""

    def __init__(
        self,
        store: JobStore,
        settings: Settings,
        client_factory: Callable[[], GatewayClient] | None = None,
    ) -> None:
        self._store = store
        self._settings = settings
        self._client_factory = client_factory or (lambda: GatewayClient(settings))
        self._recording: threading.Event | None = None  # one job at a time per runner

    def heartbeat(self, job: Job) -> Heartbeat:
        return Heartbeat(self._store, job, self._settings.heartbeat_seconds)

    def run(
        self,
        job: Job,
        lost: threading.Event | None = None,
        recording: threading.Event | None = None,
    ) -> JobReport:
        """Make the job's gateway call and record what happened.

        `lost` is set by the heartbeat when the claim was taken over; this sets
        `recording` (the heartbeat's) just before it writes the outcome.
        """
        started = time.monotonic()
        lost = lost or threading.Event()
        self._recording = recording
        elapsed_in_claim = 0.0
        if job.claimed_at is not None:
            elapsed_in_claim = max(0.0, time.time() - job.claimed_at.timestamp())
        deadline = started + self._settings.claim_timeout_seconds - elapsed_in_claim

        try:
            generator = generator_for(job.kind)
            messages = generator.build(job.user_id, job.subject)
        except Exception as exc:  # noqa: BLE001 - a bad generator fails its job only
            return self._fail(job, f"generator {job.kind!r}: {type(exc).__name__}: {exc}", started)

        client = self._client_factory()
        try:
            answer = _call_in_thread(
                lambda: client.complete(messages, job=job.run_name, **generator.options),
                lost,
                deadline,
            )
        except _Abandoned as why:
            if lost.is_set():
                return JobReport(job.id, job.run_name, Outcome.LOST, str(why), _since(started))
            return self._fail(job, f"abandoned: {why}", started)
        except GatewayError as exc:
            if is_unavailable(exc):
                return self._outage(job, str(exc), started)
            if is_abandoned(exc):
                return JobReport(job.id, job.run_name, Outcome.LOST, str(exc), _since(started))
            report = self._fail(job, str(exc), started)
            if is_timeout(exc) and report.outcome != Outcome.LOST:
                # The attempt is spent, but the gateway may still be working
                # on the abandoned call: starting the next one at once would
                # put two of ours on a box shared with two other projects.
                report = dataclasses.replace(report, pause_seconds=self._pause(str(exc)))
            return report
        finally:
            client.close()

        try:
            result = generator.parse(answer)
        except Exception as exc:  # noqa: BLE001 - a bad generator fails its job only
            return self._fail(job, f"generator {job.kind!r}: {type(exc).__name__}: {exc}", started)
        return self._record(
            job,
            lambda: self._store.finish(
                job.id, job.holder or "", result=result, duration_seconds=answer.elapsed_seconds
            ),
            started,
        )

    def _fail(self, job: Job, message: str, started: float) -> JobReport:
        return self._record(
            job,
            lambda: self._store.finish(job.id, job.holder or "", error=message),
            started,
            error=message,
        )

    def _outage(self, job: Job, message: str, started: float) -> JobReport:
        report = self._record(
            job,
            lambda: self._store.release(job.id, job.holder or "", error=message),
            started,
            error=message,
            released=True,
        )
        if report.outcome == Outcome.LOST:
            return report
        return dataclasses.replace(report, pause_seconds=self._pause(message))

    def _pause(self, message: str) -> float | None:
        """Pause claiming for every worker, with the store's growing backoff."""
        try:
            pause = self._store.report_outage(message)
        except StoreError as exc:
            logger.error("could not record the gateway outage: %s", exc)
            return None
        logger.warning("gateway in trouble (%s); claiming paused for %.0f s", message, pause)
        return pause

    def _record(
        self,
        job: Job,
        write: Callable[[], Any],
        started: float,
        *,
        error: str | None = None,
        released: bool = False,
    ) -> JobReport:
        if self._recording is not None:
            self._recording.set()
        for attempt in range(1, RECORD_RETRIES + 1):
            try:
                status = write()
                break
            except ClaimLost:
                return JobReport(job.id, job.run_name, Outcome.LOST, error, _since(started))
            except StoreError as exc:
                if attempt == RECORD_RETRIES:
                    raise
                logger.warning("recording %s failed (%s); retrying", job.run_name, exc)
                time.sleep(RECORD_BACKOFF_SECONDS * attempt)
        if released:
            outcome = Outcome.RELEASED
        elif status == Status.DONE:
            outcome = Outcome.DONE
        elif status == Status.FAILED:
            outcome = Outcome.FAILED
        else:
            outcome = Outcome.REQUEUED
        return JobReport(job.id, job.run_name, outcome, error, _since(started))


def _since(started: float) -> float:
    return round(time.monotonic() - started, 3)
