"""The local Prefect server for `serve`, the demo, the tests and the benchmarks."""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Self

import httpx

from deployments import processes
from queue_store import files

logger = logging.getLogger(__name__)

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_SECONDS = 120.0
DEFAULT_RETENTION_DAYS = 90.0  # AI_JOB_RETENTION_DAYS's default
# With in-memory leases a restarted server forgets who holds the `gateway` slots, but not that
# they are taken.
FILE_LEASES = "prefect.server.concurrency.lease_storage.filesystem"
BIN = Path(sys.executable).parent


def executable(name: str) -> str:
    """A console script of this environment (falls back to the PATH)."""
    return shutil.which(name, path=str(BIN)) or name


def client_env(api_url: str, home: Path) -> dict[str, str]:
    """What a process needs to report to one server and never start its own."""
    return {
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        "DO_NOT_TRACK": "1",
    }


def is_healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


@dataclasses.dataclass(eq=False)
class PrefectServer:
    """A local Prefect server subprocess."""

    home: Path
    port: int = DEFAULT_PORT
    _: dataclasses.KW_ONLY
    ui: bool = True
    database_url: str | None = None
    retention_days: float = DEFAULT_RETENTION_DAYS
    process: subprocess.Popen[bytes] | None = dataclasses.field(default=None, init=False)

    @property
    def log(self) -> Path:
        return self.home / "server.log"

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def ui_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> Self:
        if not processes.port_is_free(self.port):
            raise RuntimeError(f"port {self.port} on 127.0.0.1 is taken")
        files.private_directory(self.home)
        env = self._env()
        command = [executable("prefect"), "server", "start", "--host", "127.0.0.1"]
        # Its database and logs are this account's alone: they hold the run history (D1).
        self.process = processes.start(
            [*command, "--port", str(self.port)], env=env, log=self.log, umask=files.PRIVATE_UMASK
        )
        logger.info("starting a Prefect server (pid %d) at %s", self.process.pid, self.api_url)
        try:
            processes.wait_for(
                lambda: is_healthy(self.api_url),
                timeout=STARTUP_TIMEOUT_SECONDS,
                what=f"the Prefect server at {self.api_url} (log: {self.log})",
                interval=0.3,
                alive=lambda: self.process is not None and self.process.poll() is None,
            )
        except (TimeoutError, RuntimeError):
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            self.stop()
            raise RuntimeError(f"the Prefect server did not start:\n{tail}") from None
        return self

    def _env(self) -> dict[str, str]:
        """Its own home, file-backed leases, the store's retention for its runs, its address."""
        database = self.database_url or f"sqlite+aiosqlite:///{self.home / 'prefect.db'}"
        env = {
            **os.environ,
            "PREFECT_HOME": str(self.home),
            "PREFECT_API_DATABASE_CONNECTION_URL": database,
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": FILE_LEASES,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_DB_VACUUM_ENABLED": "events,flow_runs",
            "PREFECT_SERVER_SERVICES_DB_VACUUM_RETENTION_PERIOD": str(
                int(self.retention_days * 86400)
            ),
            "DO_NOT_TRACK": "1",
            # The UI asks the API where it was told to, not where the server
            # listens: on any port but the default it must be told.
            "PREFECT_UI_API_URL": self.api_url,
            "PREFECT_UI_URL": self.ui_url,
        }
        if not self.ui:
            env |= {"PREFECT_UI_ENABLED": "false", "PREFECT_SERVER_UI_ENABLED": "false"}
        env.pop("PREFECT_API_URL", None)
        return env

    def stop(self, grace_seconds: float = 15.0) -> None:
        """Stop the server this object started."""
        process, self.process = self.process, None
        if process is not None:
            processes.stop_group(process, grace_seconds=grace_seconds)
