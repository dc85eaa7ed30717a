"""`insight-queue demo`: the whole path, on one machine, with nothing else running.

Starts a local Prefect server, the gateway simulator (a development tool that
stands in for the LLM gateway) and `insight-queue serve`; triggers a backfill
of a demo user's eight scopes as a post-sync hook would; halfway through, a
screen opens the last-queued insight and polls `request_insight` every second.
It prints, as it happens, the order in which the gateway served the jobs, how
long the screen waited, and where the Prefect UI is; then stops everything it
started (unless told to keep running for the UI).
"""

from __future__ import annotations

import datetime as dt
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from deployments.embedded import DEFAULT_PORT, EmbeddedServer, is_healthy, stop_process_group
from deployments.triggers import BACKFILL_DEPLOYMENT, INTERACTIVE_DEPLOYMENT
from flows.simulator import GatewaySimulator
from queue_store import JobStore, Settings, migrate

DEMO_USER = "demo-user"
SCREEN_KIND = "trends"  # queued last by the backfill: the jump is easy to see
SCOPES = 8
POLL_SECONDS = 1.0
SERVE_READY_SECONDS = 120
DEMO_TIMEOUT_SECONDS = 600


def _free_port(preferred: int) -> int:
    import socket

    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return int(sock.getsockname()[1])
    raise RuntimeError("no free port on 127.0.0.1")


class Demo:
    def __init__(self, latency: float, gap: float, say: Callable[[str], None]) -> None:
        base = Settings.from_env()
        self.dir = base.data_dir / "demo"
        self.latency = latency
        self.gap = gap
        self.say = say
        self.sim = GatewaySimulator(latency=(latency * 0.8, latency * 1.2), seed=7)
        self.server: EmbeddedServer | None = None
        self.serve: subprocess.Popen[bytes] | None = None
        self.database_url = f"sqlite:///{self.dir / 'queue.db'}"

    def env(self) -> dict[str, str]:
        assert self.server is not None
        return {
            "AI_JOB_DATABASE_URL": self.database_url,
            "AI_JOB_DATA_DIR": str(self.dir),
            "AI_GATEWAY_URL": self.sim.url,
            "AI_JOB_GAP_SECONDS": str(self.gap),
            "AI_JOB_DEFAULT_DURATION": str(self.latency),
            "AI_JOB_PLUGINS": "flows.demo",
            "PREFECT_API_URL": self.server.api_url,
            "PREFECT_HOME": str(self.dir / "prefect"),
            "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE": "false",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        for leftover in self.dir.glob("queue.db*"):  # each demo starts from an empty queue
            leftover.unlink()
        migrate.upgrade(self.database_url)
        self.sim.start()
        self.say(f"gateway simulator (stands in for the LLM gateway) at {self.sim.url}")
        port = _free_port(DEFAULT_PORT)
        self.server = EmbeddedServer(self.dir / "prefect", port)
        self.say(f"starting a local Prefect server on 127.0.0.1:{port} ...")
        self.server.start()
        os.environ.update(self.env())
        executable = shutil.which("insight-queue", path=str(Path(sys.executable).parent))
        with open(self.dir / "serve.log", "ab") as log:
            self.serve = subprocess.Popen(
                [executable or "insight-queue", "serve"],
                env={**os.environ, **self.env()},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self._wait_for_deployments()
        self.say(f"serving (pid {self.serve.pid}); log in {self.dir / 'serve.log'}")

    def _wait_for_deployments(self) -> None:
        from prefect import get_client

        deadline = time.monotonic() + SERVE_READY_SECONDS
        while time.monotonic() < deadline:
            if self.serve is not None and self.serve.poll() is not None:
                raise RuntimeError(f"serve exited; see {self.dir / 'serve.log'}")
            try:
                with get_client(sync_client=True) as client:
                    for name in (BACKFILL_DEPLOYMENT, INTERACTIVE_DEPLOYMENT):
                        client.read_deployment_by_name(name)
                return
            except Exception:  # noqa: BLE001 - not registered yet
                time.sleep(0.5)
        raise TimeoutError("the deployments did not appear")

    def run(self) -> int:
        from deployments.triggers import request_insight, trigger_backfill
        from flows.demo import demo_scopes

        today = dt.datetime.now(dt.UTC).date()
        scope = next(s for s in demo_scopes(DEMO_USER) if s.kind == SCREEN_KIND)
        screen_key = f"{scope.kind}:{scope.subject}"
        self.say(f"\npost-sync hook: trigger_backfill({DEMO_USER!r}) for {today}")
        trigger_backfill(DEMO_USER, sync_id=f"demo-{time.time():.0f}")

        seen = 0
        asked_at: float | None = None
        served_at: float | None = None
        polls = 0
        deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
        settings = Settings.from_env()
        with JobStore(self.database_url, settings=settings) as store:
            while time.monotonic() < deadline:
                started = [r for r in self.sim.stats().requests if r.started is not None]
                started.sort(key=lambda r: r.started or 0)
                for record in started[seen:]:
                    seen += 1
                    label = (record.job or "?").split(" ")[0]
                    mark = "  <- the screen's insight" if record.job == screen_key else ""
                    self.say(f"  gateway call {seen}: {label}{mark}")
                    if record.job == screen_key and asked_at is not None:
                        served_at = record.started
                if asked_at is None and seen >= SCOPES // 2:
                    asked_at = time.time()
                    self.say(f"\nscreen opened: request_insight({screen_key!r}), polling every 1 s")
                if asked_at is not None:
                    state = request_insight(
                        DEMO_USER, scope.kind, scope.subject, scope.fingerprint, store=store
                    )
                    polls += 1
                    if polls == 1:
                        self.say(
                            f"  first poll: {state.status}, {state.ahead} ahead, "
                            f"ETA {state.eta_seconds} s"
                        )
                    if state.status == "done" and state.result and served_at is not None:
                        self._report(state.result, asked_at, served_at, polls, seen, store)
                        return 0
                time.sleep(POLL_SECONDS if asked_at else 0.2)
        self.say("the demo did not finish in time; see the logs under " + str(self.dir))
        return 1

    def _report(
        self,
        result: dict[str, object],
        asked_at: float,
        served_at: float,
        polls: int,
        seen: int,
        store: JobStore,
    ) -> None:
        output = result.get("output")
        text = str(output.get("text", "")) if isinstance(output, dict) else str(output)
        self.say(f"  result after {polls} poll(s): {text[:90]!r}")
        self.say(
            f"\nthe screen waited {served_at - asked_at:.1f} s for the gateway to take its "
            f"insight (it was queued last of {SCOPES}; {seen} call(s) had started)"
        )
        while store.pending_count(DEMO_USER):
            time.sleep(0.5)
        order = sorted(
            (r for r in self.sim.stats().requests if r.started), key=lambda r: r.started or 0
        )
        self.say("gateway order: " + ", ".join((r.job or "?").split(":")[0] for r in order))
        self.say(f"peak calls in flight at the gateway: {self.sim.stats().peak_in_flight}")
        assert self.server is not None
        self.say(f"run history: Prefect UI at {self.server.ui_url}")

    def stop(self) -> None:
        if self.serve is not None:
            stop_process_group(self.serve)
        if self.server is not None:
            self.server.stop()
        self.sim.stop()


@click.command("demo")
@click.option("--keep-running", is_flag=True, help="keep everything up for the UI until Ctrl-C")
@click.option(
    "--latency",
    type=click.FloatRange(0.1, 60),
    default=2.0,
    show_default=True,
    help="simulated seconds per gateway call",
)
@click.option(
    "--gap",
    type=click.FloatRange(0, 60),
    default=1.0,
    show_default=True,
    help="AI_JOB_GAP_SECONDS for the demo",
)
def demo_command(keep_running: bool, latency: float, gap: float) -> None:
    """Show the whole path on this machine: hook, screen, store, Prefect, gateway."""
    demo = Demo(latency, gap, lambda line: click.echo(line))
    code = 1
    try:
        demo.start()
        code = demo.run()
        if keep_running and code == 0:
            click.echo("keeping everything running for the UI; Ctrl-C stops it")
            while demo.server is not None and is_healthy(demo.server.api_url):
                time.sleep(1)
    except KeyboardInterrupt:
        code = 130
    finally:
        click.echo("stopping everything the demo started ...")
        demo.stop()
    sys.exit(code)
