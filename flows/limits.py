"""The `gateway` tag limit, and the repair of what a dead process left of it and of the run
history. Prefect keeps the limit as the global concurrency limit `tag:gateway`."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Iterable

from prefect import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
from prefect.concurrency._asyncio import arelease_concurrency_slots_with_lease
from prefect.states import Crashed
from prefect.utilities.asyncutils import run_coro_as_sync

from flows.guard import GATEWAY_TAG

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SlotCheck:
    limit: int
    counted: int  # slots the limit believes are taken
    live: int  # task runs holding a live lease
    repaired: bool


def ensure_gateway_limit(limit: int, tag: str = GATEWAY_TAG) -> int:
    """Create or update the tag limit to `limit`; returns the limit in force."""
    if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"limit: must be an int of at least 1, got {limit!r}")
    with get_client(sync_client=True) as client:
        # The endpoint is an upsert: it creates the limit or updates its value.
        client.create_concurrency_limit(tag=tag, concurrency_limit=limit)
        current = client.read_concurrency_limit_by_tag(tag)
    logger.info("tag concurrency limit %r = %d", tag, current.concurrency_limit)
    return int(current.concurrency_limit)


def repair_gateway_slots(tag: str = GATEWAY_TAG, *, repair: bool = True) -> SlotCheck:
    """Give back slots counted as taken but held by no live lease: a server restart with
    in-memory lease storage forgets the leases but not the count, and every later task waits."""
    with get_client(sync_client=True) as client:
        by_tag = client.read_concurrency_limit_by_tag(tag)
        limit = client.read_global_concurrency_limit_by_name(f"tag:{tag}")
        counted, live = int(limit.active_slots), len(by_tag.active_slots)
        leaked = counted > live
        if leaked and repair:
            client.update_global_concurrency_limit(
                name=f"tag:{tag}", concurrency_limit=GlobalConcurrencyLimitUpdate(active_slots=live)
            )
            logger.warning("gave back %d leaked %r slot(s)", counted - live, tag)
    return SlotCheck(int(limit.limit), counted, live, leaked and repair)


def give_back_leases(lease_ids: Iterable[str]) -> int:
    """Release `gateway` slot leases a dead process held (recorded by it), at once."""
    given = 0
    for lease_id in lease_ids:
        with contextlib.suppress(Exception):  # already expired or released: nothing to give
            run_coro_as_sync(arelease_concurrency_slots_with_lease(uuid.UUID(lease_id)))
            given += 1
    return given


def mark_crashed(run_ids: Iterable[str], message: str) -> int:
    """End these runs Crashed with `message` if they are still running; returns how many."""
    ended = 0
    with get_client(sync_client=True) as client:
        for run_id in run_ids:
            try:
                run = client.read_flow_run(uuid.UUID(run_id))
            except Exception:  # noqa: BLE001 - a run that cannot be read is left as it is
                continue
            if run.state is not None and not run.state.is_final():
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                ended += 1
    return ended
