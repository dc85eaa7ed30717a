"""PostgreSQL restarted under load: consumers ride it out, nothing lost, nothing generated twice.

The store lives in a throwaway PostgreSQL cluster (`tests.support.pgcluster`)
that the test stops and starts; the machine's own server is never touched.
Two consumer processes (`tests.support.worker`, standing by, without Prefect)
work through 24 jobs of short calls to the gateway simulator behind the
recorder, while a screen polls `insight-queue request-insight` for one job
after another, from the back of the queue. The cluster goes down twice, each
time by event:

1. while a call is in flight (the simulator has started it), and comes back
   once its answer was written: the worker's result write meets the outage
   and lands on a retry;
2. between calls (nothing open at the recorder): claims, renewals and polls
   meet it; a screen's poll and a post-sync hook made while it is down print
   their JSON state with `error` set and exit 0.

What must hold: both consumers are still running at the end, without a
traceback; every screen poll printed a JSON state and exited 0; every job is
done with its result; the gateway answered each job exactly once (counted at
the simulator) and never had two calls open at once (the recorder); attempts
are one per call, plus at most one for a claim whose commit reached the
database while its answer did not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from devtools.simulator import HUNG, OK, GatewaySimulator
from queue_store import JobStore, StoreError, migrate
from tests.support import waiting
from tests.support.factories import settings_for, store_for
from tests.support.faults import Gateway, Workers
from tests.support.pgcluster import ThrowawayPostgres
from tests.support.reads import job_of, pending, result_of
from tests.support.services import ROOT, cli, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

JOBS = 24
USER = "restart-user"
CALL_SECONDS = 0.3
LONG_CALL_SECONDS = 1.5  # the call the first outage catches in flight
GAP = 0.2
LEASE = 8.0
SCREEN_EVERY = 0.5  # seconds between the end of one poll and the next
DEADLINE = 180.0  # seconds for each stage of the run


def subject(n: int) -> str:
    return f"s{n:02d}"


@pytest.fixture
def cluster() -> Iterator[ThrowawayPostgres]:
    made = ThrowawayPostgres().create()
    try:
        migrate.upgrade(made.url)
        yield made
    finally:
        made.destroy()


@dataclasses.dataclass
class Poll:
    subject: str
    exit_code: int
    stdout: str
    stderr: str

    @property
    def state(self) -> dict[str, Any] | None:
        try:
            parsed = json.loads(self.stdout)
        except ValueError:
            return None
        return parsed if isinstance(parsed, dict) else None


def poll(env: dict[str, str], key: str) -> Poll:
    done = subprocess.run(
        cli("request-insight", USER, "ok", key),
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    return Poll(key, done.returncode, done.stdout, done.stderr)


class Screen:
    """Polls `request-insight` for one job after another, as a user moving between screens."""

    def __init__(self, env: dict[str, str], subjects: list[str]) -> None:
        self.env, self.subjects = env, list(subjects)
        self.polls: list[Poll] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="screen", daemon=True)

    def __enter__(self) -> Screen:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(150)

    def _loop(self) -> None:
        while not self._stop.is_set() and self.subjects:
            seen = poll(self.env, self.subjects[0])
            self.polls.append(seen)
            if seen.state and seen.state.get("status") == "done":
                self.subjects.pop(0)
            self._stop.wait(SCREEN_EVERY)


# A store that is down counts as "not yet".
wait_for = partial(waiting.wait_for, tolerate=(StoreError,))


def resumed(store: JobStore) -> bool:
    store.resume()
    return True


def done_count(store: JobStore) -> int:
    return sum(
        1
        for n in range(JOBS)
        if (job := job_of(store, USER, "ok", subject(n))) is not None and job.status == "done"
    )


def started_since(sim: GatewaySimulator, since: float) -> bool:
    return any(r.started and r.started > since and r.ended is None for r in sim.stats().requests)


def answered_since(sim: GatewaySimulator, since: float) -> bool:
    return any(r.started and r.started > since and r.ended for r in sim.stats().requests)


def test_postgres_restarted_under_load_loses_and_duplicates_nothing(
    cluster: ThrowawayPostgres, tmp_path: Path
) -> None:
    with Gateway(latency=CALL_SECONDS) as gateway:
        assert gateway.recorder is not None
        settings = settings_for(
            database_url=cluster.url,
            data_dir=tmp_path / "data",
            gap_seconds=GAP,
            lease_seconds=LEASE,
            heartbeat_seconds=0.5,
            poll_seconds=0.5,
            backoff_seconds=1.0,
            backoff_max_seconds=2.0,
            plugins="flows.demo,tests.support.plugins",
            gateway={"url": gateway.url},
        )
        # The app side: no Prefect server here (consumers stand by, so a
        # poll needs no run; an outage never reaches Prefect either).
        env = {**settings.to_env(), "PYTHONPATH": str(ROOT), "PREFECT_API_URL": ""}
        store = store_for(settings)
        for n in range(JOBS):
            store.enqueue(USER, "ok", subject(n))

        outage_polls: list[Poll] = []
        outage_hook: dict[str, Any] = {}
        with Workers(settings, tmp_path / "logs").running() as workers:
            workers.start("a")
            workers.start("b")
            with Screen(env, [subject(n) for n in range(JOBS - 1, -1, -4)]) as screen:
                # 1. Down while a (longer) call is in flight; up once it was answered.
                wait_for(lambda: done_count(store) >= 5, DEADLINE, "five jobs done")
                gateway.simulator.set_latency(LONG_CALL_SECONDS)
                changed = time.time()
                wait_for(lambda: started_since(gateway.simulator, changed), 60, "a long call")
                cluster.stop()
                wait_for(lambda: answered_since(gateway.simulator, changed), 60, "its answer")
                gateway.simulator.set_latency(CALL_SECONDS)
                cluster.start()

                # 2. Down between calls: claims and polls meet it.
                # Claiming is paused first, so "no call open" is a state, not a
                # moment: a claim made just before the stop would start a call
                # whose answer the outage (longer than the lease) then strands.
                wait_for(lambda: done_count(store) >= 15, DEADLINE, "fifteen jobs done")
                store.pause(DEADLINE, "between calls, for the second outage")
                wait_for(lambda: not store.queue_view().running, 60, "no job running")
                gateway.recorder.wait_until(lambda s: s.in_flight == 0, 60, "no call open")
                cluster.stop()
                outage_polls.append(poll(env, subject(0)))
                hook = run_cli("trigger-backfill", "hook-user", env=env, check=False, timeout=120)
                outage_hook = {"code": hook.returncode, "out": hook.stdout, "err": hook.stderr}
                cluster.start()
                wait_for(lambda: resumed(store), 60, "claiming resumed")

                wait_for(lambda: done_count(store) == JOBS, DEADLINE, "every job done")
                wait_for(lambda: not screen.subjects, 60, "the screen's jobs done")
            alive = {name: p.poll() is None for name, p in workers.started.items()}
            summaries = workers.stop_all()
            logs = {name: workers.log(name).read_text(errors="replace") for name in ("a", "b")}

        jobs = {n: job_of(store, USER, "ok", subject(n)) for n in range(JOBS)}
        results = {n: result_of(store, USER, "ok", subject(n)) for n in range(JOBS)}
        left = pending(store)
        store.close()
        requests = gateway.simulator.stats().requests
        seen = gateway.assert_kept(concurrency=1, gap=GAP)

    answered = Counter(r.job for r in requests if r.outcome in (OK, HUNG))
    calls = Counter(r.job for r in requests)
    polls = screen.polls + outage_polls
    print(
        "\n"
        + json.dumps(
            {
                "gateway_calls": len(requests),
                "gateway_peak_in_flight": seen.peak_in_flight,
                "screen_polls": len(polls),
                "screen_polls_with_error": sum(1 for p in polls if (p.state or {}).get("error")),
                "worker_outcomes": {n: s.get("outcomes") for n, s in summaries.items()},
                "result_writes_retried": sum(log.count("recording ok:") for log in logs.values()),
                "claims_retried": sum(log.count("claim failed") for log in logs.values()),
                "attempts": dict(Counter(j.attempts for j in jobs.values() if j)),
            },
            indent=2,
        )
    )

    # The consumers rode both outages out: still standing by, no traceback.
    assert alive == {"a": True, "b": True}, logs
    for name, log in logs.items():
        assert "Traceback" not in log, f"worker {name}:\n{log[-3000:]}"
    assert sum(s["outcomes"].get("done", 0) for s in summaries.values()) == JOBS, summaries
    # The first outage caught a result write: it failed, was retried, and landed.
    assert any("recording ok:" in log for log in logs.values()), "no result write met the outage"

    # The screen: a JSON state every time, exit 0, never a traceback; while
    # the store is down the state says so.
    assert not [p for p in polls if "Traceback" in p.stdout + p.stderr]
    bad = [(p.exit_code, p.stdout[-500:], p.stderr[-500:]) for p in polls if p.state is None]
    assert not bad, bad
    assert all(p.exit_code == 0 for p in polls)
    down = outage_polls[0].state
    assert down is not None and down["status"] == "unknown" and down["error"], down
    # The post-sync hook during the outage: its JSON state, the error, exit 0.
    assert outage_hook["code"] == 0, outage_hook
    assert "Traceback" not in outage_hook["err"], outage_hook
    hook_state = json.loads(outage_hook["out"])
    assert hook_state["error"] and hook_state["flow_run_id"] is None, hook_state

    # Every job done with its result; nothing left running or pending.
    assert left == 0
    assert all(job is not None and job.status == "done" for job in jobs.values()), jobs
    for n, result in results.items():
        assert result is not None and result.output == {
            "text": f"insight for insight for {USER}/{subject(n)}"
        }, (n, result)

    # The gateway: each job answered exactly once; one call at a time.
    assert answered == {f"ok:{subject(n)}": 1 for n in range(JOBS)}, answered
    assert seen.peak_in_flight == 1
    # Attempts: one per call, plus at most one for a claim whose answer was lost.
    for n, job in jobs.items():
        assert job is not None
        made = calls[f"ok:{subject(n)}"]
        assert made <= job.attempts <= min(made + 1, settings.max_attempts), (n, job, made)


def test_request_insight_with_the_database_down_prints_a_state_with_the_error(
    tmp_path: Path,
) -> None:
    """Even the first poll of a process, whose store cannot be opened, answers with a state."""
    env = {
        "AI_JOB_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere",
        "AI_JOB_DATA_DIR": str(tmp_path / "data"),
        "PREFECT_API_URL": "",
    }
    done = run_cli("request-insight", "u", "sleep", "2026-11-30", env=env, check=False, timeout=120)
    assert "Traceback" not in done.stderr
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["status"] == "unknown" and state["error"], state
    # Bad input is still refused as such, store or no store.
    refused = run_cli("request-insight", "u|x", "sleep", "2026-11-30", env=env, check=False)
    assert refused.returncode == 2 and "user_id" in refused.stderr, refused.stderr


def test_trigger_backfill_with_the_database_down_prints_a_state_with_the_error(
    tmp_path: Path,
) -> None:
    env = {
        "AI_JOB_DATABASE_URL": "postgresql://postgres@127.0.0.1:1/nowhere",
        "AI_JOB_DATA_DIR": str(tmp_path / "data"),
        "PREFECT_API_URL": "",
    }
    done = run_cli("trigger-backfill", "u", env=env, check=False, timeout=120)
    assert "Traceback" not in done.stderr
    assert done.returncode == 0, done.stderr
    state = json.loads(done.stdout)
    assert state["user_id"] == "u" and state["error"] and state["flow_run_id"] is None, state
