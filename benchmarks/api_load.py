"""Load benchmark of the HTTP API: many screens polling while a backfill drains.

For each backend (SQLite file, PostgreSQL database created and dropped) the
script starts `insight-queue api` as a subprocess on a free 127.0.0.1 port
(Prefect unreachable: a closed loopback port), and runs:

- in a process of its own (so that their timing is not the consumer's),
  `--screens` simulated screens (default 200), each polling one insight
  through `GET /v1/users/{user}/insights/{kind}/{subject}` every
  `--interval` seconds (default 2, staggered, whatever Retry-After says),
  with `If-None-Match` from its last answer. A screen waits for its answer
  before its next poll, so an API that cannot keep up shows as a lower rate
  and long response times, not as a pile of requests. Most screens show a result that
  is already there; `--waiting` of them wait on a queued insight; during the
  busy phase `--switching` of them move to a new insight, one after another;
- a backfill of `--backfill-users` users' scopes, triggered through
  `POST /v1/users/{user}/backfills` before the polls start;
- in this process, the gateway simulator (`--call-seconds` per answer)
  behind the recorder, and, in the busy phase only, a standing-by consumer
  (`Runtime.consumer(...)`, with the null ledger and guard) draining the queue.

Two phases: **quiet** (`--quiet-seconds`, no consumer: every poll changes
nothing; on PostgreSQL it goes on 11 s more while the statistics catch up)
and **busy** (`--seconds`, the consumer draining). It prints:

- response times (p50, p95, max) of each phase, the share of them spent in
  the store (the API's `Server-Timing`), and the answers by status;
- writes per unchanged poll in the quiet phase: the database's write counter
  (SQLite `PRAGMA data_version` from another connection; PostgreSQL
  inserted+updated+deleted tuples in `pg_stat_user_tables`) across every
  quiet poll, after one deliberate write (a probe's new fingerprint) that
  must move it by exactly one, so the check can see a write; and every polled
  job row's `revision` and `updated_at`, unchanged;
- in the busy phase: the rows of the screens showing a finished result,
  unchanged however often they were polled; the backfill jobs done; how long
  the switching screens waited for their result;
- the recorder's peak of calls open at the gateway, against `AI_JOB_CONCURRENCY`;
- the CPU each quiet poll cost the API process (and PostgreSQL's backends),
  and how late the screens' own event loop ran (a loaded client shows there).

Run from the repository root (loopback only):

    .venv/bin/python benchmarks/api_load.py
    .venv/bin/python benchmarks/api_load.py --backends sqlite --seconds 20 --screens 50

`--postgres-url` defaults to $AI_JOB_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, text

from deployments import processes
from deployments.stack import executable
from devtools.recorder import GatewayRecorder
from devtools.simulator import GatewaySimulator
from flows.consumer import Consumer
from flows.runtime import Runtime
from queue_store import PREFETCH, JobStore, Settings, job_id, migrate
from queue_store.engine import normalise_url

if not __package__:  # run as a script: the store benchmark's helpers are a sibling module
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile
from benchmarks.store import (
    WriteCounter,
    postgres_database,
    row_versions,
    sqlite_database,
)

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
KIND = "sleep"  # a demo kind: its subject is a date
API_START_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 30.0
CONSUMER_START_SECONDS = 30.0
PROBE_USER = "probe"
SPAWN = multiprocessing.get_context("spawn")
CHILD_START_SECONDS = 120.0
LAG_TICK_SECONDS = 0.05
BACKFILL_USERS = "user_id LIKE 'backfill-%'"
# PostgreSQL counts a backend's writes in pg_stat_user_tables when it reports
# them: at most a second after a transaction, or 10 s after it went idle. A
# read of the counter is trusted once nothing moved it for longer than that.
PG_STATS_SETTLE_SECONDS = 11.0


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


# -- the screens ------------------------------------------------------------------------------


@dataclasses.dataclass
class Screen:
    user: str
    subject: str
    fingerprint: str
    role: str  # "result" | "waiting" | "switching"
    offset: float  # seconds after the start of polling of its first poll
    switch_after: float | None = None  # seconds into the busy phase
    etag: str | None = None
    switched: bool = False
    opened_at: float | None = None  # when it first polled its new insight
    answered_at: float | None = None  # when it first saw that insight's fresh result

    @property
    def path(self) -> str:
        return f"/v1/users/{self.user}/insights/{KIND}/{self.subject}"


@dataclasses.dataclass(frozen=True)
class Sample:
    at: float  # loop time the request was sent
    ms: float
    status: int  # 0: no answer (connection error, timeout)
    finished: bool  # the poll was of a result made before the run (that row never changes)
    error: str = ""  # what went wrong when there was no answer
    store_ms: float | None = None  # the API's own time in the store (its Server-Timing)


@dataclasses.dataclass
class Phases:
    """What the screens' process knows of the phases, from the main process."""

    busy_from: float | None = None  # time.monotonic() when the consumer started
    stop: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)


async def poll_screen(
    client: httpx.AsyncClient,
    screen: Screen,
    interval: float,
    start: float,
    phases: Phases,
    samples: list[Sample],
    yesterday: str,
) -> None:
    due = start + screen.offset
    while not phases.stop.is_set():
        wait = due - time.monotonic()
        if wait > 0:
            try:
                await asyncio.wait_for(phases.stop.wait(), wait)
                return
            except TimeoutError:
                pass
        due += interval
        now = time.monotonic()
        if (
            screen.switch_after is not None
            and not screen.switched
            and phases.busy_from is not None
            and now >= phases.busy_from + screen.switch_after
        ):
            # The user moves on to another day: a new insight, asked at the front.
            screen.switched, screen.subject, screen.etag = True, yesterday, None
            screen.fingerprint = f"{screen.fingerprint}-next"
            screen.opened_at = now
        headers = {"If-None-Match": screen.etag} if screen.etag else {}
        finished = screen.role != "waiting" and not screen.switched
        sent = time.perf_counter()
        try:
            response = await client.get(
                screen.path, params={"fingerprint": screen.fingerprint}, headers=headers
            )
        except httpx.HTTPError as exc:
            elapsed = (time.perf_counter() - sent) * 1000
            samples.append(Sample(now, elapsed, 0, finished, f"{type(exc).__name__}: {exc}"))
            continue
        elapsed = (time.perf_counter() - sent) * 1000
        store_ms = server_timing(response.headers.get("server-timing", ""))
        samples.append(Sample(now, elapsed, response.status_code, finished, "", store_ms))
        if response.status_code == 200:
            screen.etag = response.headers.get("etag")
            body = response.json()
            if (
                screen.switched
                and screen.answered_at is None
                and body["status"] == "done"
                and body["fresh"]
            ):
                screen.answered_at = time.monotonic()


@dataclasses.dataclass(frozen=True)
class ScreensReport:
    samples: list[Sample]
    screens: list[Screen]
    lag_ms: list[float]  # how late the screens' event loop woke from 50 ms sleeps


async def drive_screens(
    api_url: str,
    screens: list[Screen],
    interval: float,
    yesterday: str,
    busy_from: Any,
    stop: Any,
    started: Any,
) -> ScreensReport:
    phases = Phases()
    samples: list[Sample] = []
    lags: list[float] = []
    limits = httpx.Limits(max_connections=len(screens) + 10)
    async with httpx.AsyncClient(
        base_url=api_url, timeout=REQUEST_TIMEOUT_SECONDS, limits=limits
    ) as client:
        start = time.monotonic()
        tasks = [
            asyncio.create_task(poll_screen(client, s, interval, start, phases, samples, yesterday))
            for s in screens
        ]
        started.set()
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(LAG_TICK_SECONDS)
            lags.append((time.monotonic() - before - LAG_TICK_SECONDS) * 1000)
            if busy_from.value > 0:
                phases.busy_from = busy_from.value
        phases.stop.set()
        await asyncio.gather(*tasks)
    return ScreensReport(samples, screens, lags)


def screens_process(
    api_url: str,
    screens: list[Screen],
    interval: float,
    yesterday: str,
    busy_from: Any,
    stop: Any,
    started: Any,
    out: Any,
) -> None:
    """The screens, in a process of their own: their timing is not the consumer's."""
    out.put(
        asyncio.run(drive_screens(api_url, screens, interval, yesterday, busy_from, stop, started))
    )


def server_timing(header: str) -> float | None:
    """The `dur` of `store;dur=12.3`, or None."""
    for part in header.split(";"):
        name, _, value = part.strip().partition("=")
        if name == "dur":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def make_screens(args: argparse.Namespace, today: str) -> list[Screen]:
    screens = []
    for n in range(args.screens):
        role = (
            "waiting"
            if n < args.waiting
            else "switching"
            if n < args.waiting + args.switching
            else "result"
        )
        switch_after = None
        if role == "switching":
            k = n - args.waiting
            # Spread over the first 70% of the busy phase, so the last can finish.
            switch_after = (k + 0.5) * args.seconds * 0.7 / max(args.switching, 1)
        screens.append(
            Screen(
                user=f"screen-{n:04d}",
                subject=today,
                fingerprint=f"fp-{n:04d}",
                role=role,
                offset=args.interval * n / args.screens,
                switch_after=switch_after,
            )
        )
    return screens


# -- the parts that run beside the API --------------------------------------------------------


class ApiProcess:
    """`insight-queue api` as a subprocess, stopped by its PID."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.port = processes.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self.process = processes.start(
            [executable("insight-queue"), "api", "--host", "127.0.0.1", "--port", str(self.port)],
            env={**os.environ, **env},
            log=log,
        )

    def wait_ready(self) -> None:
        def ready() -> bool:
            try:
                return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        try:
            processes.wait_for(
                ready,
                timeout=API_START_SECONDS,
                what=f"the API (log: {self.log})",
                alive=lambda: self.process.poll() is None,
            )
        except (TimeoutError, RuntimeError):
            print(self.log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise

    def stop(self) -> None:
        processes.stop_group(self.process, grace_seconds=15)


class ConsumerThread:
    """A standing-by consumer on an event loop of its own, in a thread of this process."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.consumer: Consumer = runtime.consumer(standby=True, worker="bench-consumer")
        self.thread = threading.Thread(target=self._run, name="bench-consumer", daemon=True)
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.consumer.run())
        except BaseException as exc:  # noqa: BLE001 - reported after the run
            self.error = exc

    def start(self) -> None:
        self.thread.start()
        processes.wait_for(
            lambda: any(
                w.name == "bench-consumer" and w.alive for w in self.runtime.store.workers()
            ),
            timeout=CONSUMER_START_SECONDS,
            what="the consumer",
        )

    def stop(self) -> None:
        self.consumer.stop("the benchmark is over")
        self.thread.join(30)


def cpu_seconds(pids: Iterable[int]) -> dict[int, float]:
    """User plus system CPU seconds so far of each of these processes still running."""
    ticks = os.sysconf("SC_CLK_TCK")
    found = {}
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        found[pid] = (int(fields[11]) + int(fields[12])) / ticks
    return found


def cpu_spent(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds spent between two readings by the processes alive at the second.

    A process that ended in between is left out (its last seconds are lost);
    one that started in between counts whole.
    """
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def postgres_backends(url: str) -> list[int]:
    """The server processes serving other connections to this database (the API's)."""
    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT pid FROM pg_stat_activity "
                    "WHERE datname = current_database() AND pid <> pg_backend_pid()"
                )
            ).all()
    finally:
        engine.dispose()
    return [int(row[0]) for row in rows]


def count(url: str, where: str) -> int:
    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as connection:
            return int(
                connection.execute(text(f"SELECT count(*) FROM ai_jobs WHERE {where}")).scalar_one()
            )
    finally:
        engine.dispose()


# -- one backend ---------------------------------------------------------------------------------


@dataclasses.dataclass
class Result:
    backend: str
    quiet: list[Sample]
    quiet_seconds: float  # the quiet window: its polls, the probe, the counter settling
    lag_ms: list[float]  # the screens' event loop, late by this much
    api_cpu_ms: float  # CPU of the API process per quiet poll
    database_cpu_ms: float | None  # CPU of PostgreSQL's backends per quiet poll
    busy: list[Sample]
    quiet_writes: int
    probe_seen: bool
    write_check: str
    quiet_rows_unchanged: bool
    quiet_rows: int
    result_rows_unchanged: bool
    result_rows: int
    result_polls: int
    backfill_done: int
    backfill_total: int
    waits: list[float]
    unanswered: int
    calls: int
    peak: int
    concurrency: int
    errors: list[str]


def finish_results(url: str, settings: Settings, screens: Sequence[Screen]) -> None:
    """The results the "result" and "switching" screens show: already made before the run."""
    store = JobStore(url, settings=Settings(**{**settings.model_dump(), "gap_seconds": 0.0}))
    try:
        for screen in screens:
            if screen.role == "waiting":
                continue
            store.enqueue(screen.user, KIND, screen.subject, screen.fingerprint, PREFETCH)
            claim = store.claim_next("bench-setup")
            assert claim.job is not None and claim.job.holder is not None
            store.finish(claim.job.id, claim.job.holder, result={"text": "made earlier"})
    finally:
        store.close()


def run_backend(backend: str, url: str, args: argparse.Namespace) -> Result:
    migrate.upgrade(url)
    today = dt.datetime.now(dt.UTC).date()
    yesterday = (today - dt.timedelta(days=1)).isoformat()
    screens = make_screens(args, today.isoformat())
    with (
        tempfile.TemporaryDirectory(prefix="insight-queue-api-load-") as directory,
        GatewaySimulator(workers=4, latency=args.call_seconds) as simulator,
        GatewayRecorder("127.0.0.1", simulator.port) as recorder,
    ):
        settings = Settings(
            database_url=url,
            data_dir=Path(directory),
            concurrency=args.concurrency,
            gap_seconds=args.gap_seconds,
            gateway={"url": recorder.url},
        )
        finish_results(url, settings, screens)
        env = {
            **settings.to_env(),
            "PREFECT_API_URL": f"http://127.0.0.1:{processes.free_port()}/api",
            "PREFECT_HOME": str(Path(directory) / "prefect"),
        }
        api = ApiProcess(env, Path(directory) / "api.log")
        try:
            api.wait_ready()
            return measure(backend, url, args, settings, screens, api, recorder, yesterday)
        finally:
            api.stop()


def measure(
    backend: str,
    url: str,
    args: argparse.Namespace,
    settings: Settings,
    screens: list[Screen],
    api: ApiProcess,
    recorder: GatewayRecorder,
    yesterday: str,
) -> Result:
    errors: list[str] = []
    with httpx.Client(base_url=api.url, timeout=REQUEST_TIMEOUT_SECONDS) as http:
        for n in range(args.backfill_users):
            answer = http.post(f"/v1/users/backfill-{n:03d}/backfills", json={"sync_id": "s1"})
            if answer.status_code != 202:
                errors.append(f"backfill answered {answer.status_code}: {answer.text[:200]}")
        for screen in screens:  # every screen's first poll: the waiting ones' jobs are queued
            answer = http.get(screen.path, params={"fingerprint": screen.fingerprint})
            screen.etag = answer.headers.get("etag")
        today = screens[0].subject if screens else ""
        http.get(f"/v1/users/{PROBE_USER}/insights/{KIND}/{today}", params={"fingerprint": "p1"})
    backfill_total = count(url, BACKFILL_USERS)

    watched = [job_id(s.user, KIND, s.subject) for s in screens]
    probe = job_id(PROBE_USER, KIND, today)
    counter = WriteCounter(url)
    runtime: Runtime | None = None
    consumer: ConsumerThread | None = None
    busy_at, stop, started, out = SPAWN.Value("d", 0.0), SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
    child = SPAWN.Process(
        target=screens_process,
        args=(api.url, screens, args.interval, yesterday, busy_at, stop, started, out),
        name="screens",
        daemon=True,
    )
    try:
        settle = 0.0 if counter.is_sqlite else PG_STATS_SETTLE_SECONDS
        baseline = counter.stable(settle or 0.3)
        backends = [] if counter.is_sqlite else postgres_backends(url)
        cpu_before = (cpu_seconds([api.process.pid]), cpu_seconds(backends))
        rows_before = row_versions(url, [*watched, probe])
        recorder.reset()

        child.start()
        if not started.wait(CHILD_START_SECONDS):
            raise RuntimeError("the screens' process did not start")
        start = time.monotonic()
        time.sleep(args.quiet_seconds)
        # One deliberate write through the API: the counter must see exactly it.
        httpx.get(
            f"{api.url}/v1/users/{PROBE_USER}/insights/{KIND}/{today}",
            params={"fingerprint": "p2"},
            timeout=REQUEST_TIMEOUT_SECONDS,
        )
        time.sleep(settle)  # the screens go on polling: any write of theirs gets counted
        final = counter.settled(baseline, 1)
        quiet_end = time.monotonic()
        now_serving = [] if counter.is_sqlite else postgres_backends(url)
        cpu_after = (cpu_seconds([api.process.pid]), cpu_seconds({*backends, *now_serving}))
        rows_after_quiet = row_versions(url, [*watched, probe])

        runtime = Runtime.open(settings)
        consumer = ConsumerThread(runtime)
        consumer.start()
        busy_from = time.monotonic()
        busy_at.value = busy_from
        backfill_before = count(url, f"{BACKFILL_USERS} AND status = 'done'")
        time.sleep(args.seconds)
        stop.set()
        report: ScreensReport = out.get(timeout=CHILD_START_SECONDS)
        child.join(CHILD_START_SECONDS)
    finally:
        stop.set()
        if child.is_alive():
            child.terminate()
            child.join(10)
        if consumer is not None:
            consumer.stop()
            if consumer.error is not None:
                errors.append(f"consumer: {consumer.error!r}")
        if runtime is not None:
            runtime.close()
        counter.close()
    samples, screens = report.samples, report.screens

    backfill_done = count(url, f"{BACKFILL_USERS} AND status = 'done'") - backfill_before
    quiet_rows_unchanged = all(rows_after_quiet.get(i) == rows_before.get(i) for i in watched)
    probe_moved = rows_after_quiet.get(probe) != rows_before.get(probe)
    result_ids = [job_id(s.user, KIND, today) for s in screens if s.role != "waiting"]
    rows_end = row_versions(url, result_ids)
    result_rows_unchanged = all(rows_end.get(i) == rows_before.get(i) for i in result_ids)
    result_polls = sum(1 for s in samples if s.finished and s.status in (200, 304))
    snapshot = recorder.snapshot()
    quiet = [s for s in samples if s.at < quiet_end]
    busy = [s for s in samples if s.at >= busy_from]
    waits = [
        s.answered_at - s.opened_at
        for s in screens
        if s.opened_at is not None and s.answered_at is not None
    ]
    unanswered = sum(1 for s in screens if s.opened_at is not None and s.answered_at is None)
    delta = final - baseline
    return Result(
        backend=backend,
        quiet=quiet,
        quiet_seconds=quiet_end - start,
        api_cpu_ms=cpu_spent(cpu_before[0], cpu_after[0]) * 1000 / max(len(quiet), 1),
        database_cpu_ms=None
        if backend == "sqlite"
        else cpu_spent(cpu_before[1], cpu_after[1]) * 1000 / max(len(quiet), 1),
        lag_ms=report.lag_ms,
        busy=busy,
        quiet_writes=delta - 1,
        probe_seen=delta >= 1 and probe_moved,
        write_check="PRAGMA data_version"
        if backend == "sqlite"
        else "pg_stat_user_tables ins+upd+del",
        quiet_rows_unchanged=quiet_rows_unchanged,
        quiet_rows=len(watched),
        result_rows_unchanged=result_rows_unchanged,
        result_rows=len(result_ids),
        result_polls=result_polls,
        backfill_done=backfill_done,
        backfill_total=backfill_total,
        waits=waits,
        unanswered=unanswered,
        calls=snapshot.count,
        peak=snapshot.peak_in_flight,
        concurrency=settings.concurrency,
        errors=errors,
    )


# -- reporting -------------------------------------------------------------------------------------


def describe(samples: Sequence[Sample], seconds: float) -> str:
    answered = [s.ms for s in samples if s.status in (200, 304)]
    inside = [s.store_ms for s in samples if s.store_ms is not None]
    statuses = collections.Counter(s.status for s in samples)
    shown = ", ".join(f"{status or 'none'}: {n}" for status, n in sorted(statuses.items()))
    return (
        f"{len(samples)} polls, {len(samples) / seconds:.0f}/s ({shown}); "
        f"ms p50 {percentile(answered, 0.5):.1f}, "
        f"p95 {percentile(answered, 0.95):.1f}, max {max(answered, default=float('nan')):.1f}; "
        f"of which in the store p50 {percentile(inside, 0.5):.1f}, "
        f"p95 {percentile(inside, 0.95):.1f}"
    )


def report(result: Result, args: argparse.Namespace) -> list[str]:
    quiet_polls = len([s for s in result.quiet if s.status in (200, 304)])
    per_poll = result.quiet_writes / quiet_polls if quiet_polls else float("nan")
    bad = [s for s in [*result.quiet, *result.busy] if s.status not in (200, 304)]
    waits = sorted(result.waits)
    lines = [
        f"== {result.backend}",
        f"quiet {result.quiet_seconds:.0f} s (no consumer): "
        f"{describe(result.quiet, result.quiet_seconds)}",
        f"  writes per unchanged poll: {result.quiet_writes} in {quiet_polls} polls = "
        f"{per_poll:.4f} ({result.write_check}; the probe's one write "
        f"{'seen' if result.probe_seen else 'NOT SEEN'}); "
        f"{result.quiet_rows} polled rows' revision/updated_at "
        f"{'unchanged' if result.quiet_rows_unchanged else 'CHANGED'}",
        f"  CPU per quiet poll: API process {result.api_cpu_ms:.2f} ms"
        + (
            ""
            if result.database_cpu_ms is None
            else f", PostgreSQL backends {result.database_cpu_ms:.2f} ms"
        ),
        f"busy {args.seconds:g} s (consumer draining): {describe(result.busy, args.seconds)}",
        f"  {result.result_rows} rows of finished results, polled {result.result_polls} times "
        f"in both phases: {'unchanged' if result.result_rows_unchanged else 'CHANGED'}",
        f"  backfill: {result.backfill_done} of {result.backfill_total} jobs done in the busy "
        f"phase; gateway calls {result.calls}, peak in flight {result.peak} "
        f"(AI_JOB_CONCURRENCY {result.concurrency})",
        f"  switching screens: {len(waits)} got their new result, wait p50 "
        f"{percentile(waits, 0.5):.1f} s, max {max(waits, default=float('nan')):.1f} s; "
        f"{result.unanswered} still waiting at the end",
        f"  failed requests: {len(bad)}; the screens' event loop was late by at most "
        f"{max(result.lag_ms, default=0):.0f} ms (p99 {percentile(result.lag_ms, 0.99):.0f} ms)",
    ]
    lines += [f"  error: {e}" for e in result.errors]
    for error, n in collections.Counter(s.error for s in bad).items():
        lines.append(f"  no answer ({n}x): {error[:200]}")
    return lines


@contextmanager
def database(backend: str, postgres_url: str) -> Iterator[str]:
    if backend == "sqlite":
        with sqlite_database() as url:
            yield url
    else:
        with postgres_database(postgres_url) as url:
            yield url


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL,
    )
    parser.add_argument("--screens", type=int, default=200)
    parser.add_argument("--waiting", type=int, default=20, help="screens waiting from the start")
    parser.add_argument("--switching", type=int, default=30, help="screens moving on when busy")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    parser.add_argument("--quiet-seconds", type=float, default=10.0)
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the busy phase")
    parser.add_argument("--backfill-users", type=int, default=10)
    parser.add_argument("--call-seconds", type=float, default=0.5)
    parser.add_argument("--gap-seconds", type=float, default=0.25)
    parser.add_argument("--concurrency", type=int, default=1)
    args = parser.parse_args(argv)
    if args.waiting + args.switching > args.screens:
        parser.error("--waiting plus --switching must not exceed --screens")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"api_load: {args.screens} screens every {args.interval:g} s; quiet "
        f"{args.quiet_seconds:g} s, busy {args.seconds:g} s; calls {args.call_seconds:g} s, "
        f"gap {args.gap_seconds:g} s, AI_JOB_CONCURRENCY {args.concurrency}; "
        f"{os.cpu_count()} cores, load {loadavg()}",
        flush=True,
    )
    failed = False
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        with database(backend, args.postgres_url) as url:
            result = run_backend(backend, url, args)
        for line in report(result, args):
            print(line, flush=True)
        failed |= (
            result.quiet_writes != 0
            or not result.probe_seen
            or not result.quiet_rows_unchanged
            or not result.result_rows_unchanged
            or result.peak > result.concurrency
            or bool(result.errors)
        )
    print(f"load at the end: {loadavg()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
