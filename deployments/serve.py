"""`insight-queue serve`: a local Prefect server (unless `PREFECT_API_URL` names one), the warm
consumer and the deployments, in one process per data directory."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import fcntl
import hashlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
from prefect.context import refresh_global_settings_context
from prefect.deployments.runner import RunnerDeployment
from prefect.logging.handlers import APILogWorker
from prefect.runner import Runner

from deployments import processes, table
from deployments.prefect_api import ServeState
from deployments.stack import PrefectServer, client_env, is_healthy
from flows import flows
from flows.consumer import Consumer, short_hostname
from flows.flows import prefect_consumer
from flows.history import RUN_HEARTBEAT_ENV
from flows.limits import ensure_gateway_limit, give_back_leases, mark_crashed
from flows.runtime import Runtime
from queue_store import JobStore, Settings, files, migrate

logger = logging.getLogger(__name__)

RUNNER_POLL_SECONDS = 1  # how often the runner looks for flow runs (Prefect's default: 10 s)
RUN_LIMIT = 20  # flow runs at once (each follows its jobs; the consumer does the work)
STOP_CONSUMER_SECONDS = 8.0
STOP_RUNNER_SECONDS = 5.0
STOP_SERVER_SECONDS = 5.0
RUNNER_RESTART_SECONDS = 2.0
RUNNER_RESTART_MAX_SECONDS = 60.0


class AlreadyServing(RuntimeError):
    """Another serve holds this data directory."""


def serve_worker(settings: Settings) -> str:
    """Stable for this host and data directory: a restart takes back its claims at once."""
    where = hashlib.sha256(str(settings.data_dir.resolve()).encode()).hexdigest()[:10]
    return f"serve@{short_hostname()}:{where}"


@contextlib.contextmanager
def _data_dir_lock(settings: Settings) -> Iterator[None]:
    files.private_directory(settings.data_dir)
    with open(settings.data_dir / "serve.lock", "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "?"
            raise AlreadyServing(
                f"another `insight-queue serve` (pid {holder}) is running for {settings.data_dir}"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(str(os.getpid()))
        handle.flush()
        yield


def prepare(runtime: Runtime, worker: str, upgrade: bool, leases_left: tuple[str, ...]) -> None:
    """The store's schema, the `gateway` limit, leaked slots, and what a previous serve left."""
    settings = runtime.settings
    if upgrade:
        migrate.upgrade(settings.database_url)
    ensure_gateway_limit(settings.concurrency)
    if leases_left and (given := give_back_leases(leases_left)):
        logger.warning("gave back %d gateway slot(s) a previous serve held", given)
    # No blanket repair of the slot count here: a consumer's lease has no task
    # run, so Prefect cannot tell it from a leak. Leases are file-backed, and a
    # crashed serve's own are given back above; others lapse on their own.
    if taken := runtime.store.recover(worker):
        names = ", ".join(j.run_name for j in taken)
        logger.warning(
            "took back %d claim(s) of a previous serve or of dead workers: %s", len(taken), names
        )
        why = "the worker stopped while this call was in flight; its job was taken back"
        mark_crashed([j.flow_run_id for j in taken if j.flow_run_id], why)


def _prefect_away(error: BaseException | None) -> bool:
    """Whether the runner failed because Prefect could not be reached (an outage, not a fault)."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        if isinstance(error, httpx.TransportError | ConnectionError | TimeoutError):
            return True
        if isinstance(error, httpx.HTTPStatusError) and error.response.status_code >= 500:
            return True
        error = error.__cause__ or error.__context__
    return False


class _ConsumerThread(threading.Thread):
    def __init__(self, consumer: Consumer, ledger: Any) -> None:
        super().__init__(name="consumer", daemon=True)
        self.consumer = consumer
        self._ledger = ledger
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            asyncio.run(self._consume())
        except BaseException as exc:  # noqa: BLE001 - reported by serve
            self.error = exc

    async def _consume(self) -> None:
        try:
            await self.consumer.run()
        finally:
            await self._ledger.flush(timeout=5.0)


class _RunnerThread(threading.Thread):
    """Prefect's runner for the deployments. Not in the main thread, it installs no signal
    handler of its own: serve decides how it stops. It stops for good after a few polls that
    could not reach its server: another starts after a pause, doubling up to the maximum."""

    def __init__(self) -> None:
        super().__init__(name="prefect-runner", daemon=True)
        self.error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: Any = None
        self._served = False  # a runner got going once
        self._stopping = threading.Event()

    def run(self) -> None:
        pause = RUNNER_RESTART_SECONDS
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                asyncio.run(self._serve())
                self.error = None
            except BaseException as exc:  # noqa: BLE001 - reported by serve
                self.error = exc
            if self._stopping.is_set() or not (self._served or _prefect_away(self.error)):
                return  # stopped, or it never got going: not an outage, a fault to report
            if time.monotonic() - started > RUNNER_RESTART_MAX_SECONDS:
                pause = RUNNER_RESTART_SECONDS  # it had been running a while
            logger.warning(
                "Prefect's runner stopped (%s); starting it again in %g s", self.error, pause
            )
            self._stopping.wait(pause)
            pause = min(pause * 2, RUNNER_RESTART_MAX_SECONDS)
            self._served = True

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._runner = Runner(
            name=f"insight-queue-{os.getpid()}", limit=RUN_LIMIT, pause_on_shutdown=False
        )
        for entry in table.DEPLOYMENTS:
            deployment = RunnerDeployment.from_flow(
                getattr(flows, entry.flow),
                name=table.DEPLOYMENT,
                tags=["insight-queue"],
                description=entry.description,
                concurrency_limit=entry.concurrency_limit,
                interval=entry.interval_seconds if entry.scheduled_under_serve else None,
            )
            await self._runner.add_deployment(deployment)
        self._served = True
        await self._runner.start()

    def stop(self, timeout: float) -> None:
        self._stopping.set()
        loop, runner = self._loop, self._runner
        if loop is not None and runner is not None and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop has just closed
                asyncio.run_coroutine_threadsafe(runner.astop(), loop)
        self.join(timeout)


def serve(settings: Settings, prefect_port: int, *, upgrade: bool, ui: bool) -> None:
    """Run until a signal; stop everything started, within seconds. `upgrade` migrates a
    PostgreSQL store too (SQLite always is)."""
    serving = _Serving(settings)
    with _data_dir_lock(settings):
        try:
            with contextlib.suppress(KeyboardInterrupt), processes.stop_signals():
                serving.start(prefect_port, upgrade, ui)
                serving.supervise()
        finally:
            serving.stop()


class _Serving:
    """What serve started, so that it stops in order whenever it is asked to."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.server: PrefectServer | None = None
        self.state: ServeState | None = None
        self.consumer_thread: _ConsumerThread | None = None
        self.runner_thread: _RunnerThread | None = None

    def start(self, prefect_port: int, upgrade: bool, ui: bool) -> None:
        settings = self.settings
        api_url = os.environ.get("PREFECT_API_URL", "").strip()
        home = settings.data_dir / "prefect"
        if not api_url:
            port = processes.free_port(prefect_port)
            if port != prefect_port:
                print(f"port {prefect_port} is taken; the Prefect server uses {port}", flush=True)
            self.server = PrefectServer(home, port, ui=ui, retention_days=settings.retention_days)
            self.server.start()
            api_url = self.server.api_url
        elif not is_healthy(api_url):
            raise RuntimeError(f"PREFECT_API_URL={api_url} does not answer")
        # This process and the flow runs it starts report to that server. Prefect reads its
        # settings once, when first imported: have it read them again.
        processes.export_to_children(
            # The runs beat as a pool's do: where `deploy` put its automations, a run
            # that beats no more is ended as lost (W3).
            overrides=client_env(api_url, home) | RUN_HEARTBEAT_ENV,
            PREFECT_RUNNER_POLL_FREQUENCY=str(RUNNER_POLL_SECONDS),
        )
        refresh_global_settings_context()
        runtime = Runtime.open(settings)
        runtime.redact_logs()
        worker = serve_worker(settings)
        left = ServeState.read_left(settings)
        prepare(runtime, worker, upgrade, left.leases if left else ())
        ui_url = api_url.removesuffix("/api")
        state = self.state = ServeState(api_url, ui_url, os.getpid(), worker)
        state.write(settings)

        def record_leases(held: frozenset[str]) -> None:
            # Where a restart after a crash finds the slots to give back.
            dataclasses.replace(state, leases=tuple(sorted(held))).write(settings)

        consumer, ledger = prefect_consumer(
            runtime,
            "consumer",
            worker=worker,
            on_change=record_leases,
            standby=True,
            hold_slot_when_idle=True,  # a screen never waits for a slot
        )
        self.consumer_thread = _ConsumerThread(consumer, ledger)
        self.consumer_thread.start()
        self.runner_thread = _RunnerThread()
        self.runner_thread.start()
        print(f"insight-queue serving; Prefect UI at {ui_url}", flush=True)

    def supervise(self) -> None:
        """Until the consumer ends, or the runner with a fault."""
        assert self.consumer_thread is not None and self.runner_thread is not None
        while self.consumer_thread.is_alive() and self.runner_thread.is_alive():
            time.sleep(0.5)
        for thread in (self.consumer_thread, self.runner_thread):
            if thread.error is not None:
                raise RuntimeError(f"{thread.name} stopped: {thread.error}") from thread.error

    def stop(self) -> None:
        """In order: the call in flight, the runner's runs, the Prefect server."""
        if self.consumer_thread is not None:
            logger.info("stopping: the consumer")
            self.consumer_thread.consumer.stop("serve is stopping")
            self.consumer_thread.join(STOP_CONSUMER_SECONDS)
        if self.runner_thread is not None:
            logger.info("stopping: Prefect's runner and its runs")
            self.runner_thread.stop(STOP_RUNNER_SECONDS)
        # Whatever the runner could not stop (the Prefect server may be gone
        # already), and nothing else of ours, by PID.
        server = self.server.process if self.server is not None else None
        for pid in processes.children():
            if server is None or pid != server.pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, 15)
        if self.state is not None:
            self.state.remove(self.settings)
        try:  # the runs' last log lines, while the Prefect server is still up
            APILogWorker.drain_all(timeout=3.0)
        except Exception as exc:  # noqa: BLE001 - history only; stopping goes on
            logger.warning("could not flush the run logs to Prefect: %s", exc)
        if self.server is not None:
            # Everything that wrote to it has stopped: it need not wait for clients.
            logger.info("stopping: the Prefect server")
            self.server.stop(grace_seconds=STOP_SERVER_SECONDS)
        with contextlib.suppress(Exception), JobStore(settings=self.settings) as store:
            store.presence(serve_worker(self.settings), "consumer", leaving=True)
