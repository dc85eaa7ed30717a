"""The Prefect flows: backfill, interactive, and the consumer that drains the queue.

Prefect decides when and where these run and keeps their history; the store
decides which job runs next. Each gateway call is a task run named
`kind:subject`, tagged `gateway` (whose tag concurrency limit is a second,
independent guard on the gateway) plus its kind and priority class, so the
UI shows every generation with its outcome and failure message.

The claim comes from the store, whose claim is itself the gateway lease: it
is taken only when the store sees the gateway free (concurrency and global
gap), so the job claimed is the highest-priority one at that moment. Its
heartbeat starts at the claim and covers any wait for the `gateway` slot.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from prefect import flow, get_run_logger, tags, task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import flow_run

from flows.registry import scopes_for
from flows.runner import JobReport, JobRunner, Outcome
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    Blocked,
    Job,
    JobStore,
    Settings,
    StoreError,
    priority_class,
)

logger = logging.getLogger(__name__)

GATEWAY_TAG = "gateway"
# Longest single sleep of a consumer waiting out a gap or a pause, so a
# change (an operator's `resume`) is noticed soon.
MAX_WAIT_SECONDS = 5.0
# How often a consumer standing by looks for queued work (a read-only query).
STANDBY_POLL_SECONDS = 0.25
# How long a consumer keeps retrying a store it cannot reach before it stops.
STORE_OUTAGE_SECONDS = 60.0


class GenerationFailed(Exception):
    """Raised by the gateway task so its run shows as failed with the reason."""


@functools.cache
def settings() -> Settings:
    return Settings.from_env()


@functools.cache
def store() -> JobStore:
    return JobStore(settings().database_url, settings=settings())


@functools.cache
def runner() -> JobRunner:
    return JobRunner(store(), settings())


@functools.cache
def worker_name() -> str:
    """This process, as a claim's holder: host, pid and a per-process nonce."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


def job_tags(job: Job) -> list[str]:
    return [GATEWAY_TAG, f"kind:{job.kind}", f"priority:{priority_class(job.priority)}"]


# Per job this process has claimed: its heartbeat's "lost" signal for the task,
# and the task's report for the flow. Both run in this process; the task's
# return value or exception is for the UI.
_lost_events: dict[str, threading.Event] = {}
_recording_events: dict[str, threading.Event] = {}
_reports: dict[str, JobReport] = {}


# Never cached: each claim is a new attempt, whatever its inputs.
@task(name="generate", retries=0, persist_result=False, cache_policy=NO_CACHE)
def generate(job: Job) -> dict[str, Any]:
    """One gateway call for one claimed job (runs holding a `gateway` slot)."""
    report = runner().run(job, _lost_events.get(job.id), _recording_events.get(job.id))
    _reports[job.id] = report
    log = get_run_logger()
    if report.outcome in (Outcome.DONE, Outcome.RELEASED):
        log.info("%s: %s in %.1f s", job.run_name, report.outcome, report.seconds)
        if report.outcome == Outcome.RELEASED:
            log.warning("gateway unreachable, paused %s s: %s", report.pause_seconds, report.error)
        return dataclasses.asdict(report)
    raise GenerationFailed(f"{report.outcome}: {report.error}")


@dataclasses.dataclass
class DrainSummary:
    ran: int = 0
    outcomes: dict[str, int] = dataclasses.field(default_factory=dict)
    stopped_because: str = ""

    def add(self, outcome: str) -> None:
        self.ran += 1
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1


def _run_claimed(job: Job) -> str:
    """Run one claimed job as a tagged task; returns its outcome."""
    current = flow_run.get_id()
    if current:
        try:
            store().set_flow_run(job.id, job.holder or "", current)
        except StoreError as exc:
            logger.warning("could not record the flow run on %s: %s", job.run_name, exc)
    with runner().heartbeat(job) as beat:
        _lost_events[job.id] = beat.lost
        _recording_events[job.id] = beat.recording
        try:
            with tags(*job_tags(job)):
                generate.with_options(task_run_name=job.run_name)(job, return_state=True)
        finally:
            _lost_events.pop(job.id, None)
            _recording_events.pop(job.id, None)
    report = _reports.pop(job.id, None)
    # No report: the task crashed before recording anything. The claim lapses
    # and the job is taken over; the attempt it spent counts.
    return report.outcome.value if report else "crashed"


def drain_queue(
    max_jobs: int | None = None, *, wait_for_gap: bool = True, standby_seconds: float = 0.0
) -> DrainSummary:
    """Claim and run jobs until nothing is runnable (drain mode).

    Stops when the queue is empty or another consumer holds the gateway: that
    consumer takes the next job when its call ends, so nothing is stranded.
    Waits out the global gap and any outage pause (in short sleeps) when
    `wait_for_gap`; otherwise stops there too.

    With `standby_seconds` it does not stop at once when idle: it stands by
    that long, looking for queued work every `STANDBY_POLL_SECONDS` with a
    read-only query, so a screen's job is claimed without waiting for a new
    flow run's process to start.
    """
    summary = DrainSummary()
    s = settings()
    if not s.enabled:
        summary.stopped_because = "disabled by AI_JOBS"
        return summary
    store_down_since: float | None = None
    idle_since: float | None = None
    while max_jobs is None or summary.ran < max_jobs:
        if idle_since is not None:
            if time.monotonic() - idle_since >= standby_seconds:
                summary.stopped_because = "standby over"
                return summary
            if not _work_waiting():
                time.sleep(STANDBY_POLL_SECONDS)
                continue
        try:
            claim = store().claim_next(worker_name())
            store_down_since = None
        except StoreError as exc:
            # A database restart takes seconds: ride it out, then leave the
            # rest to the safety net rather than spin.
            now = time.monotonic()
            store_down_since = store_down_since or now
            if now - store_down_since > STORE_OUTAGE_SECONDS:
                logger.error(
                    "store unavailable for %.0f s, stopping: %s", now - store_down_since, exc
                )
                summary.stopped_because = f"store error: {exc}"
                return summary
            logger.warning("claim failed, retrying: %s", exc)
            time.sleep(s.poll_seconds)
            continue
        if claim.job is None:
            if claim.blocked in (Blocked.GAP, Blocked.PAUSED) and wait_for_gap:
                time.sleep(min(claim.retry_in or s.poll_seconds, MAX_WAIT_SECONDS))
                continue
            if standby_seconds > 0:
                idle_since = idle_since or time.monotonic()
                # A consumer mid-call takes the next job itself: look less often.
                busy = claim.blocked == Blocked.CONCURRENCY
                time.sleep(s.poll_seconds if busy else STANDBY_POLL_SECONDS)
                continue
            summary.stopped_because = str(claim.blocked)
            return summary
        idle_since = None
        summary.add(_run_claimed(claim.job))
    summary.stopped_because = "max_jobs"
    return summary


def _work_waiting() -> bool:
    """Whether a job is queued (one indexed read; never a write)."""
    try:
        return store().has_pending()
    except StoreError:
        return True  # let the claim find out, and ride out the outage there


@flow(name="drain", log_prints=True)
def drain(max_jobs: int | None = None, standby_seconds: float = 0.0) -> dict[str, Any]:
    """Consumer: run queued jobs in priority order until nothing is runnable.

    With `standby_seconds` (the safety net's runs under `serve`), it then
    stands by that long for new work, so a screen finds a consumer running.
    """
    summary = drain_queue(max_jobs, standby_seconds=standby_seconds)
    get_run_logger().info("drained: %s", summary)
    return dataclasses.asdict(summary)


@flow(name="backfill", flow_run_name="backfill:{user_id}", log_prints=True)
def backfill(user_id: str, drain_after: bool = True) -> dict[str, Any]:
    """After a data sync: queue every scope of the user at prefetch priority, then drain."""
    log = get_run_logger()
    queued = 0
    for scope in scopes_for(user_id):
        store().enqueue(user_id, scope.kind, scope.subject, scope.fingerprint, PREFETCH)
        if scope.single_subject:
            store().supersede(user_id, scope.kind, scope.subject)
        queued += 1
    log.info("queued %d scope(s) for %s", queued, user_id)
    summary = drain_queue() if drain_after else DrainSummary(stopped_because="not asked to drain")
    return {"queued": queued, **dataclasses.asdict(summary)}


@flow(name="interactive", flow_run_name="{kind}:{subject}", log_prints=True)
def interactive(
    user_id: str, kind: str, subject: str, fingerprint: str | None = None
) -> dict[str, Any]:
    """A screen is open: promote its insight to the front, then drain."""
    status = store().enqueue(user_id, kind, subject, fingerprint, INTERACTIVE)
    summary = drain_queue() if status == "pending" else DrainSummary(stopped_because=status)
    return {"status": status, **dataclasses.asdict(summary)}
