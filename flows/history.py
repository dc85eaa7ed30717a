"""The run history in Prefect: a `generate` flow run per attempt, written beside the call by one
background task per consumer, so that a slow or absent Prefect delays or drops history, never a
generation (README, "The run history in the Prefect UI")."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from prefect import Flow
from prefect.client.orchestration import PrefectClient, get_client
from prefect.client.schemas import filters
from prefect.client.schemas.actions import LogCreate
from prefect.client.schemas.objects import State, StateType
from prefect.events import emit_event
from prefect.states import Cancelled, Completed, Crashed, Failed, Running

from flows.ledger import LedgerEntry, Outcome, Report
from queue_store import Failure, Job, Redactor

logger = logging.getLogger(__name__)

RUN_ID_WAIT_SECONDS = 2.0  # a result's wait for its history entry's id before it is stored
MAX_PENDING_WRITES = 1000  # history writes waiting beyond this are dropped (Prefect is away)
ERASE_BATCH = 50  # runs a round of erasing reads and deletes at most
TAG_PREFIX_USER = "user:"
UNKNOWN_PSEUDONYM = "p-unknown"  # a job read without its user's pseudonym (never a user id)
PROJECT_TAG = "insight-queue"  # on every run of ours: the automations of `deploy` match on it
CONSUMER_ALIVE = "insight-queue.consumer.alive"
CONSUMER_STOPPED = "insight-queue.consumer.stopped"
# How often an open generation run says it is alive: as often as the runs
# Prefect's engine executes on our deployments (PREFECT_FLOWS_HEARTBEAT_FREQUENCY).
RUN_HEARTBEAT_SECONDS = 30.0
# The setting that has the flow runs Prefect's engine executes send them that often.
RUN_HEARTBEAT_ENV = {"PREFECT_FLOWS_HEARTBEAT_FREQUENCY": str(int(RUN_HEARTBEAT_SECONDS))}
_ENDED = {  # how a generation's run names an outcome it failed with
    Outcome.REQUEUED: "attempt failed, queued again",
    Outcome.FAILED: "failed, attempts spent",
    Outcome.RELEASED: "handed back, attempt kept",
    Outcome.LOST: "claim taken over",
    Outcome.UNRECORDED: "outcome not recorded",
}


def user_tag(job: Job) -> str:
    """How a run names its user: the pseudonym, never the user's id (D4)."""
    return f"{TAG_PREFIX_USER}{job.pseudonym or UNKNOWN_PSEUDONYM}"


def generation_tags(job: Job) -> list[str]:
    return [
        PROJECT_TAG,
        "generation",
        user_tag(job),
        f"kind:{job.kind}",
        f"priority:{job.priority_class}",
        f"attempt:{job.attempts}",
    ]


class _PrefectEntry:
    """One attempt's run: created as its job is claimed, ended with its report."""

    def __init__(self, ledger: PrefectLedger, job: Job) -> None:
        self._ledger = ledger
        self._job = job
        self._claimed = job.claimed_at or dt.datetime.now(dt.UTC)
        self._run: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._logs: list[tuple[float, int, str]] = []
        self.flow_id: str | None = None  # known once the run is recorded
        self.beat_at = time.monotonic()

    def call_started(self, at: float) -> None:
        asked = self._job.requested_at
        waited = f"; a screen asked {max(0.0, at - asked.timestamp()):.1f} s ago" if asked else ""
        self.note(f"call sent to the gateway{waited}")

    def note(self, message: str, level: int = logging.INFO) -> None:
        self._logs.append((time.time(), level, self._ledger.redact(message)))

    async def run_id(self, wait: float | None = None) -> str | None:
        timeout = RUN_ID_WAIT_SECONDS if wait is None else wait
        try:
            return await asyncio.wait_for(asyncio.shield(self._run), timeout)
        except TimeoutError:
            return None

    @property
    def recorded_id(self) -> str | None:
        return self._run.result() if self._run.done() else None

    async def create(self, client: PrefectClient) -> None:
        job, worker, flow = self._job, self._ledger.worker, self._ledger.flow
        try:
            run = await client.create_flow_run(
                flow=flow,
                name=job.run_name,
                parameters={
                    "user": job.pseudonym or UNKNOWN_PSEUDONYM,
                    "kind": job.kind,
                    "subject": job.subject,
                    "attempt": job.attempts,
                    "worker": worker,
                },
                tags=generation_tags(job),
                context={"insight_queue": {"parent": self._ledger.parent}},
                state=Running(
                    timestamp=self._claimed, message=f"attempt {job.attempts}, claimed by {worker}"
                ),
            )
        except BaseException:
            self._run.set_result(None)
            raise
        self.flow_id = str(run.flow_id)
        self._run.set_result(str(run.id))
        # An earlier attempt's run may still be open: a spent attempt, or a lost one (H2, W3).
        if job.attempts > 1 or job.flow_run_id or job.losses:
            await _close_earlier_attempts(client, job, run.id, flow.name)

    def close(self, report: Report) -> None:
        self._ledger.opened.discard(self)
        state, message = _final_state(report)
        level = logging.INFO if state is Completed else logging.WARNING
        self.note(f"{report.outcome}: {report.public_message}", level)
        if report.settlement is not None and report.settlement.verdict:
            self.note(report.settlement.verdict, level)
        message = self._ledger.redact(message)

        async def finish(client: PrefectClient) -> None:
            if (run_id := self.recorded_id) is None:
                name = self._job.run_name
                logger.warning("run history: %s was never recorded, so it cannot be closed", name)
                return
            await client.create_logs(
                [
                    LogCreate.model_validate(
                        {
                            "name": "insight_queue.generation",
                            "level": lvl,
                            "message": text,
                            "timestamp": dt.datetime.fromtimestamp(at, dt.UTC),
                            "flow_run_id": uuid.UUID(run_id),
                        }
                    )
                    for at, lvl, text in self._logs
                ]
            )
            await client.set_flow_run_state(uuid.UUID(run_id), state(message=message), force=True)

        self._ledger.submit(finish)


class PrefectLedger:
    """Writes each attempt as a flow run, one write at a time in the background, never raising."""

    def __init__(
        self,
        worker: str,
        redactor: Redactor,
        flow: Flow[..., Any],
        *,
        parent_flow_run_id: str | None = None,
    ) -> None:
        self.worker = worker
        self.redact = redactor
        self.flow = flow
        self.parent = parent_flow_run_id
        self.opened: set[_PrefectEntry] = set()
        self._writes: asyncio.Queue[Callable[[PrefectClient], Awaitable[None]]] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None
        self._failing = False

    def alive(self, worker: str, role: str) -> None:
        """Say that `worker` is alive, and its open runs too, as Prefect's engine does (W3)."""
        _emit(CONSUMER_ALIVE, _consumer(worker, role))
        now = time.monotonic()
        for entry in list(self.opened):
            run_id = entry.recorded_id
            if run_id is not None and now - entry.beat_at >= RUN_HEARTBEAT_SECONDS:
                entry.beat_at = now
                run = _resource(f"prefect.flow-run.{run_id}", entry._job.run_name)
                flow = _resource(f"prefect.flow.{entry.flow_id}", self.flow.name, role="flow")
                related = [flow, *_tags(generation_tags(entry._job))]
                _emit("prefect.flow-run.heartbeat", run, related)

    def stopped(self, worker: str) -> None:
        _emit(CONSUMER_STOPPED, _consumer(worker, ""))

    def open(self, job: Job) -> LedgerEntry:
        entry = _PrefectEntry(self, job)
        self.opened.add(entry)
        self.submit(entry.create)
        return entry

    def submit(self, write: Callable[[PrefectClient], Awaitable[None]]) -> None:
        if self._writes.qsize() >= MAX_PENDING_WRITES:
            logger.warning("run history: %d writes waiting; dropping one", MAX_PENDING_WRITES)
            return
        self._writes.put_nowait(write)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.create_task(self._write_all(), name="run-history")

    async def _write_all(self) -> None:
        async with get_client() as client:
            while not self._writes.empty():
                write = self._writes.get_nowait()
                try:
                    await write(client)
                except Exception as exc:  # noqa: BLE001 - history never breaks a generation
                    if not self._failing:
                        logger.warning("run history not written (%s: %s)", type(exc).__name__, exc)
                    self._failing = True
                else:
                    if self._failing:
                        logger.warning("run history written again")
                    self._failing = False

    async def flush(self, timeout: float = 10.0) -> None:
        """Wait (up to `timeout`) for the writes submitted so far."""
        if self._writer is not None and not self._writer.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._writer), timeout)


async def _close_earlier_attempts(
    client: PrefectClient, job: Job, current: uuid.UUID, flow_name: str
) -> None:
    """End Crashed this job's earlier attempts' open runs, found by their record (W3)."""
    runs = await client.read_flow_runs(
        flow_filter=filters.FlowFilter(name=filters.FlowFilterName(any_=[flow_name])),
        flow_run_filter=filters.FlowRunFilter(
            name=filters.FlowRunFilterName(any_=[job.run_name]),
            tags=filters.FlowRunFilterTags(all_=[PROJECT_TAG, user_tag(job)]),
            state=filters.FlowRunFilterState(
                type=filters.FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
            ),
        ),
        limit=20,
    )
    for run in runs:
        if run.id != current:
            message = "its worker stopped while this attempt was in flight; the job was taken over"
            await client.set_flow_run_state(run.id, Crashed(message=message), force=True)


def _resource(resource_id: str, name: str = "", role: str = "") -> dict[str, str]:
    found = {"prefect.resource.id": resource_id, "prefect.resource.name": name}
    return {key: value for key, value in (found | {"prefect.resource.role": role}).items() if value}


def _tags(tags: list[str]) -> list[dict[str, str]]:
    return [_resource(f"prefect.tag.{tag}", role="tag") for tag in tags]


def _consumer(worker: str, role: str) -> dict[str, str]:
    found = _resource(f"insight-queue.consumer.{worker}", worker)
    return found | ({"insight-queue.role": role} if role else {})


def _emit(
    event: str, resource: dict[str, str], related: list[dict[str, str]] | None = None
) -> None:
    """Send an event to Prefect (queued, never blocking); a failure is logged, not raised."""
    try:
        emit_event(event=event, resource=resource, related=related or _tags([PROJECT_TAG]))
    except Exception as exc:  # noqa: BLE001 - events never break a generation
        logger.debug("event %s not sent: %s", event, exc)


def _final_state(report: Report) -> tuple[Callable[..., State[Any]], str]:
    """The state a generation's run ends in, and its message."""
    job, tokens = report.job, "tokens unknown"
    if (used := report.usage) is not None:
        tokens = f"{used.prompt_tokens + used.completion_tokens:,} tokens"
    if report.outcome is Outcome.DONE:
        call = f" in {report.call_seconds:.1f} s" if report.call_seconds is not None else ""
        waited = ""
        if (asked := job.requested_at) is not None:
            waited = f"; the screen waited {max(0.0, time.time() - asked.timestamp()):.0f} s"
        return Completed, f"generated{call} (attempt {job.attempts}, {tokens}){waited}"
    if report.outcome is Outcome.RELEASED and report.failure == Failure.STOPPED:
        return Cancelled, report.public_message
    shown = report.public_message
    first = shown.splitlines()[0] if shown else str(report.outcome)
    spent = f" ({tokens})" if report.answered else ""
    return Failed, f"{_ENDED.get(report.outcome, str(report.outcome))}{spent}: {first}"[:500]


async def erase_runs(pseudonyms: list[str]) -> tuple[list[str], str | None]:
    """Delete the runs and artifacts of forgotten pseudonyms (D3): those done, and why not all."""
    done: list[str] = []
    try:
        async with get_client() as client:
            for pseudonym in pseudonyms:
                tag = filters.FlowRunFilterTags(all_=[f"{TAG_PREFIX_USER}{pseudonym}"])
                tagged = filters.FlowRunFilter(tags=tag)
                while runs := await client.read_flow_runs(
                    flow_run_filter=tagged, limit=ERASE_BATCH
                ):
                    ids = [run.id for run in runs]
                    run_ids = filters.ArtifactFilterFlowRunId(any_=ids)
                    of_runs = filters.ArtifactFilter(flow_run_id=run_ids)
                    for artifact in await client.read_artifacts(artifact_filter=of_runs):
                        await client.delete_artifact(artifact.id)
                    for run_id in ids:
                        await client.delete_flow_run(run_id)
                done.append(pseudonym)
    except Exception as exc:  # noqa: BLE001 - what is left is done by a later erasure
        return done, f"the run history could not be erased now: {type(exc).__name__}: {exc}"
    return done, None
