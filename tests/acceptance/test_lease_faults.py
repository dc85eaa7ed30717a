"""The lease holds at the gateway under faults (L1-L3): clocks, stalls, outages.

Every scenario runs consumer processes (`tests.support.worker`, without
Prefect: the store and the self-fencing worker alone must keep the limit) and
measures the gateway side with the recording proxy: the peak of calls in
flight and every quiet gap. Faults are injected by event or by count.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_store import JobStore, Settings, Status, migrate
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway, Workers
from tests.support.pgcluster import ThrowawayPostgres
from tests.support.reads import job_of, pending
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

GAP = 0.3
LEASE = 3.0
HEARTBEAT = 0.5


def _settings(database_url: str, gateway: Gateway, data_dir: Path, **more: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": database_url,
        "data_dir": data_dir,
        # The simulator here stops working on a call whose client left: nothing to hold (H1).
        "gateway": {"url": gateway.url, "read_timeout": 30.0, "cut_hold_seconds": 0},
        "gap_seconds": GAP,
        "lease_seconds": LEASE,
        "heartbeat_seconds": HEARTBEAT,
        "backoff_seconds": 0.5,
        "backoff_max_seconds": 2.0,
        "plugins": "tests.support.plugins",
        **more,
    }
    return settings_for(**values)


def _wait_until_settled(store: JobStore, user: str, timeout: float) -> None:
    wait_for(lambda: pending(store, user) == 0, timeout, f"every job of {user} to settle")


@pytest.mark.parametrize("shift", ["+300s", "-300s"])
def test_workers_with_clocks_five_minutes_off_never_overlap_at_the_gateway(
    postgres: object, database_url: str, backend: str, tmp_path: Path, shift: str
) -> None:
    """L1: lease decisions use the database's clock, so a worker's own clock changes nothing."""
    if backend != "postgresql":
        pytest.skip("one host shares one clock on SQLite; the skew case is PostgreSQL's")
    with Gateway(latency=1.2) as gateway:
        settings = _settings(database_url, gateway, tmp_path)
        store = store_for(settings)
        subjects = [f"s{n}" for n in range(6)]
        for subject in subjects:
            store.enqueue("skew", "ok", subject)
        with Workers(settings, tmp_path).running() as workers:
            # The shifted worker arrives while the other is mid-call, contends
            # for every claim while both run, and finishes alone.
            workers.start("true-clock")
            assert gateway.recorder is not None
            gateway.recorder.wait_until(lambda s: s.count >= 2 and s.in_flight == 1, 60)
            workers.start("shifted", shift=shift)
            gateway.recorder.wait_for_connections(4, 60)
            summaries = {"true-clock": workers.stop("true-clock")}
            _wait_until_settled(store, "skew", timeout=120)
            summaries |= workers.stop_all()
        gateway.assert_kept(concurrency=1, gap=GAP)
        for subject in subjects:
            job = job_of(store, "skew", "ok", subject)
            assert job is not None and (job.status, job.attempts) == (Status.DONE, 1)
            # One answer each; a call stopped with its worker was not answered.
            assert gateway.answers_for(f"ok:{subject}") == 1
        # Both worked: the shifted one is not simply locked out.
        assert all(s.get("ran", 0) >= 1 for s in summaries.values()), summaries
        store.close()


def test_a_prompt_builder_that_sleeps_past_the_lease_keeps_its_claim(
    database_url: str, tmp_path: Path
) -> None:
    """The heartbeat renews while the prompt is built: one call, by one worker."""
    with Gateway(latency=0.5) as gateway:
        settings = _settings(database_url, gateway, tmp_path)
        store = store_for(settings)
        store.enqueue("sleepy", "sleepy", "s1")
        store.enqueue("sleepy", "ok", "after")
        with Workers(
            settings, tmp_path, env={"TEST_SLEEPY_SECONDS": str(LEASE * 2)}
        ).running() as workers:
            workers.start("a")
            workers.start("b")
            _wait_until_settled(store, "sleepy", timeout=90)
            workers.stop_all()
        gateway.assert_kept(concurrency=1, gap=GAP)
        job = job_of(store, "sleepy", "sleepy", "s1")
        assert job is not None and (job.status, job.attempts) == (Status.DONE, 1)
        assert gateway.calls_for("sleepy:s1") == 1
        store.close()


def test_a_prompt_builder_that_holds_the_gil_past_the_lease_never_calls_late(
    database_url: str, tmp_path: Path
) -> None:
    """A worker that could not renew (its heartbeat starved) must not call once it wakes.

    The first build of the job holds the GIL for three leases; the other
    worker takes the job over after the lease and makes the one call. The
    stalled worker wakes past its deadline and starts nothing.
    """
    marks = tmp_path / "marks"
    marks.mkdir()
    with Gateway(latency=0.5) as gateway:
        settings = _settings(database_url, gateway, tmp_path)
        store = store_for(settings)
        store.enqueue("gil", "hog", "h1")
        env = {"TEST_MARKS": str(marks), "TEST_HOG_SECONDS": str(LEASE * 3)}
        with Workers(settings, tmp_path, env=env).running() as workers:
            workers.start("first")
            deadline = time.monotonic() + 30
            while not (marks / "hogged-h1").exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert (marks / "hogged-h1").exists(), "the first build never started"
            workers.start("second")
            _wait_until_settled(store, "gil", timeout=120)
            # The stalled worker wakes up after three leases: let it.
            time.sleep(LEASE * 3)
            summaries = workers.stop_all()
        gateway.assert_kept(concurrency=1, gap=GAP)
        assert gateway.calls_for("hog:h1") == 1
        job = job_of(store, "gil", "hog", "h1")
        # The stalled claim was lost without a call: no attempt spent (H2).
        assert job is not None and job.status == Status.DONE and job.attempts == 1
        first = summaries["first"]["reports"]
        assert all(not r["called"] for r in first), first
        store.close()


@pytest.fixture
def throwaway_postgres() -> Iterator[ThrowawayPostgres]:
    cluster = ThrowawayPostgres().create()
    try:
        yield cluster
    finally:
        cluster.destroy()


def test_a_database_outage_longer_than_the_lease_stops_the_call_before_anyone_takes_over(
    throwaway_postgres: ThrowawayPostgres, tmp_path: Path
) -> None:
    """The holder cannot renew: it stops its call within its budget; the job is taken over after.

    PostgreSQL is stopped while a long call is in flight (by event: the call
    reached the gateway), stays down for more than twice the lease, and comes
    back. The recorder sees the stopped call close, then the retried call,
    never both at once.
    """
    url = throwaway_postgres.url
    migrate.upgrade(url)
    with Gateway(latency=8.0) as gateway:
        assert gateway.recorder is not None
        settings = _settings(url, gateway, tmp_path)
        store = store_for(settings)
        for subject in ("long-1", "long-2"):
            store.enqueue("outage", "ok", subject)
        with Workers(settings, tmp_path).running() as workers:
            workers.start("a")
            workers.start("b")
            gateway.recorder.wait_until(lambda s: s.in_flight == 1, 60, "a call in flight")
            throwaway_postgres.stop()
            down_at = time.monotonic()
            # The holder gives up its call within its budget (lease minus margin
            # after its last renewal), long before the 8 s answer.
            closed = gateway.recorder.wait_until(lambda s: s.in_flight == 0, LEASE + 5, "stopped")
            stopped_after = time.monotonic() - down_at
            time.sleep(LEASE * 2)
            throwaway_postgres.start()
            _wait_until_settled(store, "outage", timeout=180)
            workers.stop_all()
        seen = gateway.assert_kept(concurrency=1, gap=GAP)
        assert closed.intervals[0].closed is not None
        print(f"FIGURES outage: the call stopped {stopped_after:.2f} s into the outage")
        assert stopped_after < LEASE, f"the call ran on {stopped_after:.1f} s into the outage"
        for subject in ("long-1", "long-2"):
            job = job_of(store, "outage", "ok", subject)
            assert job is not None and job.status == Status.DONE
            assert gateway.answers_for(f"ok:{subject}") == 1
        assert seen.count >= 3  # the stopped call, then one answered call per job
        store.close()
