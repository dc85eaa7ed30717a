"""`make demo`: the whole path, on one machine, with nothing else running.

Starts the gateway simulator (a development tool that stands in for the LLM
gateway) behind an independent recorder, a local Prefect server and
`insight-queue serve`; triggers a backfill of a demo user's scopes as a
post-sync hook would; halfway through, a screen opens the last-queued insight
and polls `request_insight` every second. It prints, as it happens, the order
in which the gateway served the jobs, how long the screen waited, and the
peak of calls in flight the recorder saw at the gateway; then stops
everything it started, on success, failure, Ctrl-C, SIGTERM or SIGHUP (with
`--keep-running`, after Ctrl-C, leaving the Prefect UI up until then).
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from deployments import processes
from deployments.stack import DEFAULT_PORT, PrefectServer
from devtools.recorder import GatewayRecorder
from devtools.simulator import DEFAULT_PORT as SIMULATOR_PORT
from devtools.simulator import GatewaySimulator
from devtools.stack import ServeProcess
from queue_store import Settings

DEMO_USER = "demo-user"
SCREEN_KIND = "trends"  # queued last by the backfill: the jump is easy to see
POLL_SECONDS = 1.0
DEMO_TIMEOUT_SECONDS = 600.0


@dataclasses.dataclass
class Demo:
    latency: float
    gap: float
    say: Callable[[str], None]
    base: Settings = dataclasses.field(default_factory=Settings)

    def __post_init__(self) -> None:
        self.dir: Path = self.base.data_dir / "demo"
        self.sim = GatewaySimulator(latency=(self.latency * 0.8, self.latency * 1.2), seed=7)
        self.recorder: GatewayRecorder | None = None
        self.server: PrefectServer | None = None
        self.serve: ServeProcess | None = None

    def settings(self) -> Settings:
        assert self.recorder is not None
        return Settings(
            data_dir=self.dir,
            database_url=f"sqlite:///{self.dir / 'queue.db'}",
            gateway={"url": self.recorder.url},
            gap_seconds=self.gap,
            default_duration_seconds=self.latency,
            plugins="flows.demo",
        )

    def start(self) -> None:
        if self.dir.exists():  # each demo starts from an empty queue and history
            shutil.rmtree(self.dir)
        self.dir.mkdir(parents=True)
        port = processes.free_port(SIMULATOR_PORT)
        self.sim = GatewaySimulator(
            port=port, latency=(self.latency * 0.8, self.latency * 1.2), seed=7
        )
        self.sim.start()
        self.recorder = GatewayRecorder("127.0.0.1", self.sim.port).start()
        self.say(
            f"gateway simulator (stands in for the LLM gateway) at {self.sim.url}, "
            f"recorded at {self.recorder.url}"
        )
        prefect_port = processes.free_port(DEFAULT_PORT)
        if prefect_port != DEFAULT_PORT:
            self.say(f"port {DEFAULT_PORT} is taken; the Prefect server uses {prefect_port}")
        self.server = PrefectServer(self.dir / "prefect", prefect_port)
        self.say(f"starting a local Prefect server on 127.0.0.1:{prefect_port} ...")
        self.server.start()
        self.say("starting insight-queue serve ...")
        self.serve = ServeProcess(
            self.settings(),
            self.server.api_url,
            env={"PREFECT_LOGGING_LEVEL": "WARNING"},
            log=self.dir / "serve.log",
        ).start()
        self.say(f"serving (pid {self.serve.pid}); log in {self.serve.log}")

    def run(self) -> int:
        from deployments.triggers import Triggers
        from flows.demo import demo_scopes
        from flows.runtime import Runtime

        assert self.server is not None and self.recorder is not None
        runtime = Runtime.open(self.settings())
        triggers = Triggers(runtime, prefect_url=self.server.api_url)
        scopes = demo_scopes(DEMO_USER)
        screen = next(s for s in scopes if s.kind == SCREEN_KIND)
        screen_key = f"{screen.kind}:{screen.subject}"
        self.say(f"\npost-sync hook: trigger_backfill({DEMO_USER!r})")
        backfill = triggers.trigger_backfill(DEMO_USER, sync_id=f"demo-{time.time():.0f}")
        run = backfill.flow_run_id or backfill.run_note
        self.say(f"  {backfill.queued} scopes queued; backfill run {run}")

        seen = 0
        asked_at: float | None = None
        served_at: float | None = None
        polls = 0
        deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            started = sorted(
                (r for r in self.sim.stats().requests if r.started is not None),
                key=lambda r: r.started or 0,
            )
            for record in started[seen:]:
                seen += 1
                mark = "  <- the screen's insight" if record.job == screen_key else ""
                self.say(f"  gateway call {seen}: {record.job}{mark}")
                if record.job == screen_key and asked_at is not None:
                    served_at = record.started
            if asked_at is None and seen >= len(scopes) // 2:
                asked_at = time.time()
                self.say(f"\nscreen opened: request_insight({screen_key!r}), polling every 1 s")
            if asked_at is not None:
                state = triggers.request_insight(
                    DEMO_USER, screen.kind, screen.subject, screen.fingerprint
                )
                polls += 1
                if polls == 1:
                    self.say(
                        f"  first poll: {state.status}, {state.ahead} ahead, "
                        f"ETA {state.eta_seconds} s"
                    )
                if state.status == "done" and state.result and served_at is not None:
                    output = state.result.get("output")
                    text = str(output.get("text", "")) if isinstance(output, dict) else str(output)
                    self.say(f"  result after {polls} poll(s): {text[:90]!r}")
                    self.say(
                        f"\nthe screen waited {served_at - asked_at:.1f} s for the gateway to "
                        "take its "
                        f"insight (queued last of {len(scopes)}; {seen} call(s) had started)"
                    )
                    self._finish(runtime, len(scopes))
                    return 0
            time.sleep(POLL_SECONDS if asked_at else 0.2)
        self.say(f"the demo did not finish in time; see the logs under {self.dir}")
        return 1

    def _finish(self, runtime: object, scopes: int) -> None:
        from flows.runtime import Runtime

        assert isinstance(runtime, Runtime) and self.recorder is not None
        deadline = time.monotonic() + DEMO_TIMEOUT_SECONDS
        while runtime.store.has_work(or_running=True) and time.monotonic() < deadline:
            time.sleep(0.5)
        order = sorted(
            (r for r in self.sim.stats().requests if r.started), key=lambda r: r.started or 0
        )
        self.say("gateway order: " + ", ".join((r.job or "?").split(":")[0] for r in order))
        recorded = self.recorder.snapshot()
        gap = (
            ""
            if recorded.min_gap is None
            else f", shortest gap between calls {recorded.min_gap:.2f} s"
        )
        self.say(
            f"measured at the gateway by the recorder: {recorded.count} calls, "
            f"peak {recorded.peak_in_flight} in flight{gap} (AI_JOB_GAP_SECONDS={self.gap:g})"
        )

    def stop(self) -> None:
        if self.serve is not None:
            self.serve.stop()
        if self.server is not None:
            self.server.stop()
        if self.recorder is not None:
            self.recorder.stop()
        self.sim.stop()


@click.command("demo")
@click.option(
    "--keep-running", is_flag=True, help="keep everything up for the Prefect UI until Ctrl-C"
)
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
        with processes.stop_signals():
            demo.start()
            code = demo.run()
            assert demo.server is not None
            if keep_running and code == 0:
                click.echo(f"\nPrefect UI at {demo.server.ui_url}; Ctrl-C stops everything")
                while demo.serve is not None and demo.serve.alive():
                    time.sleep(1)
            elif code == 0:
                click.echo(
                    "\n(`make demo ARGS=--keep-running` leaves the Prefect UI up "
                    "to browse the runs)"
                )
    except KeyboardInterrupt:
        code = 130
    finally:
        click.echo("stopping everything the demo started ...")
        demo.stop()
    sys.exit(code)


if __name__ == "__main__":
    demo_command(prog_name="make demo")
