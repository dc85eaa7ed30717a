"""Prefect's run history as the ledger of generations (N4), read through Prefect's API.

A served stack (`serve` with a Prefect server), a backfill of a user with one
scope that works and one that never can, a screen's run whose job the warm
consumer takes, an idle stretch and a graceful stop. The history must answer,
without opening logs: what was generated, for whom, when, whether it worked
and why not, and how long a screen waited.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from deployments import table
from deployments.prefect_api import PrefectApi
from devtools.stack import ServeProcess
from flows.registry import Registry
from queue_store import Status
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of
from tests.support.services import ROOT, PrefectServer

pytestmark = [pytest.mark.slow, pytest.mark.prefect]

USER = "mixed-history"


class History:
    def __init__(self, api_url: str) -> None:
        self.api = api_url

    def post(self, path: str, body: dict[str, Any]) -> Any:
        response = httpx.post(f"{self.api}{path}", json=body, timeout=10)
        response.raise_for_status()
        return response.json()

    def runs(self, **flow_run_filter: Any) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = self.post(
            "/flow_runs/filter", {"limit": 200, "flow_runs": flow_run_filter}
        )
        return runs

    def run(self, run_id: str) -> dict[str, Any]:
        response = httpx.get(f"{self.api}/flow_runs/{run_id}", timeout=10)
        response.raise_for_status()
        run: dict[str, Any] = response.json()
        return run

    def logs(self, run_id: str) -> list[str]:
        logs = self.post(
            "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "limit": 200}
        )
        return [str(entry["message"]) for entry in logs]

    def artifacts(self, run_id: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self.post(
            "/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [run_id]}}, "limit": 50}
        )
        return found

    def wait_final(self, run_id: str, timeout: float = 120) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            run = self.run(run_id)
            if run["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED"):
                return run
            time.sleep(0.5)
        raise AssertionError(f"run {run_id} still {run['state']['type']} after {timeout:g} s")


def state(run: dict[str, Any]) -> tuple[str, str]:
    return str(run["state"]["type"]), str(run["state"].get("message") or "")


def test_the_history_tells_what_was_generated_for_whom_and_how_it_ended(
    prefect_server: PrefectServer, tmp_path: Path
) -> None:
    history = History(prefect_server.api_url)
    with Gateway(latency=0.5) as gateway:
        settings = settings_for(
            data_dir=tmp_path / "data",
            gap_seconds=0.2,
            max_attempts=2,
            plugins="tests.support.plugins",
            gateway={"url": gateway.url},
        )
        serve = ServeProcess(
            settings,
            prefect_server.api_url,
            env={"PYTHONPATH": str(ROOT)},
            log=tmp_path / "serve.log",
        ).start()
        api = PrefectApi(prefect_server.api_url)
        store = store_for(settings)
        try:
            # The post-sync hook: the scopes queued, one backfill run following them, which
            # knows the user by the pseudonym the store gave them (D4).
            scopes = Registry.from_plugins(settings.plugin_modules).scopes_for(USER)
            store.enqueue_many([scope.request(USER) for scope in scopes])
            who = next(e.job.pseudonym for e in store.list_jobs(USER) if e.job.pseudonym)
            backfill_id = api.create_run(
                table.BACKFILL.name,
                {"user": who},
                name=f"backfill:{who}",
                tags=[f"user:{who}"],
                idempotency_key=f"history-{time.time()}",
            )
            backfill = history.wait_final(backfill_id)

            # A screen's run for a new job: the warm consumer takes the job,
            # the screen's run tells the story.
            screen_id = api.create_run(
                table.INTERACTIVE.name,
                {"user": who, "kind": "ok", "subject": "on-screen"},
                name="ok:on-screen",
                tags=[f"user:{who}"],
                idempotency_key=f"history-screen-{time.time()}",
            )
            screen = history.wait_final(screen_id)

            # An idle stretch adds no run to the history.
            before_idle = len(history.runs())
            time.sleep(8)
            after_idle = len(history.runs())

            assert serve.process is not None
            serve.process.send_signal(signal.SIGTERM)
            serve.process.wait(30)
            serve.process = None
        finally:
            serve.stop()
            api.close()

        # The backfill: honest about the scope that failed, no traceback.
        assert state(backfill) == ("FAILED", "1 done, 1 failed")
        backfill_logs = history.logs(backfill_id)
        assert any("queued 2 scope(s)" in m for m in backfill_logs), backfill_logs
        assert not [m for m in backfill_logs if "Traceback" in m], backfill_logs
        artifacts = {a["type"]: a for a in history.artifacts(backfill_id)}
        assert artifacts["progress"]["data"] == 100.0
        rows = artifacts["table"]["data"]
        assert '"status": "done"' in rows and '"status": "failed"' in rows

        # One run per generation attempt, named kind:subject, for whom and which try.
        generations = history.runs(tags={"all_": ["generation", f"user:{who}"]})
        assert not [r for r in history.runs() if USER in json.dumps(r)]  # never the user's id
        by_name: dict[str, list[dict[str, Any]]] = {}
        for run in generations:
            by_name.setdefault(str(run["name"]), []).append(run)
        assert set(by_name) == {"ok:first", "broken:second", "ok:on-screen"}
        assert [state(r)[0] for r in by_name["ok:first"]] == ["COMPLETED"]
        ok_run = by_name["ok:first"][0]
        assert {"kind:ok", "priority:prefetch", "attempt:1"} <= set(ok_run["tags"])
        broken = sorted(by_name["broken:second"], key=lambda r: str(r["start_time"]))
        assert [state(r)[0] for r in broken] == ["FAILED", "FAILED"]
        assert [f"attempt:{n}" in r["tags"] for n, r in enumerate(broken, 1)] == [True, True]
        first_message, last_message = state(broken[0])[1], state(broken[1])[1]
        assert first_message.startswith("attempt failed, queued again: generator 'broken'")
        assert last_message.startswith("failed, attempts spent: generator 'broken'")
        assert "\n" not in last_message and "RuntimeError" in last_message
        # The generator's own words stay in the store (D4).
        assert "no data for second" not in last_message
        for run in broken:
            logs = history.logs(str(run["id"]))
            assert any("generator 'broken'" in m for m in logs), logs
            assert not [m for m in logs if "Traceback" in m], logs

        # The screen's run: which run made its insight, and how long it took.
        story_type, story_message = state(screen)
        assert story_type == "COMPLETED" and story_message.startswith("served in ")
        generated = by_name["ok:on-screen"][0]
        assert str(generated["id"]) in story_message
        assert "priority:interactive" in generated["tags"]
        story = [a for a in history.artifacts(screen_id) if a["type"] == "markdown"]
        assert story and f"/runs/flow-run/{generated['id']}" in story[0]["data"]

        # Idle: nothing added. Stopped gracefully: nothing left running, the
        # finished runs kept their states.
        assert after_idle == before_idle
        ours = history.runs(tags={"all_": [f"user:{who}"]})
        assert not [r["name"] for r in ours if state(r)[0] in ("RUNNING", "PENDING")]
        assert state(history.run(backfill_id)) == ("FAILED", "1 done, 1 failed")
        job = job_of(store, USER, "ok", "on-screen")
        assert job is not None and job.status == Status.DONE
        assert job.flow_run_id == generated["id"]
        store.close()
