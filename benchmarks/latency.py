"""What a screen waits for: from `request_insight` returning to the gateway receiving the call.

Starts, in a temporary directory, everything it measures, and stops all of it
at the end (by PID, also on Ctrl-C): a Prefect server and `insight-queue
serve` (the embedded default's path: the warm consumer takes a screen's job),
the gateway simulator, and the recording proxy in front of it, which times
each call's arrival independently of the project's own bookkeeping.

- idle: the gateway idle and the gap passed; `request_insight` for a fresh
  key, in this process (an app process); pickup = the recorder's open time of
  the call minus the time `request_insight` returned (negative when the
  consumer had already started the call before the poll finished reporting).
- busy: a long call of another job is in flight when the screen asks; the
  screen's job must be the next call: reported is its arrival minus (the end
  of the call in flight plus the gap), and whether it was next.
- baseline: plain Prefect, for comparison: a deployment of a one-task flow
  that calls the gateway, served by `prefect.serve` with the same runner poll
  setting, triggered per request over the REST API; pickup = trigger returned
  to call received.

    .venv/bin/python benchmarks/latency.py [--requests 20] [--gap 1]

Everything listens on 127.0.0.1 only. It prints a table of p50/p95/max per case.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

if not __package__:  # run as a script: the development tools and helpers are in the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile
from deployments import processes
from deployments.prefect_api import PrefectApi
from deployments.stack import PrefectServer, client_env
from devtools.recorder import GatewayRecorder, RecorderSnapshot
from devtools.simulator import GatewaySimulator
from devtools.stack import ServeProcess
from queue_store import JobStore, Settings
from tests.support.reads import pending

ROOT = Path(__file__).resolve().parent.parent
RUNNER_POLL_SECONDS = "1"  # what `serve` uses too
BASELINE_DEPLOYMENT = "baseline-call/baseline"


def _new_call(recorder: GatewayRecorder, count_before: int, timeout: float = 60) -> float:
    """Wall-clock time the next connection reached the gateway."""
    seen = recorder.wait_until(lambda s: s.count > count_before, timeout, "the call")
    return seen.intervals[count_before].opened_at


def _busy_after(count: int) -> Callable[[RecorderSnapshot], bool]:
    return lambda seen: seen.count > count and seen.in_flight == 1


def _quiet(store: JobStore, recorder: GatewayRecorder, gap: float) -> None:
    """Wait until nothing is queued or in flight and the gap has passed."""
    processes.wait_for(lambda: pending(store) == 0, timeout=120, what="an empty queue")
    recorder.wait_until_idle(60)
    time.sleep(gap + 0.3)


def measure_standby(
    settings: Settings,
    server: PrefectServer,
    recorder: GatewayRecorder,
    sim: GatewaySimulator,
    requests: int,
) -> dict[str, list[float]]:
    from deployments.triggers import Triggers
    from flows.runtime import Runtime

    results: dict[str, list[float]] = {"idle": [], "busy": []}
    with ServeProcess(settings, server.api_url, env={"PREFECT_LOGGING_LEVEL": "WARNING"}):
        runtime = Runtime.open(settings)
        triggers = Triggers(runtime, prefect_url=server.api_url)
        store = runtime.store
        for n in range(requests):
            _quiet(store, recorder, settings.gap_seconds)
            before = recorder.snapshot().count
            triggers.request_insight(f"idle-{n}", "sleep", "2026-11-30")
            returned = time.time()
            results["idle"].append(_new_call(recorder, before) - returned)
        sim.set_latency(3.0)
        for n in range(requests):
            _quiet(store, recorder, settings.gap_seconds)
            before = recorder.snapshot().count
            store.enqueue(f"busy-{n}", "steps", "2026-11-30")  # the call in flight
            recorder.wait_until(_busy_after(before), 60, "the call in flight")
            triggers.request_insight(f"screen-{n}", "sleep", "2026-11-30")
            arrived = _new_call(recorder, before + 1, timeout=120)
            in_flight = recorder.snapshot().intervals[before]
            assert in_flight.closed_at is not None
            results["busy"].append(arrived - (in_flight.closed_at + settings.gap_seconds))
        sim.set_latency(0.3)
        runtime.close()
    return results


def measure_baseline(
    server: PrefectServer, recorder: GatewayRecorder, home: Path, requests: int
) -> list[float]:
    env = {
        **os.environ,
        **client_env(server.api_url, home),
        "PREFECT_RUNNER_POLL_FREQUENCY": RUNNER_POLL_SECONDS,
        "PREFECT_LOGGING_LEVEL": "WARNING",
        "PYTHONPATH": str(ROOT),
        "BASELINE_GATEWAY_URL": recorder.url,
    }
    process = processes.start(
        [sys.executable, "-m", "benchmarks.baseline_flow"],
        env=env,
        log=home / "baseline.log",
        cwd=ROOT,
    )
    api = PrefectApi(server.api_url, timeout=10)
    pickups: list[float] = []
    try:
        processes.wait_for(
            lambda: _has_deployment(api), timeout=120, what="the baseline deployment"
        )
        for n in range(requests):
            recorder.wait_until_idle(60)
            time.sleep(1.0)
            before = recorder.snapshot().count
            api.create_run(
                BASELINE_DEPLOYMENT,
                {"subject": f"b{n}"},
                name=f"b{n}",
                tags=[],
                idempotency_key=f"b{n}-{time.time()}",
            )
            returned = time.time()
            pickups.append(_new_call(recorder, before, timeout=120) - returned)
    finally:
        api.close()
        processes.stop_group(process)
    return pickups


def _has_deployment(api: PrefectApi) -> bool:
    try:
        api.deployment_id(BASELINE_DEPLOYMENT)
    except Exception:  # noqa: BLE001 - not there yet
        return False
    return True


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--gap", type=float, default=1.0)
    options = parser.parse_args()

    load_start = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="insight-queue-latency-") as directory:
        home = Path(directory)
        sim = GatewaySimulator(latency=0.3).start()
        recorder = GatewayRecorder("127.0.0.1", sim.port).start()
        server = PrefectServer(home / "prefect", processes.free_port(), ui=False)
        try:
            server.start()
            settings = Settings(
                data_dir=home / "data",
                gap_seconds=options.gap,
                default_duration_seconds=0.3,
                plugins="flows.demo",
                gateway={"url": recorder.url},
            )
            standby = measure_standby(settings, server, recorder, sim, options.requests)
            baseline = measure_baseline(server, recorder, home, options.requests)
            peak = recorder.snapshot().peak_in_flight
        finally:
            server.stop()
            recorder.stop()
            sim.stop()
    load_end = os.getloadavg()
    rows: list[tuple[str, list[float]]] = [
        ("standby, gateway idle: request_insight returned -> call received", standby["idle"]),
        ("standby, gateway busy: call received - (call in flight ended + gap)", standby["busy"]),
        ("plain Prefect: deployment run triggered -> call received", baseline),
    ]
    print(f"{'case':<72} {'n':>3} {'p50 s':>7} {'p95 s':>7} {'max s':>7}")
    for name, values in rows:
        p50, p95, worst = percentile(values, 0.5), percentile(values, 0.95), max(values)
        print(f"{name:<72} {len(values):>3} {p50:>7.3f} {p95:>7.3f} {worst:>7.3f}")
    print(f"peak calls in flight at the gateway (recorder): {peak}")
    print(f"load average at start {load_start[0]:.2f}, at end {load_end[0]:.2f} (2 cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
