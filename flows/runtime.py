"""The runtime: everything a process needs to run jobs, made once and looked up in one place.

A `Runtime` holds the settings, the store, the registry of generators and
scopes (with the plugin modules loaded), and the redactor. A process makes one
(`Runtime.from_env()`), and code that needs it calls `current()`, which
returns the runtime in force: the one installed with `use(...)` for the
current context (tests build their own and install it), else the process's
own, made on first use. `deployments.triggers` keeps the app side's
`Triggers` (a runtime and a client for Prefect's API) the same way, through
the same `InForce`. Nothing else in `flows` or `deployments` keeps state at
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
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from flows.consumer import Consumer, worker_name
from flows.gateway import GatewayClient
from flows.guard import Guard, NullGuard
from flows.ledger import Ledger, NullLedger
from flows.registry import Registry, default
from flows.runner import JobRunner
from queue_store import JobStore, Redactor, Settings
from queue_store.redact import install_log_redaction

logger = logging.getLogger(__name__)

T = TypeVar("T")


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
        settings = settings or Settings()
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


class InForce(Generic[T]):
    """The object in force: the one a context installed with `use`, else the process's own.

    The process's own is made by `make` on first use, once, under a lock.
    What a context installs is seen by the tasks and threads it starts.
    """

    def __init__(self, name: str, make: Callable[[], T]) -> None:
        self._installed: contextvars.ContextVar[T | None] = contextvars.ContextVar(
            name, default=None
        )
        self._make = make
        self._process: T | None = None
        self._lock = threading.Lock()

    def current(self) -> T:
        installed = self._installed.get()
        if installed is not None:
            return installed
        with self._lock:
            if self._process is None:
                self._process = self._make()
            return self._process

    @contextlib.contextmanager
    def use(self, value: T) -> Iterator[T]:
        """Install `value` for the current context, until the block ends."""
        token = self._installed.set(value)
        try:
            yield value
        finally:
            self._installed.reset(token)


_runtime: InForce[Runtime] = InForce("insight_queue_runtime", Runtime.from_env)


def current() -> Runtime:
    """The runtime in force: the one installed with `use`, else this process's own."""
    return _runtime.current()


def use(runtime: Runtime) -> contextlib.AbstractContextManager[Runtime]:
    """Install `runtime` for the current context (and the tasks and threads it starts)."""
    return _runtime.use(runtime)
