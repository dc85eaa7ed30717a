"""The flows against a real Prefect server subprocess and the gateway simulator.

Consumers run as `insight-queue` CLI processes, so every claim, heartbeat and
gateway call crosses real process boundaries; the simulator records what the
gateway saw.
"""

from __future__ import annotations

import datetime as dt
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.simulator import GatewaySimulator
from queue_store import INTERACTIVE, JobStore, Settings, migrate
from tests.support.services import PrefectServer, cli, client_env, run_cli, running

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

GAP = 0.4  # seconds: AI_JOB_GAP_SECONDS for these tests


@pytest.fixture
def sim() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=0.3) as simulator:
        yield simulator


@pytest.fixture
def env(tmp_path: Path, prefect_server: PrefectServer, sim: GatewaySimulator) -> dict[str, str]:
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    migrate.upgrade(url)
    return {
        **client_env(prefect_server.api_url, tmp_path / "prefect-client"),
        "AI_JOB_DATABASE_URL": url,
        "AI_GATEWAY_URL": sim.url,
        "AI_JOB_GAP_SECONDS": str(GAP),
        "AI_JOB_HEARTBEAT_SECONDS": "0.5",
        "AI_JOB_LEASE_SECONDS": "10",
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_BACKOFF_SECONDS": "1",
        "AI_JOB_BACKOFF_MAX_SECONDS": "4",
        "AI_JOB_PLUGINS": "flows.demo,tests.support.plugins",
    }


@pytest.fixture
def store(env: dict[str, str]) -> Iterator[JobStore]:
    settings = Settings.from_env(env)
    with JobStore(settings.database_url, settings=settings) as opened:
        yield opened


def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def served(sim: GatewaySimulator) -> list[str]:
    """The jobs the gateway received, in the order it started them."""
    records = sorted(
        (r for r in sim.stats().requests if r.started is not None), key=lambda r: r.started or 0
    )
    return [r.job or "" for r in records]


def test_interactive_request_is_the_next_call_the_gateway_receives(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    sim.set_latency(2.0)
    with running(cli("backfill", "demo"), env, tmp_path / "backfill.log") as backfill:
        wait_for(lambda: sim.stats().in_flight == 1, 60, "the first backfill call")
        today = dt.datetime.now(dt.UTC).date().isoformat()
        target = f"recovery:{today}"  # queued sixth of eight
        assert served(sim)[0] != target
        # The promotion happens while this command runs; at most one more
        # prefetch call can be claimed before it commits.
        started_before = len(served(sim))
        run_cli("interactive", "demo", "recovery", today, env=env)
        promoted = store.job("demo", "recovery", today)
        assert promoted is not None and promoted.priority == INTERACTIVE
        assert backfill.wait(120) == 0

    order = served(sim)
    assert len(order) == 8 and len(set(order)) == 8
    assert order.index(target) <= started_before + 1, (
        f"the screen's insight did not jump the queue ({started_before} calls had started "
        f"when it was requested): {order}"
    )
    assert order.index(target) < 5, order


def test_three_consumers_never_overlap_and_keep_the_gap(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    sim.set_latency(0.2)
    for n in range(20):
        store.enqueue(f"user-{n % 4}", "ok", f"s{n:02d}")
    logs = [tmp_path / f"consumer-{i}.log" for i in range(3)]
    with (
        running(cli("drain"), env, logs[0]) as first,
        running(cli("drain"), env, logs[1]) as second,
        running(cli("drain"), env, logs[2]) as third,
    ):
        for consumer in (first, second, third):
            assert consumer.wait(180) == 0
        # A consumer that found another holding the gateway may have left
        # early; whoever was last drained the rest.
    if store.pending_count():
        run_cli("drain", env=env)

    stats = sim.stats()
    assert stats.peak_in_flight == 1
    calls = sorted((r for r in stats.requests), key=lambda r: r.started or 0)
    assert len(calls) == 20
    assert sorted(r.job or "" for r in calls) == sorted(f"ok:s{n:02d}" for n in range(20))
    for before, after in itertools.pairwise(calls):
        assert after.started is not None and before.ended is not None
        assert after.started - before.ended >= GAP - 0.05, (before, after)
    for n in range(20):
        row = store.job(f"user-{n % 4}", "ok", f"s{n:02d}")
        assert row is not None and row.status == "done" and row.attempts == 1


def test_outage_spends_no_attempt_and_the_queue_recovers(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    for n in range(3):
        store.enqueue("u", "ok", f"s{n}")
    sim.set_fault("status", status=503, seconds=4)
    run_cli("drain", env=env, timeout=120)

    statuses = [r.status for r in sorted(sim.stats().requests, key=lambda r: r.received)]
    assert 503 in statuses and statuses[-3:] == [200, 200, 200]
    for n in range(3):
        row = store.job("u", "ok", f"s{n}")
        assert row is not None and (row.status, row.attempts) == ("done", 1)
    assert store.gate_state().outages_in_a_row == 0
    # The consumer backed off instead of hammering: 1 s, then 2 s, then 4 s
    # pauses fit in a 4 s outage with a handful of probes, not dozens.
    assert statuses.count(503) <= 5


def test_a_failing_generator_spends_its_attempts_and_the_queue_goes_on(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore
) -> None:
    store.enqueue("u", "broken", "day-1")
    store.enqueue("u", "ok", "day-1")
    run_cli("drain", env=env, timeout=120)

    broken = store.job("u", "broken", "day-1")
    assert broken is not None
    assert (broken.status, broken.attempts) == ("failed", 3)
    assert broken.error is not None and "no data for day-1" in broken.error
    ok = store.job("u", "ok", "day-1")
    assert ok is not None and ok.status == "done"
    table = run_cli("jobs", "--user", "u", env=env).stdout
    assert "no data for day-1" in table and "failed" in table


def test_gateway_limit_exists_and_gateway_task_runs_carry_the_tag(
    env: dict[str, str], store: JobStore, prefect_server: PrefectServer
) -> None:
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterName

    run_cli("setup-limit", env={**env, "AI_JOB_CONCURRENCY": "2"})
    run_cli("setup-limit", env={**env, "AI_JOB_CONCURRENCY": "1"})
    store.enqueue("tagged", "ok", "one")
    run_cli("drain", env=env)
    job = store.job("tagged", "ok", "one")
    assert job is not None and job.flow_run_id

    with (
        temporary_settings({PREFECT_API_URL: prefect_server.api_url}),
        get_client(sync_client=True) as client,
    ):
        limit = client.read_concurrency_limit_by_tag("gateway")
        runs = client.read_task_runs(
            task_run_filter=TaskRunFilter(name=TaskRunFilterName(any_=["ok:one"]))
        )
    assert limit.concurrency_limit == 1
    assert len(runs) == 1
    assert set(runs[0].tags) >= {"gateway", "kind:ok", "priority:prefetch"}
    assert str(runs[0].flow_run_id) == job.flow_run_id


def test_a_consumer_standing_by_takes_new_work_without_a_new_run(
    env: dict[str, str], sim: GatewaySimulator, store: JobStore, tmp_path: Path
) -> None:
    with running(cli("drain", "--standby", "60"), env, tmp_path / "standby.log") as consumer:
        store.enqueue("u", "ok", "warm-up")
        wait_for(lambda: len(sim.stats().requests) == 1, 60, "the warm-up call")
        wait_for(lambda: store.pending_count() == 0, 30, "the warm-up job done")
        time.sleep(GAP + 1)  # idle now: standing by

        asked = time.time()
        store.enqueue("u", "ok", "screen", priority=INTERACTIVE)
        wait_for(lambda: len(sim.stats().requests) == 2, 10, "the screen's call")
        assert consumer.poll() is None  # still standing by, no new process
    assert sim.stats().requests[-1].job == "ok:screen"
    # Claimed by the consumer already running: within a few standby polls,
    # not after a new flow run's process has started (1.5 s and more). What
    # follows the claim (the task run, the `gateway` slot) is Prefect's time.
    job = store.job("u", "ok", "screen")
    assert job is not None and job.claimed_at is not None
    assert job.claimed_at.timestamp() - asked < 1.0, job.claimed_at.timestamp() - asked
