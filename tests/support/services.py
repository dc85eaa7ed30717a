"""Real processes for the tests: the local stack, CLI runs, background samplers.

The Prefect server and `serve` come from `deployments.stack`, the one launcher
the project, its demo and its benchmarks use. Every process started here is
stopped here, by the PID we got when starting it.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Self

from deployments import processes
from deployments.stack import PrefectServer, client_env

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

__all__ = [
    "BIN",
    "ROOT",
    "BackgroundSampler",
    "PrefectServer",
    "cli",
    "client_env",
    "group_members",
    "run_cli",
    "running",
    "stop",
]


def stop(process: subprocess.Popen[bytes] | subprocess.Popen[str], grace: float = 15) -> None:
    """Stop a process we started, and its group: TERM, then KILL after `grace`."""
    processes.stop_group(process, grace)


def group_members(pgid: int) -> list[int]:
    """PIDs in the process group `pgid`, from /proc."""
    return [found for found, _, group in processes.process_table() if group == pgid]


@contextlib.contextmanager
def running(
    args: list[str], env: Mapping[str, str], log: Path
) -> Iterator[subprocess.Popen[bytes]]:
    """Run a command in the background for the length of a block."""
    process = processes.start(args, env={**os.environ, **env}, log=log, cwd=ROOT)
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
