"""Screenshots for the docs, taken in headless Chromium.

    .venv/bin/python docs/screenshots.py queue-page
    .venv/bin/python docs/screenshots.py prefect-ui

`queue-page` builds a small, plausible queue in a temporary SQLite store (a
backfill draining with one call in flight, a screen's insight at the front,
two failures, a consumer standing by), serves the API on a free loopback
port in this process, and writes `docs/queue-page.png` (desktop) and
`docs/queue-page-phone.png` (a phone's width). `prefect-ui` runs a served
stack (a Prefect server with its UI, `serve`, the gateway simulator) through
a backfill with a refused scope and a screen's run, and writes the Prefect
UI's runs list, a screen's run, the backfill's run and its table of scopes,
and a failed generation. Each stops everything it started and leaves nothing
behind but the images.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from pydantic import SecretStr
from sqlalchemy import update

# Run as a script from the checkout: the development tools are not installed.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from deployments import processes
from deployments.http import create_app
from deployments.http.credentials import Credentials
from deployments.triggers import Triggers
from devtools.stack import ApiServer
from flows.registry import Registry
from flows.runtime import Runtime
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    EnqueueRequest,
    Failure,
    JobStore,
    Redactor,
    Settings,
    Usage,
    schema,
)
from queue_store.engine import create_store_engine

DOCS = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "chromium"
TOKEN = "screenshot-token"
PRETEND_UI = "http://127.0.0.1:4200"
WORKER = "serve@app-1:3f9c2a07de"
DESKTOP = (1280, 1700)
UI_WINDOW = (1440, 1000)
UI_SETTLE_SECONDS = 8.0  # the Prefect UI fetches its data after it loads
PHONE = (390, 1400)
PHONE_SCALE = 2

KINDS = ("sleep", "resting_heart_rate", "hrv", "steps", "training_load", "recovery", "weight")
# Mean call seconds per kind, as a day of real calls would have left them.
DURATIONS = {"sleep": 184, "hrv": 151, "steps": 122, "trends": 431, "recovery": 140}
# Prompt and completion tokens per kind, as a gateway's `usage` reports them.
TOKENS = {
    "sleep": Usage(2_310, 412),
    "hrv": Usage(1_870, 366),
    "steps": Usage(1_540, 298),
    "trends": Usage(7_920, 905),
    "recovery": Usage(2_050, 341),
}


class Clock:
    """The time the sample queue is built at: set by hand, in the past, so its ages look real."""

    def __init__(self) -> None:
        self.now = dt.datetime.now(dt.UTC)
        self.base = self.now

    def at(self, seconds_ago: float) -> None:
        self.now = self.base - dt.timedelta(seconds=seconds_ago)

    def __call__(self) -> dt.datetime:
        self.now += dt.timedelta(microseconds=1)
        return self.now


def _claim(store: JobStore) -> tuple[str, str]:
    claim = store.claim_next(WORKER)
    assert claim.job is not None and claim.job.holder is not None
    return claim.job.id, claim.job.holder


def build_queue(url: str, clock: Clock) -> None:
    """A backfill draining, a screen waiting at the front, two failures, one consumer."""
    settings = Settings(database_url=url, gap_seconds=0.0, max_attempts=3)
    store = JobStore(url, settings=settings, clock=clock)
    try:
        # Yesterday's calls, which the ETAs are made from, and the tokens they used
        # (one gateway answer did not say: unknown, not zero).
        for n, (kind, seconds) in enumerate(DURATIONS.items()):
            for i, user in enumerate(("u-1001", "u-2291")):
                clock.at(86_400 - n * 600 - i * 180)
                store.enqueue(user, kind, "2026-11-28")
                used = None if (user, kind) == ("u-2291", "trends") else TOKENS[kind]
                store.finish(
                    *_claim(store), result={"text": "…"}, duration_seconds=seconds, usage=used
                )

        clock.at(1_900)
        store.enqueue("u-2291", "hrv", "2026-11-29")
        for attempt in range(3):
            clock.at(1_900 - attempt * 300)
            jid, holder = _claim(store)
            store.fail(
                jid,
                holder,
                Failure.REJECTED,
                "gateway answered HTTP 400: this model's maximum context length is 8192 "
                "tokens; the messages came to 9120",
                flow_run_id=f"a41c9e2b-7d35-4f80-9b6e-0c7d5e3f21{attempt:02d}",
            )
        clock.at(700)
        store.enqueue("u-1876", "trends", "2026-11-02..2026-11-29")
        for attempt in range(3):
            clock.at(700 - attempt * 200)
            jid, holder = _claim(store)
            store.fail(
                jid,
                holder,
                Failure.PARSE,
                "the generator could not read the answer: KeyError: 'insight'",
                flow_run_id=f"5e0b7a13-2c94-4d6f-a8e1-93b2c4d6e8{attempt:02d}",
            )

        # A sync 6 minutes ago queued a user's scopes; one call is in flight.
        clock.at(360)
        store.enqueue_many(
            EnqueueRequest("u-1042", kind, "2026-11-30", f"u-1042-{kind}", PREFETCH)
            for kind in KINDS
        )
        clock.at(134)
        jid, holder = _claim(store)
        store.heartbeat(jid, holder, flow_run_id="0b8f3c2e-9d14-4a6b-8c3e-5f7a9b1d2e4f")
        for seconds_ago in range(104, 0, -25):  # renewed all along (a lapsed claim stays lapsed)
            clock.at(seconds_ago)
            assert store.heartbeat(jid, holder)

        # A screen opened 20 s ago: its insight goes to the front.
        clock.at(20)
        store.enqueue("u-5120", "sleep", "2026-11-30", "u-5120-sleep", INTERACTIVE)

        clock.at(2)
        store.presence(WORKER, "consumer", {"busy": ["sleep:2026-11-30"]})
    finally:
        store.close()
    # The consumer is a sample one: give it a neutral host and pid.
    engine = create_store_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(update(schema.workers).values(host="app-1", pid=4242))
    finally:
        engine.dispose()


CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
)


def chromium(url: str, out: Path, window: tuple[int, int], scale: int = 1) -> None:
    """One screenshot of `url`, by a Chromium process of its own (stopped by its PID)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        process = subprocess.Popen(
            [
                CHROMIUM,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={window[0]},{window[1]}",
                f"--force-device-scale-factor={scale}",
                f"--screenshot={out}",
                url,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            process.wait(60)
        finally:
            if process.poll() is None:
                processes.stop_group(process, grace_seconds=5)
    if process.returncode != 0 or not out.exists():
        raise RuntimeError(f"chromium could not take {out.name}")


def chromium_after_load(
    pages: Sequence[tuple[str, Path]], window: tuple[int, int], settle_seconds: float
) -> None:
    """Screenshots of pages that build themselves with scripts (the Prefect UI).

    One Chromium, driven over its DevTools protocol: each page is opened, given
    `settle_seconds` of real time to fetch its data, then captured.
    """
    import asyncio
    import base64
    import json
    import time

    import httpx
    import websockets

    port = processes.free_port()
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        process = processes.start(
            [
                CHROMIUM,
                *CHROMIUM_FLAGS,
                f"--user-data-dir={profile}",
                f"--window-size={window[0]},{window[1]}",
                "--remote-debugging-address=127.0.0.1",
                f"--remote-debugging-port={port}",
                "about:blank",
            ],
            log=Path(profile) / "chromium.log",
        )
        try:
            endpoint = f"http://127.0.0.1:{port}/json"
            processes.wait_for(
                lambda: _answers(endpoint), timeout=30, what="chromium's debugging port"
            )
            target = next(t for t in httpx.get(endpoint, timeout=5).json() if t["type"] == "page")

            async def capture() -> None:
                async with websockets.connect(
                    target["webSocketDebuggerUrl"], max_size=None
                ) as socket:
                    ids = iter(range(1, 1_000_000))

                    async def call(method: str, **params: object) -> dict[str, object]:
                        number = next(ids)
                        await socket.send(
                            json.dumps({"id": number, "method": method, "params": params})
                        )
                        while True:
                            message = json.loads(await socket.recv())
                            if message.get("id") == number:
                                result: dict[str, object] = message.get("result", {})
                                return result

                    await call(
                        "Emulation.setDeviceMetricsOverride",
                        width=window[0],
                        height=window[1],
                        deviceScaleFactor=1,
                        mobile=False,
                    )
                    for url, out in pages:
                        await call("Page.navigate", url=url)
                        await asyncio.sleep(settle_seconds)
                        shot = await call("Page.captureScreenshot", format="png")
                        out.write_bytes(base64.b64decode(str(shot["data"])))

            started = time.monotonic()
            asyncio.run(capture())
            if time.monotonic() - started > 600:
                raise RuntimeError("the screenshots took too long")
        finally:
            processes.stop_group(process, grace_seconds=5)


def _answers(url: str) -> bool:
    import httpx

    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def queue_page(out_dir: Path) -> list[Path]:
    with tempfile.TemporaryDirectory(prefix="insight-queue-screens-") as directory:
        url = f"sqlite:///{Path(directory) / 'queue.db'}"
        build_queue(url, Clock())
        settings = Settings(
            database_url=url,
            data_dir=Path(directory),
            api={"operator_token": SecretStr(TOKEN)},
        )
        registry = Registry()
        runtime = Runtime(
            settings, JobStore(url, settings=settings), registry, Redactor(settings.secrets())
        )
        try:
            triggers = Triggers(runtime, prefect_url=f"http://127.0.0.1:{processes.free_port()}")
            app = create_app(triggers, Credentials.load(settings), ui_url=lambda: PRETEND_UI)
            with ApiServer(app) as server:
                page = server.url.replace("http://", f"http://operator:{TOKEN}@", 1)
                page += "/queue"
                written = [out_dir / "queue-page.png", out_dir / "queue-page-phone.png"]
                chromium(page, written[0], DESKTOP)
                chromium(page, written[1], PHONE, PHONE_SCALE)
        finally:
            runtime.close()
    return written


def prefect_ui(out_dir: Path) -> list[Path]:
    """The run history as an operator sees it, on a served stack with the demo's generators.

    A backfill of the demo user in which one scope's calls are refused by the
    gateway (a failed generation), and a screen's run whose job the warm
    consumer takes. Writes the runs list, the screen's run, the backfill's
    run with its artifacts, and the failed generation's run.
    """
    import time

    import httpx

    from deployments import table
    from deployments.prefect_api import PrefectApi
    from deployments.stack import PrefectServer
    from devtools.recorder import GatewayRecorder
    from devtools.simulator import GatewaySimulator
    from devtools.stack import ServeProcess
    from flows.demo import demo_scopes

    user = "ada"
    refused = next(s for s in demo_scopes(user) if s.kind == "steps")
    written: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="insight-queue-ui-") as directory:
        home = Path(directory)
        sim = GatewaySimulator(latency=(0.6, 1.4), seed=3).start()
        sim.set_fault("status", status=400, job=f"steps:{refused.subject}")
        recorder = GatewayRecorder("127.0.0.1", sim.port).start()
        server = PrefectServer(home / "prefect", processes.free_port(), ui=True)
        try:
            server.start()
            settings = Settings(
                data_dir=home / "data",
                gap_seconds=0.5,
                max_attempts=2,
                plugins="flows.demo",
                gateway={"url": recorder.url},
            )
            api = PrefectApi(server.api_url, timeout=10)
            with ServeProcess(settings, server.api_url, log=home / "serve.log"):

                def final(run_id: str) -> dict[str, object]:
                    for _ in range(600):
                        run: dict[str, object] = httpx.get(
                            f"{server.api_url}/flow_runs/{run_id}", timeout=10
                        ).json()
                        state = run["state"]
                        if isinstance(state, dict) and state["type"] in ("COMPLETED", "FAILED"):
                            return run
                        time.sleep(0.5)
                    raise RuntimeError(f"run {run_id} did not end")

                backfill = api.create_run(
                    table.BACKFILL.name,
                    {"user_id": user},
                    name=f"backfill:{user}",
                    tags=[f"user:{user}", "priority:prefetch"],
                    idempotency_key=f"shots-backfill-{time.time()}",
                )
                final(backfill)
                screen = api.create_run(
                    table.INTERACTIVE.name,
                    {
                        "user_id": user,
                        "kind": "sleep",
                        "subject": "2026-11-29",
                        "fingerprint": None,
                    },
                    name="sleep:2026-11-29",
                    tags=[f"user:{user}", "kind:sleep", "priority:interactive"],
                    idempotency_key=f"shots-screen-{time.time()}",
                )
                final(screen)
                failed = httpx.post(
                    f"{server.api_url}/flow_runs/filter",
                    json={
                        "flow_runs": {
                            "name": {"any_": [f"steps:{refused.subject}"]},
                            "state": {"type": {"any_": ["FAILED"]}},
                        },
                        "sort": "START_TIME_DESC",
                        "limit": 1,
                    },
                    timeout=10,
                ).json()[0]["id"]
                table_id = httpx.post(
                    f"{server.api_url}/artifacts/filter",
                    json={
                        "artifacts": {"key": {"any_": [f"backfill-{user}-scopes"]}},
                        "sort": "CREATED_DESC",
                        "limit": 1,
                    },
                    timeout=10,
                ).json()[0]["id"]
                ui = server.ui_url
                pages = [
                    ("runs-list.png", f"{ui}/runs"),
                    ("screen-run.png", f"{ui}/runs/flow-run/{screen}"),
                    ("backfill-run.png", f"{ui}/runs/flow-run/{backfill}"),
                    ("backfill-scopes.png", f"{ui}/artifacts/artifact/{table_id}"),
                    ("failed-generation.png", f"{ui}/runs/flow-run/{failed}"),
                ]
                shots = [(url, out_dir / name) for name, url in pages]
                chromium_after_load(shots, UI_WINDOW, UI_SETTLE_SECONDS)
                written += [out for _, out in shots]
            api.close()
        finally:
            server.stop()
            recorder.stop()
            sim.stop()
    return written


SHOTS = {"queue-page": queue_page, "prefect-ui": prefect_ui}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("shot", choices=sorted(SHOTS), help="which screenshots to take")
    parser.add_argument("--out", type=Path, default=DOCS, help="directory to write them to")
    args = parser.parse_args(argv)
    for path in SHOTS[args.shot](args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
