"""Stopping `serve` mid-call, and starting it again (L4).

SIGTERM or SIGINT to `serve` while a generation is in flight: the call is
really stopped (its connection closes at the gateway, unanswered), the job is
handed back without spending its attempt, its run ends Cancelled, and nothing
of serve's is left running. Started again, serve takes the job at once and it
is done after exactly one answer from the gateway.

The gateway here stops working on a call whose client went away (the
simulator's default), so the stopped call holds nothing: the hold is 0
(`AI_GATEWAY_CUT_HOLD_SECONDS`, H1). With a gateway that finishes what it
started, the restart waits for the hold: `test_cut_calls.py`.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import cast

import httpx
import pytest

from deployments import processes
from devtools.stack import ServeProcess
from queue_store import Status
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of
from tests.support.services import PrefectServer

pytestmark = [pytest.mark.slow, pytest.mark.prefect]


def _runs(api_url: str) -> list[dict[str, object]]:
    response = httpx.post(f"{api_url}/flow_runs/filter", json={"limit": 200}, timeout=10)
    response.raise_for_status()
    runs: list[dict[str, object]] = response.json()
    return runs


def _state(run: dict[str, object]) -> str:
    state = run["state"]
    assert isinstance(state, dict)
    return str(state["type"])


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_stopping_serve_mid_call_hands_the_job_back_and_a_restart_finishes_it(
    prefect_server: PrefectServer, tmp_path: Path, sig: signal.Signals
) -> None:
    with Gateway(latency=6.0) as gateway:
        assert gateway.recorder is not None
        settings = settings_for(
            data_dir=tmp_path / "data",
            gap_seconds=0.2,
            plugins="tests.support.plugins",
            gateway={"url": gateway.url, "cut_hold_seconds": 0},
        )
        store = store_for(settings)
        subject = f"stop-{sig.name}"
        store.enqueue("stopper", "ok", subject)
        serve = ServeProcess(
            settings,
            prefect_server.api_url,
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            log=tmp_path / "serve-1.log",
        ).start()
        assert serve.process is not None
        pid = serve.process.pid
        gateway.recorder.wait_until(lambda s: s.in_flight == 1, 120, "the call in flight")
        children = processes.children(pid)

        stop_at = time.monotonic()
        serve.process.send_signal(sig)
        code = serve.process.wait(30)
        stopped_in = time.monotonic() - stop_at
        serve.process = None

        # The call was stopped, not abandoned: its connection closed, unanswered.
        seen = gateway.recorder.wait_until(lambda s: s.in_flight == 0, 5, "the call closed")
        assert seen.count == 1
        assert gateway.answers_for(f"ok:{subject}") == 0
        print(f"FIGURES {sig.name}: serve stopped in {stopped_in:.2f} s")
        assert stopped_in < 20, f"serve took {stopped_in:.1f} s to stop"
        assert code == 0, (tmp_path / "serve-1.log").read_text()[-3000:]
        for child in children:
            with pytest.raises(ProcessLookupError):
                os.kill(child, 0)

        job = job_of(store, "stopper", "ok", subject)
        assert job is not None and (job.status, job.attempts) == (Status.PENDING, 0)
        runs = _runs(prefect_server.api_url)
        generation = [r for r in runs if r["name"] == f"ok:{subject}"]
        assert [_state(r) for r in generation] == ["CANCELLED"], generation
        if job.flow_run_id is not None:
            assert job.flow_run_id == generation[0]["id"]
        # None of this serve's runs left running (the session's server holds other tests' too).
        ours = [r for r in runs if f"user:{job.pseudonym}" in cast(list[str], r["tags"])]
        assert ours and not [r["name"] for r in ours if _state(r) == "RUNNING"]

        # Started again: the job is taken at once and answered once.
        restarted = ServeProcess(
            settings,
            prefect_server.api_url,
            env={"PYTHONPATH": str(Path(__file__).resolve().parents[2])},
            log=tmp_path / "serve-2.log",
        ).start()
        restarted_at = time.monotonic()
        try:
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                job = job_of(store, "stopper", "ok", subject)
                if job is not None and job.status == Status.DONE:
                    break
                time.sleep(0.3)
        finally:
            restarted.stop()
        print(f"FIGURES ready again -> job done {time.monotonic() - restarted_at:.2f} s")
        assert job is not None and (job.status, job.attempts) == (Status.DONE, 1)
        assert gateway.answers_for(f"ok:{subject}") == 1
        gateway.assert_kept(concurrency=1, gap=0.2)
        store.close()
