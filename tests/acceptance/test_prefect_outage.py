"""Consumers outlast a Prefect server that is away: `serve`, and `consume` beside workers.

- Prefect's runner stops for good after a few polls that could not reach its
  server. `serve` must not stop with it: it starts another runner (its log
  says so) while its consumer goes on, and once the server is back the
  deployments are served again. Here serve's Prefect client retries a
  refused connection once instead of five times with a growing backoff, so
  the runner gives up within seconds of the outage instead of minutes: a
  fault by count. The test waits for serve's log to say it starts another
  runner (the event), then brings Prefect back.
- `insight-queue consume` takes a `gateway` slot for each call. With Prefect
  away no slot can be asked for: it starts no call, keeps standing by, and
  makes the call once Prefect is back.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments.processes import free_port
from devtools.stack import ServeProcess
from flows.limits import ensure_gateway_limit
from tests.support import waiting
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of, standing_by
from tests.support.services import ROOT, PrefectServer, cli, client_env, run_cli, running

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

USER = "outage-user"
GAP = 0.2


# Conditions here ask Prefect's API; five times a second is enough.
wait_for = partial(waiting.wait_for, every=0.2)


def outlasts_the_runner(serve: ServeProcess, log: Path) -> None:
    """Prefect is away: serve's log says it starts its runner again, and serve lives on."""
    wait_for(
        lambda: "starting it again" in log.read_text() or not serve.alive(),
        120,
        "serve to notice that Prefect's runner stopped",
    )
    assert serve.alive(), log.read_text(errors="replace")[-4000:]


def run_state(api_url: str, run_id: str) -> dict[str, Any]:
    response = httpx.get(f"{api_url}/flow_runs/{run_id}", timeout=10)
    response.raise_for_status()
    state: dict[str, Any] = response.json()["state"]
    return state


def test_serve_starts_another_runner_when_prefect_s_gives_up_and_serves_again(
    tmp_path: Path,
) -> None:
    with Gateway(latency=0.2) as gateway:
        settings = settings_for(
            data_dir=tmp_path / "data",
            gap_seconds=GAP,
            lease_seconds=5.0,
            heartbeat_seconds=0.5,
            poll_seconds=0.5,
            gateway={"url": gateway.url},
        )
        server = PrefectServer(tmp_path / "prefect-server", free_port(), ui=False)
        log = tmp_path / "serve.log"
        serve = ServeProcess(
            settings,
            server.api_url,
            env={"PYTHONPATH": str(ROOT), "PREFECT_CLIENT_MAX_RETRIES": "1"},
            log=log,
        )
        env = {**settings.to_env(), "PREFECT_API_URL": server.api_url}
        try:
            server.start()
            with serve:
                server.stop()
                outlasts_the_runner(serve, log)
                server.start()

                # The post-sync hook's run is taken by the runner serve started.
                # (The hook waits a second at most for Prefect: a server just
                # started may need a few tries; the same sync starts one run.)
                hook: dict[str, Any] = {}

                def triggered() -> bool:
                    nonlocal hook
                    done = run_cli("trigger-backfill", USER, "--sync-id", "s1", env=env)
                    hook = json.loads(done.stdout)
                    return bool(hook["flow_run_id"])

                wait_for(triggered, 60, "the hook to start its run")
                assert hook["error"] is None, hook

                def ended() -> bool:
                    return bool(
                        run_state(server.api_url, hook["flow_run_id"])["type"] == "COMPLETED"
                    )

                wait_for(ended, 180, "the backfill run to complete")
                state = run_state(server.api_url, hook["flow_run_id"])
                assert state["message"] == "8 done", state
                code = serve.stop()
            assert code == 0, log.read_text(errors="replace")[-4000:]
        finally:
            serve.stop()
            server.stop()
        gateway.assert_kept(concurrency=1, gap=GAP)


def test_serve_rides_out_prefect_going_away_before_its_deployments_were_registered(
    tmp_path: Path,
) -> None:
    """The window between serve saying where it is and its runner registering the deployments."""
    with Gateway(latency=0.2) as gateway:
        settings = settings_for(data_dir=tmp_path / "data", gateway={"url": gateway.url})
        server = PrefectServer(tmp_path / "prefect-server", free_port(), ui=False)
        log = tmp_path / "serve.log"
        serve = ServeProcess(
            settings,
            server.api_url,
            env={"PYTHONPATH": str(ROOT), "PREFECT_CLIENT_MAX_RETRIES": "1"},
            log=log,
        )
        state = settings.data_dir / "serve.json"

        def announced() -> bool:
            return state.exists() and json.loads(state.read_text()).get("pid") == serve.pid

        try:
            server.start()
            serve.start(wait=False)
            wait_for(lambda: announced() or not serve.alive(), 120, "serve to say where it is")
            server.stop()
            outlasts_the_runner(serve, log)
            server.start()
            serve.wait_ready(timeout=120)
            assert serve.alive()
            code = serve.stop()
            assert code == 0, log.read_text(errors="replace")[-4000:]
        finally:
            serve.stop()
            server.stop()


def test_consume_waits_for_a_gateway_slot_while_prefect_is_away_and_calls_once_it_is_back(
    tmp_path: Path,
) -> None:
    with Gateway(latency=0.2) as gateway:
        recorder = gateway.recorder
        assert recorder is not None
        settings = settings_for(
            data_dir=tmp_path / "data",
            gap_seconds=GAP,
            lease_seconds=5.0,
            heartbeat_seconds=0.5,
            poll_seconds=0.5,
            gateway={"url": gateway.url},
        )
        server = PrefectServer(tmp_path / "prefect-server", free_port(), ui=False)
        env = {**settings.to_env(), **client_env(server.api_url, tmp_path / "client")}
        log = tmp_path / "consume.log"
        try:
            server.start()
            with temporary_settings({PREFECT_API_URL: server.api_url}):
                ensure_gateway_limit(1)
            with (
                store_for(settings) as store,
                running(cli("consume"), env, log) as consumer,
            ):
                wait_for(lambda: bool(standing_by(store)), 60, "the consumer standing by")
                server.stop()
                store.enqueue(USER, "sleep", "2026-01-01")
                wait_for(
                    lambda: "slot could be asked for" in log.read_text() or consumer.poll(),
                    60,
                    "the consumer to find no gateway slot",
                )
                assert consumer.poll() is None, log.read_text(errors="replace")[-4000:]
                assert recorder.count == 0  # no call without the slot
                server.start()

                def done() -> bool:
                    job = job_of(store, USER, "sleep", "2026-01-01")
                    return job is not None and job.status == "done"

                wait_for(done, 120, "the job done once Prefect is back")
                consumer.send_signal(15)
                assert consumer.wait(30) == 0, log.read_text(errors="replace")[-4000:]
        finally:
            server.stop()
        summary = json.loads(
            next(line for line in reversed(log.read_text().splitlines()) if line.startswith("{"))
        )
        assert summary["outcomes"] == {"done": 1}, summary
        assert gateway.answers_for("sleep:2026-01-01") == 1
        gateway.assert_kept(concurrency=1, gap=GAP)
