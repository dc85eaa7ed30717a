"""The second, independent guard of the gateway: a slot of the `gateway` tag limit.

The store's claim is the lease on the gateway; Prefect's `gateway` tag
concurrency limit (`AI_JOB_CONCURRENCY` slots) is a second guard that does not
trust the store. A consumer holds a slot while it claims and calls, taken
before the claim, so the job claimed is the most urgent one at the moment the
gateway frees up.

`NullGuard` takes nothing (tests, and the store-only paths);
`flows.history.PrefectSlotGuard` takes a slot of the tag limit through
Prefect's concurrency API, the same slots Prefect's engine takes for task runs
tagged `gateway`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Protocol

GATEWAY_TAG = "gateway"


class GuardUnavailable(Exception):
    """The guard could not be asked for a slot (its server is away): no call may start."""


class Held:
    """A slot held: `lost` turns true if the guard took it back (its lease lapsed)."""

    def __init__(self) -> None:
        self.lost = False


class Guard(Protocol):
    def slot(self) -> contextlib.AbstractAsyncContextManager[Held]:
        """Hold one slot for the duration of the block (waits for one).

        Raises `GuardUnavailable` when no slot can be asked for now.
        """


class NullGuard:
    """No second guard: the store's claim alone keeps the limit."""

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[Held]:
        yield Held()
