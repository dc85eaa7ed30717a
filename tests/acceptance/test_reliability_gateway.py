"""A gateway outage of 25-30 s seen by a real `insight-queue drain` consumer (N2).

The simulator goes through three phases, each set while the previous one is
still in force (and while the consumer is paused) so no call slips through
between them; a phase ends after a set number of calls, not after a set time,
so a slow machine changes the durations but not the story:

1. refusing connections (nothing listens on its port) for 4 calls: pauses of
   1, 2, 4 and 4 s, the last one at the cap (~7 s);
2. answering HTTP 503 to 2 calls, paused 4 s each (~8 s);
3. accepting 2 calls and holding them far beyond AI_GATEWAY_READ_TIMEOUT
   (~4 s more),

then it is healthy again. An unreachable gateway (phases 1 and 2) must not
spend an attempt, and the consumer must back off with a growing, capped pause
and resume by itself; a timeout (phase 3) does spend an attempt (N2), so the
two hung calls cost their job two of its three attempts and it still ends done.

The backoff is read from the store's gate row (`gate_state()`), sampled from
the test process: each outage report sets `outages_in_a_row`, `paused_until`
and `last_finished_at` in one write, so their difference is the pause the
store chose. The spacing of the 503 probes is read from the simulator.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from flows.simulator import INJECTED_STATUS, OK, GatewaySimulator
from queue_store import JobStore, Settings
from tests.support.services import BackgroundSampler, PrefectServer, cli, client_env, running

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

BACKOFF = 1.0  # seconds: AI_JOB_BACKOFF_SECONDS
BACKOFF_MAX = 4.0  # seconds: AI_JOB_BACKOFF_MAX_SECONDS
READ_TIMEOUT = 2.0  # seconds: AI_GATEWAY_READ_TIMEOUT
GAP = 0.2  # seconds: AI_JOB_GAP_SECONDS
REFUSED_CALLS = 4  # phase 1; the 3rd and 4th pauses are at the cap
STATUS_CALLS = 2  # phase 2: HTTP 503
HUNG_CALLS = 2  # phase 3: held past the read timeout; each spends an attempt (N2)
HOLD = 30.0  # seconds a hung call is held: far beyond the read timeout
SAFETY = 120.0  # seconds: faults are set with a deadline so a failed test cannot hang
# Between a pause's end and the next call the consumer claims and starts a
# Prefect task run: ~0.1 s, but on a loaded machine Prefect's own SQLite
# server answers 503 ("database is locked") and its client retries after 2 s
# or more. So a probe may come this much later than its pause; never earlier.
PROBE_SLACK = 8.0  # seconds
JOBS = 4


@pytest.fixture
def sim() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=0.2) as simulator:
        yield simulator


@pytest.fixture
def env(
    tmp_path: Path, prefect_server: PrefectServer, sim: GatewaySimulator, database_url: str
) -> dict[str, str]:
    return {
        **client_env(prefect_server.api_url, tmp_path / "prefect-client"),
        "AI_JOB_DATABASE_URL": database_url,
        "AI_GATEWAY_URL": sim.url,
        "AI_GATEWAY_READ_TIMEOUT": str(READ_TIMEOUT),
        "AI_GATEWAY_CONNECT_TIMEOUT": "1",
        "AI_JOB_GAP_SECONDS": str(GAP),
        "AI_JOB_HEARTBEAT_SECONDS": "0.5",
        "AI_JOB_LEASE_SECONDS": "10",
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_MAX_ATTEMPTS": "3",
        "AI_JOB_BACKOFF_SECONDS": str(BACKOFF),
        "AI_JOB_BACKOFF_MAX_SECONDS": str(BACKOFF_MAX),
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
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@dataclasses.dataclass(frozen=True)
class Pause:
    """One outage report as the gate row recorded it (first sample of its streak)."""

    streak: int
    reported_at: float  # time.time() of the report (the row's last_finished_at)
    seconds: float  # paused_until - reported_at: the pause the store chose


class GateSampler(BackgroundSampler):
    """Reads `gate_state()` every 50 ms and keeps the first sample of each streak value."""

    def __init__(self, store: JobStore) -> None:
        super().__init__()
        self.store = store
        self.pauses: dict[int, Pause] = {}
        self.samples = 0

    def sample(self, stop: threading.Event) -> None:
        while not stop.wait(0.05):
            state = self.store.gate_state()
            self.samples += 1
            streak = state.outages_in_a_row
            if streak and streak not in self.pauses:
                assert state.paused_until is not None and state.last_finished_at is not None
                self.pauses[streak] = Pause(
                    streak,
                    state.last_finished_at.timestamp(),
                    (state.paused_until - state.last_finished_at).total_seconds(),
                )


def expected_pause(streak: int) -> float:
    return min(BACKOFF * 2 ** (streak - 1), BACKOFF_MAX)


def test_an_outage_spends_no_attempt_backs_off_with_a_cap_and_the_queue_drains(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    keys = [(f"user-{n}", "ok", f"day-{n}") for n in range(JOBS)]
    for key in keys:
        store.enqueue(*key)
    head = keys[0]  # oldest at equal priority: the job every probe carries

    sim.set_fault("refuse", seconds=SAFETY)
    with (
        GateSampler(store) as sampler,
        running(cli("drain"), env, tmp_path / "consumer.log") as consumer,
    ):
        wait_for(lambda: store.gate_state().outages_in_a_row >= 1, 60, "the first refused call")
        first_refusal = store.gate_state().last_finished_at
        assert first_refusal is not None
        outage_began = first_refusal.timestamp()

        wait_for(lambda: store.gate_state().outages_in_a_row >= REFUSED_CALLS, 60, "refused calls")
        status_began = time.time()
        sim.set_fault("status", status=503, seconds=SAFETY)  # ends the refusal

        def seen_503() -> int:
            return sum(r.outcome == INJECTED_STATUS for r in sim.stats().requests)

        wait_for(lambda: seen_503() >= STATUS_CALLS, 60, "503 answers")
        hang_began = time.time()
        sim.set_fault("hang", requests=HUNG_CALLS, hold_seconds=HOLD)
        assert consumer.wait(120) == 0, (tmp_path / "consumer.log").read_text()[-3000:]
        drained_at = time.time()

    records = sorted(sim.stats().requests, key=lambda r: r.received)
    timeline = [(round(r.received - outage_began, 2), r.job, r.outcome, r.status) for r in records]

    # 1. Nothing reached the gateway while it refused; then 503s only, then
    # the hung calls, then answers.
    probes_503 = [r for r in records if r.outcome == INJECTED_STATUS]
    hung = [r for r in records if r.outcome not in (OK, INJECTED_STATUS)]
    answered = [r for r in records if r.outcome == OK]
    assert all(r.received >= status_began for r in records), timeline
    assert len(probes_503) == STATUS_CALLS, timeline
    assert all(r.status == 503 for r in probes_503)
    assert len(hung) == HUNG_CALLS, timeline
    assert probes_503[-1].received < hung[0].received
    assert hung[-1].received < answered[0].received

    # 2. The backoff: one report per pause, doubling from BACKOFF, capped at BACKOFF_MAX.
    assert sampler.error is None, repr(sampler.error)
    streaks = sorted(sampler.pauses)
    assert streaks == list(range(1, len(streaks) + 1)), streaks
    # One report per refused or 503 call, and one per timeout: the gateway may
    # still be working on a call we gave up on, so claiming pauses then too.
    assert len(streaks) == REFUSED_CALLS + STATUS_CALLS + HUNG_CALLS, sampler.pauses
    for streak in streaks:
        pause = sampler.pauses[streak]
        assert pause.seconds == pytest.approx(expected_pause(streak), abs=0.01), pause
    assert max(p.seconds for p in sampler.pauses.values()) == pytest.approx(BACKOFF_MAX)
    for before, after in itertools.pairwise(streaks):
        spacing = sampler.pauses[after].reported_at - sampler.pauses[before].reported_at
        pause = expected_pause(before)
        assert pause - 0.05 <= spacing <= pause + PROBE_SLACK, (before, spacing)
    # The same spacing, seen by the gateway: consecutive 503 probes.
    for before_probe, after_probe in itertools.pairwise(probes_503):
        spacing = after_probe.received - before_probe.received
        assert BACKOFF_MAX - 0.05 <= spacing <= BACKOFF_MAX + PROBE_SLACK, spacing

    # 3. The hung calls timed out on the client and spent the head job's
    # attempts; nothing else did. Then each job was answered once.
    assert [r.job for r in hung] == [f"ok:{head[2]}"] * HUNG_CALLS, hung
    for earlier, later in itertools.pairwise(hung):
        assert later.received - earlier.received >= READ_TIMEOUT - 0.1
    assert [r.status for r in answered] == [200] * JOBS, answered
    assert sorted(r.job or "" for r in answered) == sorted(f"ok:{k[2]}" for k in keys)

    # 4. Every job done; attempts count the timeouts only (N2).
    timeouts = {f"ok:{head[2]}": HUNG_CALLS}
    for key in keys:
        job = store.job(*key)
        assert job is not None
        assert (job.status, job.attempts, job.error) == (
            "done",
            1 + timeouts.get(f"ok:{key[2]}", 0),
            None,
        ), job
    assert store.gate_state().outages_in_a_row == 0  # the first answer ended the streak

    refused = [p for p in sampler.pauses.values() if p.reported_at < status_began]
    assert len(refused) == REFUSED_CALLS
    print(
        f"refused {status_began - outage_began:.1f} s, 503 {hang_began - status_began:.1f} s, "
        f"first answer {answered[0].received - outage_began:.1f} s; drained "
        f"{drained_at - outage_began:.1f} s after the first refusal; "
        f"pauses {[(p.streak, round(p.seconds, 2)) for p in sampler.pauses.values()]}; "
        f"refused probes {len(refused)}, 503 probes {len(probes_503)} spaced "
        f"{[round(b.received - a.received, 2) for a, b in itertools.pairwise(probes_503)]} s; "
        f"hung {len(hung)}; gateway peak in flight {sim.stats().peak_in_flight}"
    )
