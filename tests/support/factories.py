"""Factories the tests share: settings with the tests' defaults, stores, and the flows' parts
wired as `Runtime` wires them."""

from __future__ import annotations

from typing import Any

import httpx

from flows.gateway import GatewayClient
from flows.ledger import Ledger
from flows.registry import Registry
from flows.runner import JobRunner, LeaseConfig
from queue_store import JobStore, Redactor, Settings
from queue_store.clock import ClockFunction


def settings_for(database_url: str | None = None, **overrides: Any) -> Settings:
    """Settings for a test: no gap unless asked (a test waits for nothing it does not test),
    and the rest as given."""
    values: dict[str, Any] = {"gap_seconds": 0.0}
    if database_url is not None:
        values["database_url"] = database_url
    return Settings(**{**values, **overrides})


def store_for(
    settings: Settings, *, clock: ClockFunction | None = None, create: bool = True
) -> JobStore:
    """The store of these settings (close it, or use it in a `with`)."""
    return JobStore(settings.database_url, settings=settings, clock=clock, create=create)


def gateway_client(
    settings: Settings, *, transport: httpx.AsyncBaseTransport | None = None
) -> GatewayClient:
    """The gateway client of these settings, as the runtime makes it."""
    return GatewayClient(
        settings.gateway,
        redactor=Redactor(settings.secrets()),
        call_timeout=settings.call_timeout,
        transport=transport,
    )


def job_runner(
    store: Any,
    settings: Settings,
    registry: Registry,
    client: GatewayClient,
    *,
    ledger: Ledger | None = None,
) -> JobRunner:
    """A runner of these settings, as the runtime makes it (`store`: any worker store)."""
    return JobRunner(
        store,
        LeaseConfig.of(settings),
        registry,
        client,
        redactor=Redactor(settings.secrets()),
        ledger=ledger,
    )
