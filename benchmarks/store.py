"""Benchmark of the SQL store's hot paths at large backlogs, on SQLite and PostgreSQL.

For each backend and each backlog size (default 1k, 10k and 100k pending jobs)
the script builds a fresh database (SQLite: a file in a temporary directory;
PostgreSQL: a database it creates next to the one in `--postgres-url` and drops
at the end), upgrades it with the store's migrations, fills the backlog with
bulk inserts (1000 users, ~1% INTERACTIVE, the rest PREFETCH, queue times
spread over 30 days), runs ANALYZE, and measures through `JobStore`:

- no-op poll: `enqueue` of an existing pending job with the same priority and
  fingerprint (what a waiting screen does every few seconds); median and p95,
  and a check that the polls wrote nothing: the polled rows' `revision` and
  `updated_at` (and `xmin` on PostgreSQL) are unchanged, and the database's
  write counter did not move (SQLite: `PRAGMA data_version` seen from another
  connection; PostgreSQL: inserted+updated+deleted tuples in
  `pg_stat_user_tables`). A single real write made afterwards must move the
  counter by exactly one, which proves the check can see a write;
- `claim_next` with gap 0 and concurrency 1; each claimed job is released
  (untimed) back to its place, so the backlog keeps its size and contents;
- `list_jobs(user)` for a user whose 60 pending jobs are spread evenly through
  the backlog (it computes every entry's place in line and ETA);
- no-op polls per second from 4 processes at once (spawned; each has its own
  `JobStore` and polls random existing keys for `--poll-seconds`).

The targets it prints beside the figures: `claim_next` under 5 ms at 100k
pending on both databases; a no-op poll writes nothing and costs under 1 ms.
The original single-file queue scanned every pending row to claim (about
670 ms at 100k on SQLite).

Run from the repository root (PostgreSQL needs CREATE DATABASE rights):

    .venv/bin/python benchmarks/store.py
    .venv/bin/python benchmarks/store.py --sizes 1000,10000 --backends sqlite --repeat 3
    .venv/bin/python benchmarks/store.py --explain   # also print the hot queries' plans

`--postgres-url` defaults to $AI_JOB_TEST_POSTGRES_URL, else
postgresql://postgres@127.0.0.1:5432/test.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import multiprocessing
import os
import random
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any, NamedTuple

from sqlalchemy import Engine, create_engine, event, insert, select, text
from sqlalchemy.engine import make_url

from queue_store import migrate, schema
from queue_store.engine import create_store_engine, normalise_url
from queue_store.models import INTERACTIVE, PREFETCH, Status, job_id
from queue_store.settings import Settings
from queue_store.store import JobStore

DEFAULT_POSTGRES_URL = "postgresql://postgres@127.0.0.1:5432/test"

USERS = 1000
KINDS = ("sleep", "activity", "heart", "nutrition", "mood", "weight", "glucose", "steps")
LIST_USER = "bench-list-user"
LIST_USER_JOBS = 60
INSERT_CHUNK = 10_000
SPREAD = dt.timedelta(days=30)
WARMUP_CALLS = 20
POLL_PROCESSES = 4

CLAIM_TARGET_MS = 5.0
POLL_TARGET_MS = 1.0
ORIGINAL_CLAIM_MS_100K_SQLITE = 670.0


class Key(NamedTuple):
    user_id: str
    kind: str
    subject: str
    fingerprint: str
    priority: int

    @property
    def id(self) -> str:
        return job_id(self.user_id, self.kind, self.subject)


@dataclasses.dataclass
class Row:
    backend: str
    backlog: int
    run: int
    poll_ms: list[float]
    wrote_nothing: bool
    write_check: str
    claim_ms: list[float]
    list_ms: list[float]
    polls_per_second: float


# ---------------------------------------------------------------------------
# Statistics and formatting


def median(samples: Sequence[float]) -> float:
    return statistics.median(samples)


def p95(samples: Sequence[float]) -> float:
    if len(samples) < 2:
        return samples[0]
    return statistics.quantiles(samples, n=20, method="inclusive")[18]


def timed(call: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    value = call()
    return (time.perf_counter() - start) * 1000.0, value


# ---------------------------------------------------------------------------
# Databases: one fresh database per (backend, backlog)


@contextmanager
def sqlite_database() -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="insight-queue-bench-") as directory:
        yield f"sqlite:///{Path(directory) / 'bench.db'}"


@contextmanager
def postgres_database(admin_url: str) -> Iterator[str]:
    url = normalise_url(admin_url)
    name = f"insight_queue_bench_{os.getpid()}"
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


def settings_for(url: str) -> Settings:
    # gap 0 and concurrency 1: every claim can succeed once the previous job is finished.
    return Settings(
        database_url=url,
        data_dir=Path(tempfile.gettempdir()),
        gap_seconds=0.0,
        concurrency=1,
    )


def open_store(url: str) -> JobStore:
    return JobStore(url, settings=settings_for(url))


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


def fill(url: str, size: int) -> list[Key]:
    """Insert `size` pending jobs as `enqueue` would have, oldest first; returns their keys."""
    engine = create_store_engine(url)
    slots = list_user_slots(size)
    keys = [backlog_key(i, slots) for i in range(size)]
    start = dt.datetime.now(dt.UTC) - SPREAD - dt.timedelta(hours=1)
    step = SPREAD / max(size, 1)
    try:
        for first in range(0, size, INSERT_CHUNK):
            rows = []
            for i in range(first, min(first + INSERT_CHUNK, size)):
                key = keys[i]
                at = start + step * i
                rows.append(
                    {
                        "id": key.id,
                        "user_id": key.user_id,
                        "kind": key.kind,
                        "subject": key.subject,
                        "fingerprint": key.fingerprint,
                        "priority": key.priority,
                        "status": Status.PENDING.value,
                        "attempts": 0,
                        "queued_at": at,
                        "created_at": at,
                        "updated_at": at,
                        "revision": 0,
                    }
                )
            with engine.begin() as connection:
                connection.execute(insert(schema.jobs), rows)
        with engine.begin() as connection:
            connection.exec_driver_sql("ANALYZE")
    finally:
        engine.dispose()
    return keys


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
        previous, value = self.read(), None
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
        deadline = time.monotonic() + timeout
        value = self.read()
        while not self.is_sqlite and value - baseline < expected_delta:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
            value = self.read()
        if not self.is_sqlite:
            time.sleep(0.5)  # anything else still on its way
            value = self.read()
        return value

    def close(self) -> None:
        if self._sqlite is not None:
            self._sqlite.close()
        if self._engine is not None:
            self._engine.dispose()


def row_versions(url: str, ids: Sequence[str]) -> dict[str, tuple[Any, ...]]:
    """Each row's revision and updated time (and xmin, its tuple version, on PostgreSQL)."""
    engine = create_store_engine(url)
    jobs = schema.jobs
    columns: list[Any] = [jobs.c.id, jobs.c.revision, jobs.c.updated_at, jobs.c.status]
    if engine.dialect.name == "postgresql":
        columns.append(text("xmin::text"))
    found: dict[str, tuple[Any, ...]] = {}
    try:
        with engine.connect() as connection:
            for first in range(0, len(ids), 1000):
                chunk = list(ids[first : first + 1000])
                for row in connection.execute(select(*columns).where(jobs.c.id.in_(chunk))):
                    found[row[0]] = tuple(row[1:])
    finally:
        engine.dispose()
    return found


# ---------------------------------------------------------------------------
# Measurements


def poll(store: JobStore, key: Key) -> str:
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
            after_polls = counter.read()
            # One real write (a new fingerprint makes the job stale): the counter must see it.
            store.enqueue(
                control.user_id, control.kind, control.subject, "changed", control.priority
            )
        finally:
            store.close()
        after_control = counter.settled(baseline, expected_delta=1)
    finally:
        counter.close()
    after_rows = row_versions(url, ids)

    rows_unchanged = before_rows == after_rows and len(after_rows) == len(ids)
    if counter.is_sqlite:
        counter_ok = after_polls == baseline and after_control != after_polls
        how = "PRAGMA data_version"
    else:
        counter_ok = after_control - baseline == 1
        how = "pg_stat_user_tables ins+upd+del"
    check = (
        f"{len(ids)} rows' revision/updated_at{'/xmin' if not counter.is_sqlite else ''} "
        f"{'unchanged' if rows_unchanged else 'CHANGED'}; {how}: "
        f"{'no write seen' if counter_ok else 'WRITES SEEN or control write missed'} "
        f"(control write seen: {'yes' if after_control != baseline else 'NO'})"
    )
    return times, rows_unchanged and counter_ok, check


def measure_claims(url: str, calls: int) -> list[float]:
    store = open_store(url)
    times = []
    try:
        for n in range(WARMUP_CALLS // 4 + calls):
            elapsed, claim = timed(lambda: store.claim_next("bench-worker"))
            if claim.job is None:
                raise RuntimeError(f"claim_next handed out nothing: {claim.blocked}")
            # Untimed: hand it back to its old place (attempt not spent), so the backlog,
            # the polled keys and the listed user stay as they were for the next round.
            store.release(claim.job.id, claim.job.holder)
            if n >= WARMUP_CALLS // 4:
                times.append(elapsed)
    finally:
        store.close()
    return times


def measure_list_jobs(url: str, calls: int) -> list[float]:
    store = open_store(url)
    times = []
    try:
        for n in range(WARMUP_CALLS // 4 + calls):
            elapsed, listed = timed(lambda: store.list_jobs(LIST_USER))
            if len(listed) != LIST_USER_JOBS or "ahead" not in listed[-1]:
                raise RuntimeError(f"list_jobs returned {len(listed)} entries")
            if n >= WARMUP_CALLS // 4:
                times.append(elapsed)
    finally:
        store.close()
    return times


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


# ---------------------------------------------------------------------------
# --explain: the statements each operation runs, and their plans


def explain_operations(url: str, keys: Sequence[Key]) -> None:
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

    def claim_and_finish() -> Any:
        claim = store.claim_next("bench-explain")
        if claim.job is None:
            raise RuntimeError(f"claim_next handed out nothing: {claim.blocked}")
        return claim

    operations: dict[str, Callable[[], Any]] = {
        "no-op poll": lambda: poll(store, keys[len(keys) // 2]),
        "claim_next": claim_and_finish,
        "list_jobs": lambda: store.list_jobs(LIST_USER),
    }
    is_sqlite = engine.dialect.name == "sqlite"
    try:
        for name, operation in operations.items():
            for _ in range(2):  # a warm-up call, then the one shown
                captured.clear()
                elapsed, value = timed(operation)
                shown = list(captured)
                if name == "claim_next":  # untimed: free the gateway slot for the next claim
                    store.finish(value.job.id, value.job.holder, result={"ok": True})
            print(f"\n--- {name}: {elapsed:.2f} ms in all, {len(shown)} statements:")
            for statement, _parameters, ms in shown:
                print(f"  {ms:6.2f} ms  {' '.join(statement.split())[:110]}")
            slowest = sorted(shown, key=lambda item: -item[2])
            for statement, parameters, ms in slowest[:3]:
                if not statement.lstrip().upper().startswith(("SELECT", "UPDATE", "DELETE")):
                    continue
                print(f"\n[{ms:.2f} ms] {' '.join(statement.split())}")
                print(f"params: {parameters}")
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


def run_backlog(backend: str, url: str, size: int, args: argparse.Namespace) -> list[Row]:
    started = time.perf_counter()
    migrate.upgrade(url)
    keys = fill(url, size)
    print(
        f"  {backend} {size:>7,}: backlog filled in {time.perf_counter() - started:.1f} s",
        file=sys.stderr,
    )
    rng = random.Random(args.seed + size)
    control = keys[0]
    pollable = [key for key in keys[1:] if key.user_id != LIST_USER]
    rows = []
    for run in range(1, args.repeat + 1):
        poll_ms, wrote_nothing, check = measure_noop_polls(
            url, pollable, args.poll_calls, control, rng
        )
        # The control write made `control` stale once; poll it back to its fingerprint.
        with open_store(url) as store:
            store.enqueue(
                control.user_id,
                control.kind,
                control.subject,
                control.fingerprint,
                control.priority,
            )
        list_ms = measure_list_jobs(url, args.list_calls)
        parallel_keys = rng.sample(pollable, min(2000, len(pollable)))
        parallel_before = row_versions(url, [key.id for key in parallel_keys])
        polls_per_second = measure_parallel_polls(
            url, parallel_keys, args.poll_seconds, args.seed + run
        )
        if row_versions(url, [key.id for key in parallel_keys]) != parallel_before:
            wrote_nothing = False
            check += "; 4-process polls CHANGED rows"
        else:
            check += f"; 4-process polls: {len(parallel_keys)} rows unchanged"
        claim_ms = measure_claims(url, args.claim_calls)
        row = Row(
            backend,
            size,
            run,
            poll_ms,
            wrote_nothing,
            check,
            claim_ms,
            list_ms,
            polls_per_second,
        )
        print(f"  {format_row(row)}", file=sys.stderr)
        rows.append(row)
    if args.explain:
        print(f"\n===== query plans: {backend}, backlog {size:,} =====")
        explain_operations(url, pollable)
    return rows


HEADER = (
    "| backend | backlog | run | no-op poll median / p95 ms | wrote nothing "
    "| claim_next median / p95 ms | list_jobs median / p95 ms | polls/s, 4 procs |"
)
RULE = "|---|---:|---:|---:|:---:|---:|---:|---:|"


def format_row(row: Row) -> str:
    return (
        f"| {row.backend} | {row.backlog:,} | {row.run} "
        f"| {median(row.poll_ms):.3f} / {p95(row.poll_ms):.3f} "
        f"| {'yes' if row.wrote_nothing else 'NO'} "
        f"| {median(row.claim_ms):.2f} / {p95(row.claim_ms):.2f} "
        f"| {median(row.list_ms):.2f} / {p95(row.list_ms):.2f} "
        f"| {row.polls_per_second:,.0f} |"
    )


def met(samples: Sequence[float], target_ms: float) -> str:
    """Whether the median and the p95 are under the target."""
    return (
        f"median {median(samples):.3f} ms {'MET' if median(samples) < target_ms else 'MISSED'}, "
        f"p95 {p95(samples):.3f} ms {'MET' if p95(samples) < target_ms else 'MISSED'}"
    )


def verdicts(rows: Sequence[Row]) -> list[str]:
    lines = []
    largest = max(row.backlog for row in rows)
    for row in rows:
        line = (
            f"- {row.backend} {row.backlog:,} (run {row.run}): no-op poll writes nothing: "
            f"{'MET' if row.wrote_nothing else 'MISSED'}; under {POLL_TARGET_MS:g} ms: "
            f"{met(row.poll_ms, POLL_TARGET_MS)}"
        )
        if row.backlog == largest:
            line += (
                f"; claim_next under {CLAIM_TARGET_MS:g} ms: {met(row.claim_ms, CLAIM_TARGET_MS)}"
            )
        lines.append(line)
    return lines


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Measure the store's no-op poll, claim_next and list_jobs at large backlogs.",
    )
    parser.add_argument(
        "--sizes",
        default="1000,10000,100000",
        help="comma-separated backlog sizes (pending jobs); default %(default)s",
    )
    parser.add_argument(
        "--backends", default="sqlite,postgresql", help="comma-separated; default %(default)s"
    )
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL,
        help="server to create the benchmark database on "
        "(default: $AI_JOB_TEST_POSTGRES_URL or %(default)s)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="measurement rounds per backlog; one row each"
    )
    parser.add_argument("--poll-calls", type=int, default=500, help="no-op polls timed")
    parser.add_argument("--claim-calls", type=int, default=200, help="claims timed")
    parser.add_argument("--list-calls", type=int, default=100, help="list_jobs calls timed")
    parser.add_argument(
        "--poll-seconds", type=float, default=3.0, help="length of the 4-process poll run"
    )
    parser.add_argument("--seed", type=int, default=1, help="random seed for the keys polled")
    parser.add_argument(
        "--explain", action="store_true", help="print the plans of each operation's slowest queries"
    )
    args = parser.parse_args(argv)
    args.sizes = [int(size) for size in args.sizes.split(",") if size.strip()]
    args.backends = [name.strip() for name in args.backends.split(",") if name.strip()]
    unknown = set(args.backends) - {"sqlite", "postgresql"}
    if unknown:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    if any(size < LIST_USER_JOBS * 2 for size in args.sizes):
        parser.error(f"every size must be at least {LIST_USER_JOBS * 2}")
    if args.repeat < 1 or args.poll_calls < 1 or args.claim_calls < 1 or args.list_calls < 1:
        parser.error("--repeat and the call counts must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows: list[Row] = []
    for backend in args.backends:
        for size in args.sizes:
            database = (
                sqlite_database() if backend == "sqlite" else postgres_database(args.postgres_url)
            )
            with database as url:
                rows.extend(run_backlog(backend, url, size, args))

    print(
        f"\nno-op poll: {args.poll_calls} calls; claim_next: {args.claim_calls} claims "
        f"(gap 0, concurrency 1, each released untimed); list_jobs: {args.list_calls} "
        f"calls for a user with {LIST_USER_JOBS} pending jobs spread through the backlog; "
        f"polls/s: {POLL_PROCESSES} spawned processes for {args.poll_seconds:g} s.\n"
    )
    print(HEADER)
    print(RULE)
    for row in rows:
        print(format_row(row))
    print(
        f"\nTargets: claim_next under {CLAIM_TARGET_MS:g} ms at 100k pending on both databases; "
        f"a no-op poll writes nothing and costs under {POLL_TARGET_MS:g} ms. "
        f"Reference: the original queue's claim scanned every pending row, "
        f"about {ORIGINAL_CLAIM_MS_100K_SQLITE:g} ms at 100k on SQLite."
    )
    print("\n".join(verdicts(rows)))
    print("\nWrite checks:")
    for row in rows:
        print(f"- {row.backend} {row.backlog:,} (run {row.run}): {row.write_check}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
