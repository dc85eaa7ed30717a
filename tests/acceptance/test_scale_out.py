"""Scale-out: the flows on a process work pool, Prefect and the store both on PostgreSQL.

Runs are created while no worker is up, backfills first and a screen's run
last; the worker (limit 1, so it takes one run at a time) must start the
screen's run first, because its queue has the higher priority.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.settings import PREFECT_API_URL, temporary_settings
from sqlalchemy import create_engine, text

from flows.demo import demo_scopes
from flows.simulator import GatewaySimulator
from queue_store import JobStore, Settings, migrate
from tests.support.databases import POSTGRES_URL, postgres_schema_url
from tests.support.services import BIN, ROOT, PrefectServer, client_env, run_cli, stop

pytestmark = [pytest.mark.prefect, pytest.mark.slow, pytest.mark.postgres]


@pytest.fixture
def postgres() -> Iterator[tuple[str, str]]:
    """A database for Prefect's server and a schema for the store, dropped afterwards."""
    if not POSTGRES_URL:
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    name = f"iq_prefect_{uuid.uuid4().hex[:8]}"
    admin = create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
        connection.execute(text(f"CREATE SCHEMA store_{name}"))
    base = POSTGRES_URL.rsplit("/", 1)[0]
    prefect_url = f"{base}/{name}".replace("postgresql://", "postgresql+asyncpg://", 1)
    try:
        yield prefect_url, postgres_schema_url(POSTGRES_URL, f"store_{name}")
    finally:
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
            connection.execute(text(f"DROP SCHEMA IF EXISTS store_{name} CASCADE"))
        admin.dispose()


def test_interactive_runs_are_served_before_backfill_runs(
    tmp_path: Path, postgres: tuple[str, str]
) -> None:
    from prefect import get_client

    prefect_db, store_url = postgres
    migrate.upgrade(store_url)
    server = PrefectServer(tmp_path / "prefect", database_url=prefect_db).start()
    worker: subprocess.Popen[bytes] | None = None
    try:
        with GatewaySimulator(latency=0.2) as sim:
            env = {
                **client_env(server.api_url, tmp_path / "client"),
                "AI_JOB_DATABASE_URL": store_url,
                "AI_GATEWAY_URL": sim.url,
                "AI_JOB_GAP_SECONDS": "0.2",
                "AI_JOB_PLUGINS": "flows.demo",
            }
            run_cli("deploy", "--source", str(ROOT), "--safety-net", "3600", env=env)
            run_cli("deploy", "--source", str(ROOT), "--safety-net", "3600", env=env)  # idempotent
            for user in ("alice", "bob"):
                run_cli("trigger-backfill", user, env=env)
            screen = demo_scopes("carol")[0]
            run_cli("request-insight", "carol", screen.kind, screen.subject, env=env)

            with open(tmp_path / "worker.log", "ab") as log:
                worker = subprocess.Popen(
                    [
                        str(BIN / "prefect"),
                        "worker",
                        "start",
                        "--pool",
                        "insight-queue",
                        "--limit",
                        "1",
                    ],
                    env={**os.environ, **env},
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                    cwd=ROOT,
                )
            settings = Settings.from_env(env)
            with JobStore(store_url, settings=settings) as store:
                deadline = time.monotonic() + 240
                while time.monotonic() < deadline:
                    jobs = [
                        store.job(user, s.kind, s.subject)
                        for user in ("alice", "bob")
                        for s in demo_scopes(user)
                    ] + [store.job("carol", screen.kind, screen.subject)]
                    if all(job is not None and job.status == "done" for job in jobs):
                        break
                    time.sleep(1)
                else:
                    raise AssertionError(
                        f"not all done: {(tmp_path / 'worker.log').read_text()[-3000:]}"
                    )
            assert sim.stats().peak_in_flight == 1

        # The backfill triggers queued their scopes in the store themselves,
        # so the screen's run may have drained everything: wait for the
        # worker to have started all three runs before comparing.
        screen_run = f"{screen.kind}:{screen.subject}"
        expected = {screen_run, "backfill:alice", "backfill:bob"}
        deadline = time.monotonic() + 180
        while True:
            with (
                temporary_settings({PREFECT_API_URL: server.api_url}),
                get_client(sync_client=True) as client,
            ):
                runs = [r for r in client.read_flow_runs() if r.start_time is not None]
            if expected <= {r.name for r in runs} or time.monotonic() > deadline:
                break
            time.sleep(1)
        starts = {r.name: r.start_time for r in runs}
        assert screen_run in starts, list(starts)
        backfills = [t for name, t in starts.items() if name.startswith("backfill:")]
        assert len(backfills) == 2
        assert all(starts[screen_run] < t for t in backfills), starts
        queues = {r.name: r.work_queue_name for r in runs}
        assert queues[screen_run] == "interactive"
        assert {queues["backfill:alice"], queues["backfill:bob"]} == {"backfill"}
    finally:
        if worker is not None:
            stop(worker)
        server.stop()
