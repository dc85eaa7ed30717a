"""The embedded default's Prefect server: a local subprocess with its own home.

Its home lives under the data directory, its leases in files
(`PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE`): with the default in-memory
storage a restart forgets who holds the `gateway` slots but not that they are
taken, and every later gateway task waits for ever. It binds to 127.0.0.1
only. `EmbeddedServer.stop` ends the process it started, by its PID.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

DEFAULT_PORT = 4200
STARTUP_TIMEOUT_SECONDS = 120
STOP_GRACE_SECONDS = 20
FILE_LEASES = "prefect.server.concurrency.lease_storage.filesystem"


def server_env(home: Path) -> dict[str, str]:
    """Environment of the embedded server process."""
    return {
        "PREFECT_HOME": str(home),
        "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{home / 'prefect.db'}",
        "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": FILE_LEASES,
        # A gateway task that finds the slot taken is told to retry after at
        # most this long (Prefect's default, 10 s, would be most of a screen's
        # wait when a call ends just as the next one is claimed).
        "PREFECT_SERVER_TASKS_TAG_CONCURRENCY_SLOT_WAIT_SECONDS": "1",
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }


def is_healthy(api_url: str, timeout: float = 2.0) -> bool:
    try:
        return httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class EmbeddedServer:
    """A local Prefect server subprocess, or an already-running one at the same address."""

    def __init__(self, home: Path, port: int = DEFAULT_PORT, *, ui: bool = True) -> None:
        self.home = home
        self.port = port
        self.ui = ui
        self.api_url = f"http://127.0.0.1:{port}/api"
        self.ui_url = f"http://127.0.0.1:{port}"
        self.log_path = home / "server.log"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> EmbeddedServer:
        """Start the server, or reuse one already answering at this address."""
        if is_healthy(self.api_url):
            logger.info("using the Prefect server already running at %s", self.api_url)
            return self
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **server_env(self.home)}
        env.pop("PREFECT_API_URL", None)
        if not self.ui:
            env["PREFECT_UI_ENABLED"] = "false"
            env["PREFECT_SERVER_UI_ENABLED"] = "false"
        prefect = shutil.which("prefect", path=str(Path(sys.executable).parent)) or "prefect"
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its children are stopped with it
            )
        logger.info("starting a Prefect server (pid %d) at %s", self._process.pid, self.api_url)
        self._wait_healthy()
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"the Prefect server exited while starting:\n{tail}")
            if is_healthy(self.api_url):
                return
            time.sleep(0.5)
        self.stop()
        raise TimeoutError(
            f"the Prefect server did not answer within {STARTUP_TIMEOUT_SECONDS} s "
            f"(log: {self.log_path})"
        )

    def stop(self) -> None:
        """Stop the server this object started (never one it merely reused)."""
        process, self._process = self._process, None
        if process is not None:
            stop_process_group(process)


def stop_process_group(
    process: subprocess.Popen[Any], grace_seconds: float = STOP_GRACE_SECONDS
) -> None:
    """Stop a process we started in its own session, with everything it started.

    SIGTERM to its process group (whose id is the PID we got at start), then
    SIGKILL if it is still there after `grace_seconds`.
    """
    if process.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(grace_seconds)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(10)
