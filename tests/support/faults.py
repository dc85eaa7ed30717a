"""A gateway with an independent recorder, and consumer processes, for the fault tests.

`Gateway` is the simulator behind the recording TCP proxy: the proxy, not the
store, says how many calls were in flight at once and how quiet it was
between them, and the simulator's own times say how long its workers were
busy (with `finish_abandoned`, past a client that left). `Workers` starts
`tests.support.worker` processes (optionally under libfaketime with a
shifted clock) and stops them by PID.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from deployments import processes
from devtools.recorder import GatewayRecorder, RecorderSnapshot
from devtools.simulator import OK, GatewaySimulator
from queue_store import Settings
from tests.support.services import ROOT

# The recorder timestamps opens and closes as the bytes pass; a gap a few ms
# short of the setting is measurement, not a breach.
GAP_SLACK_SECONDS = 0.05


class Gateway:
    def __init__(
        self, latency: float = 1.0, workers: int = 4, finish_abandoned: bool = False
    ) -> None:
        self.simulator = GatewaySimulator(
            latency=latency, workers=workers, finish_abandoned=finish_abandoned
        )
        self.recorder: GatewayRecorder | None = None

    def __enter__(self) -> Gateway:
        self.simulator.start()
        self.recorder = GatewayRecorder("127.0.0.1", self.simulator.port).start()
        return self

    def __exit__(self, *_: object) -> None:
        if self.recorder is not None:
            self.recorder.stop()
        self.simulator.stop()

    @property
    def url(self) -> str:
        assert self.recorder is not None
        return self.recorder.url

    def snapshot(self) -> RecorderSnapshot:
        assert self.recorder is not None
        return self.recorder.snapshot()

    def assert_kept(self, concurrency: int, gap: float) -> RecorderSnapshot:
        """The promise, measured at the gateway: peak and every gap, of the
        connections (the recorder) and of the workers' occupancy (the
        simulator's own times, which outlast a client that left when the
        workers finish abandoned calls)."""
        seen = self.snapshot()
        stats = self.simulator.stats()
        peak, quiet = stats.peak_occupancy, stats.min_occupancy_gap
        print(
            f"FIGURES recorder: {seen.count} connections, peak in flight "
            f"{seen.peak_in_flight}, smallest gap {_seconds(seen.min_gap)}; "
            f"simulator: peak occupancy {peak}, smallest occupancy gap {_seconds(quiet)}"
        )
        assert seen.peak_in_flight <= concurrency, f"{seen.peak_in_flight} calls at once"
        if seen.min_gap is not None:
            assert seen.min_gap >= gap - GAP_SLACK_SECONDS, f"gap of {seen.min_gap:.3f} s"
        assert peak <= concurrency, f"{peak} calls on the gateway's workers at once"
        if quiet is not None:
            assert quiet >= gap - GAP_SLACK_SECONDS, f"occupancy gap of {quiet:.3f} s"
        return seen

    def served(self) -> list[str]:
        """The jobs the gateway received, in the order it received them."""
        records = sorted(self.simulator.stats().requests, key=lambda r: r.received)
        return [r.job or "" for r in records]

    def calls_for(self, job: str) -> int:
        """Calls the gateway received for a job (answered or not)."""
        return sum(1 for r in self.simulator.stats().requests if r.job == job)

    def answers_for(self, job: str) -> int:
        """Calls for a job the gateway answered in full."""
        return sum(1 for r in self.simulator.stats().requests if r.job == job and r.outcome == OK)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f} s"


def libfaketime() -> Path | None:
    """Debian's libfaketime (multi-threaded build), preloaded to shift one process's clocks."""
    for directory in ("/usr/lib/x86_64-linux-gnu/faketime", "/usr/lib/aarch64-linux-gnu/faketime"):
        library = Path(directory) / "libfaketimeMT.so.1"
        if library.exists():
            return library
    return None


class Workers:
    """Consumer processes on one store; stopped (by PID) when the block ends."""

    def __init__(
        self, settings: Settings, logs: Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.settings = settings
        self.logs = logs
        self.env = dict(env or {})
        self.started: dict[str, subprocess.Popen[bytes]] = {}

    def start(
        self, name: str, *, standby: bool = True, shift: str | None = None
    ) -> subprocess.Popen[bytes]:
        """Start worker `name`; `shift` runs it under libfaketime (e.g. "+300s")."""
        args = [sys.executable, "-m", "tests.support.worker", "--name", name]
        if standby:
            args.append("--standby")
        env = {
            **os.environ,
            **self.settings.to_env(),
            **self.env,
            "PYTHONPATH": str(ROOT),
        }
        if shift is not None:
            # Preloaded directly (not through the `faketime` wrapper) so the
            # worker's PID is ours to signal. Its monotonic clock is shifted too.
            library = libfaketime()
            if library is None:
                pytest.fail(
                    "libfaketime is needed to shift a worker's clock (apt install faketime)"
                )
            env |= {"LD_PRELOAD": str(library), "FAKETIME": shift}
        env.pop("PREFECT_API_URL", None)
        process = processes.start(args, env=env, cwd=ROOT, log=self.log(name))
        self.started[name] = process
        return process

    def log(self, name: str) -> Path:
        return self.logs / f"worker-{name}.log"

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout: float = 30) -> dict[str, Any]:
        """Signal one worker (not its group) and read its summary."""
        process = self.started.pop(name)
        if process.poll() is None:
            process.send_signal(sig)
        process.wait(timeout)
        return self.summary(name)

    def summary(self, name: str) -> dict[str, Any]:
        lines = [line for line in self.log(name).read_text().splitlines() if line.startswith("{")]
        return json.loads(lines[-1]) if lines else {}

    def stop_all(self) -> dict[str, dict[str, Any]]:
        return {name: self.stop(name) for name in list(self.started)}

    @contextmanager
    def running(self) -> Iterator[Workers]:
        try:
            yield self
        finally:
            for process in self.started.values():
                processes.stop_group(process, grace_seconds=10)
            self.started.clear()
