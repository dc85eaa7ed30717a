"""A consumer SIGKILLed while its gateway call is in flight (FIX3, FIX4, FIX5).

Consumers are `insight-queue drain` processes, each in its own session so the
test can SIGKILL its whole group by the PID it started; the gateway is the
simulator, the store SQLite or PostgreSQL. After the kill, consumers are run
one after another, like `serve`'s safety net on a 0 s interval: a run that
finds the dead worker's claim still live leaves at once ("concurrency"), as
`drain` does, and a later run takes the job over once the claim has lapsed.

The Prefect server here is this module's own, without a `gateway` tag limit:
a killed task run keeps its tag slot until Prefect's 60 s task lease expires
(plus the repossessor's 15 s loop), which would hold the next call back for
that long. That delay is Prefect's, measured once and written up in
RELIABILITY.md; these tests measure the store's takeover.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flows.simulator import GatewaySimulator, RequestRecord
from queue_store import INTERACTIVE, JobStore, Settings
from tests.support.services import (
    BackgroundSampler,
    PrefectServer,
    cli,
    client_env,
    run_cli,
    running,
)

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

LEASE = 3.0  # seconds: AI_JOB_LEASE_SECONDS, short so a lapse is quick to see
HEARTBEAT = 0.5  # seconds: AI_JOB_HEARTBEAT_SECONDS
CALL = 4.0  # seconds per gateway call while a kill is staged: longer than the lease
FAST_CALL = 0.3  # seconds per call once the interesting part is over
POLL = 0.05  # seconds between the watcher's looks at the store
# A safety-net run starts, claims within ~1.5 s and exits within ~4 s; two
# runs may be needed (the first can find the claim still live), and on a
# loaded machine each takes longer.
TAKEOVER_SLACK = 15.0  # seconds beyond the lease
# How late the watcher may notice a lapse (its polling, a busy machine).
NOTICE_SLACK = 1.0  # seconds


@pytest.fixture(scope="module")
def own_prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A server without a `gateway` tag limit, so a killed task run leaks no slot
    into other tests' server (see the module docstring). Stopped by its PID."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server-kill")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def sim() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=CALL) as simulator:
        yield simulator


@pytest.fixture
def env(
    tmp_path: Path, own_prefect_server: PrefectServer, sim: GatewaySimulator, database_url: str
) -> dict[str, str]:
    return {
        **client_env(own_prefect_server.api_url, tmp_path / "prefect-client"),
        "AI_JOB_DATABASE_URL": database_url,
        "AI_GATEWAY_URL": sim.url,
        "AI_JOB_GAP_SECONDS": "0.2",
        "AI_JOB_HEARTBEAT_SECONDS": str(HEARTBEAT),
        "AI_JOB_LEASE_SECONDS": str(LEASE),
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_MAX_ATTEMPTS": "3",
        "AI_JOB_BACKOFF_SECONDS": "1",
        "AI_JOB_BACKOFF_MAX_SECONDS": "4",
        "AI_JOB_PLUGINS": "flows.demo,tests.support.plugins",
    }


@pytest.fixture
def store(env: dict[str, str]) -> Iterator[JobStore]:
    settings = Settings.from_env(env)
    with JobStore(settings.database_url, settings=settings) as opened:
        yield opened


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(POLL)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def calls_for(sim: GatewaySimulator, label: str) -> list[RequestRecord]:
    return sorted((r for r in sim.stats().requests if r.job == label), key=lambda r: r.received)


def drain_summary(stdout: str) -> dict[str, Any]:
    """The JSON summary `insight-queue drain` prints last."""
    summary: dict[str, Any] = json.loads(stdout[stdout.index("{") :])
    return summary


def safety_net(
    env: dict[str, str], done: Callable[[], bool], timeout: float
) -> list[dict[str, Any]]:
    """Run `drain` consumers back to back until `done()`; returns their summaries."""
    summaries: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"the queue was not drained in {timeout} s: {summaries}")
        summaries.append(drain_summary(run_cli("drain", env=env, timeout=timeout).stdout))
    return summaries


class Watcher(BackgroundSampler):
    """Samples the victim's claim from the test process every POLL seconds.

    Records when the store stops counting the dead worker's call as in flight
    (or hands the job to someone else), and whether the new holder's claim is
    still counted live once it is older than the lease (its heartbeat renews
    it); speeds the simulator up once the victim's retried call has started.
    """

    def __init__(
        self, store: JobStore, sim: GatewaySimulator, victim: tuple[str, str, str], dead_holder: str
    ) -> None:
        super().__init__()
        self.store = store
        self.sim = sim
        self.victim = victim
        self.dead_holder = dead_holder
        self.declared_dead_at: float | None = None  # time.time()
        self.live_samples_before: int = 0
        self.new_claim_live_past_lease = False

    def sample(self, stop: threading.Event) -> None:
        label = f"{self.victim[1]}:{self.victim[2]}"
        sped_up = False
        while not stop.wait(POLL):
            if self.declared_dead_at is None:
                job = self.store.job(*self.victim)
                in_flight = self.store.calls_in_flight()
                if in_flight == 0 or (job is not None and job.holder != self.dead_holder):
                    # Taken after the reads: the store judged the claim dead
                    # no later than this, so it bounds the lapse from above.
                    self.declared_dead_at = time.time()
                else:
                    self.live_samples_before += 1
            elif not self.new_claim_live_past_lease:
                job = self.store.job(*self.victim)
                if (
                    job is not None
                    and job.status == "running"
                    and job.holder != self.dead_holder
                    and job.claimed_at is not None
                    and time.time() - job.claimed_at.timestamp() > LEASE + HEARTBEAT
                    and self.store.calls_in_flight() == 1
                ):
                    self.new_claim_live_past_lease = True
            if not sped_up and len([r for r in calls_for(self.sim, label) if r.started]) >= 2:
                self.sim.set_latency(FAST_CALL)
                sped_up = True


def kill_group(process: Any) -> float:
    """SIGKILL the consumer's process group; returns the wall-clock time of the kill."""
    killed_at = time.time()
    os.killpg(process.pid, signal.SIGKILL)
    process.wait(10)
    return killed_at


def test_a_killed_worker_is_declared_dead_within_the_lease_and_its_job_taken_over(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    victim = ("victim-user", "ok", "victim")
    others = [(f"user-{n}", "ok", f"other-{n}") for n in range(3)]
    store.enqueue(*victim, priority=INTERACTIVE)
    for key in others:
        store.enqueue(*key)

    with running(cli("drain"), env, tmp_path / "killed.log") as doomed:
        wait_for(lambda: sim.stats().in_flight == 1, 60, "the victim's call in flight")
        assert [r.job for r in sim.stats().requests] == ["ok:victim"]

        def renewed() -> bool:  # the heartbeat thread is alive and writing
            job = store.job(*victim)
            if job is None or job.heartbeat_at is None or job.claimed_at is None:
                return False
            return (job.heartbeat_at - job.claimed_at).total_seconds() >= HEARTBEAT

        wait_for(renewed, 10, "a heartbeat on the victim's claim")
        assert sim.stats().in_flight == 1, "the call ended before the kill: raise CALL"
        killed_at = kill_group(doomed)

    row = store.job(*victim)
    assert row is not None and row.status == "running" and row.attempts == 1
    assert row.holder and row.heartbeat_at is not None
    dead_holder, last_beat = row.holder, row.heartbeat_at.timestamp()
    assert 0 <= killed_at - last_beat <= HEARTBEAT + NOTICE_SLACK, "no heartbeat before the kill"

    with Watcher(store, sim, victim, dead_holder) as watcher:
        summaries = safety_net(env, lambda: store.pending_count() == 0, timeout=120)
    assert watcher.error is None, repr(watcher.error)
    assert watcher.declared_dead_at is not None

    # Declared dead no earlier than the lease after its last heartbeat (FIX5:
    # a live claim is never taken), and no later than the lease after the kill.
    dead_after_kill = watcher.declared_dead_at - killed_at
    dead_after_beat = watcher.declared_dead_at - last_beat
    assert dead_after_beat >= LEASE - 0.05, (dead_after_beat, watcher.live_samples_before)
    assert dead_after_kill <= LEASE + NOTICE_SLACK, dead_after_kill

    final = store.job(*victim)
    assert final is not None and final.claimed_at is not None
    assert (final.status, final.attempts, final.error) == ("done", 2, None)
    assert final.holder is None
    takeover = final.claimed_at.timestamp() - killed_at
    assert final.claimed_at.timestamp() - last_beat >= LEASE  # never while live (FIX5)
    assert takeover <= LEASE + TAKEOVER_SLACK, takeover

    victim_calls = calls_for(sim, "ok:victim")
    assert len(victim_calls) == 2, victim_calls
    retried = victim_calls[1]
    assert retried.status == 200 and retried.started is not None and retried.ended is not None
    # The retry outlived the lease: the new holder's heartbeat kept it alive.
    assert retried.ended - retried.started >= CALL - 0.1
    assert watcher.new_claim_live_past_lease
    assert retried.started - killed_at <= LEASE + TAKEOVER_SLACK

    for key in others:
        job = store.job(*key)
        assert job is not None and (job.status, job.attempts) == ("done", 1), job
        calls = calls_for(sim, f"{key[1]}:{key[2]}")
        assert [c.status for c in calls] == [200]
    assert sum(s["outcomes"].get("done", 0) for s in summaries) == 1 + len(others)
    assert all(s["outcomes"].keys() <= {"done"} for s in summaries), summaries
    print(
        f"\nkill->declared dead {dead_after_kill:.2f} s (last heartbeat->dead "
        f"{dead_after_beat:.2f} s), kill->takeover claim {takeover:.2f} s, "
        f"kill->retried call {retried.started - killed_at:.2f} s, "
        f"safety-net runs {[s['stopped_because'] for s in summaries]}, "
        f"gateway peak in flight {sim.stats().peak_in_flight}"
    )


def test_a_kill_on_the_last_allowed_attempt_fails_the_job_as_worker_lost(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    victim = ("victim-user", "ok", "last-try")
    others = [(f"user-{n}", "ok", f"after-{n}") for n in range(2)]
    store.enqueue(*victim, priority=INTERACTIVE)
    for key in others:
        store.enqueue(*key)
    # The victim's first two attempts are spent for real: HTTP 500 is a
    # rejection (N2), not an outage. The third, last allowed, is the one killed.
    sim.set_fault("status", status=500, requests=2)

    with running(cli("drain"), env, tmp_path / "killed.log") as doomed:

        def third_attempt_in_flight() -> bool:
            job = store.job(*victim)
            return sim.stats().in_flight == 1 and job is not None and job.attempts == 3

        wait_for(third_attempt_in_flight, 60, "the victim's third attempt in flight")
        time.sleep(HEARTBEAT * 2)  # let the heartbeat renew the claim at least once
        assert sim.stats().in_flight == 1, "the call ended before the kill: raise CALL"
        killed_at = kill_group(doomed)

    row = store.job(*victim)
    assert row is not None and (row.status, row.attempts) == ("running", 3)
    assert row.heartbeat_at is not None
    last_beat = row.heartbeat_at.timestamp()
    sim.set_latency(FAST_CALL)
    summaries = safety_net(env, lambda: store.pending_count() == 0, timeout=90)

    final = store.job(*victim)
    assert final is not None
    assert (final.status, final.attempts) == ("failed", 3), final
    assert final.error is not None and "worker lost" in final.error, final.error
    assert final.holder is None and final.finished_at is not None
    failed_after_kill = final.finished_at.timestamp() - killed_at
    assert final.finished_at.timestamp() - last_beat >= LEASE  # never while live (FIX5)
    assert failed_after_kill <= LEASE + TAKEOVER_SLACK, failed_after_kill
    # Three calls for the victim, none after the kill: it was not run a fourth time.
    statuses = [c.status for c in calls_for(sim, "ok:last-try")]
    assert statuses[:2] == [500, 500] and len(statuses) == 3, statuses
    assert all(c.received < killed_at for c in calls_for(sim, "ok:last-try"))

    for key in others:
        job = store.job(*key)
        assert job is not None and (job.status, job.attempts) == ("done", 1), job
    assert sum(s["outcomes"].get("done", 0) for s in summaries) == len(others)
    print(
        f"\nkill->failed as worker lost {failed_after_kill:.2f} s, "
        f"safety-net runs {[s['stopped_because'] for s in summaries]}"
    )
