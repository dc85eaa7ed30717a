"""Screenshots for the docs, taken in headless Chromium.

    .venv/bin/python docs/screenshots.py queue-page

`queue-page` builds a small, plausible queue in a temporary SQLite store (a
backfill draining with one call in flight, a screen's insight at the front,
two failures, a consumer standing by), serves the API on a free loopback
port in this process, and writes `docs/queue-page.png` (desktop) and
`docs/queue-page-phone.png` (a phone's width). It stops everything it
started and leaves nothing behind but the two images.
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

from deployments import processes
from deployments.api import ApiServer, create_app
from deployments.triggers import Triggers
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
    schema,
)
from queue_store.engine import create_store_engine

DOCS = Path(__file__).resolve().parent
CHROMIUM = os.environ.get("CHROMIUM") or shutil.which("chromium") or "chromium"
TOKEN = "screenshot-token"
PRETEND_UI = "http://127.0.0.1:4200"
WORKER = "serve@app-1:3f9c2a07de"
DESKTOP = (1280, 1180)
PHONE = (390, 1400)
PHONE_SCALE = 2

KINDS = ("sleep", "resting_heart_rate", "hrv", "steps", "training_load", "recovery", "weight")
# Mean call seconds per kind, as a day of real calls would have left them.
DURATIONS = {"sleep": 184, "hrv": 151, "steps": 122, "trends": 431, "recovery": 140}


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
    settings = Settings.from_env({}, database_url=url, gap_seconds=0.0, max_attempts=3)
    store = JobStore(url, settings=settings, clock=clock)
    try:
        # Yesterday's calls, which the ETAs are made from.
        for n, (kind, seconds) in enumerate(DURATIONS.items()):
            clock.at(86_400 - n * 600)
            store.enqueue("u-1001", kind, "2026-11-28")
            store.finish(*_claim(store), result={"text": "…"}, duration_seconds=seconds)

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
        store.set_flow_run(jid, holder, "0b8f3c2e-9d14-4a6b-8c3e-5f7a9b1d2e4f")
        clock.at(4)
        store.heartbeat(jid, holder)

        # A screen opened 20 s ago: its insight goes to the front.
        clock.at(20)
        store.enqueue("u-5120", "sleep", "2026-11-30", "u-5120-sleep", INTERACTIVE)

        clock.at(2)
        store.worker_seen(WORKER, "consumer", {"busy": ["sleep:2026-11-30"]})
    finally:
        store.close()
    # The consumer is a sample one: give it a neutral host and pid.
    engine = create_store_engine(url)
    try:
        with engine.begin() as connection:
            connection.execute(update(schema.workers).values(host="app-1", pid=4242))
    finally:
        engine.dispose()


def chromium(url: str, out: Path, window: tuple[int, int], scale: int = 1) -> None:
    """One screenshot of `url`, by a Chromium process of its own (stopped by its PID)."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        process = subprocess.Popen(
            [
                CHROMIUM,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--disable-quic",
                "--no-first-run",
                "--disable-background-networking",
                "--disable-component-update",
                "--disable-sync",
                "--hide-scrollbars",
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


def queue_page(out_dir: Path) -> list[Path]:
    with tempfile.TemporaryDirectory(prefix="insight-queue-screens-") as directory:
        url = f"sqlite:///{Path(directory) / 'queue.db'}"
        build_queue(url, Clock())
        settings = Settings.from_env(
            {}, database_url=url, data_dir=Path(directory), api_token=SecretStr(TOKEN)
        )
        registry = Registry()
        runtime = Runtime(
            settings, JobStore(url, settings=settings), registry, Redactor.for_settings(settings)
        )
        try:
            triggers = Triggers(runtime, prefect_url=f"http://127.0.0.1:{processes.free_port()}")
            app = create_app(triggers, ui_url=lambda: PRETEND_UI)
            with ApiServer(app) as server:
                page = server.url.replace("http://", f"http://operator:{TOKEN}@", 1)
                page += "/queue"
                written = [out_dir / "queue-page.png", out_dir / "queue-page-phone.png"]
                chromium(page, written[0], DESKTOP)
                chromium(page, written[1], PHONE, PHONE_SCALE)
        finally:
            runtime.close()
    return written


SHOTS = {"queue-page": queue_page}


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
