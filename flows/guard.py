"""The second guard of the gateway, independent of the store: a slot of Prefect's `gateway` tag
limit, as its engine takes for task runs tagged `gateway`. It never chooses the job."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import httpx

logger = logging.getLogger(__name__)

GATEWAY_TAG = "gateway"
# Prefect's shortest slot lease. A consumer's is its claim's, so that a lost machine's slot frees
# when its claim does, but never shorter.
SLOT_LEASE_SECONDS = 60.0
SLOT_RENEWALS_PER_LEASE = 4  # a missed renewal or two still leave the lease alive


class GuardUnavailable(Exception):
    """The guard could not be asked for a slot (its server is away): no call may start."""


@dataclasses.dataclass
class Held:
    lost: bool = False  # the guard took the slot back (its lease lapsed)


class Guard(Protocol):
    def slot(self) -> contextlib.AbstractAsyncContextManager[Held]:
        """Hold one slot for the block (waits for one); `GuardUnavailable` if none can be asked."""


class NullGuard:
    """No second guard: the store's claim alone keeps the limit."""

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Held]:
        yield Held()


class PrefectSlotGuard:
    """One slot per `slot()` block, on a lease that expires by itself if this process dies."""

    def __init__(
        self, lease_seconds: float, on_change: Callable[[frozenset[str]], None] | None = None
    ) -> None:
        self._name = f"tag:{GATEWAY_TAG}"
        self._lease_seconds = max(lease_seconds, SLOT_LEASE_SECONDS)
        # `on_change` records the leases held where a restart finds them, to give them back.
        self.lease_ids: set[str] = set()
        self._on_change = on_change

    def _changed(self) -> None:
        if self._on_change is not None:
            try:
                self._on_change(frozenset(self.lease_ids))
            except Exception as exc:  # noqa: BLE001 - bookkeeping never blocks a call
                logger.warning("could not record the gateway slot leases: %s", exc)

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Held]:
        from prefect.concurrency._asyncio import (
            ConcurrencySlotAcquisitionError,
            aacquire_concurrency_slots_with_lease,
            arelease_concurrency_slots_with_lease,
        )

        try:
            response = await aacquire_concurrency_slots_with_lease(
                [self._name],
                1,
                lease_duration=self._lease_seconds,
                strict=False,
                suppress_warnings=True,
            )
        except ConcurrencySlotAcquisitionError as exc:
            cause = exc.__cause__ or exc
            raise GuardUnavailable(
                f"no `{self._name}` slot could be asked for ({type(cause).__name__}: {cause})"
            ) from exc
        held = Held()
        if not response.limits:
            # No `gateway` limit exists: nothing to hold (setup-limit creates it).
            yield held
            return
        lease_id = response.lease_id
        self.lease_ids.add(str(lease_id))
        self._changed()
        keeper = asyncio.create_task(self._renew(lease_id, held), name="gateway-slot-lease")
        try:
            yield held
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
            with contextlib.suppress(Exception):
                await asyncio.shield(arelease_concurrency_slots_with_lease(lease_id))
            self.lease_ids.discard(str(lease_id))
            self._changed()

    async def _renew(self, lease_id: uuid.UUID, held: Held) -> None:
        # Prefect's own renewal gives up after a few failures while its holder goes on; these go
        # on through a server outage, and a lapsed lease tells the holder to take a new slot.
        from prefect.client.orchestration import get_client

        interval = self._lease_seconds / SLOT_RENEWALS_PER_LEASE
        while True:
            await asyncio.sleep(interval)
            try:
                async with get_client() as client:
                    await client.renew_concurrency_lease(lease_id, self._lease_seconds)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code in (404, 410):
                    logger.warning("the `%s` slot lease lapsed; a new slot is needed", self._name)
                    held.lost = True
                    return
                logger.warning("renewing the `%s` slot lease failed: %s", self._name, exc)
            except Exception as exc:  # noqa: BLE001 - the server may be restarting: keep trying
                logger.warning("renewing the `%s` slot lease failed: %s", self._name, exc)
