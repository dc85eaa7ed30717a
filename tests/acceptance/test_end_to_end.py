"""End to end as a user runs it: `serve`, the app's calls and the operator's, as processes.

`serve` runs as its own process with the gateway simulator behind the
recorder; everything else is the `insight-queue` command, run the way the
post-sync hook, a screen and an operator would: `trigger-backfill`,
`request-insight` (once a second, as a screen polls), `status`, `jobs`,
`queue --json`, `retry-failed`. Faults are set by count or by event: the first
call of the backfill is held at the gateway until the screen has asked, so
"the screen's job is the next call" is a fact, not a race.

- The embedded default: `serve` starts its own Prefect server, and the app's
  calls find it through the data directory (no PREFECT_API_URL).
- A Prefect server of its own, restarted while a call is in flight: nothing
  is lost, `serve` keeps going, and no `gateway` slot is left counted.

The recorder, not the store, says how many calls were open at the gateway.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings

from deployments.processes import free_port
from devtools.simulator import HUNG, OK
from devtools.stack import ServeProcess
from flows.demo import demo_scopes
from queue_store import Settings
from tests.support import waiting
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of
from tests.support.services import ROOT, PrefectServer, run_cli

pytestmark = [pytest.mark.prefect, pytest.mark.slow]

USER = "e2e-user"
GAP = 0.5
INSIGHT_STATE_KEYS = {
    "status",
    "ahead",
    "ahead_exact",
    "in_flight",
    "eta_seconds",
    "result",
    "fresh",
    "flow_run_id",
    "run_note",
    "paused",
    "error",
}
SNAKE = re.compile(r"[a-z][a-z0-9_]*")


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway(latency=0.8) as started:
        yield started


def stack_settings(tmp_path: Path, gateway: Gateway) -> Settings:
    return settings_for(
        data_dir=tmp_path / "data",
        gap_seconds=GAP,
        lease_seconds=5.0,
        heartbeat_seconds=0.5,
        poll_seconds=0.5,
        backoff_seconds=1.0,
        backoff_max_seconds=4.0,
        plugins="flows.demo,tests.support.plugins",
        gateway={"url": gateway.url},
    )


# Conditions here ask Prefect's API; five times a second is enough.
wait_for = partial(waiting.wait_for, every=0.2)


def cli_json(*args: str, env: dict[str, str]) -> Any:
    """Run a command that prints JSON; it must exit 0 without a traceback."""
    done = run_cli(*args, env=env, timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    return json.loads(done.stdout)


def snake_case_keys(value: Any) -> set[str]:
    """Every key that is not snake_case, anywhere in a JSON value."""
    if isinstance(value, dict):
        found = {k for k in value if not SNAKE.fullmatch(k)}
        return found.union(*(snake_case_keys(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(snake_case_keys(v) for v in value))
    return set()


def answered(gateway: Gateway) -> Counter[str]:
    return Counter(
        r.job or "" for r in gateway.simulator.stats().requests if r.outcome in (OK, HUNG)
    )


def flow_run(api_url: str, run_id: str) -> dict[str, Any]:
    response = httpx.get(f"{api_url}/flow_runs/{run_id}", timeout=10)
    response.raise_for_status()
    found: dict[str, Any] = response.json()
    return found


def final_state(api_url: str, run_id: str, timeout: float = 60) -> tuple[str, str]:
    state: dict[str, Any] = {}

    def final() -> bool:
        nonlocal state
        state = flow_run(api_url, run_id)["state"]
        return state["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")

    wait_for(final, timeout, f"flow run {run_id} to end")
    return str(state["type"]), str(state["message"] or "")


def runs_of_deployment(api_url: str, name: str) -> list[dict[str, Any]]:
    deployment = httpx.get(f"{api_url}/deployments/name/{name}", timeout=10)
    deployment.raise_for_status()
    response = httpx.post(
        f"{api_url}/flow_runs/filter",
        json={"deployments": {"id": {"any_": [deployment.json()["id"]]}}},
        timeout=10,
    )
    response.raise_for_status()
    found: list[dict[str, Any]] = response.json()
    return found


def environment_of_run(run_id: str) -> dict[str, str] | None:
    """The environment a flow run's process was started with, found by its run id."""
    for entry in Path("/proc").iterdir():
        try:
            raw = (entry / "environ").read_bytes()
        except OSError:  # not a process, gone, or not ours
            continue
        pairs = dict(item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
        if pairs.get(b"PREFECT__FLOW_RUN_ID") == run_id.encode():
            return {k.decode(): v.decode(errors="replace") for k, v in pairs.items()}
    return None


def log_tail(path: Path) -> str:
    return path.read_text(errors="replace")[-4000:] if path.exists() else "(no log)"


def test_a_day_of_the_embedded_default_through_the_command_line(
    tmp_path: Path, gateway: Gateway
) -> None:
    recorder = gateway.recorder
    assert recorder is not None
    settings = stack_settings(tmp_path, gateway)
    port = free_port()
    api_url = f"http://127.0.0.1:{port}/api"
    log = tmp_path / "serve.log"
    # The app's side: no PREFECT_API_URL; serve says where it is in the data directory.
    env = {**settings.to_env(), "PYTHONPATH": str(ROOT), "PREFECT_API_URL": ""}
    scopes = demo_scopes(USER)
    screen = next(s for s in scopes if s.kind == "trends")  # queued last
    screen_label = f"{screen.kind}:{screen.subject}"
    # The backfill's first call is held at the gateway until the screen has asked.
    gateway.simulator.set_fault("hang", requests=1)

    serve = ServeProcess(
        settings,
        api_url,
        env={"PYTHONPATH": str(ROOT), "PREFECT_API_URL": ""},
        log=log,
        args=("--prefect-port", str(port), "--no-ui"),
    )
    with serve, store_for(settings) as store:
        # The post-sync hook: the same sync twice starts one run.
        hook = cli_json("trigger-backfill", USER, "--sync-id", "sync-1", env=env)
        again = cli_json("trigger-backfill", USER, "--sync-id", "sync-1", env=env)
        assert hook["flow_run_id"] and hook == again, (hook, again)
        assert (hook["user_id"], hook["queued"], hook["run_note"], hook["error"]) == (
            USER,
            len(scopes),
            None,
            None,
        )

        recorder.wait_until(lambda s: s.in_flight == 1, 120, "the first backfill call")
        # The recorder sees the connection before the simulator has read the body.
        gateway.simulator.wait_for(lambda s: len(s.requests) >= 1, 30)
        first = gateway.served()[0]
        # The backfill's run follows that call. It beats as a pool's runs do, not at
        # Prefect's default of 180 s: where `deploy` put its automations, which end a
        # run silent for 90 s, it is not taken for lost (W3).
        run_env = environment_of_run(hook["flow_run_id"])
        assert run_env is not None, "the backfill's run has no process"
        beat = run_env.get("PREFECT_FLOWS_HEARTBEAT_FREQUENCY")
        assert beat == "30", beat
        queue = cli_json("queue", "--json", env=env)
        assert not snake_case_keys(queue), snake_case_keys(queue)
        assert [f"{e['kind']}:{e['subject']}" for e in queue["running"]] == [first]
        assert queue["waiting_total"] == len(scopes) - 1
        assert any(w["alive"] and w["role"] == "consumer" for w in queue["workers"]), queue

        # A screen opens the insight queued last: it goes to the front.
        asked = cli_json(
            "request-insight",
            USER,
            screen.kind,
            screen.subject,
            "--fingerprint",
            screen.fingerprint or "",
            env=env,
        )
        assert set(asked) == INSIGHT_STATE_KEYS, asked
        assert asked["status"] == "pending" and (asked["ahead"], asked["in_flight"]) == (0, 1)
        assert asked["eta_seconds"] > 0 and asked["result"] is None and not asked["fresh"]
        # A consumer stands by: no run is needed, none is started.
        assert (asked["flow_run_id"], asked["run_note"], asked["error"]) == (None, None, None)

        status = cli_json("status", USER, screen.kind, screen.subject, env=env)
        assert not snake_case_keys(status), snake_case_keys(status)
        assert (status["status"], status["priority_class"], status["ahead"]) == (
            "pending",
            "interactive",
            0,
        )
        assert status["eta_seconds"] > 0 and status["result"] is None

        table = run_cli("jobs", "--user", USER, env=env).stdout.splitlines()
        assert table[0].split()[:4] == ["STATUS", "PRIO", "KIND", "SUBJECT"]
        assert table[1].split()[:3] == ["running", "10", first.split(":")[0]], table
        assert table[2].split()[:3] == ["pending", "0*", screen.kind], table
        assert len(table) == 1 + len(scopes)

        # The held call is answered; the screen polls once a second until done.
        gateway.simulator.clear_fault()
        polls: list[dict[str, Any]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            started = time.monotonic()
            polls.append(
                cli_json(
                    "request-insight",
                    USER,
                    screen.kind,
                    screen.subject,
                    "--fingerprint",
                    screen.fingerprint or "",
                    env=env,
                )
            )
            if polls[-1]["status"] == "done":
                break
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started)))
        final = polls[-1]
        assert final["status"] == "done" and final["fresh"] is True, polls
        assert "28-day averages" in final["result"]["output"]["text"]
        assert all(p["flow_run_id"] is None and p["error"] is None for p in polls), polls
        # The screen's job was the very next call after the one in flight.
        assert gateway.served()[:2] == [first, screen_label], gateway.served()

        def all_done() -> bool:
            return all(
                (job := job_of(store, USER, s.kind, s.subject)) is not None and job.status == "done"
                for s in scopes
            )

        wait_for(all_done, 120, "every scope done")
        done = cli_json("status", USER, screen.kind, screen.subject, env=env)
        assert done["status"] == "done" and done["result"]["flow_run_id"] == done["flow_run_id"]
        generation = flow_run(api_url, done["flow_run_id"])
        assert generation["name"] == screen_label
        who = done["pseudonym"]  # all Prefect knows the user as (D4)
        assert {"generation", f"user:{who}", "priority:interactive"} <= set(generation["tags"])
        assert USER not in json.dumps(generation)

        # A job the gateway keeps rejecting fails; `retry-failed` puts it back.
        gateway.simulator.set_fault("status", status=500, requests=3, job="ok:flaky")
        assert cli_json("request-insight", USER, "ok", "flaky", env=env)["status"] == "pending"

        def failed() -> bool:
            job = job_of(store, USER, "ok", "flaky")
            return job is not None and job.status == "failed"

        wait_for(failed, 60, "the flaky job to fail")
        rows = cli_json("jobs", "--user", USER, "--json", env=env)
        flaky = next(r for r in rows if r["subject"] == "flaky")
        assert (flaky["status"], flaky["attempts"]) == ("failed", 3) and "500" in flaky["error"]
        retried = run_cli("retry-failed", USER, env=env).stdout
        assert retried.startswith(f"retried 1 failed job(s) of {USER};"), retried
        wait_for(
            lambda: (j := job_of(store, USER, "ok", "flaky")) and j.status == "done", 60, "flaky"
        )

        # The backfill's run followed its scopes to the end.
        assert final_state(api_url, hook["flow_run_id"]) == ("COMPLETED", "8 done")
        # Nobody needed a screen's run: the consumer stood by all along.
        assert runs_of_deployment(api_url, "interactive/insight-queue") == []
        code = serve.stop()
    assert code == 0, log_tail(log)
    assert not (settings.data_dir / "serve.json").exists()

    assert answered(gateway) == Counter(
        {**{f"{s.kind}:{s.subject}": 1 for s in scopes}, "ok:flaky": 1}
    )
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    assert seen.peak_in_flight == 1


def test_a_prefect_server_restart_with_a_call_in_flight_loses_nothing_and_leaks_no_slot(
    tmp_path: Path, gateway: Gateway
) -> None:
    from flows.limits import repair_gateway_slots

    recorder = gateway.recorder
    assert recorder is not None
    settings = stack_settings(tmp_path, gateway)
    server = PrefectServer(tmp_path / "prefect-server", free_port(), ui=False)
    log = tmp_path / "serve.log"
    serve = ServeProcess(settings, server.api_url, env={"PYTHONPATH": str(ROOT)}, log=log)
    env = {**settings.to_env(), "PYTHONPATH": str(ROOT), "PREFECT_API_URL": server.api_url}
    later = "late-user"  # synced while Prefect is down
    keys = [(user, s.kind, s.subject) for user in (USER, later) for s in demo_scopes(user)]
    gateway.simulator.set_fault("hang", requests=1)

    def slots() -> int:
        """`gateway` slots Prefect counts as taken (read only: nothing is repaired)."""
        with temporary_settings({PREFECT_API_URL: server.api_url}):
            return repair_gateway_slots(repair=False).counted

    try:
        server.start()
        with serve, store_for(settings) as store:
            hook = cli_json("trigger-backfill", USER, env=env)
            assert hook["flow_run_id"] and hook["error"] is None, hook
            recorder.wait_until(lambda s: s.in_flight == 1, 120, "a call in flight")
            # The backfill's run is following its scopes by then.
            wait_for(
                lambda: flow_run(server.api_url, hook["flow_run_id"])["state"]["type"] == "RUNNING",
                120,
                "the backfill run to start",
            )

            server.stop()
            # The screen keeps polling and the hook keeps working: work is
            # queued in the store, no traceback, no error (the store is up).
            for scope in demo_scopes(USER)[2:5]:
                state = cli_json("request-insight", USER, scope.kind, scope.subject, env=env)
                assert state["status"] in ("pending", "running"), state
                assert state["error"] is None and state["flow_run_id"] is None, state
            synced = cli_json("trigger-backfill", later, env=env)
            assert synced["queued"] == 8 and synced["error"] is None, synced
            assert synced["flow_run_id"] is None and "Prefect unreachable" in synced["run_note"]
            server.start()
            gateway.simulator.clear_fault()

            def all_done() -> bool:
                return all(
                    (j := job_of(store, *key)) is not None and j.status == "done" for key in keys
                )

            wait_for(all_done, 180, "every job done after the restart")
            assert serve.alive(), log_tail(log)
            # At most the one slot serve's consumer holds is counted.
            assert slots() <= 1
            # The backfill's run is not left "running": it ends, having seen its
            # scopes through, or crashed by Prefect when the slot lease of its
            # deployment's concurrency limit could not be renewed in the outage.
            ended = final_state(server.api_url, hook["flow_run_id"], timeout=120)
            assert ended in (("COMPLETED", "8 done"), ("CRASHED", ended[1])), ended
            code = serve.stop()
        assert code == 0, log_tail(log)
        wait_for(lambda: slots() == 0, 60, "the gateway slot given back")
    finally:
        serve.stop()
        server.stop()

    assert answered(gateway) == Counter({f"{kind}:{subject}": 2 for _, kind, subject in keys})
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    assert seen.peak_in_flight == 1
