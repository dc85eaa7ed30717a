"""The runtime: what a process needs to run jobs (store, registry), made by a command, a flow
run or an app, and closed by it. Nothing global is touched unless asked (`redact_logs`)."""

from __future__ import annotations

import dataclasses
from typing import Self

from flows.consumer import Consumer, ConsumerConfig, worker_name
from flows.gateway import GatewayClient
from flows.guard import Guard
from flows.ledger import Ledger
from flows.registry import Registry
from flows.runner import JobRunner, LeaseConfig
from queue_store import JobStore, Redactor, Settings
from queue_store.redact import install_log_redaction


@dataclasses.dataclass
class Runtime:
    settings: Settings
    store: JobStore
    registry: Registry
    redactor: Redactor

    @classmethod
    def open(cls, settings: Settings | None = None, *, check_schema: bool = True) -> Runtime:
        """`check_schema=False` does not touch the database."""
        settings = settings or Settings()
        registry = Registry.from_plugins(settings.plugin_modules)
        store = JobStore(settings.database_url, settings=settings, check_schema=check_schema)
        return cls(settings, store, registry, Redactor(settings.secrets()))

    def redact_logs(self) -> None:
        """Remove this runtime's secrets from every log record of this process (G5)."""
        install_log_redaction(self.redactor, ("", "prefect", "httpx"))

    def consumer(
        self,
        *,
        standby: bool = False,
        ledger: Ledger | None = None,
        guard: Guard | None = None,
        worker: str | None = None,
        max_jobs: int | None = None,
        hold_slot_when_idle: bool = False,
        role: str = "consumer",
    ) -> Consumer:
        settings = self.settings
        client = GatewayClient(
            settings.gateway, redactor=self.redactor, call_timeout=settings.call_timeout
        )
        lease = LeaseConfig.of(settings)
        runner = JobRunner(
            self.store, lease, self.registry, client, redactor=self.redactor, ledger=ledger
        )
        return Consumer(
            self.store,
            ConsumerConfig.of(settings),
            runner,
            worker=worker or worker_name(role),
            guard=guard,
            standby=standby,
            max_jobs=max_jobs,
            hold_slot_when_idle=hold_slot_when_idle,
            role=role,
        )

    def close(self) -> None:
        self.store.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
