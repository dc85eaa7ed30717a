"""Crash to takeover at the default settings: what the self-fencing lease costs after a crash.

A worker is SIGKILLed while its gateway call is in flight, with a second
worker standing by. The job can be taken over only once the dead worker's
claim has lapsed and the margin its call would have stopped within has
passed: `AI_JOB_LEASE_SECONDS` (60 s) after its last renewal, which was at
most `AI_JOB_HEARTBEAT_SECONDS` (5 s) before the kill, with
`AI_JOB_LEASE_MARGIN_SECONDS` (10 s) inside it. Every other setting is the
default too; only the gateway's address, the plugin and a hold of 0 are set
(the simulator stops on disconnect; with the default hold the next call also
waits for the cut call's start plus the read timeout, H1).

The workers are `tests.support.worker` processes (the store and the
self-fencing runner, without Prefect); the gateway is the simulator behind
the recording proxy, whose record gives the retried call's start. A consumer
that also held a Prefect `gateway` slot (`serve`, `consume`) adds the slot's
lease on top when it dies (`flows.guard.SLOT_LEASE_SECONDS`), unless its
successor is the same `serve` restarted, which gives its old slots back.

Run from the repository root (about two minutes):

    .venv/bin/python benchmarks/takeover.py
    .venv/bin/python benchmarks/takeover.py --postgres-url postgresql://postgres@127.0.0.1:5432/test
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from queue_store import INTERACTIVE, JobStore, Settings, migrate
from tests.support.databases import PostgresDatabases
from tests.support.faults import Gateway, Workers
from tests.support.reads import job_of, pending

CALL_SECONDS = 300.0  # the killed call: far longer than any lease


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return time.monotonic()
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout:g} s")


def measure(database_url: str, workdir: Path) -> dict[str, float]:
    migrate.upgrade(database_url)
    with Gateway(latency=CALL_SECONDS) as gateway:
        recorder = gateway.recorder
        assert recorder is not None
        settings = Settings(
            database_url=database_url,
            data_dir=workdir / "data",
            plugins="tests.support.plugins",
            # The simulator stops on disconnect: the cut call holds nothing (H1), so what is
            # measured is the lease and the gap alone.
            gateway={"url": gateway.url, "cut_hold_seconds": 0},
        )
        store = JobStore(database_url, settings=settings)
        key = ("takeover", "ok", "victim")
        store.enqueue(*key, priority=INTERACTIVE)
        with Workers(settings, workdir).running() as workers:
            workers.start("doomed")
            recorder.wait_until(lambda s: s.in_flight == 1, 120, "a call in flight")
            workers.start("survivor")
            wait_for(
                lambda: any(w.name == "survivor" and w.alive for w in store.queue_view(0).workers),
                120,
                "survivor standing by",
            )
            row = job_of(store, *key)
            assert row is not None and row.heartbeat_at is not None
            gateway.simulator.set_latency(1.0)
            killed = time.monotonic()
            workers.stop("doomed", sig=signal.SIGKILL, timeout=10)
            closed = recorder.wait_until(lambda s: s.in_flight == 0, 10, "closed")
            assert closed.count == 1

            def taken_over() -> bool:
                job = job_of(store, *key)
                return job is not None and job.worker == "survivor"

            takeover = wait_for(taken_over, 300, "takeover")
            wait_for(lambda: recorder.snapshot().count >= 2, 60, "retried call")
            retried = time.monotonic()
            wait_for(lambda: pending(store) == 0, 60, "job done")
            workers.stop_all()
        final = job_of(store, *key)
        assert final is not None and final.status == "done" and final.attempts == 2
        assert final.claimed_at is not None
        beat_to_claim = (final.claimed_at - row.heartbeat_at).total_seconds()
        store.close()
        gateway.assert_kept(concurrency=settings.concurrency, gap=settings.gap_seconds)
    return {
        "lease": settings.lease_seconds,
        "margin": settings.lease_margin,
        "heartbeat": settings.heartbeat_seconds,
        "kill_to_takeover": takeover - killed,
        "kill_to_retried_call": retried - killed,
        "last_renewal_to_takeover_claim": beat_to_claim,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--postgres-url", help="measure on a scratch database of this server")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="takeover-") as tmp:
        workdir = Path(tmp)
        if args.postgres_url:
            databases = PostgresDatabases(args.postgres_url)
            try:
                figures = measure(databases.empty(), workdir)
            finally:
                databases.close()
            backend = "postgresql"
        else:
            figures = measure(f"sqlite:///{workdir / 'queue.db'}", workdir)
            backend = "sqlite"
    print(
        f"{backend}: lease {figures['lease']:g} s, margin {figures['margin']:g} s, "
        f"heartbeat {figures['heartbeat']:g} s\n"
        f"  kill -> takeover claim            {figures['kill_to_takeover']:6.1f} s\n"
        f"  kill -> retried call at gateway   {figures['kill_to_retried_call']:6.1f} s\n"
        f"  last renewal -> takeover claim    {figures['last_renewal_to_takeover_claim']:6.1f} s"
        " (store's clock)"
    )


if __name__ == "__main__":
    main()
