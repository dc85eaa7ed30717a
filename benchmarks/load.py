"""Load benchmark: many consumer processes draining a big queue through the gateway guard.

The scenario (defaults): 2,000 jobs from 200 users (every 10th one
INTERACTIVE), 4 consumer processes, each with its own `JobStore` and so its
own connections, a gateway simulator answering in 10 ms, `AI_JOB_GAP_SECONDS`
0, and `AI_JOB_CONCURRENCY` 1 and then 2. It prints jobs per second and the
queue's overhead per job next to the 10 ms call:

- `overhead/job` = wall time x limit / jobs - call: what a gateway slot spends
  per job outside the call (claim, lease renewals, HTTP client, finish);
- `idle p50/p95` (limit 1 only) = the gateway's idle time between one call's
  end and the next call's start, as the simulator saw it.

Each consumer process drives the product's runner the way `flows.consumer`
does, on an asyncio loop of its own: it notes the loop's time, claims with
`JobStore.claim_next` (in a thread), and awaits `JobRunner.run(job,
claim_sent)`, which keeps the lease itself (its `LeaseKeeper` renews the claim
in the background and once more right before the call) and records the
outcome. One claim at a time per process, so the consumers compete for the
gateway through the store. They are not `insight-queue drain` (nor a draining
`flows.consumer.Consumer`): a Prefect task run costs ~50 ms per job, five
times the call, and a draining consumer leaves as soon as another one holds
the gateway, so four of them would not stay to compete. A consumer that finds
the gateway busy polls again after `--poll-ms`.

`--client per-job` (the default) is what the flows do: one `GatewayClient`
per process (`Runtime.consumer()`), which opens a new `httpx.AsyncClient`, and
so a new connection, per call, on the process's one cached SSL context.
`--client shared-tls` gives that client one `httpx.AsyncHTTPTransport` made
from one SSL context per process (it still opens an `AsyncClient` per call,
on that transport, and each call still has a connection of its own), which
shows what building a transport per call costs (and is what the load test
uses).

`run_load` is also what `tests/acceptance/test_load.py` runs and checks
(every job done exactly once, the gateway's peak equal to the limit, claims
in queue order); `check` is the same verdict for the command line.

Run from the repository root; PostgreSQL runs in a fresh schema it drops
afterwards, SQLite in a temporary file:

    .venv/bin/python benchmarks/load.py
    .venv/bin/python benchmarks/load.py --backends postgresql,sqlite --limits 1,2
    .venv/bin/python benchmarks/load.py --jobs 500 --users 50 --consumers 8 --latency-ms 50

`--postgres-url` defaults to $AI_JOB_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import datetime as dt
import itertools
import multiprocessing
import os
import queue
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import create_engine, select, text
from sqlalchemy.exc import OperationalError

if not __package__:  # run as a script: the development tools and helpers are in the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile
from devtools.simulator import GatewaySimulator
from flows.registry import Registry
from flows.runner import JobRunner
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    Blocked,
    JobStore,
    Settings,
    StoreError,
    migrate,
    schema,
)
from queue_store.engine import create_store_engine
from tests.support.factories import gateway_client, job_runner
from tests.support.reads import pending

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"
KIND = "load"
INTERACTIVE_EVERY = 10  # every 10th job is a screen's
POLL_SECONDS = 0.002  # a consumer that found the gateway busy looks again after this
STORE_ERROR_PAUSE_SECONDS = 1.0  # a consumer whose claim failed waits this long
GIVE_UP_SECONDS = 600.0  # a consumer still running after this reports a timeout
START_TIMEOUT_SECONDS = 120.0  # spawned consumers must be connected by then
SPAWN = multiprocessing.get_context("spawn")
Row = dict[str, Any]  # a job row, by column name
CLIENTS = ("per-job", "shared-tls")
DROP_ATTEMPTS = 10  # tries to drop a PostgreSQL schema while the server restarts
DROP_PAUSE_SECONDS = 2.0


def _messages(user_id: str, subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"load {user_id}/{subject}"}]


# Made on import, so every spawned consumer has the kind too.
REGISTRY = Registry()
REGISTRY.register_generator(KIND, _messages)


def job_keys(jobs: int, users: int) -> list[tuple[str, str, str, int]]:
    """(user_id, kind, subject, priority) for the scenario; subjects are unique,
    so the simulator's label `kind:subject` names one job."""
    return [
        (
            f"user-{n % users:04d}",
            KIND,
            f"s{n:06d}",
            INTERACTIVE if n % INTERACTIVE_EVERY == 0 else PREFETCH,
        )
        for n in range(jobs)
    ]


@dataclasses.dataclass(frozen=True)
class ClaimRecord:
    job_id: str
    holder: str
    attempts: int  # the attempt this claim started
    outcome: str
    consumer: str


@dataclasses.dataclass
class ConsumerReport:
    name: str
    records: list[ClaimRecord]
    blocked: dict[str, int]  # claims that got no job, by reason
    error: str | None


def runner_for(store: JobStore, settings: Settings, client: str) -> JobRunner:
    """The flows' runner, as `Runtime.consumer()` builds it but without run history.

    "per-job": the flows' gateway client; "shared-tls": a gateway client whose
    calls all go through one transport made from one SSL context.
    """
    if client == "per-job":
        gateway = gateway_client(settings)
    elif client == "shared-tls":
        # Safe only because a consumer process makes one call at a time: every
        # call's `AsyncClient` closes the transport's connections as it ends.
        context = httpx.create_ssl_context()
        gateway = gateway_client(settings, transport=httpx.AsyncHTTPTransport(verify=context))
    else:
        raise ValueError(f"client: expected one of {CLIENTS}, got {client!r}")
    return job_runner(store, settings, REGISTRY, gateway)


def consume(
    url: str,
    settings: dict[str, Any],
    name: str,
    ready: Any,
    start: Any,
    out: Any,
    poll_seconds: float,
    give_up_after: float,
    client: str = "per-job",
) -> None:
    """One consumer process: claim, run through `JobRunner`, until nothing is left.

    It stops when the queue has nothing pending or running (a job another
    consumer holds could still be queued again), and reports every claim. A
    claim that fails with a store error (the database restarting) is counted
    under "store-error" and tried again after a pause, as the safety net
    would start a new consumer.
    """
    records: list[ClaimRecord] = []
    blocked: collections.Counter[str] = collections.Counter()
    error: str | None = None
    store: JobStore | None = None
    try:
        configured = Settings(**settings)
        store = JobStore(url, settings=configured)
        pending(store)  # connected before the start line
        ready.put(name)
        if not start.wait(START_TIMEOUT_SECONDS):
            raise TimeoutError("the start signal never came")
        asyncio.run(
            drain(store, configured, name, client, poll_seconds, give_up_after, records, blocked)
        )
    except BaseException:  # noqa: BLE001 - reported to the parent, which asserts on it
        error = traceback.format_exc()
    finally:
        if store is not None:
            store.close()
    out.put(ConsumerReport(name, records, dict(blocked), error))


async def drain(
    store: JobStore,
    settings: Settings,
    name: str,
    client: str,
    poll_seconds: float,
    give_up_after: float,
    records: list[ClaimRecord],
    blocked: collections.Counter[str],
) -> None:
    """The consumer's loop, as `flows.consumer.Consumer` runs one lane of it.

    The claim's time is the loop's, taken just before the claim is sent: the
    runner's lease counts from it. `records` and `blocked` are filled as it
    goes, so a consumer that fails still reports what it did.
    """
    runner = runner_for(store, settings, client)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + give_up_after
    while True:
        if loop.time() > deadline:
            raise TimeoutError(f"{name} gave up after {give_up_after} s")
        claim_sent = loop.time()
        try:
            claim = await asyncio.to_thread(store.claim_next, name)
        except StoreError:
            blocked["store-error"] += 1
            await asyncio.sleep(STORE_ERROR_PAUSE_SECONDS)
            continue
        job = claim.job
        if job is None:
            blocked[str(claim.blocked)] += 1
            if claim.blocked is Blocked.EMPTY and not await asyncio.to_thread(
                store.has_work, or_running=True
            ):
                return
            await asyncio.sleep(poll_seconds)
            continue
        report = await runner.run(job, claim_sent)
        records.append(
            ClaimRecord(job.id, job.holder or "", job.attempts, str(report.outcome), name)
        )


@dataclasses.dataclass
class LoadResult:
    backend: str
    client: str
    jobs: int
    users: int
    consumers: int
    concurrency: int
    latency: float  # seconds per call at the simulator
    enqueue_seconds: float
    wall_seconds: float  # from the start signal to the last consumer's report
    reports: list[ConsumerReport]
    labels: list[str]  # the simulator's label per request, in order of arrival
    statuses: list[int | None]
    peak_in_flight: int
    idle_between_calls: list[float]  # seconds from one call's end to the next's start
    call_seconds: list[float]  # started -> ended, per call
    rows: list[dict[str, Any]]  # every job row, ordered by claimed_at

    @property
    def jobs_per_second(self) -> float:
        return self.jobs / self.wall_seconds

    @property
    def overhead_per_job(self) -> float:
        """Seconds a gateway slot spends per job outside the call."""
        return self.wall_seconds * self.concurrency / self.jobs - self.latency

    @property
    def records(self) -> list[ClaimRecord]:
        return [r for report in self.reports for r in report.records]

    @property
    def errors(self) -> list[str]:
        return [f"{r.name}: {r.error}" for r in self.reports if r.error]


def consumer_settings(url: str, gateway_url: str, concurrency: int) -> dict[str, Any]:
    return {
        "database_url": url,
        "concurrency": concurrency,
        "gap_seconds": 0.0,
        # Each of the scenario's screens is its own user's one look: none falls back (A3).
        "max_interactive": 1_000_000,
        "gateway": {"url": gateway_url},
    }


def run_load(
    url: str,
    *,
    backend: str,
    jobs: int = 2000,
    users: int = 200,
    consumers: int = 4,
    latency: float = 0.010,
    concurrency: int = 1,
    poll_seconds: float = POLL_SECONDS,
    give_up_after: float = GIVE_UP_SECONDS,
    client: str = "per-job",
) -> LoadResult:
    """Enqueue the scenario into an upgraded, empty store at `url`, drain it, and report."""
    if client not in CLIENTS:
        raise ValueError(f"client: expected one of {CLIENTS}, got {client!r}")
    with GatewaySimulator(workers=4, latency=latency) as sim:
        settings = consumer_settings(url, sim.url, concurrency)
        with JobStore(url, settings=Settings(**settings)) as setup:
            began = time.monotonic()
            for user_id, kind, subject, priority in job_keys(jobs, users):
                setup.enqueue(user_id, kind, subject, priority=priority)
            enqueue_seconds = time.monotonic() - began

        ready, out, start = SPAWN.Queue(), SPAWN.Queue(), SPAWN.Event()
        names = [f"consumer-{i}" for i in range(consumers)]
        processes = [
            SPAWN.Process(
                target=consume,
                args=(url, settings, name, ready, start, out, poll_seconds, give_up_after, client),
                daemon=True,
            )
            for name in names
        ]
        reports: list[ConsumerReport] = []
        try:
            for process in processes:
                process.start()
            for _ in names:
                ready.get(timeout=START_TIMEOUT_SECONDS)
            began = time.monotonic()
            start.set()
            for _ in names:
                reports.append(out.get(timeout=give_up_after + 30))
            wall = time.monotonic() - began
        except queue.Empty:
            raise TimeoutError(f"consumers did not report: {reports}") from None
        finally:
            _stop(processes)
        stats = sim.stats()

    calls = sorted(stats.requests, key=lambda r: r.received)
    timed = sorted(
        (r for r in calls if r.started is not None and r.ended is not None),
        key=lambda r: r.started or 0.0,
    )
    idle = [
        (after.started or 0.0) - (before.ended or 0.0)
        for before, after in itertools.pairwise(timed)
    ]
    return LoadResult(
        backend=backend,
        client=client,
        jobs=jobs,
        users=users,
        consumers=consumers,
        concurrency=concurrency,
        latency=latency,
        enqueue_seconds=enqueue_seconds,
        wall_seconds=wall,
        reports=reports,
        labels=[r.job or "" for r in calls],
        statuses=[r.status for r in calls],
        peak_in_flight=stats.peak_in_flight,
        idle_between_calls=idle,
        call_seconds=[(r.ended or 0.0) - (r.started or 0.0) for r in timed],
        rows=job_rows(url),
    )


def job_rows(url: str) -> list[dict[str, Any]]:
    """Every job row, in the order the jobs were (last) claimed."""
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            jobs = schema.jobs
            rows = connection.execute(
                select(
                    jobs.c.id,
                    jobs.c.kind,
                    jobs.c.subject,
                    jobs.c.status,
                    jobs.c.attempts,
                    jobs.c.priority,
                    jobs.c.queued_at,
                    jobs.c.claimed_at,
                    jobs.c.holder,
                ).order_by(jobs.c.claimed_at, jobs.c.id)
            ).all()
        return [dict(row._mapping) for row in rows]
    finally:
        engine.dispose()


def _stop(processes: Sequence[Any]) -> None:
    """Join the consumers we started; one still alive is ended by its own handle."""
    for process in processes:
        process.join(30)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


# ---------------------------------------------------------------------------
# Databases for a run: a fresh PostgreSQL schema, or a SQLite file.


def postgres_schema_url(base: str, schema_name: str) -> str:
    separator = "&" if "?" in base else "?"
    return f"{base}{separator}options=-csearch_path%3D{schema_name}"


@contextmanager
def fresh_database(backend: str, postgres_url: str = "") -> Iterator[str]:
    """An upgraded, empty store; PostgreSQL in its own schema, dropped afterwards."""
    if backend == "sqlite":
        with tempfile.TemporaryDirectory(prefix="insight-queue-load-") as directory:
            url = f"sqlite:///{Path(directory) / 'queue.db'}"
            migrate.upgrade(url)
            yield url
        return
    if backend != "postgresql":
        raise ValueError(f"backend: expected sqlite or postgresql, got {backend!r}")
    schema_name = f"load_{uuid.uuid4().hex[:12]}"
    admin = create_engine(
        postgres_url.replace("postgresql://", "postgresql+psycopg://", 1), pool_pre_ping=True
    )
    with admin.begin() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema_name}"))
    try:
        url = postgres_schema_url(postgres_url, schema_name)
        migrate.upgrade(url)
        yield url
    finally:
        _drop_schema(admin, schema_name)
        admin.dispose()


def _drop_schema(admin: Any, schema_name: str) -> None:
    # A database restarting under us should not leave the schema behind.
    for attempt in range(DROP_ATTEMPTS):
        try:
            with admin.begin() as connection:
                connection.execute(text(f"DROP SCHEMA IF EXISTS {schema_name} CASCADE"))
            return
        except OperationalError:
            if attempt + 1 == DROP_ATTEMPTS:
                raise
            time.sleep(DROP_PAUSE_SECONDS)


# ---------------------------------------------------------------------------


def check(result: LoadResult) -> list[str]:
    """What went wrong, if anything: the run's correctness, beside its speed."""
    problems = list(result.errors)
    by_label = collections.Counter(result.labels)
    if len(by_label) != result.jobs or set(by_label.values()) != {1}:
        repeated = [label for label, n in by_label.items() if n > 1][:5]
        problems.append(f"{len(by_label)} labels for {result.jobs} jobs; repeated: {repeated}")
    if any(status != 200 for status in result.statuses):
        problems.append("the gateway answered something other than 200")
    store_errors = sum(report.blocked.get("store-error", 0) for report in result.reports)
    if store_errors:
        problems.append(f"{store_errors} claims failed with a store error (database restart?)")
    if result.peak_in_flight != result.concurrency:
        problems.append(f"peak in flight {result.peak_in_flight}, limit {result.concurrency}")
    done = sum(1 for row in result.rows if row["status"] == "done" and row["attempts"] == 1)
    if done != result.jobs:
        problems.append(f"{done} of {result.jobs} jobs done after exactly one attempt")
    records = result.records
    if len(records) != result.jobs or len({r.job_id for r in records}) != result.jobs:
        problems.append(
            f"{len(records)} claims of {len({r.job_id for r in records})} jobs for {result.jobs}"
        )
    outcomes = collections.Counter(r.outcome for r in records if r.outcome != "done")
    if outcomes:
        problems.append(f"claims that did not end done: {dict(outcomes)}")
    disorder = out_of_queue_order(result.rows)
    if disorder:
        before, after = disorder[0]
        problems.append(
            f"{len(disorder)} claims out of queue order, e.g. {after['subject']}"
            f" (priority {after['priority']}) after {before['subject']}"
            f" (priority {before['priority']})"
        )
    return problems


def out_of_queue_order(rows: Sequence[Row]) -> list[tuple[Row, Row]]:
    """Consecutive claims (rows ordered by claimed_at) taken against the queue's order (R8).

    Claims are serialised on the gate row, so by claim time the jobs must go
    by priority, then age; two claims stamped with the same time are not compared.
    """
    claimed = [row for row in rows if row["claimed_at"] is not None]
    return [
        (before, after)
        for before, after in itertools.pairwise(claimed)
        if before["claimed_at"] != after["claimed_at"]
        and (before["priority"], before["queued_at"]) > (after["priority"], after["queued_at"])
    ]


def describe(result: LoadResult) -> str:
    idle = ""
    if result.concurrency == 1:
        idle_ms = [s * 1000 for s in result.idle_between_calls]
        idle = (
            f"  idle p50 {percentile(idle_ms, 0.5):5.1f} ms"
            f"  p95 {percentile(idle_ms, 0.95):5.1f} ms"
        )
    call_ms = statistics.median(result.call_seconds) * 1000 if result.call_seconds else 0.0
    per_consumer = sorted(len(r.records) for r in result.reports)
    return (
        f"{result.backend:<10} {result.client:<10} limit {result.concurrency}  {result.jobs} jobs"
        f"  {result.wall_seconds:6.1f} s  {result.jobs_per_second:6.1f} jobs/s"
        f"  call p50 {call_ms:4.1f} ms  overhead/job {result.overhead_per_job * 1000:5.1f} ms"
        f"{idle}  peak {result.peak_in_flight}  per consumer {per_consumer}"
        f"  (enqueue {result.enqueue_seconds:.1f} s)"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="Jobs per second and overhead per job with several consumer processes."
    )
    parser.add_argument("--jobs", type=int, default=2000)
    parser.add_argument("--users", type=int, default=200)
    parser.add_argument("--consumers", type=int, default=4)
    parser.add_argument("--latency-ms", type=float, default=10.0, help="simulated call")
    parser.add_argument("--limits", default="1,2", help="AI_JOB_CONCURRENCY values to run")
    parser.add_argument("--backends", default="postgresql", help="postgresql and/or sqlite")
    parser.add_argument("--clients", default="per-job", help="per-job and/or shared-tls")
    parser.add_argument("--poll-ms", type=float, default=POLL_SECONDS * 1000)
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL,
    )
    args = parser.parse_args(argv)
    if args.jobs < 1 or args.users < 1 or args.consumers < 1:
        parser.error("--jobs, --users and --consumers must be at least 1")

    print(
        f"load: {args.jobs} jobs from {args.users} users, {args.consumers} consumer processes,"
        f" {args.latency_ms:g} ms calls, gap 0;"
        f" {os.cpu_count()} CPUs, {dt.datetime.now(dt.UTC):%Y-%m-%d}"
    )
    failed = False
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    clients = [c.strip() for c in args.clients.split(",") if c.strip()]
    limits = [int(n) for n in args.limits.split(",") if n.strip()]
    if not set(clients) <= set(CLIENTS):
        parser.error(f"--clients: expected some of {', '.join(CLIENTS)}")
    for backend, client, limit in itertools.product(backends, clients, limits):
        with fresh_database(backend, args.postgres_url) as url:
            result = run_load(
                url,
                backend=backend,
                jobs=args.jobs,
                users=args.users,
                consumers=args.consumers,
                latency=args.latency_ms / 1000,
                concurrency=limit,
                poll_seconds=args.poll_ms / 1000,
                client=client,
            )
        print(describe(result), flush=True)
        for problem in check(result):
            failed = True
            print(f"  PROBLEM: {problem}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())


__all__ = [
    "LoadResult",
    "check",
    "describe",
    "fresh_database",
    "job_keys",
    "out_of_queue_order",
    "run_load",
]
