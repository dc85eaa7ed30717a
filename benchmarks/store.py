"""Benchmark of the SQL store at large backlogs and for bulk enqueues, on SQLite and PostgreSQL.

Every figure is taken through `JobStore`, on a fresh database per measurement
group (SQLite: a file in a temporary directory; PostgreSQL: a database this
script creates next to the one in `--postgres-url` and drops at the end).

Backlog measures, for each size in `--sizes` (default 1k, 10k and 100k pending
jobs): the backlog is bulk-inserted (1000 users, about 1% INTERACTIVE, the rest
PREFETCH, queue times spread over 30 days, plus 1% as many failed jobs, and a
mean duration known for every kind), then `ANALYZE` (with `--vacuum`, on
PostgreSQL `VACUUM ANALYZE`; with `--fresh`, neither, and autovacuum off for the
store's tables: the table as a bulk backfill leaves it, before autovacuum has
run). Median and p95 of:

- no-op poll: `enqueue` of an existing pending job with the same priority and
  fingerprint (what a waiting screen does every few seconds). "Wrote nothing"
  means the polled rows' `revision` and `updated_at` (and `xmin`/`xmax` on
  PostgreSQL) are unchanged and the database's write counter did not move
  (SQLite: `PRAGMA data_version` seen from another connection; PostgreSQL:
  inserted+updated+deleted tuples in `pg_stat_user_tables`). One real write
  made afterwards must move that counter, which shows the check can see one;
- `claim_next` with gap 0 and concurrency 1; each claimed job is handed
  back (untimed) to its place, so the backlog keeps its size and order;
- a place near the end of the queue: `state()` of one of the last ten jobs
  (exact up to 1,000 ahead, "more than" beyond);
- `list_jobs(user)` for a user whose 60 pending jobs are spread evenly through
  the backlog (every entry with its place in line and ETA);
- `queue_view(limit=50)` with one call in flight;
- a `/metrics` scrape: `JobStore.metrics()` rendered by the API's collector;
- no-op polls per second from 4 spawned processes at once (`--poll-seconds`,
  0 to skip).

Bulk measures (once per backend; `--bulk-users` users × 8 scopes, default
10,000 × 8 = 80,000 jobs, 7 dated scopes and one superseding scope per user,
the way a backfill queues them):

- `enqueue_many` in one call: the first pass inserts every job; a second pass
  changes the fingerprint of 1% of the scopes (those rows, and only those,
  must be written); a third pass repeats the second and must write nothing at
  all (no row revision, time, tuple version or lock, no write counted);
- `enqueue_many` per user (one call of 8 per user, as the backfill flow does),
  first pass and an unchanged second pass that must write nothing;
- `requeue(kinds=[one kind])` and `requeue()` over the finished jobs (all
  marked done, untimed, beforehand);
- per-call `enqueue` of `--per-call` new keys, for comparison with the bulk path.

Each backlog is measured in each order of `--orders` (default both: `fair`,
where each user's jobs take turns 0, 1, 2... as a backfill deals them, and
`fifo`).

Targets printed beside the figures: bulk enqueue and requeue of 10,000 users ×
8 scopes on PostgreSQL well under 30 s; a place at the back p95 under 10 ms,
`list_jobs` and `queue_view` under 50 ms, a scrape under 50 ms, at 100k
pending on both databases; a no-op poll writes nothing and costs well under
1 ms; `claim_next` a few ms.

Run from the repository root (PostgreSQL needs CREATE DATABASE rights):

    .venv/bin/python benchmarks/store.py
    .venv/bin/python benchmarks/store.py --sizes 1000,10000 --backends sqlite --bulk-users 1000
    .venv/bin/python benchmarks/store.py --sizes 100000 --explain   # also the slowest plans

`--postgres-url` defaults to $AI_JOB_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import itertools
import multiprocessing
import os
import platform
import random
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine, create_engine, event, insert, select, text, update
from sqlalchemy.engine import make_url

from queue_store import Failure, migrate, schema
from queue_store.engine import create_store_engine, normalise_url
from queue_store.models import INTERACTIVE, PREFETCH, EnqueueRequest, ListedJob, Status, job_id
from queue_store.places import PLACE_BOUND
from queue_store.settings import Settings
from queue_store.store import JobStore
from tests.support.reads import state_of

if not __package__:  # run as a script: the shared helpers are in this folder's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.figures import percentile

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

USERS = 1000
KINDS = ("sleep", "activity", "heart", "nutrition", "mood", "weight", "glucose", "steps")
LIST_USER = "bench-list-user"
LIST_USER_JOBS = 60
INSERT_CHUNK = 10_000
SPREAD = dt.timedelta(days=30)
WARMUP_CALLS = 10
POLL_PROCESSES = 4
POSITION_TAIL = 10  # position() asks about one of the last this many jobs in line

# The bulk scenario: per user, one scope per dated kind and one superseding scope.
BULK_DATED_KINDS = ("sleep", "activity", "heart", "nutrition", "mood", "weight", "glucose")
BULK_SUPERSEDING_KIND = "trends"
BULK_CHANGED_EVERY = 100  # the second pass changes one scope in this many
BULK_REQUEUE_KIND = BULK_SUPERSEDING_KIND

POLL_TARGET_MS = 1.0
CLAIM_TARGET_MS = 5.0
PLACE_TARGET_MS = 10.0
READ_TARGET_MS = 50.0
# The order the backlogs are measured in (set from --orders, one at a time).
ORDER = {"value": "fair"}
# --fresh: no ANALYZE, no VACUUM, autovacuum off for the store's tables (PostgreSQL).
FRESH = {"value": False}
BULK_TARGET_S = 30.0
# From the issue: the original per-call enqueue of 100k rows.
ORIGINAL_ENQUEUE_100K_S = {"postgresql": 441.0, "sqlite": 118.0}


class Key(NamedTuple):
    user_id: str
    kind: str
    subject: str
    fingerprint: str
    priority: int
    turn: int = 0  # in the fair order: the user's job number, as a backfill deals them

    @property
    def id(self) -> str:
        return job_id(self.user_id, self.kind, self.subject)


@dataclasses.dataclass
class BacklogRow:
    backend: str
    order: str
    backlog: int
    poll_ms: list[float]
    wrote_nothing: bool
    write_check: str
    claim_ms: list[float]
    position_ms: list[float]
    list_ms: list[float]
    view_ms: list[float]
    scrape_ms: list[float]
    polls_per_second: float | None


@dataclasses.dataclass
class BulkStep:
    name: str
    jobs: int
    seconds: float
    check: str
    ok: bool
    per_call_ms: list[float] | None = None


@dataclasses.dataclass
class BulkRow:
    backend: str
    users: int
    steps: list[BulkStep]


# ---------------------------------------------------------------------------
# Statistics and formatting


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    """Milliseconds the call took, and what it returned."""
    start = time.perf_counter()
    value = call()
    return (time.perf_counter() - start) * 1000.0, value


def sample_times(call: Callable[[], Any], calls: int, check: Callable[[Any], None]) -> list[float]:
    """`calls` timed calls after a few untimed ones; `check` sees every result."""
    times = []
    for n in range(WARMUP_CALLS + calls):
        elapsed, value = timed(call)
        check(value)
        if n >= WARMUP_CALLS:
            times.append(elapsed)
    return times


# ---------------------------------------------------------------------------
# Databases: a fresh one per measurement group


@contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="insight-queue-bench-") as directory:
        yield f"sqlite:///{Path(directory) / 'bench.db'}"


_databases = itertools.count(1)


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    url = normalise_url(admin_url)
    name = f"insight_queue_bench_{os.getpid()}_{next(_databases)}"
    admin = create_engine(url, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as connection:
            connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
            connection.exec_driver_sql(f'CREATE DATABASE "{name}"')
        try:
            yield url.set(database=name).render_as_string(hide_password=False)
        finally:
            with admin.connect() as connection:
                connection.exec_driver_sql(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        admin.dispose()


def fresh_database(backend: str, args: argparse.Namespace) -> Any:
    return sqlite_database() if backend == "sqlite" else postgres_database(args.postgres_url)


def data_dir_for(url: str) -> Path:
    """The SQLite database's own folder, which the store may narrow to its account; a
    PostgreSQL store never touches its data directory."""
    database = make_url(url).database
    if make_url(url).get_backend_name() == "sqlite" and database:
        return Path(database).parent
    return Path(tempfile.gettempdir())


def settings_for(url: str) -> Settings:
    # gap 0 and concurrency 1: every claim can succeed once the previous job is handed back.
    return Settings(
        database_url=url,
        data_dir=data_dir_for(url),
        gap_seconds=0.0,
        concurrency=1,
        order=ORDER["value"],
    )


def open_store(url: str) -> JobStore:
    return JobStore(url, settings=settings_for(url))


def analyse(url: str, vacuum: bool = False) -> None:
    """ANALYZE; with `vacuum`, on PostgreSQL VACUUM ANALYZE (what autovacuum would leave)."""
    if FRESH["value"]:
        return
    engine = create_store_engine(url)
    try:
        if vacuum and engine.dialect.name == "postgresql":
            with engine.connect() as connection:
                connection.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(
                    "VACUUM ANALYZE"
                )
            return
        with engine.begin() as connection:
            connection.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()


# ---------------------------------------------------------------------------
# The backlog


def list_user_slots(size: int) -> set[int]:
    step = size // LIST_USER_JOBS
    return {k * step + step // 2 for k in range(LIST_USER_JOBS)}


def backlog_key(i: int, list_slots: set[int]) -> Key:
    user = LIST_USER if i in list_slots else f"bench-user-{(i * 7919) % USERS:04d}"
    # Deterministic, spread pseudo-randomly: about 1 job in 100 is interactive.
    priority = INTERACTIVE if (i * 2_654_435_761) % 100 == 0 else PREFETCH
    return Key(user, KINDS[i % len(KINDS)], f"day-{i:07d}", f"fp-{i:07d}", priority)


def fill(url: str, size: int, vacuum: bool = False) -> list[Key]:
    """`size` pending jobs as `enqueue` would have made them, oldest first, plus 1% failed.

    Returns the pending jobs' keys, in the order they were queued.
    """
    engine = create_store_engine(url)
    if FRESH["value"] and engine.dialect.name == "postgresql":
        with engine.begin() as connection:
            for table in schema.metadata.sorted_tables:
                connection.exec_driver_sql(
                    f"ALTER TABLE {table.name} SET (autovacuum_enabled = false)"
                )
    slots = list_user_slots(size)
    keys = [backlog_key(i, slots) for i in range(size)]
    if ORDER["value"] == "fair":  # each user's prefetch jobs in turns 0, 1, 2...
        dealt: dict[str, int] = {}
        for i, key in enumerate(keys):
            if key.priority > INTERACTIVE:
                keys[i] = key._replace(turn=dealt.get(key.user_id, 0))
                dealt[key.user_id] = keys[i].turn + 1
    start = dt.datetime.now(dt.UTC) - SPREAD - dt.timedelta(hours=1)
    step = SPREAD / max(size, 1)
    failed = max(size // 100, 20)
    try:
        for first in range(0, size, INSERT_CHUNK):
            rows = []
            for i in range(first, min(first + INSERT_CHUNK, size)):
                key = keys[i]
                at = start + step * i
                rows.append(_row(key, Status.PENDING, at))
            with engine.begin() as connection:
                connection.execute(insert(schema.jobs), rows)
        rows = []
        for n in range(failed):
            key = Key(f"bench-user-{n % USERS:04d}", "failing", f"f-{n:07d}", "fp", PREFETCH)
            at = start + SPREAD * n / failed
            row = _row(key, Status.FAILED, at)
            row.update(attempts=3, error="the gateway said no", finished_at=at)
            rows.append(row)
        with engine.begin() as connection:
            connection.execute(insert(schema.jobs), rows)
            # A queue that has run for a while knows how long each kind takes.
            connection.execute(
                insert(schema.kind_durations),
                [
                    {"kind": kind, "mean_seconds": 20.0 + n, "samples": 50}
                    for n, kind in enumerate(KINDS)
                ],
            )
            # Each user's pseudonym, as their first `enqueue` gave them one.
            users = sorted({key.user_id for key in keys} | {r["user_id"] for r in rows})
            connection.execute(
                insert(schema.people),
                [
                    {"user_id": user, "pseudonym": f"p-bench-{n:08d}", "created_at": start}
                    for n, user in enumerate(users)
                ],
            )
    finally:
        engine.dispose()
    analyse(url, vacuum)
    return keys


def _row(key: Key, status: Status, at: dt.datetime) -> dict[str, Any]:
    return {
        "id": key.id,
        "user_id": key.user_id,
        "kind": key.kind,
        "subject": key.subject,
        "fingerprint": key.fingerprint,
        "priority": key.priority,
        "status": status.value,
        "attempts": 0,
        "queued_at": at,
        "created_at": at,
        "updated_at": at,
        "requested_at": at if key.priority <= INTERACTIVE else None,
        "revision": 0,
        "turn": key.turn,
    }


def queue_order(keys: Sequence[Key]) -> list[Key]:
    """The pending keys in the order the worker takes them (they were queued in list order)."""
    ranked = sorted(enumerate(keys), key=lambda item: (item[1].priority, item[1].turn, item[0]))
    return [key for _, key in ranked]


# ---------------------------------------------------------------------------
# Did anything write?


class WriteCounter:
    """A number that moves whenever anything is committed to the store's tables."""

    def __init__(self, url: str) -> None:
        parsed = make_url(url)
        self.is_sqlite = parsed.get_backend_name() == "sqlite"
        self._sqlite: sqlite3.Connection | None = None
        self._engine: Engine | None = None
        if self.is_sqlite:
            assert parsed.database is not None
            self._sqlite = sqlite3.connect(parsed.database)
        else:
            self._engine = create_engine(normalise_url(url), isolation_level="AUTOCOMMIT")

    def read(self) -> int:
        if self._sqlite is not None:
            # Changes when another connection commits to the file.
            return int(self._sqlite.execute("PRAGMA data_version").fetchone()[0])
        assert self._engine is not None
        with self._engine.connect() as connection:
            connection.exec_driver_sql("SELECT pg_stat_clear_snapshot()")
            value = connection.exec_driver_sql(
                "SELECT coalesce(sum(n_tup_ins + n_tup_upd + n_tup_del), 0)"
                " FROM pg_stat_user_tables"
            ).scalar_one()
        return int(value)

    def stable(self, interval: float = 0.3) -> int:
        """The counter once earlier writes (the fill, other phases) have all been reported."""
        if self.is_sqlite:
            return self.read()
        previous = self.read()
        for _ in range(50):
            time.sleep(interval)
            value = self.read()
            if value == previous:
                break
            previous = value
        return previous

    def settled(self, baseline: int, expected_delta: int, timeout: float = 10.0) -> int:
        """The counter once PostgreSQL's statistics have caught up (at least `expected_delta`).

        Backends report tuple counts in batches; the store was closed before this is
        called, so its backends flush when they exit. SQLite's counter is immediate.
        """
        if self.is_sqlite:
            return self.read()
        deadline = time.monotonic() + timeout
        value = self.read()
        while value - baseline < expected_delta and time.monotonic() < deadline:
            time.sleep(0.05)
            value = self.read()
        return self.stable()

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
        if self._engine is not None:
            self._engine.dispose()


def row_versions(url: str, ids: Sequence[str] | None = None) -> dict[str, tuple[Any, ...]]:
    """Each row's revision and updated time, and on PostgreSQL its tuple version and locker.

    `xmin` changes when the row is written, `xmax` when it is locked or deleted.
    Every row of the table if `ids` is None.
    """
    engine = create_store_engine(url)
    jobs = schema.jobs
    columns: list[Any] = [jobs.c.id, jobs.c.revision, jobs.c.updated_at, jobs.c.status]
    if engine.dialect.name == "postgresql":
        columns += [text("xmin::text"), text("xmax::text")]
    found: dict[str, tuple[Any, ...]] = {}
    try:
        with engine.connect() as connection:
            if ids is None:
                for row in connection.execute(select(*columns)):
                    found[row[0]] = tuple(row[1:])
            for first in range(0, len(ids or ()), 1000):
                chunk = list((ids or ())[first : first + 1000])
                for row in connection.execute(select(*columns).where(jobs.c.id.in_(chunk))):
                    found[row[0]] = tuple(row[1:])
    finally:
        engine.dispose()
    return found


# ---------------------------------------------------------------------------
# Backlog measurements


def poll(store: JobStore, key: Key) -> Status:
    return store.enqueue(key.user_id, key.kind, key.subject, key.fingerprint, key.priority)


def measure_noop_polls(
    url: str, keys: Sequence[Key], calls: int, control: Key, rng: random.Random
) -> tuple[list[float], bool, str]:
    sample = [rng.choice(keys) for _ in range(calls)]
    ids = sorted({key.id for key in sample})
    before_rows = row_versions(url, ids)
    counter = WriteCounter(url)
    try:
        store = open_store(url)
        try:
            for key in sample[:WARMUP_CALLS]:
                poll(store, key)
            baseline = counter.stable()
            times = []
            for key in sample:
                elapsed, status = timed(functools.partial(poll, store, key))
                if status != Status.PENDING:
                    raise RuntimeError(f"no-op poll returned {status!r}, expected pending")
                times.append(elapsed)
        finally:
            store.close()  # its backends report their counts when they exit
        after_polls = counter.stable()
        # One real write (a new fingerprint makes the job stale): the counter must see it.
        store = open_store(url)
        try:
            store.enqueue(
                control.user_id, control.kind, control.subject, "changed", control.priority
            )
            # ... and put it back, untimed, so the backlog stays as it was.
            poll(store, control)
        finally:
            store.close()
        after_control = counter.settled(after_polls, expected_delta=2)
    finally:
        counter.close()
    after_rows = row_versions(url, ids)

    rows_unchanged = before_rows == after_rows and len(after_rows) == len(ids)
    if counter.is_sqlite:
        counter_ok = after_polls == baseline and after_control != after_polls
        how = "PRAGMA data_version"
    else:
        counter_ok = after_polls == baseline and after_control - after_polls >= 2
        how = "pg_stat_user_tables ins+upd+del"
    check = (
        f"{len(ids)} polled rows' revision/updated_at{'' if counter.is_sqlite else '/xmin/xmax'} "
        f"{'unchanged' if rows_unchanged else 'CHANGED'}; {how}: "
        f"{'no write seen' if counter_ok else 'WRITES SEEN, or the control writes missed'}"
    )
    return times, rows_unchanged and counter_ok, check


def measure_claims(url: str, calls: int) -> list[float]:
    store = open_store(url)
    times = []
    try:
        for n in range(WARMUP_CALLS + calls):
            elapsed, claim = timed(lambda: store.claim_next("bench-worker"))
            if claim.job is None:
                raise RuntimeError(f"claim_next handed out nothing: {claim.blocked}")
            # Untimed: hand it back to its old place (attempt not spent).
            store.fail(claim.job.id, claim.job.holder, Failure.STOPPED, "handed back")
            if n >= WARMUP_CALLS:
                times.append(elapsed)
    finally:
        store.close()
    return times


def _position(store: JobStore, key: Key) -> Any:
    state = state_of(store, key.user_id, key.kind, key.subject)
    return state.position if state else None


def measure_positions(url: str, ordered: Sequence[Key], calls: int) -> list[float]:
    tail = [
        (len(ordered) - 1 - n, key)
        for n, key in enumerate(reversed(ordered))
        if key.user_id != LIST_USER
    ][:POSITION_TAIL]
    picks = itertools.cycle(tail)
    store = open_store(url)
    try:

        def ask() -> tuple[int, Any]:
            place, key = next(picks)
            return place, _position(store, key)

        def check(value: tuple[int, Any]) -> None:
            place, position = value
            if position is None or (position.ahead, position.ahead_exact) != shown(place):
                raise RuntimeError(f"state() gave {position}, expected {place} ahead")

        return sample_times(ask, calls, check)
    finally:
        store.close()


def shown(place: int) -> tuple[int, bool]:
    """A place as the store shows it: exact up to the bound, "more than" the bound beyond."""
    return (place, True) if place <= PLACE_BOUND else (PLACE_BOUND, False)


def measure_list_jobs(url: str, ordered: Sequence[Key], calls: int) -> list[float]:
    expected = [shown(place) for place, key in enumerate(ordered) if key.user_id == LIST_USER]
    store = open_store(url)
    try:

        def check(listed: list[ListedJob]) -> None:
            places = [(e.position.ahead, e.position.ahead_exact) for e in listed if e.position]
            if places != expected:
                raise RuntimeError("list_jobs gave other places than a count of the queue")

        return sample_times(lambda: store.list_jobs(LIST_USER), calls, check)
    finally:
        store.close()


def measure_queue_view(url: str, size: int, calls: int) -> list[float]:
    store = open_store(url)
    try:
        running = store.claim_next("bench-view")  # one call in flight, kept for the view
        if running.job is None:
            raise RuntimeError(f"claim_next handed out nothing: {running.blocked}")

        def check(view: Any) -> None:
            if (
                len(view.running) != 1
                or len(view.waiting) != 50
                or view.waiting_total != size - 1
                or not view.recent_failures
            ):
                raise RuntimeError("queue_view did not show the queue")

        times = sample_times(lambda: store.queue_view(limit=50), calls, check)
        store.fail(running.job.id, running.job.holder or "", Failure.STOPPED, "handed back")
        return times
    finally:
        store.close()


def measure_scrapes(url: str, calls: int) -> list[float]:
    """A /metrics scrape: the store's figures, rendered by the API's collector."""
    from prometheus_client import generate_latest

    from deployments.metrics import registry_for

    store = open_store(url)
    try:
        registry = registry_for(store)

        def check(body: Any) -> None:
            if b"insight_queue_waiting_jobs" not in body:
                raise RuntimeError("the scrape shows no waiting jobs")

        return sample_times(lambda: generate_latest(registry), calls, check)
    finally:
        store.close()


def poll_worker(
    url: str, keys: list[Key], seconds: float, seed: int, barrier: Barrier, out: Queue[Any]
) -> None:
    """One of the polling processes: no-op polls on random keys for `seconds`."""
    rng = random.Random(seed)
    store = open_store(url)
    try:
        for key in rng.sample(keys, min(WARMUP_CALLS, len(keys))):
            poll(store, key)
        barrier.wait(timeout=120)
        count = 0
        start = time.perf_counter()
        deadline = start + seconds
        while (now := time.perf_counter()) < deadline:
            poll(store, rng.choice(keys))
            count += 1
        out.put((count, now - start))
    finally:
        store.close()


def measure_parallel_polls(url: str, keys: list[Key], seconds: float, seed: int) -> float:
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(POLL_PROCESSES)
    out: Queue[Any] = context.Queue()
    processes = [
        context.Process(
            target=poll_worker, args=(url, keys, seconds, seed + n, barrier, out), daemon=True
        )
        for n in range(POLL_PROCESSES)
    ]
    for process in processes:
        process.start()
    try:
        results: list[tuple[int, float]] = [out.get(timeout=seconds + 120) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
    if any(process.exitcode != 0 for process in processes):
        raise RuntimeError("a polling process failed")
    return float(sum(count / elapsed for count, elapsed in results))


def run_backlog(backend: str, url: str, size: int, args: argparse.Namespace) -> BacklogRow:
    started = time.perf_counter()
    migrate.upgrade(url)
    keys = fill(url, size, args.vacuum)
    log(
        f"{backend} {ORDER['value']} {size:>7,}: backlog filled in "
        f"{time.perf_counter() - started:.1f} s"
    )
    ordered = queue_order(keys)
    rng = random.Random(args.seed + size)
    control = keys[0]
    pollable = [key for key in keys[1:] if key.user_id != LIST_USER]

    poll_ms, wrote_nothing, check = measure_noop_polls(url, pollable, args.calls, control, rng)
    claim_ms = measure_claims(url, args.calls)
    position_ms = measure_positions(url, ordered, args.calls)
    list_ms = measure_list_jobs(url, ordered, args.calls)
    view_ms = measure_queue_view(url, size, args.calls)
    scrape_ms = measure_scrapes(url, args.calls)
    polls_per_second = None
    if args.poll_seconds > 0:
        parallel_keys = rng.sample(pollable, min(2000, len(pollable)))
        before = row_versions(url, [key.id for key in parallel_keys])
        polls_per_second = measure_parallel_polls(url, parallel_keys, args.poll_seconds, args.seed)
        if row_versions(url, [key.id for key in parallel_keys]) != before:
            wrote_nothing = False
            check += "; 4-process polls CHANGED rows"
        else:
            check += f"; 4-process polls: {len(parallel_keys)} rows unchanged"
    row = BacklogRow(
        backend,
        ORDER["value"],
        size,
        poll_ms,
        wrote_nothing,
        check,
        claim_ms,
        position_ms,
        list_ms,
        view_ms,
        scrape_ms,
        polls_per_second,
    )
    log(format_backlog(row))
    if args.explain:
        print(f"\n===== statements and plans: {backend}, backlog {size:,} =====")
        explain_operations(url, ordered)
    return row


# ---------------------------------------------------------------------------
# Bulk measurements


def bulk_user(n: int) -> str:
    return f"bulk-user-{n:05d}"


def bulk_requests(users: int, day: str, changed: bool = False) -> list[EnqueueRequest]:
    """Every user's scopes for `day`; `changed`: one scope in BULK_CHANGED_EVERY has new data."""
    window = f"window-to-{day}"
    requests: list[EnqueueRequest] = []
    for u in range(users):
        user = bulk_user(u)
        scopes = [(kind, day, False) for kind in BULK_DATED_KINDS]
        scopes.append((BULK_SUPERSEDING_KIND, window, True))
        for kind, subject, supersede in scopes:
            fingerprint = f"fp-{user}-{kind}-{subject}"
            if changed and len(requests) % BULK_CHANGED_EVERY == 0:
                fingerprint += "-new"
            requests.append(
                EnqueueRequest(user, kind, subject, fingerprint, PREFETCH, supersede=supersede)
            )
    return requests


def by_user(requests: Sequence[EnqueueRequest]) -> list[list[EnqueueRequest]]:
    return [list(group) for _, group in itertools.groupby(requests, key=lambda r: r.user_id)]


def table_totals(url: str) -> dict[str, int]:
    engine = create_store_engine(url)
    try:
        with engine.connect() as connection:
            return {
                str(status): int(count)
                for status, count in connection.execute(
                    select(schema.jobs.c.status, text("count(*)")).group_by(schema.jobs.c.status)
                )
            }
    finally:
        engine.dispose()


def changes_between(
    before: dict[str, tuple[Any, ...]], after: dict[str, tuple[Any, ...]]
) -> tuple[set[str], set[str]]:
    """Ids whose revision moved, and ids whose row changed in any other way (time, xmin, xmax)."""
    revised = {
        i for i in before.keys() | after.keys() if before.get(i, ())[:1] != after.get(i, ())[:1]
    }
    touched = {i for i in before.keys() | after.keys() if before.get(i) != after.get(i)}
    return revised, touched - revised


def bulk_pass(
    url: str,
    name: str,
    calls: Sequence[Sequence[EnqueueRequest]],
    expect_written: set[str] | None,
) -> BulkStep:
    """Run `enqueue_many` once per entry of `calls`; check which rows were written.

    `expect_written`: ids that must be written (their revision moves by one) while every
    other row stays exactly as it was; None for a first pass (every job new).
    """
    jobs = sum(len(c) for c in calls)
    before = row_versions(url) if expect_written is not None else {}
    counter = WriteCounter(url)
    store = open_store(url)
    per_call: list[float] = []
    try:
        baseline = counter.stable()
        start = time.perf_counter()
        statuses: list[Status] = []
        for requests in calls:
            elapsed, got = timed(functools.partial(store.enqueue_many, requests))
            per_call.append(elapsed)
            statuses += got
        seconds = time.perf_counter() - start
    finally:
        store.close()
    expected_writes = jobs if expect_written is None else len(expect_written)
    after_count = counter.settled(baseline, expected_writes)
    counter.close()
    problems = []
    if any(status != Status.PENDING for status in statuses):
        problems.append("a status other than pending")
    totals = table_totals(url)
    if totals.get(Status.PENDING, 0) != jobs:
        problems.append(f"table holds {totals}, expected {jobs:,} pending")
    counted = after_count - baseline
    if expect_written is None:
        check = f"{jobs:,} inserted"
        if not counter.is_sqlite and counted != jobs:
            problems.append(f"pg_stat counted {counted:,} writes, expected {jobs:,}")
    else:
        after = row_versions(url)
        revised, otherwise = changes_between(before, after)
        if revised != expect_written:
            problems.append(f"{len(revised):,} rows revised, expected {len(expect_written):,}")
        if otherwise:
            problems.append(f"{len(otherwise):,} rows touched without a revision")
        if any(after[i][0] != before[i][0] + 1 for i in revised & after.keys() & before.keys()):
            problems.append("a revision moved by more than one")
        if counter.is_sqlite:
            counter_ok = (counted == 0) == (not expect_written)
            how = "data_version " + ("unchanged" if counted == 0 else "moved")
        else:
            counter_ok = counted == len(expect_written)
            how = f"pg_stat counted {counted:,} writes"
        if not counter_ok:
            problems.append(how)
        untouched = len(after.keys() - revised - otherwise)
        check = (
            f"{len(revised):,} rows written, {untouched:,} untouched "
            f"(revision/updated_at{'' if counter.is_sqlite else '/xmin/xmax'}); {how}"
        )
    if problems:
        check += "; PROBLEM: " + "; ".join(problems)
    step = BulkStep(name, jobs, seconds, check, not problems, per_call if len(calls) > 1 else None)
    log(f"  {name}: {seconds:.2f} s; {check}")
    return step


def mark_all_done(url: str) -> int:
    """Untimed: every job finished, as if the gateway had worked through the queue."""
    engine = create_store_engine(url)
    jobs = schema.jobs
    finished = dt.datetime.now(dt.UTC)
    try:
        with engine.begin() as connection:
            count = connection.execute(
                update(jobs).values(
                    status=Status.DONE,
                    attempts=1,
                    finished_at=finished,
                    updated_at=finished,
                    revision=jobs.c.revision + 1,
                )
            ).rowcount
    finally:
        engine.dispose()
    analyse(url)
    return int(count)


def requeue_step(url: str, name: str, kinds: list[str] | None, expected: int) -> BulkStep:
    store = open_store(url)
    try:
        start = time.perf_counter()
        queued = store.requeue(kinds)
        seconds = time.perf_counter() - start
    finally:
        store.close()
    totals = table_totals(url)
    ok = queued == expected and totals.get(Status.PENDING, 0) == expected
    check = f"{queued:,} queued again; table: {totals}"
    if not ok:
        check += f"; PROBLEM: expected {expected:,}"
    log(f"  {name}: {seconds:.2f} s; {check}")
    return BulkStep(name, expected, seconds, check, ok)


def per_call_step(url: str, count: int) -> BulkStep:
    requests = bulk_requests(max(count // 8, 1), "per-call")[:count]
    store = open_store(url)
    times = []
    try:
        for r in requests:
            elapsed, _ = timed(
                functools.partial(
                    store.enqueue, r.user_id, r.kind, r.subject, r.fingerprint, r.priority
                )
            )
            times.append(elapsed)
    finally:
        store.close()
    seconds = sum(times) / 1000.0
    check = f"{len(requests):,} new keys, one `enqueue` each"
    log(f"  per-call enqueue: {seconds:.2f} s; {check}")
    return BulkStep("per-call `enqueue`, new keys", len(requests), seconds, check, True, times)


def run_bulk(backend: str, args: argparse.Namespace) -> BulkRow:
    users = args.bulk_users
    steps: list[BulkStep] = []
    first = bulk_requests(users, "2026-06-01")
    second = bulk_requests(users, "2026-06-01", changed=True)
    changed_ids = {
        job_id(r.user_id, r.kind, r.subject)
        for r, old in zip(second, first, strict=True)
        if r.fingerprint != old.fingerprint
    }
    log(f"{backend}: bulk, {users:,} users × 8 scopes")
    with fresh_database(backend, args) as url:
        migrate.upgrade(url)
        steps.append(bulk_pass(url, "`enqueue_many`, one call: first pass", [first], None))
        analyse(url)
        steps.append(bulk_pass(url, "one call: second pass, 1% changed", [second], changed_ids))
        steps.append(bulk_pass(url, "one call: third pass, unchanged", [second], set()))
        kind_total = mark_all_done(url) // (len(BULK_DATED_KINDS) + 1)
        steps.append(
            requeue_step(
                url, f"`requeue(['{BULK_REQUEUE_KIND}'])`", [BULK_REQUEUE_KIND], kind_total
            )
        )
        mark_all_done(url)
        steps.append(requeue_step(url, "`requeue()`", None, len(first)))
    with fresh_database(backend, args) as url:
        migrate.upgrade(url)
        calls = by_user(first)
        steps.append(bulk_pass(url, "`enqueue_many` per user: first pass", calls, None))
        analyse(url)
        steps.append(bulk_pass(url, "per user: second pass, unchanged", calls, set()))
        if args.per_call > 0:
            steps.append(per_call_step(url, args.per_call))
    return BulkRow(backend, users, steps)


# ---------------------------------------------------------------------------
# --explain: the statements each operation runs, and the slowest ones' plans


def explain_operations(url: str, ordered: Sequence[Key]) -> None:
    store = open_store(url)
    engine: Engine = store._engine
    captured: list[tuple[str, Any, float]] = []
    started: list[float] = []

    def before(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        started.append(time.perf_counter())

    def after(_conn: Any, _cursor: Any, statement: str, parameters: Any, *_: Any) -> None:
        captured.append((statement, parameters, (time.perf_counter() - started.pop()) * 1000))

    event.listen(engine, "before_cursor_execute", before)
    event.listen(engine, "after_cursor_execute", after)

    last = next(key for key in reversed(ordered) if key.user_id != LIST_USER)
    middle = ordered[len(ordered) // 2]

    def claim_and_release() -> Any:
        claim = store.claim_next("bench-explain")
        if claim.job is None:
            raise RuntimeError(f"claim_next handed out nothing: {claim.blocked}")
        return claim

    operations: dict[str, Callable[[], Any]] = {
        "no-op poll": lambda: poll(store, middle),
        "claim_next": claim_and_release,
        "position (last in line)": lambda: _position(store, last),
        "list_jobs": lambda: store.list_jobs(LIST_USER),
        "queue_view": lambda: store.queue_view(limit=50),
    }
    is_sqlite = engine.dialect.name == "sqlite"
    try:
        for name, operation in operations.items():
            for _ in range(2):  # a warm-up call, then the one shown
                captured.clear()
                elapsed, value = timed(operation)
                shown = list(captured)
                if name == "claim_next":  # untimed: free the gateway slot again
                    store.fail(value.job.id, value.job.holder, Failure.STOPPED, "handed back")
            print(f"\n--- {name}: {elapsed:.2f} ms in all, {len(shown)} statements:")
            for statement, _parameters, ms in shown:
                print(f"  {ms:6.2f} ms  {' '.join(statement.split())[:110]}")
            slowest = sorted(shown, key=lambda item: -item[2])
            for statement, parameters, ms in slowest[:2]:
                if not statement.lstrip().upper().startswith(("SELECT", "WITH")):
                    continue
                print(f"\n[{ms:.2f} ms] {' '.join(statement.split())[:400]}")
                for line in plan(engine, statement, parameters, is_sqlite):
                    print(f"    {line}")
    finally:
        event.remove(engine, "before_cursor_execute", before)
        event.remove(engine, "after_cursor_execute", after)
        store.close()


def plan(engine: Engine, statement: str, parameters: Any, is_sqlite: bool) -> list[str]:
    raw = engine.raw_connection()
    try:
        cursor = raw.cursor()
        if is_sqlite:
            cursor.execute(f"EXPLAIN QUERY PLAN {statement}", parameters)
            return [str(row[-1]) for row in cursor.fetchall()]
        # ANALYZE runs the statement: inside a transaction that is rolled back.
        cursor.execute(f"EXPLAIN (ANALYZE, BUFFERS) {statement}", parameters)
        lines = [str(row[0]) for row in cursor.fetchall()]
        raw.rollback()
        return lines
    finally:
        raw.close()


# ---------------------------------------------------------------------------
# Report


def log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ms(samples: Sequence[float], digits: int = 2) -> str:
    return f"{median(samples):.{digits}f} / {percentile(samples, 0.95):.{digits}f}"


BACKLOG_HEADER = (
    "| order | backlog | no-op poll ms | wrote nothing | claim_next ms | place at the back ms "
    "| list_jobs ms | queue_view ms | scrape ms | polls/s, 4 procs |"
)
BACKLOG_RULE = "|---|---:|---:|:---:|---:|---:|---:|---:|---:|---:|"


def format_backlog(row: BacklogRow) -> str:
    polls = "–" if row.polls_per_second is None else f"{row.polls_per_second:,.0f}"
    return (
        f"| {row.order} | {row.backlog:,} | {ms(row.poll_ms, 3)} "
        f"| {'yes' if row.wrote_nothing else 'NO'} | {ms(row.claim_ms)} | {ms(row.position_ms)} "
        f"| {ms(row.list_ms)} | {ms(row.view_ms)} | {ms(row.scrape_ms)} | {polls} |"
    )


def format_bulk(step: BulkStep) -> str:
    rate = step.jobs / step.seconds if step.seconds else 0.0
    calls = "–" if step.per_call_ms is None else ms(step.per_call_ms)
    return (
        f"| {step.name} | {step.jobs:,} | {step.seconds:.2f} | {rate:,.0f} | {calls} "
        f"| {'yes' if step.ok else 'NO'} |"
    )


def verdict(samples: Sequence[float], target: float) -> str:
    value = percentile(samples, 0.95)
    return f"p95 {value:.2f} ms {'MET' if value < target else 'MISSED'}"


def report(
    backlogs: Sequence[BacklogRow], bulks: Sequence[BulkRow], args: argparse.Namespace
) -> None:
    print(
        f"\nBacklog: {args.calls} timed calls per operation after {WARMUP_CALLS} untimed; "
        "figures are median / p95 in ms. A place at the back: state() of one of the last "
        f"{POSITION_TAIL} jobs in line; list_jobs: a user with {LIST_USER_JOBS} pending jobs "
        "spread through the backlog; queue_view(limit=50) with one call in flight."
    )
    for backend in args.backends:
        rows = [row for row in backlogs if row.backend == backend]
        if rows:
            print(f"\n{backend}\n\n{BACKLOG_HEADER}\n{BACKLOG_RULE}")
            for row in rows:
                print(format_backlog(row))
    for bulk in bulks:
        print(
            f"\n{bulk.backend}, bulk: {bulk.users:,} users × 8 scopes "
            "(per-call column: median / p95 ms of each call)\n"
        )
        print("| step | jobs | seconds | jobs/s | per call ms | checks |")
        print("|---|---:|---:|---:|---:|:---:|")
        for step in bulk.steps:
            print(format_bulk(step))

    print("\nTargets:")
    largest = max((row.backlog for row in backlogs), default=0)
    for row in backlogs:
        if row.backlog != largest:
            continue
        print(
            f"- {row.backend} {row.order} {row.backlog:,}: no-op poll writes nothing: "
            f"{'MET' if row.wrote_nothing else 'MISSED'}, under {POLL_TARGET_MS:g} ms "
            f"{verdict(row.poll_ms, POLL_TARGET_MS)}; claim_next under {CLAIM_TARGET_MS:g} ms "
            f"{verdict(row.claim_ms, CLAIM_TARGET_MS)}; a place at the back under "
            f"{PLACE_TARGET_MS:g} ms {verdict(row.position_ms, PLACE_TARGET_MS)}; under "
            f"{READ_TARGET_MS:g} ms: list_jobs {verdict(row.list_ms, READ_TARGET_MS)}, "
            f"queue_view {verdict(row.view_ms, READ_TARGET_MS)}, "
            f"scrape {verdict(row.scrape_ms, READ_TARGET_MS)}"
        )
    for bulk in bulks:
        for step in bulk.steps:
            if step.per_call_ms is not None and "per-call" in step.name:
                whole = step.seconds / step.jobs * bulk.users * 8
                print(
                    f"- {bulk.backend}: per-call enqueue would take about {whole:.0f} s for "
                    f"{bulk.users * 8:,} jobs (the issue's figure for the original: "
                    f"{ORIGINAL_ENQUEUE_100K_S[bulk.backend]:g} s per 100k)"
                )
                continue
            print(
                f"- {bulk.backend}: {step.name}: {step.seconds:.2f} s "
                f"{'MET' if step.seconds < BULK_TARGET_S else 'MISSED'} "
                f"(under {BULK_TARGET_S:g} s); checks {'passed' if step.ok else 'FAILED'}"
            )
    print("\nWrite checks:")
    for row in backlogs:
        print(f"- {row.backend} {row.order} {row.backlog:,}: {row.write_check}")
    for bulk in bulks:
        for step in bulk.steps:
            print(f"- {bulk.backend} bulk, {step.name}: {step.check}")


def environment(args: argparse.Namespace) -> list[str]:
    lines = [
        f"date {dt.datetime.now(dt.UTC).isoformat(timespec='seconds')}",
        f"python {platform.python_version()}, SQLite {sqlite3.sqlite_version}, "
        f"{os.cpu_count()} cores",
    ]
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            timeout=10,
        ).stdout.strip()
        if commit:
            lines.append(f"commit {commit}")
    except OSError:
        pass
    if "postgresql" in args.backends:
        engine = create_engine(normalise_url(args.postgres_url))
        try:
            with engine.connect() as connection:
                version = connection.exec_driver_sql("SHOW server_version").scalar_one()
                settings = {
                    name: connection.exec_driver_sql(f"SHOW {name}").scalar_one()
                    for name in ("fsync", "synchronous_commit", "autovacuum", "shared_buffers")
                }
            lines.append(
                f"PostgreSQL {version} (" + ", ".join(f"{k} {v}" for k, v in settings.items()) + ")"
            )
        finally:
            engine.dispose()
    return lines


def load() -> str:
    return " ".join(f"{value:.2f}" for value in os.getloadavg())


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure the store's hot paths at large backlogs and its bulk enqueues.",
    )
    parser.add_argument(
        "--sizes",
        default="1000,10000,100000",
        help="comma-separated backlog sizes (pending jobs); default %(default)s; empty: none",
    )
    parser.add_argument(
        "--backends", default="sqlite,postgresql", help="comma-separated; default %(default)s"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL,
        help="server to create the benchmark databases on "
        "(default: $AI_JOB_TEST_POSTGRES_URL or %(default)s)",
    )
    parser.add_argument(
        "--orders", default="fair,fifo", help="claim orders to measure each backlog in"
    )
    parser.add_argument("--calls", type=int, default=200, help="timed calls per backlog operation")
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=3.0,
        help="length of the 4-process poll run; 0 skips it",
    )
    parser.add_argument(
        "--bulk-users", type=int, default=10_000, help="users in the bulk measures; 0 skips them"
    )
    parser.add_argument(
        "--per-call", type=int, default=2000, help="new keys queued one `enqueue` each; 0 skips"
    )
    parser.add_argument(
        "--vacuum",
        action="store_true",
        help="PostgreSQL: VACUUM ANALYZE the backlog instead of ANALYZE, as autovacuum "
        "(on by default) would soon after a bulk load: index-only scans then skip the table",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="neither ANALYZE nor VACUUM after the fill, and on PostgreSQL autovacuum off for "
        "the store's tables: what a screen meets right after a bulk backfill",
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed for the keys polled")
    parser.add_argument(
        "--explain",
        action="store_true",
        help="print every operation's statements and the slowest ones' plans",
    )
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    args.orders = [name.strip() for name in args.orders.split(",") if name.strip()]
    if set(args.orders) - {"fair", "fifo"}:
        parser.error("--orders takes fair and fifo")
    unknown = set(args.backends) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    if any(size < LIST_USER_JOBS * 2 for size in args.sizes):
        parser.error(f"every size must be at least {LIST_USER_JOBS * 2}")
    if args.calls < 1 or args.bulk_users < 0 or args.per_call < 0:
        parser.error("--calls must be at least 1, --bulk-users and --per-call at least 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    load_at_start = load()
    for line in environment(args):
        print(line)
    print(f"load average at start: {load_at_start}")
    if args.vacuum:
        print("backlogs: VACUUM ANALYZE on PostgreSQL (ANALYZE on SQLite)")
    FRESH["value"] = args.fresh
    if args.fresh:
        print("backlogs: fresh, as a bulk load leaves them (no ANALYZE, autovacuum off)")
    backlogs: list[BacklogRow] = []
    bulks: list[BulkRow] = []
    for backend in args.backends:
        for order in args.orders:
            ORDER["value"] = order
            for size in args.sizes:
                with fresh_database(backend, args) as url:
                    backlogs.append(run_backlog(backend, url, size, args))
        ORDER["value"] = "fair"
        if args.bulk_users:
            bulks.append(run_bulk(backend, args))
    report(backlogs, bulks, args)
    print(f"\nload average at end: {load()}")
    failed = any(not row.wrote_nothing for row in backlogs) or any(
        not step.ok for bulk in bulks for step in bulk.steps
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
