"""End to end: `serve`, the post-sync trigger and a polling screen, all as CLI processes.

A Prefect server subprocess, `insight-queue serve` in another, and the gateway
simulator; the app's side is `insight-queue trigger-backfill` and
`insight-queue request-insight` run as a screen would, once a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from flows.demo import demo_scopes
from flows.simulator import GatewaySimulator
from queue_store import JobStore, Settings, migrate
from tests.support.services import PrefectServer, cli, client_env, run_cli, running

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

USER = "e2e-user"


@pytest.fixture
def sim() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=1.5) as simulator:
        yield simulator


def stack_env(tmp_path: Path, api_url: str, sim: GatewaySimulator) -> dict[str, str]:
    url = f"sqlite:///{tmp_path / 'queue.db'}"
    migrate.upgrade(url)
    return {
        **client_env(api_url, tmp_path / "prefect-client"),
        "AI_JOB_DATABASE_URL": url,
        "AI_JOB_DATA_DIR": str(tmp_path / "data"),
        "AI_GATEWAY_URL": sim.url,
        "AI_JOB_GAP_SECONDS": "0.5",
        "AI_JOB_HEARTBEAT_SECONDS": "0.5",
        "AI_JOB_LEASE_SECONDS": "5",
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_BACKOFF_SECONDS": "1",
        "AI_JOB_BACKOFF_MAX_SECONDS": "4",
        "AI_JOB_PLUGINS": "flows.demo",
        "PREFECT_LOGGING_LEVEL": "INFO",
    }


def wait_for(condition: Callable[[], object], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


def deployments_ready(api_url: str) -> bool:
    from prefect import get_client

    try:
        with (
            temporary_settings({PREFECT_API_URL: api_url}),
            get_client(sync_client=True) as client,
        ):
            client.read_deployment_by_name("interactive/insight-queue")
            client.read_deployment_by_name("backfill/insight-queue")
        return True
    except Exception:  # noqa: BLE001 - not there yet
        return False


def flow_runs_of(api_url: str, deployment: str) -> list[Any]:
    from prefect import get_client
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        found = client.read_deployment_by_name(deployment)
        return list(
            client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[found.id]))
            )
        )


def poll(env: dict[str, str], kind: str, subject: str, fingerprint: str | None) -> dict[str, Any]:
    args = ["request-insight", USER, kind, subject]
    if fingerprint:
        args += ["--fingerprint", fingerprint]
    result = run_cli(*args, env=env, timeout=60)
    assert "Traceback" not in result.stderr, result.stderr
    state: dict[str, Any] = json.loads(result.stdout)
    return state


def test_backfill_then_a_screen_polling_every_second(
    tmp_path: Path, prefect_server: PrefectServer, sim: GatewaySimulator
) -> None:
    env = stack_env(tmp_path, prefect_server.api_url, sim)
    screen = next(s for s in demo_scopes(USER) if s.kind == "trends")  # queued last
    with running(cli("serve", "--safety-net", "3600"), env, tmp_path / "serve.log"):
        wait_for(lambda: deployments_ready(prefect_server.api_url), 120, "the deployments")
        first = run_cli("trigger-backfill", USER, "--sync-id", "sync-1", env=env).stdout.strip()
        again = run_cli("trigger-backfill", USER, "--sync-id", "sync-1", env=env).stdout.strip()
        assert first == again  # the same sync twice starts one run

        wait_for(lambda: len(sim.stats().requests) >= 3, 120, "three gateway calls")
        states = []
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            started = time.monotonic()
            states.append(poll(env, screen.kind, screen.subject, screen.fingerprint))
            if states[-1]["status"] == "done":
                break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        wait_for(lambda: len(sim.stats().requests) >= 8, 180, "all eight calls")

        interactive_runs = flow_runs_of(prefect_server.api_url, "interactive/insight-queue")
        backfill_runs = flow_runs_of(prefect_server.api_url, "backfill/insight-queue")

    final = states[-1]
    assert final["status"] == "done", states
    assert final["result"] is not None and final["fresh"] is True
    assert "28-day averages" in final["result"]["output"]["text"]
    assert states[0]["status"] in ("pending", "running")

    order = [
        r.job
        for r in sorted(sim.stats().requests, key=lambda r: r.started or 0)
        if r.started is not None
    ]
    assert len(order) == 8, order
    target = f"{screen.kind}:{screen.subject}"
    assert order.index(target) <= 4, f"the screen's insight did not jump the backfill: {order}"
    assert sim.stats().peak_in_flight == 1
    # A screen polls every second; runs are started only when needed.
    assert len(states) >= 2
    assert len(interactive_runs) <= 2, [r.name for r in interactive_runs]
    assert len(backfill_runs) == 1


def test_prefect_server_restart_loses_nothing_and_leaks_no_slot(
    tmp_path: Path, sim: GatewaySimulator
) -> None:
    from flows.limits import repair_gateway_slots

    server = PrefectServer(tmp_path / "prefect-server").start()
    try:
        env = stack_env(tmp_path, server.api_url, sim)
        settings = Settings.from_env(env)
        scopes = demo_scopes(USER)[:4]
        with (
            JobStore(settings.database_url, settings=settings) as store,
            running(cli("serve", "--safety-net", "5"), env, tmp_path / "serve.log"),
        ):
            wait_for(lambda: deployments_ready(server.api_url), 120, "the deployments")
            run_cli("trigger-backfill", USER, env=env)
            wait_for(lambda: sim.stats().in_flight == 1, 120, "a call in flight")

            server.stop()
            for scope in scopes:  # the screen keeps polling: queued, no traceback
                state = poll(env, scope.kind, scope.subject, scope.fingerprint)
                assert state["status"] in ("pending", "running", "done")
                assert state["error"] is None
            time.sleep(3)
            server.start()

            def all_done() -> bool:
                return all(
                    (job := store.job(USER, s.kind, s.subject)) is not None and job.status == "done"
                    for s in demo_scopes(USER)
                )

            wait_for(all_done, 240, "every job done after the restart")
            with temporary_settings({PREFECT_API_URL: server.api_url}):
                wait_for(lambda: repair_gateway_slots(repair=False).counted == 0, 60, "a free slot")
                check = repair_gateway_slots(repair=False)
        assert (check.counted, check.live) == (0, 0)
        assert sim.stats().peak_in_flight == 1
        for scope in demo_scopes(USER):
            job = store.job(USER, scope.kind, scope.subject)
            assert job is not None and job.status == "done"
    finally:
        server.stop()
