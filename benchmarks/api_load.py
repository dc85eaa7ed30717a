"""Load benchmark of the HTTP API: CPU per poll beside a bare route, and screens beside `serve`.

For each backend (`--backends`, default `sqlite,postgresql`: a SQLite file in a
temporary directory; a PostgreSQL database created on the server of
`--postgres-url` and dropped at the end), two parts, each on a fresh store:

**Part A, CPU per request.** The store holds one job done with a result (a
dict of about 1 KB of JSON) and one job waiting with `AHEAD` interactive jobs
ahead of it. A standing-by consumer is only a live row in the workers table
(`presence`, refreshed from a thread), so no poll asks Prefect for a run;
Prefect is unreachable anyway (`PREFECT_API_URL` is a closed loopback port).
Two servers run as subprocesses on free 127.0.0.1 ports: `insight-queue api`
(one worker) and `benchmarks/bare_route.py`, a Starlette route that reads one
`ai_jobs` row by primary key and answers it as JSON. For each case, after a
warm-up, `--requests` sequential requests (default 2000) go to the API over
one keep-alive connection, and as many bare reads of that case's row to the
bare route over another, the two taking turns in rounds of 200 (so a change
in what else runs on the machine weighs on both alike); every answer's status
is checked (a wrong one aborts the run):

1. a poll of the waiting job (200, no `If-None-Match`);
2. a poll of the done job with its ETag (304);
3. a poll of the done job without one (200 with the result).

The CPU each request cost is read from `/proc/<pid>/stat` (utime+stime) of
the server process before and after each round, and on PostgreSQL also of
the backends serving it (listed in `pg_stat_activity` by the
`application_name` each server's URL sets). It prints CPU ms per request of
the API and of the bare route, their ratio, the wall time per request, and
how many cores the whole machine had in use meanwhile (`/proc/stat`: a
figure well above one says something else competed for the CPU).

**Part B, screens beside `serve`.** A Prefect server (its own home, no UI),
the gateway simulator (`--call-seconds` per call) behind the recording proxy
(`devtools.recorder`, which times every call at the gateway), `insight-queue
serve` (gap `--gap`, the demo plugins, the recorder as its gateway) and
`insight-queue api` (`--workers`), on one store. A backfill of
`--backfill-users` users is queued through `POST /v1/users/{user}/backfills`
so serve's consumer drains while the screens poll. `--screens` screens
(default 200) poll in a spawned process of their own (asyncio, one httpx
client), each one insight every `--interval` s (staggered), with
`If-None-Match` from its last answer and a screen token of its own user,
for `--seconds`. Most show a result made before the run; `--waiting` wait on
an insight their first poll queued. Beside them, `--slow-clients` (default
300) connections cost the server what slow clients can: half send nothing,
half send their headers a byte every 2 s, each connecting again as soon as
the server closes it (after its 10 s header deadline).
It prints the polls' latency (p50, p95, max), their statuses, the share of
polls in which the store (the API's `Server-Timing`) took at least half the
response time, the recorder's peak of calls in flight and smallest gap
between calls, the API's CPU (and its PostgreSQL backends') per poll, and the
cores the API and the whole machine used during the run.

At the end, per backend, the targets and whether each was met: at most 2 ms
of API process CPU per waiting-job poll and 1 ms per 304 (Part A), p95 under
250 ms, no 5xx and a recorder peak within `AI_JOB_CONCURRENCY` (Part B). The
exit status is 0 when all were met, 1 when one was missed, 2 when the run
was aborted. Every process it starts is stopped by its PID, also on errors
and Ctrl-C; everything listens on loopback.

Run from the repository root (PostgreSQL needs CREATE DATABASE rights):

    .venv/bin/python benchmarks/api_load.py
    .venv/bin/python benchmarks/api_load.py --backends sqlite --seconds 10 --screens 20 \
        --requests 200

`--postgres-url` defaults to $AI_JOB_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url

from deployments import processes
from deployments.http.credentials import ScreenTokens
from deployments.stack import PrefectServer, client_env, executable
from queue_store import INTERACTIVE, PREFETCH, JobStore, Settings, StoreError, job_id, migrate
from queue_store.engine import normalise_url

if not __package__:  # run as a script: the shared helpers and devtools are one folder up
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile
from benchmarks.store import postgres_database, sqlite_database
from devtools.recorder import GatewayRecorder
from devtools.simulator import GatewaySimulator
from devtools.stack import ServeProcess
from tests.support.services import group_members

ROOT = Path(__file__).resolve().parent.parent
# The API's credentials for the run (A1): the app's backend polls and backfills with the
# service token; each screen signs in with a token of its own, for its user.
SERVICE_TOKEN = "bench-service-token-0123456789"
OPERATOR_TOKEN = "bench-operator-token-0123456789"
SCREEN_SECRET = "bench-screen-secret-0123456789abcdef"
CREDENTIALS = {
    "AI_API_SERVICE_TOKEN": SERVICE_TOKEN,
    "AI_API_OPERATOR_TOKEN": OPERATOR_TOKEN,
    "AI_API_SCREEN_SECRET": SCREEN_SECRET,
    # Part A sends its requests back to back: the rate is not what it measures.
    "AI_API_SERVICE_RATE": str(10**9),
}
AS_SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}
# Slow clients beside the screens (A2): connections that send nothing, and ones that send
# their headers a byte at a time; the server closes each after its header deadline, and each
# connects again at once.
SLOW_BYTE_SECONDS = 2.0
SLOW_REQUEST = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: "
BARE_ROUTE = Path(__file__).resolve().parent / "bare_route.py"
DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
KIND = "sleep"  # a demo kind: its subject is a date
SERVER_START_SECONDS = 60.0
REQUEST_TIMEOUT_SECONDS = 30.0
HOOK_TRIES = 5  # a post-sync hook's tries when Prefect refuses a run
SPAWN = multiprocessing.get_context("spawn")
CHILD_START_SECONDS = 120.0
LAG_TICK_SECONDS = 0.05
BACKFILL_USERS = "user_id LIKE 'backfill-%'"
# PostgreSQL tells each server's connections apart by these (set in its URL).
API_APPLICATION = "bench-api"
BARE_APPLICATION = "bench-bare"

# Part A's store: a done job, and a waiting job with this many ahead of it.
AHEAD = 5
DONE_USER = "bench-done"
WAITING_USER = "bench-waiting"
# Part A's stand-in consumer: a live row, refreshed well within one lease.
CONSUMER = "bench-consumer"
CONSUMER_SEEN_SECONDS = 5.0
WARMUP_FRACTION = 0.1
WARMUP_MIN = 50
ROUND_REQUESTS = 200  # the API and the bare route take turns in rounds of this many

# The targets the summary checks.
WAITING_CPU_TARGET_MS = 2.0
NOT_MODIFIED_CPU_TARGET_MS = 1.0
P95_TARGET_MS = 250.0


class Aborted(Exception):
    """The run cannot go on: an answer was not what the benchmark relies on."""


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def made_result(subject: str) -> dict[str, Any]:
    """A generator's output of about 1 KB of JSON, as a screen shows it."""
    return {
        "text": (
            f"Over the seven nights to {subject} you slept 6 h 52 min on average, 38 minutes "
            "less than the week before. Your two shortest nights both followed late training "
            "sessions; on the nights you were in bed before 23:00 you slept 7 h 31 min. Try "
            "moving hard workouts earlier in the day and keeping a steady bedtime for the next "
            "week, then compare."
        ),
        "model": "demo-model-2025-06",
        "highlights": [
            {"metric": "sleep", "value": 6.87, "unit": "h", "change": -0.63},
            {"metric": "bedtime_before_23", "value": 3, "unit": "nights", "change": -2},
            {"metric": "resting_heart_rate", "value": 57, "unit": "bpm", "change": 2},
            {"metric": "training_load", "value": 142, "unit": "TRIMP", "change": 31},
        ],
        "series": [6.4, 7.1, 6.9, 7.5, 6.2, 6.8, 7.2],
        "bedtimes": ["23:40", "22:55", "23:10", "22:40", "00:25", "23:50", "22:45"],
        "suggestion": "Keep bedtime within 30 minutes of 22:45 for the next seven nights.",
        "generated": {"subject": subject, "days": 7, "prompt_version": 3},
    }


def with_changes(settings: Settings, **changes: Any) -> Settings:
    return Settings(**{**settings.model_dump(), **changes})


def tagged(url: str, application: str) -> str:
    """The store's URL, naming its connections `application` on PostgreSQL."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "postgresql":
        return url
    return parsed.update_query_dict({"application_name": application}).render_as_string(
        hide_password=False
    )


def count(url: str, where: str) -> int:
    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as connection:
            return int(
                connection.execute(text(f"SELECT count(*) FROM ai_jobs WHERE {where}")).scalar_one()
            )
    finally:
        engine.dispose()


# -- processes and their CPU ----------------------------------------------------------------------


class ServerProcess:
    """A server subprocess on a free loopback port, stopped by its PID (with its group)."""

    def __init__(
        self, name: str, command: list[str], env: dict[str, str], log: Path, ready_path: str
    ) -> None:
        self.name = name
        self.port = processes.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = [*command, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = {**os.environ, **env}
        self.log = log
        self.ready_path = ready_path
        self.process: Any = None

    def start(self) -> None:
        self.process = processes.start(self.command, env=self.env, log=self.log, cwd=ROOT)

    def wait_ready(self) -> None:
        def ready() -> bool:
            try:
                answer = httpx.get(f"{self.url}{self.ready_path}", timeout=2)
            except httpx.HTTPError:
                return False
            return answer.status_code == 200

        try:
            processes.wait_for(
                ready,
                timeout=SERVER_START_SECONDS,
                what=f"{self.name} (log: {self.log})",
                alive=lambda: self.process is not None and self.process.poll() is None,
            )
        except (TimeoutError, RuntimeError):
            print(self.log.read_text(errors="replace")[-3000:], file=sys.stderr)
            raise

    def pids(self) -> list[int]:
        """The server and its workers (uvicorn's supervisor starts them in its group)."""
        if self.process is None:
            return []
        return group_members(self.process.pid) or [self.process.pid]

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is not None:
            processes.stop_group(process, grace_seconds=15)


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


def machine_cpu() -> tuple[int, int]:
    """The whole machine's (busy, all) CPU ticks so far, from /proc/stat."""
    fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:9]]
    idle = fields[3] + fields[4]  # idle, iowait
    return sum(fields) - idle, sum(fields)


def busy_cores(before: tuple[int, int], after: tuple[int, int]) -> float:
    """How many cores were busy on average between two readings (by anyone)."""
    busy, total = after[0] - before[0], after[1] - before[1]
    return (os.cpu_count() or 1) * busy / total if total else math.nan


class Backends:
    """The PostgreSQL server processes serving one application's connections to the store."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self._engine: Engine | None = None
        if parsed.get_backend_name() == "postgresql":
            self._engine = create_engine(normalise_url(url), isolation_level="AUTOCOMMIT")

    @property
    def present(self) -> bool:
        return self._engine is not None

    def pids(self, application: str) -> list[int]:
        if self._engine is None:
            return []
        with self._engine.connect() as connection:
            rows = connection.execute(
                text(
                    "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                    "AND application_name = :name AND pid <> pg_backend_pid()"
                ),
                {"name": application},
            ).all()
        return [int(row[0]) for row in rows]

    def close(self) -> None:
        if self._engine is not None:
            self._engine.dispose()


@dataclasses.dataclass(frozen=True)
class CpuReading:
    process: dict[int, float]
    database: dict[int, float]
    database_pids: frozenset[int]


class CpuMeter:
    """CPU of one server's processes, and of the PostgreSQL backends serving it."""

    def __init__(self, server: ServerProcess, backends: Backends, application: str) -> None:
        self.server, self.backends, self.application = server, backends, application

    def read(self, since: CpuReading | None = None) -> CpuReading:
        pids = set(self.backends.pids(self.application))
        if since is not None:  # a backend that served the earlier reading and is still there
            pids |= since.database_pids
        return CpuReading(cpu_seconds(self.server.pids()), cpu_seconds(pids), frozenset(pids))

    def spent(self, before: CpuReading, after: CpuReading) -> tuple[float, float | None]:
        """CPU seconds of the server's processes, and of its backends (None on SQLite)."""
        database = cpu_spent(before.database, after.database) if self.backends.present else None
        return cpu_spent(before.process, after.process), database


# -- Part A: CPU per request ----------------------------------------------------------------------


class StandingBy:
    """A consumer's live row in the workers table, refreshed from a thread: no run is needed."""

    def __init__(self, store: JobStore) -> None:
        self.store = store
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-standby", daemon=True)

    def start(self) -> None:
        self.store.presence(CONSUMER, "consumer")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(CONSUMER_SEEN_SECONDS):
            try:
                self.store.presence(CONSUMER, "consumer")
            except StoreError as exc:
                self.errors.append(str(exc))

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(30)
        with contextlib.suppress(StoreError):
            self.store.presence(CONSUMER, "consumer", leaving=True)


@dataclasses.dataclass(frozen=True)
class Cost:
    """Per request, over one case's measured requests."""

    requests: int
    process_ms: float  # CPU of the server's process(es)
    database_ms: float | None  # CPU of the PostgreSQL backends serving it
    wall_ms: float  # as the client saw it, one request after the other

    @property
    def total_ms(self) -> float:
        return self.process_ms + (self.database_ms or 0.0)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    api: Cost
    bare: Cost
    status: int
    note: str  # what the first answer showed
    busy_cores: float  # the whole machine's CPU in use while the case ran, in cores


@dataclasses.dataclass(frozen=True)
class Probe:
    """One request, sent again and again to one server, and that server's CPU."""

    client: httpx.Client
    meter: CpuMeter
    path: str
    params: dict[str, str]
    headers: dict[str, str]
    expected: int
    what: str

    def send(self) -> httpx.Response:
        return send(self.client, self.path, self.params, self.headers, self.expected, self.what)


def send(
    client: httpx.Client,
    path: str,
    params: dict[str, str],
    headers: dict[str, str],
    expected: int,
    what: str,
) -> httpx.Response:
    answer = client.get(path, params=params, headers=headers)
    if answer.status_code != expected:
        raise Aborted(
            f"{what}: expected HTTP {expected}, got {answer.status_code}: {answer.text[:300]!r}"
        )
    return answer


def warmup_requests(requests: int) -> int:
    return max(WARMUP_MIN, int(requests * WARMUP_FRACTION))


def compare(api: Probe, bare: Probe, requests: int) -> tuple[Cost, Cost, float]:
    """CPU and wall time per request of the API and the bare route, and the machine's load.

    After a warm-up of each, the two take turns in rounds of `ROUND_REQUESTS`,
    so a change in what else runs on the machine weighs on both alike.
    """
    for probe in (api, bare):
        for _ in range(warmup_requests(requests)):
            probe.send()
    spent = {id(api): [0.0, 0.0, 0.0], id(bare): [0.0, 0.0, 0.0]}
    machine = machine_cpu()
    left = requests
    while left > 0:
        n = min(ROUND_REQUESTS, left)
        for probe in (api, bare):
            before = probe.meter.read()
            started = time.perf_counter()
            for _ in range(n):
                probe.send()
            wall = time.perf_counter() - started
            process, database = probe.meter.spent(before, probe.meter.read(before))
            totals = spent[id(probe)]
            totals[0] += process
            totals[1] += database or 0.0
            totals[2] += wall
        left -= n
    busy = busy_cores(machine, machine_cpu())

    def cost(probe: Probe) -> Cost:
        process, database, wall = spent[id(probe)]
        return Cost(
            requests=requests,
            process_ms=process * 1000 / requests,
            database_ms=database * 1000 / requests if probe.meter.backends.present else None,
            wall_ms=wall * 1000 / requests,
        )

    return cost(api), cost(bare), busy


@dataclasses.dataclass(frozen=True)
class PartA:
    cases: list[Case]
    result_bytes: int
    warmup: int
    errors: list[str]


def prepare_store(url: str, settings: Settings, subject: str) -> int:
    """The done job and the waiting job of Part A; returns the result's size in JSON bytes."""
    result = made_result(subject)
    store = JobStore(url, settings=with_changes(settings, gap_seconds=0.0))
    try:
        # The done job first: the only job queued, so the claim takes it.
        store.enqueue(DONE_USER, KIND, subject, "fp-done", PREFETCH)
        claim = store.claim_next("bench-setup")
        assert claim.job is not None and claim.job.holder is not None
        store.finish(claim.job.id, claim.job.holder, result=result)
        for n in range(AHEAD):
            store.enqueue(f"bench-ahead-{n}", KIND, subject, f"fp-ahead-{n}", INTERACTIVE)
        store.enqueue(WAITING_USER, KIND, subject, "fp-waiting", INTERACTIVE)
    finally:
        store.close()
    return len(json.dumps(result).encode())


def run_part_a(url: str, args: argparse.Namespace) -> PartA:
    migrate.upgrade(url)
    subject = dt.datetime.now(dt.UTC).date().isoformat()
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="api-load-a-")))
        settings = Settings(database_url=url, data_dir=directory / "data", plugins="flows.demo")
        result_bytes = prepare_store(url, settings, subject)
        store = JobStore(url, settings=settings)
        stack.callback(store.close)
        standby = StandingBy(store)
        stack.callback(standby.stop)
        standby.start()

        api_settings = with_changes(settings, database_url=tagged(url, API_APPLICATION))
        api = ServerProcess(
            "the API",
            [executable("insight-queue"), "api", "--workers", "1"],
            {
                **api_settings.to_env(),
                **CREDENTIALS,
                # Nothing listens there: a run asked for would fail fast (none should be).
                "PREFECT_API_URL": f"http://127.0.0.1:{processes.free_port()}/api",
                "PREFECT_HOME": str(directory / "prefect"),
            },
            directory / "api.log",
            "/healthz",
        )
        done_id = job_id(DONE_USER, KIND, subject)
        waiting_id = job_id(WAITING_USER, KIND, subject)
        bare = ServerProcess(
            "the bare route",
            [sys.executable, str(BARE_ROUTE)],
            {"AI_JOB_DATABASE_URL": tagged(url, BARE_APPLICATION)},
            directory / "bare.log",
            f"/job/{done_id}",
        )
        for server in (api, bare):
            stack.callback(server.stop)
            server.start()
        api.wait_ready()
        bare.wait_ready()
        backends = Backends(url)
        stack.callback(backends.close)
        api_meter = CpuMeter(api, backends, API_APPLICATION)
        bare_meter = CpuMeter(bare, backends, BARE_APPLICATION)
        api_http = stack.enter_context(
            httpx.Client(base_url=api.url, timeout=REQUEST_TIMEOUT_SECONDS, headers=AS_SERVICE)
        )
        bare_http = stack.enter_context(
            httpx.Client(base_url=bare.url, timeout=REQUEST_TIMEOUT_SECONDS)
        )

        def poll_path(user: str) -> str:
            return f"/v1/users/{user}/insights/{KIND}/{subject}"

        waiting = {"fingerprint": "fp-waiting"}
        done = {"fingerprint": "fp-done"}
        first = send(api_http, poll_path(WAITING_USER), waiting, {}, 200, "the waiting job's poll")
        shown = first.json()
        if shown.get("status") != "pending" or shown.get("flow_run_id") or shown.get("run_note"):
            raise Aborted(f"the waiting job's poll: expected pending, no run asked: {shown}")
        waiting_note = f"pending, {shown.get('ahead')} ahead"
        first = send(api_http, poll_path(DONE_USER), done, {}, 200, "the done job's poll")
        shown = first.json()
        if shown.get("status") != "done" or not shown.get("fresh") or not shown.get("result"):
            raise Aborted(f"the done job's poll: expected done, fresh, with a result: {shown}")
        etag = first.headers.get("etag")
        if not etag:
            raise Aborted("the done job's poll: no ETag")

        plan = [
            ("1 waiting job, no ETag", WAITING_USER, waiting, {}, 200, waiting_id, waiting_note),
            (
                "2 done job, ETag sent",
                DONE_USER,
                done,
                {"If-None-Match": etag},
                304,
                done_id,
                "no body",
            ),
            (
                "3 done job, no ETag",
                DONE_USER,
                done,
                {},
                200,
                done_id,
                f"result {result_bytes} B of JSON",
            ),
        ]
        cases = []
        for name, user, params, headers, status, row, note in plan:
            api_probe = Probe(
                api_http, api_meter, poll_path(user), params, headers, status, f"{name}: the API"
            )
            bare_probe = Probe(
                bare_http, bare_meter, f"/job/{row}", {}, {}, 200, f"{name}: the bare route"
            )
            api_cost, bare_cost, busy = compare(api_probe, bare_probe, args.requests)
            cases.append(Case(name, api_cost, bare_cost, status, note, busy))
        errors = list(standby.errors)
    return PartA(cases, result_bytes, warmup_requests(args.requests), errors)


# -- Part B: the screens --------------------------------------------------------------------------


@dataclasses.dataclass
class Screen:
    user: str
    subject: str
    fingerprint: str
    waiting: bool  # its insight was queued by its first poll (else: made before the run)
    offset: float  # seconds after the start of polling of its first poll
    etag: str | None = None
    answered: bool = False  # a waiting screen saw its fresh result
    token: str = ""  # the screen's own credential, for its user

    @property
    def path(self) -> str:
        return f"/v1/users/{self.user}/insights/{KIND}/{self.subject}"

    @property
    def headers(self) -> dict[str, str]:
        signed = {"Authorization": f"Bearer {self.token}"}
        return signed | ({"If-None-Match": self.etag} if self.etag else {})


@dataclasses.dataclass(frozen=True)
class Sample:
    ms: float
    status: int  # 0: no answer (connection error, timeout)
    error: str = ""  # what went wrong when there was no answer
    store_ms: float | None = None  # the API's own time in the store (its Server-Timing)


async def poll_screen(
    client: httpx.AsyncClient,
    screen: Screen,
    interval: float,
    start: float,
    stop: asyncio.Event,
    samples: list[Sample],
) -> None:
    due = start + screen.offset
    while not stop.is_set():
        wait = due - time.monotonic()
        if wait > 0:
            try:
                await asyncio.wait_for(stop.wait(), wait)
                return
            except TimeoutError:
                pass
        due += interval
        sent = time.perf_counter()
        try:
            response = await client.get(
                screen.path, params={"fingerprint": screen.fingerprint}, headers=screen.headers
            )
        except httpx.HTTPError as exc:
            elapsed = (time.perf_counter() - sent) * 1000
            samples.append(Sample(elapsed, 0, f"{type(exc).__name__}: {exc}"))
            continue
        elapsed = (time.perf_counter() - sent) * 1000
        store_ms = server_timing(response.headers.get("server-timing", ""))
        samples.append(Sample(elapsed, response.status_code, "", store_ms))
        if response.status_code == 200:
            screen.etag = response.headers.get("etag")
            body = response.json()
            if screen.waiting and body.get("status") == "done" and body.get("fresh"):
                screen.answered = True


@dataclasses.dataclass(frozen=True)
class ScreensReport:
    samples: list[Sample]
    screens: list[Screen]
    seconds: float  # from the first poll due to the stop
    lag_ms: list[float]  # how late the screens' event loop woke from 50 ms sleeps
    slow_lives: list[float]  # seconds each slow client's connection lived until it was closed
    slow_open_at_stop: int  # slow connections still open when the run stopped


async def slow_client(
    port: int, trickle: bool, stop: asyncio.Event, lives: list[float], open_now: list[int]
) -> None:
    """One slow client: a connection that sends nothing (or, `trickle`, its headers a byte
    every `SLOW_BYTE_SECONDS`), again as soon as the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            await asyncio.sleep(0.5)
            continue
        opened = time.monotonic()
        open_now[0] += 1
        try:
            if trickle:
                writer.write(SLOW_REQUEST)
            while not stop.is_set():
                if trickle:
                    writer.write(b"a")
                    await writer.drain()
                try:
                    if await asyncio.wait_for(reader.read(1024), SLOW_BYTE_SECONDS) == b"":
                        lives.append(time.monotonic() - opened)
                        break
                except TimeoutError:
                    continue
        except OSError:
            lives.append(time.monotonic() - opened)
        finally:
            open_now[0] -= 1
            writer.close()


async def drive_screens(
    api_url: str, screens: list[Screen], interval: float, stop: Any, started: Any, slow: int
) -> ScreensReport:
    stopping = asyncio.Event()
    samples: list[Sample] = []
    lags: list[float] = []
    lives: list[float] = []
    open_now = [0]
    port = int(api_url.rsplit(":", 1)[1])
    slowpokes = [
        asyncio.create_task(slow_client(port, n % 2 == 1, stopping, lives, open_now))
        for n in range(slow)
    ]
    # A screen keeps its connection: every one of them stays open between polls
    # (httpx would keep only 20 idle ones and reconnect the others on each poll).
    connections = len(screens) + 10
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(
        base_url=api_url, timeout=REQUEST_TIMEOUT_SECONDS, limits=limits
    ) as client:
        start = time.monotonic()
        tasks = [
            asyncio.create_task(poll_screen(client, s, interval, start, stopping, samples))
            for s in screens
        ]
        started.set()
        while not stop.is_set():
            before = time.monotonic()
            await asyncio.sleep(LAG_TICK_SECONDS)
            lags.append((time.monotonic() - before - LAG_TICK_SECONDS) * 1000)
        still_open = open_now[0]
        stopping.set()
        seconds = time.monotonic() - start
        await asyncio.gather(*tasks, *slowpokes)
    return ScreensReport(samples, screens, seconds, lags, lives, still_open)


def screens_process(
    api_url: str,
    screens: list[Screen],
    interval: float,
    stop: Any,
    started: Any,
    out: Any,
    slow: int,
) -> None:
    """The screens (and the slow clients), in a process of their own: their CPU is neither the
    API's nor this one's."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the main process stops them
    out.put(asyncio.run(drive_screens(api_url, screens, interval, stop, started, slow)))


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


def make_screens(args: argparse.Namespace, subject: str) -> list[Screen]:
    tokens = ScreenTokens(secret=SCREEN_SECRET, audience="insight-queue")
    valid = args.seconds + 3600  # seconds: past the run, whatever its start-up takes
    return [
        Screen(
            user=f"screen-{n:04d}",
            subject=subject,
            fingerprint=f"fp-{n:04d}",
            waiting=n < args.waiting,
            offset=args.interval * n / args.screens,
            token=tokens.issue(f"screen-{n:04d}", valid),
        )
        for n in range(args.screens)
    ]


def finish_results(url: str, settings: Settings, screens: Sequence[Screen]) -> None:
    """The results the screens that are not waiting show: made before the run."""
    store = JobStore(url, settings=with_changes(settings, gap_seconds=0.0))
    try:
        for screen in screens:
            if screen.waiting:
                continue
            store.enqueue(screen.user, KIND, screen.subject, screen.fingerprint, PREFETCH)
            claim = store.claim_next("bench-setup")
            assert claim.job is not None and claim.job.holder is not None
            store.finish(claim.job.id, claim.job.holder, result=made_result(screen.subject))
    finally:
        store.close()


@dataclasses.dataclass(frozen=True)
class PartB:
    report: ScreensReport
    api_cpu_ms: float  # per poll, the API's processes
    database_cpu_ms: float | None  # per poll, the PostgreSQL backends serving the API
    calls: int  # gateway calls the recorder saw during the run
    peak: int  # most calls in flight at once, since the recorder started
    min_gap: float | None  # smallest gap between calls, since the recorder started
    concurrency: int
    gap: float
    backfill_total: int
    backfill_done: int  # during the run
    api_cores: float  # the API's CPU seconds per second of the run
    busy_cores: float  # the whole machine's CPU in use during the run, in cores


def run_part_b(url: str, args: argparse.Namespace) -> PartB:
    migrate.upgrade(url)
    subject = dt.datetime.now(dt.UTC).date().isoformat()
    screens = make_screens(args, subject)
    with contextlib.ExitStack() as stack:
        directory = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="api-load-b-")))
        simulator = stack.enter_context(GatewaySimulator(workers=4, latency=args.call_seconds))
        recorder = stack.enter_context(GatewayRecorder("127.0.0.1", simulator.port))
        settings = Settings(
            database_url=url,
            data_dir=directory / "data",
            concurrency=args.concurrency,
            gap_seconds=args.gap,
            plugins="flows.demo",
            gateway={"url": recorder.url},
        )
        finish_results(url, settings, screens)

        server = PrefectServer(directory / "prefect-server", processes.free_port(), ui=False)
        stack.callback(server.stop)
        server.start()
        serve = ServeProcess(
            settings,
            server.api_url,
            env={"PREFECT_LOGGING_LEVEL": "WARNING"},
            log=directory / "serve.log",
        )
        stack.callback(serve.stop)
        serve.start()
        api = ServerProcess(
            "the API",
            [executable("insight-queue"), "api", "--workers", str(args.workers)],
            {
                **with_changes(settings, database_url=tagged(url, API_APPLICATION)).to_env(),
                **client_env(server.api_url, directory / "api-prefect"),
                **CREDENTIALS,
            },
            directory / "api.log",
            "/healthz",
        )
        stack.callback(api.stop)
        api.start()
        api.wait_ready()
        backends = Backends(url)
        stack.callback(backends.close)
        meter = CpuMeter(api, backends, API_APPLICATION)

        with httpx.Client(
            base_url=api.url, timeout=REQUEST_TIMEOUT_SECONDS, headers=AS_SERVICE
        ) as http:
            for n in range(args.backfill_users):
                # A busy Prefect server may refuse a run (503); the hook is sent again, as
                # an app would: the same sync starts one run.
                for _ in range(HOOK_TRIES):
                    path = f"/v1/users/backfill-{n:03d}/backfills"
                    answer = http.post(path, json={"sync_id": "s1"})
                    if answer.status_code == 202 and answer.json().get("status") == "started":
                        break
                    time.sleep(1.0)
                if answer.status_code != 202 or answer.json().get("status") != "started":
                    raise Aborted(
                        f"backfill of backfill-{n:03d}: expected 202 and a run started, got "
                        f"{answer.status_code}: {answer.text[:300]!r}"
                    )
            for screen in screens:  # every screen's first poll: the waiting ones' jobs are queued
                answer = send(
                    http,
                    screen.path,
                    {"fingerprint": screen.fingerprint},
                    screen.headers,
                    200,
                    f"{screen.user}'s first poll",
                )
                screen.etag = answer.headers.get("etag")
        backfill_total = count(url, BACKFILL_USERS)

        stop, started, out = SPAWN.Event(), SPAWN.Event(), SPAWN.Queue()
        child = SPAWN.Process(
            target=screens_process,
            args=(api.url, screens, args.interval, stop, started, out, args.slow_clients),
            name="screens",
            daemon=True,
        )
        stack.callback(stop_child, child, stop)
        before = meter.read()
        machine = machine_cpu()
        started_at = time.monotonic()
        calls_before = recorder.snapshot().count
        backfill_before = count(url, f"{BACKFILL_USERS} AND status = 'done'")
        child.start()
        deadline = time.monotonic() + CHILD_START_SECONDS
        while not started.wait(0.2):
            if not child.is_alive() or time.monotonic() > deadline:
                raise Aborted("the screens' process did not start")
        time.sleep(args.seconds)
        stop.set()
        report: ScreensReport = out.get(timeout=CHILD_START_SECONDS)
        child.join(CHILD_START_SECONDS)
        after = meter.read(before)
        busy = busy_cores(machine, machine_cpu())
        elapsed = time.monotonic() - started_at
        snapshot = recorder.snapshot()
        backfill_done = count(url, f"{BACKFILL_USERS} AND status = 'done'") - backfill_before
        if not serve.alive():
            raise Aborted(f"serve exited during the run (log: {serve.log})")

    process, database = meter.spent(before, after)
    polls = max(len(report.samples), 1)
    return PartB(
        report=report,
        api_cpu_ms=process * 1000 / polls,
        database_cpu_ms=None if database is None else database * 1000 / polls,
        calls=snapshot.count - calls_before,
        peak=snapshot.peak_in_flight,
        min_gap=snapshot.min_gap,
        concurrency=settings.concurrency,
        gap=settings.gap_seconds,
        backfill_total=backfill_total,
        backfill_done=backfill_done,
        api_cores=process / elapsed,
        busy_cores=busy,
    )


def stop_child(child: Any, stop: Any) -> None:
    """The screens' process: asked to stop, then ended by its PID if it has not."""
    stop.set()
    if child.pid is None:
        return
    child.join(10)
    if child.is_alive():
        child.terminate()
        child.join(10)


# -- reporting ------------------------------------------------------------------------------------


def ms(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def report_a(part: PartA, args: argparse.Namespace, postgres: bool) -> list[str]:
    lines = [
        f"A. CPU per request: {args.requests} sequential requests per case and server, after "
        f"{part.warmup} to warm up, over one keep-alive connection each, API and bare route "
        f"taking turns every {ROUND_REQUESTS} (ms per request)",
    ]
    header = f"  {'case':<24} {'status':>6} {'API':>7} {'bare':>7} {'API/bare':>8}"
    if postgres:
        header += f" {'API db':>7} {'bare db':>7} {'with db':>8}"
    header += f" {'wall API':>9} {'wall bare':>9} {'busy':>5}  first answer"
    lines.append(header)
    for case in part.cases:
        api, bare = case.api, case.bare
        line = (
            f"  {case.name:<24} {case.status:>6} {api.process_ms:>7.3f} {bare.process_ms:>7.3f} "
            f"{ratio(api.process_ms, bare.process_ms):>8}"
        )
        if postgres:
            line += (
                f" {ms(api.database_ms, 3):>7} {ms(bare.database_ms, 3):>7} "
                f"{ratio(api.total_ms, bare.total_ms):>8}"
            )
        line += f" {api.wall_ms:>9.3f} {bare.wall_ms:>9.3f} {case.busy_cores:>5.2f}  {case.note}"
        lines.append(line)
    lines.append(
        "  API, bare: CPU of the server process (utime+stime)"
        + (
            "; API db, bare db: of the PostgreSQL backends serving it; with db: the ratio of "
            "process plus backends"
            if postgres
            else ""
        )
        + f"; busy: cores of {os.cpu_count()} in use on the machine meanwhile (anyone's)"
    )
    lines += [f"  error (standing-by consumer): {e}" for e in part.errors]
    return lines


def ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "-"


def report_b(part: PartB, args: argparse.Namespace) -> list[str]:
    samples = part.report.samples
    seconds = part.report.seconds
    answered = [s for s in samples if s.status]
    times = [s.ms for s in answered]
    statuses = collections.Counter(s.status for s in samples)
    fivexx = sum(n for status, n in statuses.items() if status >= 500)
    other = sum(n for status, n in statuses.items() if status not in (200, 304, 503))
    inside = [s.store_ms for s in answered if s.store_ms is not None]
    dominated = sum(1 for s in answered if s.store_ms is not None and s.store_ms >= s.ms / 2)
    waiting = [s for s in part.report.screens if s.waiting]
    lags = part.report.lag_ms
    lives = part.report.slow_lives
    lines = [
        f"B. {args.screens} screens beside serve for {seconds:.0f} s, each polling every "
        f"{args.interval:g} s ({args.waiting} waiting, the rest on a result made earlier); "
        f"API workers {args.workers}; gateway call {args.call_seconds:g} s",
        f"  polls: {len(samples)} ({len(samples) / seconds:.0f}/s); by status: "
        f"200 {statuses.get(200, 0)}, 304 {statuses.get(304, 0)}, 503 {statuses.get(503, 0)}, "
        f"other {other}"
        + (f" (no answer {statuses[0]})" if statuses.get(0) else "")
        + f"; 5xx {fivexx}",
        f"  latency ms: p50 {ms(percentile(times, 0.5), 1)}, p95 {ms(percentile(times, 0.95), 1)}, "
        f"max {ms(max(times, default=None), 1)}",
        f"  store time (Server-Timing) ms: p50 {ms(percentile(inside, 0.5), 1)}, "
        f"p95 {ms(percentile(inside, 0.95), 1)}; at least half of the response time in "
        f"{dominated} of {len(answered)} polls ({percent(dominated, len(answered))})",
        f"  gateway (recorder): {part.calls} calls during the run; since serve started, peak "
        f"in flight {part.peak} (AI_JOB_CONCURRENCY {part.concurrency}) and smallest gap "
        f"between calls {ms(part.min_gap, 3)} s (AI_JOB_GAP_SECONDS {part.gap:g})",
        f"  backfill: {part.backfill_done} of {part.backfill_total} jobs done during the run; "
        f"waiting screens that got their result: {sum(s.answered for s in waiting)} of "
        f"{len(waiting)}",
        f"  API CPU per poll: {part.api_cpu_ms:.3f} ms (process"
        + ("es" if args.workers > 1 else "")
        + ")"
        + (
            ""
            if part.database_cpu_ms is None
            else f" + {part.database_cpu_ms:.3f} ms (its PostgreSQL backends)"
        )
        + f"; the API used {part.api_cores:.2f} cores, the whole machine "
        f"{part.busy_cores:.2f} of {os.cpu_count()}",
        f"  the screens' event loop was late by at most {ms(max(lags, default=None), 0)} ms "
        f"(p99 {ms(percentile(lags, 0.99), 0)} ms)",
        f"  slow clients: {args.slow_clients} ({args.slow_clients - args.slow_clients // 2} "
        f"sending nothing, {args.slow_clients // 2} a header byte every {SLOW_BYTE_SECONDS:g} s),"
        f" each connecting again when closed: {len(lives)} connections closed by the server, "
        f"after p50 {ms(percentile(lives, 0.5), 1)} s, max {ms(max(lives, default=None), 1)} s; "
        f"{part.report.slow_open_at_stop} open at the stop",
    ]
    for error, n in collections.Counter(s.error for s in samples if not s.status).items():
        lines.append(f"  no answer ({n}x): {error[:200]}")
    return lines


def percent(part: int, whole: int) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "-"


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    measured: str
    met: bool


def targets(part_a: PartA | None, part_b: PartB | None, args: argparse.Namespace) -> list[Target]:
    found = []
    if part_a is not None:
        waiting, not_modified = part_a.cases[0].api, part_a.cases[1].api
        found += [
            Target(
                f"API process CPU per waiting-job poll <= {WAITING_CPU_TARGET_MS:g} ms",
                f"{waiting.process_ms:.3f} ms",
                waiting.process_ms <= WAITING_CPU_TARGET_MS,
            ),
            Target(
                f"API process CPU per 304 <= {NOT_MODIFIED_CPU_TARGET_MS:g} ms",
                f"{not_modified.process_ms:.3f} ms",
                not_modified.process_ms <= NOT_MODIFIED_CPU_TARGET_MS,
            ),
        ]
    if part_b is not None:
        times = [s.ms for s in part_b.report.samples if s.status]
        p95 = percentile(times, 0.95)
        fivexx = sum(1 for s in part_b.report.samples if s.status >= 500)
        found += [
            Target(
                f"{args.screens} screens: p95 < {P95_TARGET_MS:g} ms",
                f"{p95:.1f} ms",
                p95 < P95_TARGET_MS,
            ),
            Target("no 5xx", f"{fivexx}", fivexx == 0),
            Target(
                f"recorder peak in flight <= AI_JOB_CONCURRENCY ({part_b.concurrency})",
                f"{part_b.peak}",
                part_b.peak <= part_b.concurrency,
            ),
        ]
    return found


@contextlib.contextmanager
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
    parser.add_argument("--requests", type=int, default=2000, help="per case and server (A)")
    parser.add_argument("--screens", type=int, default=200)
    parser.add_argument("--waiting", type=int, default=20, help="screens waiting on a queued job")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between polls")
    parser.add_argument("--seconds", type=float, default=60.0, help="length of the screens' run")
    parser.add_argument("--backfill-users", type=int, default=10)
    parser.add_argument("--call-seconds", type=float, default=0.5, help="per gateway call")
    parser.add_argument("--gap", type=float, default=1.0, help="AI_JOB_GAP_SECONDS")
    parser.add_argument("--concurrency", type=int, default=1, help="AI_JOB_CONCURRENCY")
    parser.add_argument("--workers", type=int, default=1, help="the API's uvicorn workers (B)")
    parser.add_argument(
        "--slow-clients",
        type=int,
        default=300,
        help="clients that connect and send nothing or a byte at a time, beside the screens (B)",
    )
    parser.add_argument("--parts", default="AB", help="which parts to run: A, B or AB")
    args = parser.parse_args(argv)
    if not args.parts or set(args.parts) - {"A", "B"}:
        parser.error("--parts: A, B or AB")
    if args.waiting > args.screens:
        parser.error("--waiting must not exceed --screens")
    if args.requests < 1 or args.screens < 1:
        parser.error("--requests and --screens must be at least 1")
    return args


def run(args: argparse.Namespace, summary: list[tuple[str, list[Target]]]) -> None:
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        if backend not in ("sqlite", "postgresql"):
            raise Aborted(f"--backends: unknown backend {backend!r}")
        print(f"== {backend} (load {loadavg()})", flush=True)
        part_a: PartA | None = None
        part_b: PartB | None = None
        try:
            if "A" in args.parts:
                with database(backend, args.postgres_url) as url:
                    part_a = run_part_a(url, args)
                for line in report_a(part_a, args, backend == "postgresql"):
                    print(line, flush=True)
            if "B" in args.parts:
                with database(backend, args.postgres_url) as url:
                    part_b = run_part_b(url, args)
                for line in report_b(part_b, args):
                    print(line, flush=True)
        finally:
            summary.append((backend, targets(part_a, part_b, args)))


def print_summary(summary: list[tuple[str, list[Target]]]) -> None:
    print("== summary: targets", flush=True)
    for backend, found in summary:
        for target in found:
            verdict = "met" if target.met else "MISSED"
            print(f"  {backend:<10} {target.name:<55} {target.measured:>12}  {verdict}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    print(
        f"api_load: backends {args.backends}; A: {args.requests} requests per case; B: "
        f"{args.screens} screens every {args.interval:g} s for {args.seconds:g} s, backfill "
        f"of {args.backfill_users} users, calls {args.call_seconds:g} s, gap {args.gap:g} s, "
        f"AI_JOB_CONCURRENCY {args.concurrency}; {os.cpu_count()} cores, load {loadavg()}",
        flush=True,
    )
    summary: list[tuple[str, list[Target]]] = []
    status = 0
    try:
        with processes.stop_signals():
            run(args, summary)
    except Aborted as exc:
        print(f"ABORTED: {exc}", flush=True)
        status = 2
    except KeyboardInterrupt:
        print("ABORTED: interrupted; every process started was stopped", flush=True)
        status = 2
    print_summary(summary)
    print(f"load at the end: {loadavg()}", flush=True)
    if status == 0 and not all(t.met for _, found in summary for t in found):
        status = 1
    return status


if __name__ == "__main__":
    sys.exit(main())
