"""Prefect as the ledger of generations: a `generate` flow run per attempt (README, "The run
history in the Prefect UI").

The call starts first and its record is written beside it, by one background task per
consumer: a Prefect server that is slow or down delays or drops history, never a generation
(Prefect's engine would put several round trips, and "database is locked" retries, between
the claim and the call). Open runs send `prefect.flow-run.heartbeat` like the engine's, and
the consumer `insight-queue.consumer.alive` and `.stopped`, for the automations of `deploy`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from flows.ledger import LedgerEntry
from queue_store import Failure, Job, Redactor

if TYPE_CHECKING:
    from prefect import Flow
    from prefect.client.orchestration import PrefectClient

    from flows.ledger import Report

logger = logging.getLogger(__name__)

# How long a result waits for its history entry's id before it is stored without it.
RUN_ID_WAIT_SECONDS = 2.0
# History writes waiting beyond this are dropped (the Prefect server is away).
MAX_PENDING_WRITES = 1000
TAG_PREFIX_USER = "user:"
UNKNOWN_PSEUDONYM = "p-unknown"  # a job read without its user's pseudonym (never a user id)


def run_url(ui_url: str | None, run_id: str) -> str:
    """Where a flow run is in the Prefect UI (a relative path without a UI address)."""
    path = f"/runs/flow-run/{run_id}"
    return f"{ui_url.rstrip('/')}{path}" if ui_url else path


# Every run of ours carries this tag: the automations match on it.
PROJECT_TAG = "insight-queue"
CONSUMER_ALIVE = "insight-queue.consumer.alive"
CONSUMER_STOPPED = "insight-queue.consumer.stopped"
# How often an open generation run says it is alive: as often as the runs
# Prefect's engine executes on our deployments (PREFECT_FLOWS_HEARTBEAT_FREQUENCY).
RUN_HEARTBEAT_SECONDS = 30.0


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


class _Writer:
    """Runs history writes one after another in the background, never raising."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[Callable[[PrefectClient], Awaitable[None]]] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def submit(self, write: Callable[[PrefectClient], Awaitable[None]]) -> None:
        if self._queue.qsize() >= MAX_PENDING_WRITES:
            logger.warning("run history: %d writes waiting; dropping one", MAX_PENDING_WRITES)
            return
        self._queue.put_nowait(write)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._drain(), name="run-history")

    async def _drain(self) -> None:
        from prefect.client.orchestration import get_client

        async with get_client() as client:
            while not self._queue.empty():
                write = self._queue.get_nowait()
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

    async def flush(self, timeout: float) -> None:
        """Wait (up to `timeout`) for the writes submitted so far."""
        if self._task is not None and not self._task.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._task), timeout)


class _PrefectEntry:
    def __init__(self, ledger: PrefectLedger, job: Job) -> None:
        self._ledger = ledger
        self._job = job
        self._run: asyncio.Future[str | None] = asyncio.get_running_loop().create_future()
        self._logs: list[tuple[float, int, str]] = []
        self.flow_id: str | None = None  # known once the run is recorded
        self.beat_at = time.monotonic()

    def _log(self, level: int, message: str) -> None:
        self._logs.append((time.time(), level, self._ledger.redact(message)))

    def call_started(self, at: float) -> None:
        asked = self._job.requested_at
        waited = f"; a screen asked {max(0.0, at - asked.timestamp()):.1f} s ago" if asked else ""
        self._log(logging.INFO, f"call sent to the gateway{waited}")

    def note(self, message: str) -> None:
        self._log(logging.INFO, message)

    async def run_id(self, wait: float | None = None) -> str | None:
        timeout = RUN_ID_WAIT_SECONDS if wait is None else wait
        try:
            return await asyncio.wait_for(asyncio.shield(self._run), timeout)
        except TimeoutError:
            return None

    def close(self, report: Report) -> None:
        self._ledger._close(self, report)


class PrefectLedger:
    """Writes each generation attempt as a Prefect flow run (see the module docstring)."""

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
        self._flow = flow
        self._parent = parent_flow_run_id
        self._writer = _Writer()
        self._open: set[_PrefectEntry] = set()

    def alive(self, worker: str, role: str) -> None:
        """Say that `worker` is alive, and that each of its open runs is."""
        _emit(CONSUMER_ALIVE, _consumer(worker, role))
        now = time.monotonic()
        for entry in list(self._open):
            run_id = entry._run.result() if entry._run.done() else None
            if run_id is not None and now - entry.beat_at >= RUN_HEARTBEAT_SECONDS:
                entry.beat_at = now
                run = _resource(f"prefect.flow-run.{run_id}", entry._job.run_name)
                flow = _resource(f"prefect.flow.{entry.flow_id}", self._flow.name, role="flow")
                related = [flow, *_tags(generation_tags(entry._job))]
                _emit("prefect.flow-run.heartbeat", run, related)

    def stopped(self, worker: str) -> None:
        _emit(CONSUMER_STOPPED, _consumer(worker, ""))

    def open(self, job: Job) -> LedgerEntry:
        entry = _PrefectEntry(self, job)
        self._open.add(entry)
        claimed = job.claimed_at or dt.datetime.now(dt.UTC)

        async def create(client: PrefectClient) -> None:
            from prefect.states import Running

            try:
                run = await client.create_flow_run(
                    flow=self._flow,
                    name=job.run_name,
                    parameters={
                        "user": job.pseudonym or UNKNOWN_PSEUDONYM,
                        "kind": job.kind,
                        "subject": job.subject,
                        "attempt": job.attempts,
                        "worker": self.worker,
                    },
                    tags=generation_tags(job),
                    context={"insight_queue": {"parent": self._parent}},
                    state=Running(
                        timestamp=claimed,
                        message=f"attempt {job.attempts}, claimed by {self.worker}",
                    ),
                )
            except BaseException:
                entry._run.set_result(None)
                raise
            entry.flow_id = str(run.flow_id)
            entry._run.set_result(str(run.id))
            # An earlier attempt's run may be open: a spent attempt, the run the job row
            # names, or a claim the store took back from a lost worker, whose attempt H2
            # gave back and whose run's id the dying worker may never have written.
            if job.attempts > 1 or job.flow_run_id or job.losses:
                await _close_earlier_attempts(client, job, run.id, self._flow.name)

        self._writer.submit(create)
        return entry

    def _close(self, entry: _PrefectEntry, report: Report) -> None:
        from flows.ledger import Outcome

        self._open.discard(entry)
        logs = list(entry._logs)
        name = entry._job.run_name
        if report.outcome is Outcome.DONE:
            state_name, message = "completed", _done_message(report)
        elif report.outcome is Outcome.RELEASED and report.failure == Failure.STOPPED:
            state_name, message = "cancelled", report.public_message
        else:
            state_name, message = "failed", _failed_message(report)
        level = logging.INFO if state_name == "completed" else logging.WARNING
        logs.append((time.time(), level, f"{report.outcome}: {report.public_message}"))
        if report.settlement is not None and report.settlement.verdict:
            logs.append((time.time(), level, report.settlement.verdict))

        async def finish(client: PrefectClient) -> None:
            from prefect.client.schemas.actions import LogCreate
            from prefect.states import Cancelled, Completed, Failed

            run_id = entry._run.result() if entry._run.done() else None
            if run_id is None:
                logger.warning("run history: %s was never recorded, so it cannot be closed", name)
                return
            state = {"completed": Completed, "failed": Failed, "cancelled": Cancelled}[state_name]
            await client.create_logs(
                [
                    LogCreate.model_validate(
                        {
                            "name": "insight_queue.generation",
                            "level": lvl,
                            "message": self.redact(text),
                            "timestamp": dt.datetime.fromtimestamp(at, dt.UTC),
                            "flow_run_id": uuid.UUID(run_id),
                        }
                    )
                    for at, lvl, text in logs
                ]
            )
            await client.set_flow_run_state(
                uuid.UUID(run_id), state(message=self.redact(message)), force=True
            )

        self._writer.submit(finish)

    async def flush(self, timeout: float = 10.0) -> None:
        await self._writer.flush(timeout)


async def _close_earlier_attempts(
    client: PrefectClient, job: Job, current: uuid.UUID, flow_name: str
) -> None:
    """Earlier attempts of this job whose worker never ended their run: it died, say so. Found
    by their record (flow, name, user's tag, a state not final), not by an id the dying worker
    may not have written."""
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterName,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    runs = await client.read_flow_runs(
        flow_filter=FlowFilter(name=FlowFilterName(any_=[flow_name])),
        flow_run_filter=FlowRunFilter(
            name=FlowRunFilterName(any_=[job.run_name]),
            tags=FlowRunFilterTags(all_=[PROJECT_TAG, user_tag(job)]),
            state=FlowRunFilterState(
                type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])
            ),
        ),
        limit=20,
    )
    for run in runs:
        if run.id != current:
            message = "its worker stopped while this attempt was in flight; the job was taken over"
            await client.set_flow_run_state(run.id, Crashed(message=message), force=True)


def _tags(tags: list[str]) -> list[dict[str, str]]:
    return [
        {"prefect.resource.id": f"prefect.tag.{t}", "prefect.resource.role": "tag"} for t in tags
    ]


def _resource(resource_id: str, name: str, role: str = "") -> dict[str, str]:
    found = {"prefect.resource.id": resource_id, "prefect.resource.name": name}
    return found | ({"prefect.resource.role": role} if role else {})


def _consumer(worker: str, role: str) -> dict[str, str]:
    return {
        "prefect.resource.id": f"insight-queue.consumer.{worker}",
        "prefect.resource.name": worker,
        **({"insight-queue.role": role} if role else {}),
    }


def _emit(
    event: str, resource: dict[str, str], related: list[dict[str, str]] | None = None
) -> None:
    """Send an event to Prefect (queued, never blocking); a failure is logged, not raised."""
    from prefect.events import emit_event

    try:
        emit_event(event=event, resource=resource, related=related or _tags([PROJECT_TAG]))
    except Exception as exc:  # noqa: BLE001 - events never break a generation
        logger.debug("event %s not sent: %s", event, exc)


def _done_message(report: Report) -> str:
    call = f" in {report.call_seconds:.1f} s" if report.call_seconds is not None else ""
    waited = ""
    job = report.job
    if job.requested_at is not None:
        waited = f"; the screen waited {max(0.0, time.time() - job.requested_at.timestamp()):.0f} s"
    return f"generated{call} (attempt {job.attempts}, {_tokens(report)}){waited}"


def _tokens(report: Report) -> str:
    used = report.usage
    if used is None:
        return "tokens unknown"
    return f"{used.prompt_tokens + used.completion_tokens:,} tokens"


def _failed_message(report: Report) -> str:
    shown = report.public_message
    first = shown.splitlines()[0] if shown else str(report.outcome)
    what = {
        "requeued": "attempt failed, queued again",
        "failed": "failed, attempts spent",
        "released": "handed back, attempt kept",
        "lost": "claim taken over",
        "unrecorded": "outcome not recorded",
    }.get(str(report.outcome), str(report.outcome))
    spent = f" ({_tokens(report)})" if report.answered else ""
    return f"{what}{spent}: {first}"[:500]


# Runs a round of erasing reads and deletes at most.
ERASE_BATCH = 50


async def erase_runs(pseudonyms: list[str]) -> tuple[list[str], str | None]:
    """Delete the runs of these forgotten users' pseudonyms from Prefect, with their artifacts
    (Prefect deletes a run's logs with it) (D3). Returns the pseudonyms done, and why not the
    rest (Prefect unreachable, say)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        FlowRunFilter,
        FlowRunFilterTags,
    )

    done: list[str] = []
    try:
        async with get_client() as client:
            for pseudonym in pseudonyms:
                tagged = FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[f"{TAG_PREFIX_USER}{pseudonym}"])
                )
                while runs := await client.read_flow_runs(
                    flow_run_filter=tagged, limit=ERASE_BATCH
                ):
                    ids = [run.id for run in runs]
                    of_runs = ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=ids))
                    for artifact in await client.read_artifacts(artifact_filter=of_runs):
                        await client.delete_artifact(artifact.id)
                    for run_id in ids:
                        await client.delete_flow_run(run_id)
                done.append(pseudonym)
    except Exception as exc:  # noqa: BLE001 - what is left is done by a later erasure
        return done, f"the run history could not be erased now: {type(exc).__name__}: {exc}"
    return done, None
