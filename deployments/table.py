"""The one table of deployments for `serve`, `deploy` and the triggers; no Prefect import."""

from __future__ import annotations

import dataclasses

DEPLOYMENT = "insight-queue"
POOL = "insight-queue"
INTERACTIVE_QUEUE = "interactive"
BACKFILL_QUEUE = "backfill"
# A worker serves its pool's queues in priority order: lower first.
QUEUE_PRIORITIES = {INTERACTIVE_QUEUE: 1, BACKFILL_QUEUE: 10}
# The drain's interval on a work pool, where no warm consumer may be running:
# an idle hour adds one run to the history.
SAFETY_NET_SECONDS = 3600
# Backfill runs following their scopes at once; more wait for a slot without
# a process (each run follows, the consumer does the work).
BACKFILL_RUNS_AT_ONCE = 4
# Retention (D2): each run is one row of the history; a forgotten user's runs go at the next one
# if Prefect was away.
PRUNE_SECONDS = 3600


@dataclasses.dataclass(frozen=True)
class Deployment:
    flow: str  # the flow's name, as Prefect knows it, and its function in flows/flows.py
    queue: str  # work queue on a pool (scale-out)
    description: str
    interval_seconds: int | None = None  # scheduled on a work pool
    concurrency_limit: int | None = None
    scheduled_under_serve: bool = False  # also scheduled by `serve` (the drain is not)

    @property
    def name(self) -> str:
        """`flow/deployment`, as `read_deployment_by_name` takes it."""
        return f"{self.flow}/{DEPLOYMENT}"


BACKFILL = Deployment(
    "backfill",
    BACKFILL_QUEUE,
    "after a data sync: queue every scope of a user and see them through",
    concurrency_limit=BACKFILL_RUNS_AT_ONCE,
)
INTERACTIVE = Deployment(
    "interactive",
    INTERACTIVE_QUEUE,
    "a screen is open: its insight goes to the front; the run tells the screen's story",
)
DRAIN = Deployment(
    "drain",
    BACKFILL_QUEUE,
    "run what is runnable, then stop (the safety net where no consumer stands by)",
    interval_seconds=SAFETY_NET_SECONDS,
)
PRUNE = Deployment(
    "prune",
    BACKFILL_QUEUE,
    "retention: delete what is past its time, and the runs of forgotten users",
    interval_seconds=PRUNE_SECONDS,
    concurrency_limit=1,
    scheduled_under_serve=True,
)

DEPLOYMENTS: tuple[Deployment, ...] = (INTERACTIVE, BACKFILL, DRAIN, PRUNE)
