"""Real processes for the flow and end-to-end tests: a Prefect server, CLI runs.

Every process started here is stopped here, by the PID we got when starting
it (its process group, so the server's own children go with it).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

import httpx

from deployments.embedded import server_env, stop_process_group

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
PREFECT_STARTUP_SECONDS = 90


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def prefect_server_env(home: Path) -> dict[str, str]:
    """The embedded default's server settings (file-backed leases), without the UI."""
    return {
        **server_env(home),
        "PREFECT_UI_ENABLED": "false",
        "PREFECT_SERVER_UI_ENABLED": "false",
    }


def client_env(api_url: str, home: Path) -> dict[str, str]:
    """What a process needs to report to our server and never start its own."""
    return {
        "PREFECT_API_URL": api_url,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "DO_NOT_TRACK": "1",
        "PYTHONPATH": str(ROOT),
    }


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 15) -> None:
    """Stop a process we started, and its group: TERM, then KILL after `grace`."""
    stop_process_group(process, grace)


class PrefectServer:
    def __init__(
        self, home: Path, port: int | None = None, database_url: str | None = None
    ) -> None:
        self.home = home
        self.database_url = database_url
        self.port = port or free_port()
        self.api_url = f"http://127.0.0.1:{self.port}/api"
        self.process: subprocess.Popen[bytes] | None = None
        self.log = home / "server.log"

    def start(self) -> PrefectServer:
        self.home.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **prefect_server_env(self.home)}
        if self.database_url:
            env["PREFECT_API_DATABASE_CONNECTION_URL"] = self.database_url
        env.pop("PREFECT_API_URL", None)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                [
                    str(BIN / "prefect"),
                    "server",
                    "start",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(self.port),
                ],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = PREFECT_STARTUP_SECONDS) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"prefect server exited: {self.log.read_text()[-2000:]}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.api_url}/health", timeout=2).status_code == 200:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"prefect server not ready in {timeout} s")

    def stop(self) -> None:
        if self.process is not None:
            stop(self.process)
            self.process = None


@contextlib.contextmanager
def running(
    args: list[str], env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a command in the background for the length of a block."""
    with open(log, "ab") as out:
        process = subprocess.Popen(
            args,
            env={**os.environ, **env},
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=ROOT,
        )
    try:
        yield process
    finally:
        stop(process)


def cli(*args: str) -> list[str]:
    return [str(BIN / "insight-queue"), *args]


def run_cli(
    *args: str, env: Mapping[str, str], timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        cli(*args),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    if check and result.returncode != 0:
        raise AssertionError(
            f"insight-queue {' '.join(args)} exited {result.returncode}:\n"
            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
    return result


class BackgroundSampler:
    """A thread that samples something until the `with` block ends.

    Subclasses implement `sample(stop)`, looping until `stop` is set; any
    exception it raises is kept in `error` for the test to assert on.
    """

    def __init__(self) -> None:
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        try:
            self.sample(self._stop)
        except BaseException as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc

    def sample(self, stop: threading.Event) -> None:
        raise NotImplementedError
