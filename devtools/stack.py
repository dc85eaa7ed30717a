"""The product's servers as the demo, the tests and the benchmarks run them.

`ServeProcess` is `insight-queue serve` as a subprocess, ready once its
deployments are registered and its consumer says it is alive, stopped by its
PID (with its process group). `ApiServer` serves an ASGI app (the API) on a
loopback port from a thread of this process. `Machine` plays one machine of
a work pool on this host: its processes in a directory of their own.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Self

import uvicorn
from starlette.types import ASGIApp

from deployments import processes, table
from deployments.http.serving import GuardedH11Protocol
from deployments.prefect_api import PrefectApi, PrefectUnavailable
from deployments.stack import client_env, executable
from queue_store import JobStore, Settings, StoreError

SERVE_READY_SECONDS = 180.0


class ServeProcess:
    """`insight-queue serve` as a subprocess, ready when its deployments and consumer are."""

    def __init__(
        self,
        settings: Settings,
        api_url: str,
        *,
        env: Mapping[str, str] | None = None,
        log: Path | None = None,
        args: tuple[str, ...] = (),
    ) -> None:
        self.settings = settings
        self.api_url = api_url
        self.env = dict(env or {})
        self.log = log or settings.data_dir / "serve.log"
        self.args = args
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def start(self, *, wait: bool = True) -> Self:
        env = {
            **os.environ,
            **self.settings.to_env(),
            **client_env(self.api_url, self.settings.data_dir / "prefect"),
            **self.env,
        }
        self.process = processes.start(
            [executable("insight-queue"), "serve", *self.args], env=env, log=self.log
        )
        if wait:
            self.wait_ready()
        return self

    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def wait_ready(self, timeout: float = SERVE_READY_SECONDS) -> None:
        api = PrefectApi(self.api_url)
        store = JobStore(self.settings.database_url, settings=self.settings, check_schema=False)

        def ready() -> bool:
            # This serve's own consumer: after a crash, the dead one's row
            # (same stable name) still looks alive for a lease.
            try:
                for deployment in table.DEPLOYMENTS:
                    api.deployment_id(deployment.name)
                return any(
                    w.alive and w.role == "consumer" and w.pid == self.pid
                    for w in store.queue_view(0).workers
                )
            except (PrefectUnavailable, StoreError):
                return False

        try:
            processes.wait_for(
                ready,
                timeout=timeout,
                what=f"serve (log: {self.log})",
                interval=0.3,
                alive=self.alive,
            )
        finally:
            api.close()
            store.close()

    def stop(self, grace_seconds: float = 20.0) -> int | None:
        """Stop serve (SIGTERM to its group, SIGKILL after the grace); returns its exit code."""
        process, self.process = self.process, None
        if process is None:
            return None
        processes.stop_group(process, grace_seconds)
        return process.returncode

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()


class ApiServer:
    """An ASGI app served by uvicorn on a loopback port (0: any free one), from a thread."""

    def __init__(self, app: ASGIApp, host: str = "127.0.0.1", port: int = 0) -> None:
        self._socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app, log_config=None, access_log=False, lifespan="off", http=GuardedH11Protocol
        )
        self._server = uvicorn.Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def start(self, timeout: float = 10.0) -> Self:
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start at {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


class Machine:
    """One machine of the pool: its processes, started in a directory of its own."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], root: Path) -> None:
        self.name = name
        self.home = root / name
        self.home.mkdir()
        self.log = self.home / "machine.log"
        self.env = {
            **os.environ,
            **env,
            "PREFECT_HOME": str(self.home / "prefect"),
            "AI_JOB_DATA_DIR": str(self.home / "data"),
        }
        self.process = processes.start(command, env=self.env, log=self.log, cwd=self.home)

    def family(self) -> set[int]:
        """Every process of this machine: its first, and all it started, whatever the session."""
        found = {self.process.pid}
        while True:
            more = {pid for pid, parent, _ in processes.process_table() if parent in found}
            if more <= found:
                return found
            found |= more

    def kill(self) -> set[int]:
        """SIGKILL to every process of the machine at once, as a power cut would."""
        family = self.family()
        for pid in family:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.process.wait(10)
        return family

    def stop(self) -> None:
        """Stop what is left of it: its first process, and by their PIDs the others."""
        left = self.family() if self.process.poll() is None else set()
        processes.interrupt_group(self.process)
        for pid in left - {self.process.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
