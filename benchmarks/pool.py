"""A work pool of two machines on this host: a screen's pickup, and the healing after a loss.

Prefect's server and the store on PostgreSQL (databases created beside the one
in `--postgres-url` and dropped at the end); `insight-queue deploy`; two
machines (`devtools.stack.Machine`: own working directory, PREFECT_HOME and
data directory) running the README's recipe, `insight-queue worker`, or with
`--workers-only` `prefect worker start` alone; the gateway simulator
(`--call-seconds` a call) behind the recorder. At the store's defaults but
`AI_JOB_GAP_SECONDS` (`--gap`).

It prints:
- pickup: `--screens` screens asked one at a time on an idle gateway, each
  through `Triggers.request_insight`; from the call's return to the call's
  start at the recorder (p50, p95, max);
- healing: backfills for three users, then SIGKILL to every process of the
  machine whose claim is in flight; from the kill to the next call at the
  recorder, and when every job was done;
- the runs Prefect shows Crashed, and when no run of ours was left Running or
  Pending (the automations `deploy` created);
- the recorder's peak of calls in flight and smallest gap.

    .venv/bin/python benchmarks/pool.py
    .venv/bin/python benchmarks/pool.py --workers-only --screens 0
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

if not __package__:  # run as a script: the shared helpers are in this folder's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile
from benchmarks.store import DEFAULT_POSTGRES_URL, postgres_database
from deployments import processes
from deployments.stack import PrefectServer, client_env, executable
from deployments.triggers import Triggers
from devtools.recorder import GatewayRecorder
from devtools.simulator import GatewaySimulator
from devtools.stack import Machine
from flows.demo import demo_scopes
from queue_store import JobStore, Settings, migrate
from tests.support.reads import job_of, standing_by

ROOT = Path(__file__).resolve().parents[1]
USERS = ("ann", "ben", "cid")


@contextmanager
def prefect_on_postgres(admin_url: str, home: Path) -> Iterator[PrefectServer]:
    name = f"iq_bench_prefect_{uuid.uuid4().hex[:8]}"
    admin = create_engine(
        admin_url.replace("postgresql://", "postgresql+psycopg://", 1), isolation_level="AUTOCOMMIT"
    )
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(admin_url).set(drivername="postgresql+asyncpg", database=name)
    server = PrefectServer(
        home,
        processes.free_port(),
        ui=False,
        database_url=url.render_as_string(hide_password=False),
    )
    try:
        yield server.start()
    finally:
        server.stop()
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


def cli(*args: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        [executable("insight-queue"), *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        check=True,
    )
    return done.stdout


def open_runs(api_url: str) -> list[dict[str, Any]]:
    body = {"limit": 200, "flow_runs": {"tags": {"all_": ["insight-queue"]}}}
    runs: list[dict[str, Any]] = httpx.post(
        f"{api_url}/flow_runs/filter", json=body, timeout=10
    ).json()
    return runs


def wait(condition: Any, seconds: float, what: str) -> float:
    started = time.monotonic()
    processes.wait_for(condition, timeout=seconds, what=what, interval=0.2)
    return time.monotonic() - started


def run(args: argparse.Namespace, home: Path) -> None:
    with (
        postgres_database(args.postgres_url) as store_url,
        prefect_on_postgres(args.postgres_url, home / "prefect-server") as server,
        GatewaySimulator(latency=args.call_seconds) as sim,
        GatewayRecorder("127.0.0.1", sim.port) as recorder,
    ):
        migrate.upgrade(store_url)
        env = {
            **client_env(server.api_url, home / "deployer"),
            "AI_JOB_DATABASE_URL": store_url,
            "AI_GATEWAY_URL": recorder.url,
            # The simulator stops working on a call whose client went away: a cut call
            # holds nothing (H1), so healing is the lease's and the slot's alone.
            "AI_GATEWAY_CUT_HOLD_SECONDS": "0",
            "AI_JOB_GAP_SECONDS": str(args.gap),
            "AI_JOB_PLUGINS": "flows.demo",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
        cli("deploy", "--source", str(ROOT), env=env)
        if args.workers_only:
            command = [executable("prefect"), "worker", "start", "--pool", "insight-queue"]
            env["PREFECT_WORKER_QUERY_SECONDS"] = "2"
        else:
            command = [executable("insight-queue"), "worker", "--pool", "insight-queue"]
        machines = [Machine(name, command, env, home) for name in ("a", "b")]
        settings = Settings(
            **{"database_url": store_url, "gap_seconds": args.gap, "gateway": {"url": recorder.url}}
        )
        try:
            with (
                JobStore(store_url, settings=settings) as store,
                Triggers.open(settings, prefect_url=server.api_url) as triggers,
            ):
                if not args.workers_only:
                    wait(lambda: len(standing_by(store)) == 2, 180, "two consumers standing by")
                pickup(args, triggers, recorder)
                heal(args, env, store, settings, server, recorder, machines)
        finally:
            for machine in machines:
                machine.stop()


def pickup(args: argparse.Namespace, triggers: Triggers, recorder: GatewayRecorder) -> None:
    seen: list[float] = []
    for n in range(args.screens):
        recorder.wait_until_idle(120)
        time.sleep(args.gap + 0.5)  # the gap after the last call has passed: the gateway is free
        scope = demo_scopes(f"screen-{n}")[n % 8]
        before = {i.id for i in recorder.intervals()}
        triggers.request_insight(f"screen-{n}", scope.kind, scope.subject)
        asked = time.monotonic()
        count = len(before)
        recorder.wait_until(lambda s: s.count > count, 60, "the screen's call")  # noqa: B023
        opened = min(i.opened for i in recorder.intervals() if i.id not in before)
        seen.append(opened - asked)
    if seen:
        print(
            f"pickup of a screen on an idle gateway, {len(seen)} screens: "
            f"p50 {percentile(seen, 0.5):.2f} s, p95 {percentile(seen, 0.95):.2f} s, "
            f"max {max(seen):.2f} s (target p95 <= 2 s)"
        )


def heal(
    args: argparse.Namespace,
    env: dict[str, str],
    store: JobStore,
    settings: Settings,
    server: PrefectServer,
    recorder: GatewayRecorder,
    machines: list[Machine],
) -> None:
    for user in USERS:
        for _ in range(5):  # the same sync again starts the one run, if Prefect missed it
            hook = json.loads(cli("trigger-backfill", user, "--sync-id", f"s-{user}", env=env))
            if hook["flow_run_id"]:
                break
    keys = [(u, s.kind, s.subject) for u in USERS for s in demo_scopes(u)]
    recorder.wait_until(lambda s: s.count >= args.screens + 3, 300, "three backfill calls")
    holder: list[Machine] = []

    def in_flight() -> bool:
        for entry in store.queue_view(1).running:
            pid = int((entry.job.worker or "x:0").split(":")[1])
            holder[:] = [m for m in machines if pid in m.family()]
        return bool(holder) and recorder.snapshot().in_flight == 1

    wait(in_flight, 300, "a call in flight")
    killed_at = time.monotonic()
    killed = holder[0].kill()
    print(f"killed machine {holder[0].name}: {len(killed)} processes, mid-call")
    done = wait(
        lambda: all((j := job_of(store, *k)) is not None and j.status == "done" for k in keys),
        900,
        "every job done",
    )
    after = [i.opened for i in recorder.intervals() if i.opened > killed_at]
    print(
        f"healing: the next call {min(after) - killed_at:.1f} s after the kill "
        f"(lease {settings.lease_seconds:g} s, margin {settings.lease_margin:g} s); "
        f"every job done {done:.0f} s after it"
    )
    left = wait(
        lambda: (
            not [
                r for r in open_runs(server.api_url) if r["state"]["type"] in ("RUNNING", "PENDING")
            ]
        ),
        600,
        "no run left open",
    )
    crashed = [
        f"{r['name']}: {r['state']['message']}"
        for r in open_runs(server.api_url)
        if r["state"]["type"] == "CRASHED"
    ]
    print(
        f"no run of ours Running or Pending {time.monotonic() - killed_at:.0f} s after the kill "
        f"(waited {left:.0f} s more); Crashed: {crashed}"
    )
    seen = recorder.snapshot()
    print(
        f"recorder: {seen.count} calls, peak in flight {seen.peak_in_flight}, smallest gap "
        f"{seen.min_gap:.2f} s (AI_JOB_GAP_SECONDS {args.gap:g})"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers-only", action="store_true")
    parser.add_argument("--screens", type=int, default=30)
    parser.add_argument("--call-seconds", type=float, default=2.0)
    parser.add_argument("--gap", type=float, default=1.0)
    parser.add_argument(
        "--postgres-url", default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL
    )
    args = parser.parse_args(argv)
    recipe = "prefect worker start alone" if args.workers_only else "insight-queue worker"
    print(f"two machines running {recipe}; calls of {args.call_seconds:g} s, gap {args.gap:g} s")
    with tempfile.TemporaryDirectory(prefix="iq-pool-") as home:
        run(args, Path(home))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
