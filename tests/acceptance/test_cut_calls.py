"""A call cut on our side holds the gateway until the gateway is done with it (H1, H2).

The gateway here is the simulator in its finish-abandoned mode: like the threaded server it
stands in for, a worker that took a call works it to the end whatever its client does. The peak
in flight and the gaps are the simulator's own occupancy (its workers' start and end times),
beside the recording proxy's connections; neither is the store's count. Consumers are processes
of their own (`tests.support.worker`, standing by, no Prefect). Each fault is injected by event:
once the call is at the gateway (and, for a kill, once its claim was renewed).

Each scenario: the call of the first job is cut on our side while the gateway goes on for
`WORK` seconds; the next call starts only after the hold (`HOLD` from the cut call's start) and
the gap; at the gateway the two never overlap; every job is done; the cut attempt is not spent
(our own read timeout excepted: it spends the attempt, N2). With the hold at 0 and a gateway
that stops on disconnect, the queue heals as fast as before. With `-s` each test prints the
time from the cut call's start to the next call beside the hold.
"""

from __future__ import annotations

import signal
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from devtools.simulator import RequestRecord
from queue_store import INTERACTIVE, JobStore, Settings, migrate
from tests.support.factories import settings_for, store_for
from tests.support.faults import GAP_SLACK_SECONDS, Gateway, Workers
from tests.support.pgcluster import ThrowawayPostgres
from tests.support.reads import engine_of, job_of
from tests.support.waiting import wait_for

pytestmark = pytest.mark.slow

LEASE = 3.0  # AI_JOB_LEASE_SECONDS: short, so a lapse is quick to see
HEARTBEAT = 0.5
GAP = 0.3
WORK = 6.0  # seconds the gateway works on the first call, whatever we do
HOLD = 8.0  # AI_GATEWAY_CUT_HOLD_SECONDS: the gateway is done with a call by then
QUICK = 0.4  # seconds per call once the cut is over
SEND_SLACK_SECONDS = 0.5  # from the renewal before a call to the gateway's start, at most
VICTIM = ("victim", "ok", "cut")
OTHERS = [("user-1", "ok", "after-1"), ("user-2", "ok", "after-2")]


def make_settings(
    url: str, at: Gateway, data_dir: Path, gateway: dict[str, Any] | None = None, **more: Any
) -> Settings:
    gateway_settings = {"url": at.url, "read_timeout": 30.0, "cut_hold_seconds": HOLD}
    gateway_settings |= gateway or {}
    return settings_for(
        database_url=url,
        data_dir=data_dir,
        gap_seconds=GAP,
        lease_seconds=LEASE,
        heartbeat_seconds=HEARTBEAT,
        poll_seconds=0.3,
        backoff_seconds=0.5,
        backoff_max_seconds=1.0,
        plugins="tests.support.plugins",
        gateway=gateway_settings,
        **more,
    )


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway(latency=QUICK, finish_abandoned=True) as started:
        # The first call (the victim's) takes WORK seconds at the gateway.
        started.simulator.set_fault("hang", hold_seconds=WORK, requests=1, job="ok:cut")
        yield started


def enqueue_all(store: JobStore) -> None:
    store.enqueue(*VICTIM, priority=INTERACTIVE)
    for key in OTHERS:
        store.enqueue(*key)


def calls(gateway: Gateway) -> list[RequestRecord]:
    return sorted(gateway.simulator.stats().requests, key=lambda r: r.received)


def first_call(gateway: Gateway) -> RequestRecord:
    """Wait until the victim's call is being worked on at the gateway."""
    gateway.simulator.wait_for(
        lambda s: any(r.job == "ok:cut" and r.started is not None for r in s.requests), 60
    )
    return next(r for r in calls(gateway) if r.job == "ok:cut")


def renewed(store: JobStore) -> bool:
    job = job_of(store, *VICTIM)
    return (
        job is not None
        and job.status == "running"
        and job.call_started_at is not None
        and job.heartbeat_at is not None
        and job.heartbeat_at > job.call_started_at
    )


def all_done(store: JobStore) -> bool:
    jobs = [job_of(store, *key) for key in (VICTIM, *OTHERS)]
    return all(j is not None and j.status == "done" for j in jobs)


def check_the_gateway_was_held(
    gateway: Gateway, store: JobStore, *, attempts: int, hold: float = HOLD
) -> float:
    """At the gateway: one call at a time, the next one after the hold and the gap; every job
    done once. Returns seconds from the cut call's start to the next call's."""
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    stats = gateway.simulator.stats()
    assert stats.peak_occupancy == 1
    records = calls(gateway)
    cut = records[0]
    assert cut.job == "ok:cut" and cut.started is not None and cut.ended is not None
    # The gateway really worked on the cut call to its end.
    assert cut.ended - cut.started >= WORK - GAP_SLACK_SECONDS, cut
    after = [r for r in records[1:] if r.started is not None]
    assert after, records
    next_start = min(r.started for r in after if r.started is not None)
    waited = next_start - cut.started
    # The next call waited for the hold and the gap. The hold counts from the renewal right
    # before the call, which precedes the gateway's start by the time it takes to send the
    # request (tens of milliseconds on a loaded machine): hence a hold a little longer than
    # the gateway's longest call (the default read timeout is a minute past its 17).
    assert waited >= hold + GAP - SEND_SLACK_SECONDS, (waited, records)
    assert all_done(store)
    victim = job_of(store, *VICTIM)
    assert victim is not None and victim.attempts == attempts, victim
    for key in OTHERS:
        assert gateway.answers_for(f"{key[1]}:{key[2]}") == 1
    assert seen.peak_in_flight <= 1
    return waited


def report(what: str, store: JobStore, waited: float, hold: float = HOLD) -> None:
    print(
        f"\nFIGURES cut call [{engine_of(store).dialect.name}] {what}: the next call started "
        f"{waited:.2f} s after the cut one (hold {hold:g} s, gap {GAP:g} s, the gateway "
        f"worked {WORK:g} s on the cut call)"
    )


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill", "sigterm"])
def test_a_consumer_killed_or_stopped_mid_call_leaves_the_gateway_held(
    database_url: str, gateway: Gateway, tmp_path: Path, sig: signal.Signals
) -> None:
    settings = make_settings(database_url, gateway, tmp_path / "data")
    with (
        store_for(settings) as store,
        Workers(settings, tmp_path).running() as workers,
    ):
        enqueue_all(store)
        workers.start("first")
        first_call(gateway)
        wait_for(lambda: renewed(store), 30, "the victim's claim renewed mid-call")
        workers.start("second")
        wait_for(
            lambda: any(w.name == "second" and w.alive for w in store.queue_view(0).workers),
            30,
            "second up",
        )
        workers.stop("first", sig=sig, timeout=15)
        if sig == signal.SIGTERM:
            # A graceful stop hands the job back at once; the hold stays with the store.
            held = store.queue_view().holds
            assert [str(h.cause) for h in held] == ["stopped"], held
        wait_for(lambda: all_done(store), 90, "every job done", log=workers.log("second"))
        workers.stop_all()
        waited = check_the_gateway_was_held(gateway, store, attempts=1)
    report(sig.name, store, waited)


def test_self_fencing_through_a_database_outage_leaves_the_gateway_held_on_postgresql(
    tmp_path: Path, gateway: Gateway
) -> None:
    """L2 with H1, H2: the store is away longer than the lease; the holder stops its call by
    its deadline, the takeover finds the call in flight, and the attempt is kept whoever
    writes first."""
    cluster = ThrowawayPostgres().create()
    try:
        migrate.upgrade(cluster.url)
        settings = make_settings(cluster.url, gateway, tmp_path / "data")
        with (
            store_for(settings) as store,
            Workers(settings, tmp_path).running() as workers,
        ):
            enqueue_all(store)
            workers.start("a")
            workers.start("b")
            first_call(gateway)
            cluster.stop()
            assert gateway.recorder is not None
            gateway.recorder.wait_until(lambda s: s.in_flight == 0, LEASE + 5, "the call stopped")
            time.sleep(LEASE * 2)  # the outage outlasts the lease
            cluster.start()
            wait_for(lambda: all_done(store), 120, "every job done", tolerate=(Exception,))
            workers.stop_all()
            waited = check_the_gateway_was_held(gateway, store, attempts=1)
        report("self-fencing, PostgreSQL down", store, waited)
    finally:
        cluster.destroy()


def test_self_fencing_through_a_locked_sqlite_file_leaves_the_gateway_held(
    tmp_path: Path, gateway: Gateway
) -> None:
    """The SQLite outage: another process holds the write lock longer than the lease."""
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    migrate.upgrade(url)
    settings = make_settings(url, gateway, tmp_path / "data")
    with (
        store_for(settings) as store,
        Workers(settings, tmp_path).running() as workers,
    ):
        enqueue_all(store)
        workers.start("a")
        workers.start("b")
        first_call(gateway)
        lock = sqlite3.connect(str(make_url(url).database), isolation_level=None, timeout=30)
        try:
            lock.execute("BEGIN IMMEDIATE")
            assert gateway.recorder is not None
            gateway.recorder.wait_until(lambda s: s.in_flight == 0, LEASE + 5, "the call stopped")
            time.sleep(LEASE * 2)
        finally:
            lock.execute("ROLLBACK")
            lock.close()
        wait_for(lambda: all_done(store), 120, "every job done")
        workers.stop_all()
        waited = check_the_gateway_was_held(gateway, store, attempts=1)
    report("self-fencing, SQLite locked", store, waited)


def test_our_read_timeout_leaves_the_gateway_held_and_spends_the_attempt(
    database_url: str, gateway: Gateway, tmp_path: Path
) -> None:
    """H1 with N2: we give up after 2 s; the gateway works on for WORK s; the next call waits
    for the hold. The timeout spends its attempt (a job the gateway cannot finish in time
    must not hold it for ever)."""
    settings = make_settings(
        database_url, gateway, tmp_path / "data", gateway={"read_timeout": 2.0}
    )
    with (
        store_for(settings) as store,
        Workers(settings, tmp_path).running() as workers,
    ):
        enqueue_all(store)
        workers.start("only")
        first_call(gateway)
        wait_for(lambda: all_done(store), 90, "every job done", log=workers.log("only"))
        summary = workers.stop("only")
        waited = check_the_gateway_was_held(gateway, store, attempts=2)
    timeouts = [r for r in summary["reports"] if r["failure"] == "timeout"]
    assert len(timeouts) == 1 and timeouts[0]["attempt_spent"], summary
    report("our read timeout", store, waited)


def test_with_no_hold_and_a_gateway_that_stops_the_queue_heals_as_before(
    database_url: str, tmp_path: Path
) -> None:
    """AI_GATEWAY_CUT_HOLD_SECONDS=0, for a gateway that stops when its client goes: a stopped
    call frees the gateway at once, and the next call follows after the gap."""
    with Gateway(latency=QUICK) as stops:
        stops.simulator.set_fault("hang", hold_seconds=WORK, requests=1, job="ok:cut")
        settings = make_settings(
            database_url, stops, tmp_path / "data", gateway={"cut_hold_seconds": 0}
        )
        with (
            store_for(settings) as store,
            Workers(settings, tmp_path).running() as workers,
        ):
            enqueue_all(store)
            workers.start("first")
            first_call(stops)
            workers.start("second")
            wait_for(
                lambda: any(w.name == "second" and w.alive for w in store.queue_view(0).workers),
                30,
                "second",
            )
            stopped_at = time.time()
            workers.stop("first", sig=signal.SIGTERM, timeout=15)
            wait_for(lambda: all_done(store), 60, "every job done")
            workers.stop_all()
            victim = job_of(store, *VICTIM)
        seen = stops.assert_kept(concurrency=1, gap=GAP)
        records = calls(stops)
        cut, retried = records[0], next(r for r in records[1:] if r.job == "ok:cut")
        assert cut.ended is not None and cut.ended - cut.started < WORK / 2  # type: ignore[operator]
        assert retried.started is not None
        healed = retried.started - stopped_at
        assert victim is not None and victim.attempts == 1
        assert seen.peak_in_flight == 1
    print(
        f"\nFIGURES cut call [{engine_of(store).dialect.name}] no hold: the retried call started "
        f"{healed:.2f} s after the stop"
    )
    # The gap and a standing-by consumer's next look; nowhere near the cut call's WORK.
    assert healed < WORK
