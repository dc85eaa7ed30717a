"""Scale-out: the same flows on a Prefect `process` work pool, workers on several machines.

`insight-queue deploy` creates (idempotently) a work pool with two queues and
registers the three deployments on it under the names `serve` uses, so the
triggers work unchanged:

- queue `interactive` (priority 1): `interactive/insight-queue`, a screen's run;
- queue `backfill` (priority 10): `backfill/insight-queue` and the safety net
  `drain/insight-queue` (hourly: with `insight-queue consume` running beside
  the workers, nothing waits for it).

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

from deployments import table
from flows.limits import ensure_gateway_limit
from queue_store import Settings

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Deployed:
    pool: str
    deployments: dict[str, str]  # name -> id


def ensure_pool(pool: str = table.POOL) -> None:
    """The `process` work pool and its two prioritised queues; idempotent."""
    from prefect import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

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


def deploy(
    source: str,
    *,
    pool: str = table.POOL,
    job_variables: dict[str, Any] | None = None,
) -> Deployed:
    """Register every deployment of the table on the pool; returns their ids."""
    from flows import flows

    ensure_pool(pool)
    ensure_gateway_limit(Settings().concurrency)
    ids: dict[str, str] = {}
    for entry in table.DEPLOYMENTS:
        flow_object = getattr(flows, entry.function)
        remote = flow_object.from_source(source=source, entrypoint=entry.entrypoint)
        extra: dict[str, Any] = {}
        if entry.interval_seconds:
            extra["interval"] = entry.interval_seconds
        if entry.concurrency_limit:
            extra["concurrency_limit"] = entry.concurrency_limit
        deployment_id = remote.deploy(
            name=table.DEPLOYMENT,
            work_pool_name=pool,
            work_queue_name=entry.queue,
            tags=["insight-queue"],
            description=entry.description,
            job_variables=job_variables or {},
            build=False,
            push=False,
            print_next_steps=False,
            **extra,
        )
        ids[entry.name] = str(deployment_id)
        logger.info("deployed %s to %s/%s", entry.name, pool, entry.queue)
    return Deployed(pool, ids)
