"""`insight-queue deploy`: the flows on a Prefect `process` work pool, workers on several machines;
the store (on PostgreSQL) guards the gateway whatever Prefect starts where."""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import uuid

from prefect import get_client
from prefect.automations import Automation
from prefect.client.schemas.actions import WorkPoolCreate
from prefect.client.schemas.objects import StateType
from prefect.events.actions import ChangeFlowRunState, RunDeployment
from prefect.events.schemas.automations import EventTrigger, Posture
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.utilities.asyncutils import run_coro_as_sync

from deployments import table
from flows import flows
from flows.history import (
    CONSUMER_ALIVE,
    CONSUMER_STOPPED,
    PROJECT_TAG,
    RUN_HEARTBEAT_ENV,
    RUN_HEARTBEAT_SECONDS,
)
from flows.limits import ensure_gateway_limit
from queue_store import Settings

# A run that sent no heartbeat for this long is Crashed: three beats missed.
CRASH_AFTER_SECONDS = 3 * RUN_HEARTBEAT_SECONDS
# A run Pending this long was lost while its worker started it.
PENDING_SECONDS = 120.0
# A consumer silent this long (it says it is alive every AI_JOB_HEARTBEAT_SECONDS,
# 5 s by default) is lost: a drain starts, well before its claims' lease runs out.
CONSUMER_LOST_SECONDS = 30.0
# State names a run ends in (events are named after the state's name).
FINAL_STATES = ("Completed", "Failed", "Crashed", "Cancelled", "TimedOut", "Cached")

logger = logging.getLogger(__name__)


def ensure_pool(pool: str) -> None:
    """The `process` work pool and its two prioritised queues; idempotent."""
    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        for name, priority in table.QUEUE_PRIORITIES.items():
            try:
                queue = client.read_work_queue_by_name(name, work_pool_name=pool)
            except ObjectNotFound:
                with contextlib.suppress(ObjectAlreadyExists):  # another deploy won the race
                    client.create_work_queue(name=name, work_pool_name=pool, priority=priority)
                continue
            if queue.priority != priority:
                client.update_work_queue(queue.id, priority=priority)


def deploy(settings: Settings, source: str, pool: str) -> dict[str, str]:
    """The table's deployments on the pool (their runs send heartbeats), and the automations."""
    ensure_pool(pool)
    ensure_gateway_limit(settings.concurrency)
    variables = {"env": RUN_HEARTBEAT_ENV}
    ids: dict[str, str] = {}
    for entry in table.DEPLOYMENTS:
        remote = getattr(flows, entry.flow).from_source(
            source=source, entrypoint=f"flows/flows.py:{entry.flow}"
        )
        deployment_id = remote.deploy(
            name=table.DEPLOYMENT,
            work_pool_name=pool,
            work_queue_name=entry.queue,
            tags=["insight-queue"],
            description=entry.description,
            job_variables=variables,
            build=False,
            push=False,
            print_next_steps=False,
            interval=entry.interval_seconds,
            concurrency_limit=entry.concurrency_limit,
        )
        ids[entry.name] = str(deployment_id)
        logger.info("deployed %s to %s/%s", entry.name, pool, entry.queue)
    ensure_automations(ids[table.DRAIN.name])
    return ids


def automations(drain_deployment_id: str) -> list[Automation]:
    """Prefect automations that end a lost machine's runs (W3: nothing else would) and start a
    `drain` on any live machine when a consumer stops saying it is alive."""
    ours = {"prefect.resource.role": "tag", "prefect.resource.id": f"prefect.tag.{PROJECT_TAG}"}
    ended = {f"prefect.flow-run.{state}" for state in FINAL_STATES}
    heartbeat = "prefect.flow-run.heartbeat"

    def crash(after: str, expect: set[str], within: float, why: str) -> Automation:
        message = f"its machine was lost: {why} for {within:g} s"
        return Automation(
            name=f"{PROJECT_TAG}: crash runs {why}",
            description=f"A run of {PROJECT_TAG} {why} for {within:g} s: its machine is gone.",
            trigger=EventTrigger(
                posture=Posture.Proactive,
                after={after},
                expect=expect | ended,
                match={"prefect.resource.id": "prefect.flow-run.*"},
                match_related=ours,
                for_each={"prefect.resource.id"},
                threshold=1,
                within=dt.timedelta(seconds=within),
            ),
            actions=[ChangeFlowRunState(state=StateType.CRASHED, message=message)],
        )

    pending, running = "prefect.flow-run.Pending", "prefect.flow-run.Running"
    drain = uuid.UUID(drain_deployment_id)
    return [
        crash(heartbeat, {heartbeat}, CRASH_AFTER_SECONDS, "that sent no heartbeat"),
        # A run killed as it started may never have sent its first heartbeat: the
        # server's own Running event starts the watch. A trigger of its own, as one
        # bucket for both would close at the first beat and watch nothing after it.
        crash(running, {heartbeat}, CRASH_AFTER_SECONDS, "that started and sent no heartbeat"),
        crash(pending, {running}, PENDING_SECONDS, "that stayed pending"),
        Automation(
            name=f"{PROJECT_TAG}: drain when a consumer is lost",
            description="A consumer stopped saying it is alive: a drain takes its work.",
            trigger=EventTrigger(
                posture=Posture.Proactive,
                after={CONSUMER_ALIVE},
                expect={CONSUMER_ALIVE, CONSUMER_STOPPED},
                match={"prefect.resource.id": "insight-queue.consumer.*"},
                for_each={"prefect.resource.id"},
                threshold=1,
                within=dt.timedelta(seconds=CONSUMER_LOST_SECONDS),
            ),
            actions=[RunDeployment(source="selected", deployment_id=drain, parameters={})],
        ),
    ]


def ensure_automations(drain_deployment_id: str) -> None:
    """By name; idempotent."""

    async def upsert(wanted: Automation) -> None:
        try:
            wanted.id = (await Automation.aread(name=wanted.name)).id
        except ValueError:  # none of that name yet
            await wanted.acreate()
        else:
            await wanted.aupdate()

    for wanted in automations(drain_deployment_id):
        run_coro_as_sync(upsert(wanted))
        logger.info("automation %r in place", wanted.name)
