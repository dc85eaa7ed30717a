"""Scale-out: the flows on a `process` work pool, Prefect's server and the store on PostgreSQL.

`insight-queue deploy` registers the deployments on the pool (twice: it is
idempotent); `prefect worker start` processes run them; the app's calls are
the `insight-queue` command; the gateway is the simulator behind the recorder,
which says how many calls were open at once, whatever ran them.

- Workers only: backfill runs are created before a screen's run, while no
  worker is up; a worker taking one run at a time starts the screen's run
  first (its queue has the higher priority). With no consumer standing by,
  the runs drain the queue themselves.
- With `insight-queue consume` beside the workers: the warm consumer makes
  every call, the screen's job first; a screen's poll starts no run; the
  backfill runs only follow their scopes.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.simulator import HUNG, OK
from flows.demo import demo_scopes
from queue_store import JobStore
from tests.support import waiting
from tests.support.factories import store_for
from tests.support.faults import Gateway
from tests.support.reads import job_of, standing_by
from tests.support.services import BIN, ROOT, PrefectServer, cli, client_env, run_cli, running
from tests.support.settings import settings_from

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres]

GAP = 0.2
DEADLINE = 240.0  # seconds for the queue to drain through the pool


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    with Gateway(latency=0.3) as started:
        yield started


def pool_env(server: PrefectServer, store_url: str, gateway: Gateway, home: Path) -> dict[str, str]:
    """What every machine of the pool is given: the same Prefect and AI_JOB_* settings."""
    return {
        **client_env(server.api_url, home),
        "AI_JOB_DATABASE_URL": store_url,
        "AI_JOB_DATA_DIR": str(home / "data"),
        "AI_GATEWAY_URL": gateway.url,
        "AI_JOB_GAP_SECONDS": str(GAP),
        "AI_JOB_HEARTBEAT_SECONDS": "0.5",
        "AI_JOB_LEASE_SECONDS": "10",
        "AI_JOB_POLL_SECONDS": "0.5",
        "AI_JOB_PLUGINS": "flows.demo",
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "1",
    }


def deploy(env: dict[str, str]) -> dict[str, str]:
    """`insight-queue deploy`: deployment name -> id, from the lines it ends with.

    (Prefect's own deploy prints its tables and advice before them.)
    """
    shown = run_cli("deploy", "--source", str(ROOT), env=env, timeout=180).stdout
    found = {}
    for line in shown.splitlines():
        if line.endswith("  (pool insight-queue)"):
            name, deployment_id, _ = line.split(maxsplit=2)
            found[name] = deployment_id
    return found


def worker(limit: int | None = None) -> list[str]:
    args = [str(BIN / "prefect"), "worker", "start", "--pool", "insight-queue"]
    return args + (["--limit", str(limit)] if limit else [])


# Conditions here ask Prefect's API or the store; twice a second is enough.
wait_for = partial(waiting.wait_for, every=0.5)


def all_done(store: JobStore, keys: list[tuple[str, str, str]]) -> Callable[[], bool]:
    def check() -> bool:
        jobs = [job_of(store, *key) for key in keys]
        return all(j is not None and j.status == "done" for j in jobs)

    return check


def flow_runs(api_url: str) -> list[dict[str, Any]]:
    response = httpx.post(f"{api_url}/flow_runs/filter", json={"limit": 200}, timeout=10)
    response.raise_for_status()
    found: list[dict[str, Any]] = response.json()
    return found


def final(run: dict[str, Any]) -> bool:
    return run["state"]["type"] in ("COMPLETED", "FAILED", "CANCELLED", "CRASHED")


def by_id(api_url: str, ids: list[str]) -> dict[str, dict[str, Any]]:
    return {r["id"]: r for r in flow_runs(api_url) if r["id"] in ids}


def answered(gateway: Gateway) -> Counter[str]:
    records = gateway.simulator.stats().requests
    return Counter(r.job or "" for r in records if r.outcome in (OK, HUNG))


def test_a_worker_starts_the_screen_s_run_before_waiting_backfill_runs(
    pg_prefect: PrefectServer, store_url: str, gateway: Gateway, tmp_path: Path
) -> None:
    env = pool_env(pg_prefect, store_url, gateway, tmp_path)
    first = deploy(env)
    assert deploy(env) == first  # idempotent: the same deployments, not new ones
    assert set(first) == {
        "interactive/insight-queue",
        "backfill/insight-queue",
        "drain/insight-queue",
        "prune/insight-queue",
    }

    # No worker is up yet: backfill runs wait, then a screen's run joins them.
    users = ("alice", "bob")
    hooks = [json.loads(run_cli("trigger-backfill", user, env=env).stdout) for user in users]
    assert all(h["flow_run_id"] and h["error"] is None for h in hooks), hooks
    screen = demo_scopes("carol")[0]
    asked = json.loads(
        run_cli("request-insight", "carol", screen.kind, screen.subject, env=env).stdout
    )
    # No consumer stands by and no call is in flight: the screen needs a run.
    assert asked["status"] == "pending" and asked["flow_run_id"], asked
    keys = [(u, s.kind, s.subject) for u in users for s in demo_scopes(u)]
    keys.append(("carol", screen.kind, screen.subject))

    log = tmp_path / "worker.log"
    with (
        store_for(settings_from(env)) as store,
        running(worker(limit=1), env, log),
    ):
        wait_for(all_done(store, keys), DEADLINE, "every job done", log=log)
        ids = [asked["flow_run_id"], *(h["flow_run_id"] for h in hooks)]
        wait_for(
            lambda: all(final(r) for r in by_id(pg_prefect.api_url, ids).values()),
            120,
            "the three runs to end",
            log=log,
        )
    runs = by_id(pg_prefect.api_url, ids)
    screen_run, *backfills = (runs[i] for i in ids)
    # One run at a time, the screen's first: it was created last.
    assert all(screen_run["start_time"] < b["start_time"] for b in backfills), runs
    assert screen_run["work_queue_name"] == "interactive"
    assert {b["work_queue_name"] for b in backfills} == {"backfill"}
    assert screen_run["state"]["type"] == "COMPLETED", screen_run["state"]
    assert [(b["state"]["type"], b["state"]["message"]) for b in backfills] == [
        ("COMPLETED", "8 done")
    ] * 2

    # Every job answered once, one call at a time at the gateway.
    assert answered(gateway) == Counter(f"{k}:{s}" for _, k, s in keys)
    stopped = [r for r in gateway.simulator.stats().requests if r.outcome not in (OK, HUNG)]
    print(f"\ncalls stopped when a run's own jobs were done: {len(stopped)}")
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    assert seen.peak_in_flight == 1


def test_with_a_warm_consumer_beside_the_workers_the_runs_follow_and_it_calls(
    pg_prefect: PrefectServer, store_url: str, gateway: Gateway, tmp_path: Path
) -> None:
    recorder = gateway.recorder
    assert recorder is not None
    env = pool_env(pg_prefect, store_url, gateway, tmp_path)
    deploy(env)
    users = ("dave", "erin")
    screen = demo_scopes("frank")[-1]
    keys = [(u, s.kind, s.subject) for u in users for s in demo_scopes(u)]
    keys.append(("frank", screen.kind, screen.subject))
    # The first call is held at the gateway until the screen has asked.
    gateway.simulator.set_fault("hang", requests=1)

    consumer_log, worker_log = tmp_path / "consume.log", tmp_path / "worker.log"
    with (
        store_for(settings_from(env)) as store,
        running(cli("consume"), env, consumer_log) as consumer,
        running(worker(), env, worker_log),
    ):
        wait_for(lambda: bool(standing_by(store)), 60, "the consumer standing by", log=consumer_log)
        hooks = [json.loads(run_cli("trigger-backfill", user, env=env).stdout) for user in users]
        assert all(h["flow_run_id"] for h in hooks), hooks
        recorder.wait_until(lambda s: s.in_flight == 1, 120, "the first call")
        asked = json.loads(
            run_cli("request-insight", "frank", screen.kind, screen.subject, env=env).stdout
        )
        # The consumer stands by (and is mid-call): no run is started for the screen.
        assert asked["status"] == "pending" and asked["flow_run_id"] is None, asked
        gateway.simulator.clear_fault()
        wait_for(all_done(store, keys), DEADLINE, "every job done", log=worker_log)
        ids = [h["flow_run_id"] for h in hooks]
        wait_for(
            lambda: all(final(r) for r in by_id(pg_prefect.api_url, ids).values()),
            120,
            "the backfill runs to end",
            log=worker_log,
        )
        # Prefect knows each user by a pseudonym only (D4).
        pseudonyms = {u: e.job.pseudonym for u in (*users, "frank") for e in store.list_jobs(u)}
        consumer.send_signal(15)
        assert consumer.wait(30) == 0, consumer_log.read_text(errors="replace")[-3000:]

    summary = json.loads(
        next(
            line for line in reversed(consumer_log.read_text().splitlines()) if line.startswith("{")
        )
    )
    assert summary["outcomes"] == {"done": len(keys)}, summary
    runs = flow_runs(pg_prefect.api_url)
    backfills = [r for r in runs if r["id"] in ids]
    assert [(b["state"]["type"], b["state"]["message"]) for b in backfills] == [
        ("COMPLETED", "8 done")
    ] * 2
    # Every generation was the consumer's: the backfill runs only followed.
    tags = {f"user:{p}" for p in pseudonyms.values()}
    assert not [r for r in runs if any(u in json.dumps(r) for u in (*users, "frank"))]
    generations = [r for r in runs if "generation" in r["tags"] and set(r["tags"]) & tags]
    assert len(generations) == len(keys)
    assert {r["parameters"]["worker"].split("@")[0] for r in generations} == {"consumer"}
    # The screen's job was the next call after the one held.
    order = [r.job for r in sorted(gateway.simulator.stats().requests, key=lambda r: r.received)]
    assert order[1] == f"{screen.kind}:{screen.subject}", order
    assert answered(gateway) == Counter(f"{k}:{s}" for _, k, s in keys)
    seen = gateway.assert_kept(concurrency=1, gap=GAP)
    assert seen.peak_in_flight == 1
