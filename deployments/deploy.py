"""Scale-out: the same flows on a Prefect `process` work pool, workers on several machines.

`insight-queue deploy` creates (idempotently) a work pool with two queues and
registers the three deployments on it under the names `serve` uses, so the
triggers work unchanged:

- queue `interactive` (priority 1): `interactive/insight-queue`, a screen's run;
- queue `backfill` (priority 10): `backfill/insight-queue` and the safety net
  `drain/insight-queue`.

A worker polls its pool's queues in priority order, so an interactive run
waiting beside backfill runs is started first. Every machine runs
`prefect worker start --pool insight-queue` with the same `PREFECT_API_URL` and
`AI_JOB_*` settings; the store (PostgreSQL) keeps the gateway guarded across
all of them, whatever Prefect starts where.

The code is pulled from `source` when a run starts: a git URL, or a path that
holds this project at the same place on every machine.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from typing import Any

from deployments.triggers import DEPLOYMENT
from flows.limits import ensure_gateway_limit
from queue_store import Settings

logger = logging.getLogger(__name__)

POOL = "insight-queue"
INTERACTIVE_QUEUE = "interactive"
BACKFILL_QUEUE = "backfill"
# Lower is served first.
QUEUE_PRIORITIES = {INTERACTIVE_QUEUE: 1, BACKFILL_QUEUE: 10}
SAFETY_NET_SECONDS = 60


@dataclasses.dataclass(frozen=True)
class Deployed:
    pool: str
    deployments: dict[str, str]  # name -> id


def ensure_pool(pool: str = POOL) -> None:
    """The `process` work pool and its two prioritised queues; idempotent."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_work_pool(pool)
        except ObjectNotFound:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        for name, priority in QUEUE_PRIORITIES.items():
            try:
                queue = client.read_work_queue_by_name(name, work_pool_name=pool)
            except ObjectNotFound:
                with contextlib.suppress(ObjectAlreadyExists):  # another deploy won the race
                    client.create_work_queue(name=name, work_pool_name=pool, priority=priority)
                continue
            if queue.priority != priority:
                client.update_work_queue(queue.id, priority=priority)


def deploy(
    source: str,
    *,
    pool: str = POOL,
    safety_net_seconds: int = SAFETY_NET_SECONDS,
    job_variables: dict[str, Any] | None = None,
) -> Deployed:
    """Register the three deployments on the pool; returns their ids."""
    from flows.flows import backfill, drain, interactive

    ensure_pool(pool)
    ensure_gateway_limit(Settings.from_env().concurrency)
    plan: list[tuple[Any, str, dict[str, Any]]] = [
        (interactive, INTERACTIVE_QUEUE, {}),
        (backfill, BACKFILL_QUEUE, {}),
        (drain, BACKFILL_QUEUE, {"interval": safety_net_seconds}),
    ]
    ids: dict[str, str] = {}
    for flow_object, queue, extra in plan:
        entrypoint = f"flows/flows.py:{flow_object.fn.__name__}"
        remote = flow_object.from_source(source=source, entrypoint=entrypoint)
        deployment_id = remote.deploy(
            name=DEPLOYMENT,
            work_pool_name=pool,
            work_queue_name=queue,
            tags=["insight-queue"],
            job_variables=job_variables or {},
            build=False,
            push=False,
            print_next_steps=False,
            **extra,
        )
        ids[f"{flow_object.name}/{DEPLOYMENT}"] = str(deployment_id)
        logger.info("deployed %s/%s to %s/%s", flow_object.name, DEPLOYMENT, pool, queue)
    return Deployed(pool, ids)
