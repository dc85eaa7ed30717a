"""The runtime: everything a process needs to run jobs, made once and looked up in one place.

A `Runtime` holds the settings, the store, the registry of generators and
scopes (with the plugin modules loaded), and the redactor. A process makes one
(`Runtime.from_env()`), and code that needs it calls `current()`, which
returns the runtime in force: the one installed with `use(...)` for the
current context (tests build their own and install it), else the process's
own, made on first use. `deployments.triggers` keeps the app side's
`Triggers` (a runtime and a client for Prefect's API) the same way, with its
own `use(...)`. Nothing else in `flows` or `deployments` keeps state at
module level.

What each consumer needs per run (a gateway client, the run history, the
gateway slot) is made from the runtime by `consumer(...)`.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import threading
from collections.abc import Iterator

from flows.consumer import Consumer, worker_name
from flows.gateway import GatewayClient
from flows.guard import Guard, NullGuard
from flows.ledger import Ledger, NullLedger
from flows.registry import Registry, default
from flows.runner import JobRunner
from queue_store import JobStore, Redactor, Settings
from queue_store.redact import install_log_redaction

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class Runtime:
    settings: Settings
    store: JobStore
    registry: Registry
    redactor: Redactor

    @classmethod
    def from_env(
        cls,
        settings: Settings | None = None,
        registry: Registry | None = None,
        *,
        check_schema: bool = True,
    ) -> Runtime:
        """The runtime for these settings (default: the environment), plugins loaded.

        The store's schema is checked as it is opened, which needs the
        database; `check_schema=False` opens it without touching the database.
        """
        settings = settings or Settings.from_env()
        redactor = Redactor.for_settings(settings)
        install_log_redaction(redactor, ("", "prefect", "httpx"))
        registry = registry or default
        registry.load(settings.plugin_modules)
        store = JobStore(settings.database_url, settings=settings, check_schema=check_schema)
        return cls(settings, store, registry, redactor)

    def client(self) -> GatewayClient:
        return GatewayClient(self.settings, redactor=self.redactor)

    def runner(self, ledger: Ledger | None = None) -> JobRunner:
        return JobRunner(
            self.store,
            self.settings,
            self.registry,
            self.client(),
            ledger=ledger or NullLedger(),
            redactor=self.redactor,
        )

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
        return Consumer(
            self.store,
            self.settings,
            self.runner(ledger),
            worker=worker or worker_name(role),
            guard=guard or NullGuard(),
            standby=standby,
            max_jobs=max_jobs,
            hold_slot_when_idle=hold_slot_when_idle,
            role=role,
        )

    def close(self) -> None:
        self.store.close()


_installed: contextvars.ContextVar[Runtime | None] = contextvars.ContextVar(
    "insight_queue_runtime", default=None
)
_process: Runtime | None = None
_process_lock = threading.Lock()


def current() -> Runtime:
    """The runtime in force: the one installed with `use`, else this process's own."""
    installed = _installed.get()
    if installed is not None:
        return installed
    global _process
    with _process_lock:
        if _process is None:
            _process = Runtime.from_env()
        return _process


@contextlib.contextmanager
def use(runtime: Runtime) -> Iterator[Runtime]:
    """Install `runtime` for the current context (and the tasks and threads it starts)."""
    token = _installed.set(runtime)
    try:
        yield runtime
    finally:
        _installed.reset(token)
