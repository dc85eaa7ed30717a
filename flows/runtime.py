"""The runtime: what a process needs to run jobs, made explicitly by whoever needs it.

`Runtime.open(settings)` makes the store and a registry filled by the plugin
modules of `AI_JOB_PLUGINS`; nothing is made on import or on first use, and
nothing global is touched unless asked (`redact_logs`). A command, a flow run
or an app makes one and closes it; tests make their own.
"""

from __future__ import annotations

import dataclasses
from types import TracebackType
from typing import Self

from flows.consumer import Consumer, worker_name
from flows.gateway import GatewayClient
from flows.guard import Guard
from flows.ledger import Ledger
from flows.registry import Registry
from flows.runner import JobRunner
from queue_store import JobStore, Redactor, Settings
from queue_store.redact import install_log_redaction


@dataclasses.dataclass
class Runtime:
    settings: Settings
    store: JobStore
    registry: Registry
    redactor: Redactor

    @classmethod
    def open(
        cls,
        settings: Settings | None = None,
        registry: Registry | None = None,
        *,
        check_schema: bool = True,
    ) -> Runtime:
        """The runtime for these settings (default: the environment): registry, then store.

        Opening the store checks (and on SQLite creates) its schema, which needs
        the database; `check_schema=False` opens it without touching it.
        """
        settings = settings or Settings()
        registry = registry or Registry.from_plugins(settings.plugin_modules)
        store = JobStore(settings.database_url, settings=settings, check_schema=check_schema)
        return cls(settings, store, registry, Redactor.for_settings(settings))

    def redact_logs(self) -> None:
        """Remove this runtime's secrets from every log record of this process (ours, Prefect's,
        httpx's)."""
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
        client = GatewayClient(self.settings, redactor=self.redactor)
        runner = JobRunner(
            self.store, self.settings, self.registry, client, ledger=ledger, redactor=self.redactor
        )
        return Consumer(
            self.store,
            self.settings,
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

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
