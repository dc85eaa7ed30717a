"""A consumer in a process of its own, for the acceptance tests: `python -m tests.support.worker`.

Builds `Runtime.open()` from its environment (the `AI_*` settings) and
runs a consumer with no run history and no Prefect slot: the tests prove the
store and the self-fencing worker keep the limit on their own.

- `--standby`: one standing-by consumer until SIGTERM or SIGINT;
- otherwise: drain-mode consumers, round after round, until nothing is
  queued (a drain ends when a lane finds nothing to claim, while another
  lane may still hand a job back, or when another process holds the
  gateway).

SIGTERM or SIGINT stop it as a graceful stop does in production: the calls in
flight are stopped and their jobs handed back. It prints one JSON line on
stdout at the end (the jobs it ran, each outcome, verdict, pause and message);
logs go to stderr at `--log-level`. It measures nothing: a test reads its
memory from outside and the gateway's view from the recorder in front of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import signal
import sys
from typing import Any

from flows.consumer import Consumer, worker_name
from flows.ledger import Report
from flows.runtime import Runtime


def describe(report: Report) -> dict[str, Any]:
    settlement = report.settlement
    return {
        "job": report.job.run_name,
        "subject": report.job.subject,
        "attempt": report.job.attempts,
        "outcome": str(report.outcome),
        "failure": None if report.failure is None else str(report.failure),
        "attempt_spent": None if settlement is None else settlement.attempt_spent,
        "pause_seconds": report.pause_seconds,
        "verdict": None if settlement is None else settlement.verdict,
        "message": report.message,
        "called": report.called,
        "call_started_at": report.call_started_at,
    }


async def work(runtime: Runtime, name: str, standby: bool) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    current: list[Consumer] = []

    def stop(reason: str) -> None:
        stopping.set()
        for consumer in current:
            consumer.stop(reason)

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop, signum.name)
    reports: list[Report] = []
    reasons: list[str] = []
    while not stopping.is_set():
        if not standby and not await asyncio.to_thread(runtime.store.has_work):
            break
        consumer = runtime.consumer(standby=standby, worker=name)
        current[:] = [consumer]
        summary = await consumer.run()
        reports += summary.reports
        reasons.append(summary.stopped_because)
        if standby:
            break
        if not summary.ran:
            # Another process holds the gateway: look again in a moment.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), runtime.settings.poll_seconds)
    outcomes: dict[str, int] = {}
    for report in reports:
        outcomes[str(report.outcome)] = outcomes.get(str(report.outcome), 0) + 1
    return {
        "worker": name,
        "rounds": len(reasons),
        "stopped_because": reasons[-1] if reasons else "nothing queued",
        "signalled": stopping.is_set(),
        "ran": len(reports),
        "outcomes": outcomes,
        "reports": [describe(report) for report in reports],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker")
    parser.add_argument("--standby", action="store_true")
    parser.add_argument("--name", default=None)
    parser.add_argument("--log-level", default="INFO")
    options = parser.parse_args(argv)
    # Handlers first: the redaction filter goes on the handlers there are.
    logging.basicConfig(
        level=options.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    runtime = Runtime.open()
    runtime.redact_logs()
    try:
        summary = asyncio.run(work(runtime, options.name or worker_name("test"), options.standby))
    finally:
        runtime.close()
    summary["peak_rss_bytes"] = peak_rss_bytes()
    print(json.dumps(summary), flush=True)
    return 0


def peak_rss_bytes() -> int:
    """This process's peak resident set since it started (VmHWM).

    Not `ru_maxrss`: Linux carries the parent's high-water mark across fork
    and exec into it, so a child of a large test process would report the
    parent's size.
    """
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024  # kB
    raise RuntimeError("no VmHWM in /proc/self/status")


if __name__ == "__main__":
    raise SystemExit(main())
