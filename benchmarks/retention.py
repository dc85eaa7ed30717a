"""A year of daily syncs under retention (D2): what the store holds at the end, and prune's cost.

`--users` users (1,000) sync once a day for `--days` days (365); each sync leaves one job per
dated scope (8) finished, as a consumer leaves it: done with its result (`--result-bytes` of
text) and the day's token usage per user and kind, or, one in a hundred, failed with its error.
The rows are written straight into the tables (a year of gateway calls is not the point here);
then the store's own `prune()` runs with the store's clock at the end of that day, and is
timed. Retention is `--retention-days` (90).

Printed: the rows of each table and the database's size at the end (SQLite: the file and its
write-ahead log, and the free pages that prune left for new rows to reuse; PostgreSQL: the
tables with their indexes and TOAST, autovacuum on as by default), and prune's seconds per day
of data once something is past retention: median, p95 and the worst day.

    .venv/bin/python benchmarks/retention.py                       # both databases
    .venv/bin/python benchmarks/retention.py --backends sqlite --users 100 --days 120
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import time
from pathlib import Path
from typing import Any

from sqlalchemy import func, insert, select, text

if not __package__:  # run as a script: the shared helpers are in this folder's package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.figures import percentile
from benchmarks.store import DEFAULT_POSTGRES_URL, data_dir_for, fresh_database
from queue_store import JobStore, Settings, migrate, schema
from queue_store.engine import create_store_engine
from queue_store.models import PREFETCH, Status, job_id

KINDS = ("sleep", "activity", "heart", "nutrition", "mood", "weight", "glucose", "steps")
START = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
FAILED_EVERY = 100
TABLES = ("ai_jobs", "ai_job_results", "ai_job_usage_days", "ai_job_people")


class DayClock:
    """The store's clock: the end of the day being simulated, a microsecond on per reading."""

    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> dt.datetime:
        self.now += dt.timedelta(microseconds=1)
        return self.now

    def end_of(self, day: int) -> None:
        self.now = START + dt.timedelta(days=day + 1) - dt.timedelta(minutes=1)


def day_rows(day: int, users: int, result_bytes: int) -> dict[str, list[dict[str, Any]]]:
    """One day's syncs as the consumer leaves them: jobs, results, usage."""
    subject = (START + dt.timedelta(days=day)).date().isoformat()
    jobs: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    usage: list[dict[str, Any]] = []
    text_body = "x" * result_bytes
    for n in range(users):
        user = f"user-{n:05d}"
        for k, kind in enumerate(KINDS):
            queued = START + dt.timedelta(days=day, hours=2, seconds=n * 8 + k)
            finished = queued + dt.timedelta(minutes=5)
            key = job_id(user, kind, subject)
            failed = (n * len(KINDS) + k + day) % FAILED_EVERY == 0
            jobs.append(
                {
                    "id": key,
                    "user_id": user,
                    "kind": kind,
                    "subject": subject,
                    "fingerprint": f"fp-{day}",
                    "priority": PREFETCH,
                    "status": (Status.FAILED if failed else Status.DONE).value,
                    "attempts": 3 if failed else 1,
                    "error": "the gateway said no" if failed else None,
                    "queued_at": queued,
                    "created_at": queued,
                    "updated_at": finished,
                    "finished_at": finished,
                    "revision": 2,
                }
            )
            if failed:
                continue
            results.append(
                {
                    "job_id": key,
                    "user_id": user,
                    "kind": kind,
                    "subject": subject,
                    "fingerprint": f"fp-{day}",
                    "output": {"text": text_body},
                    "produced_at": finished,
                    "duration_seconds": 60.0,
                    "size_bytes": result_bytes,
                    "prompt_tokens": 900,
                    "completion_tokens": 250,
                }
            )
            usage.append(
                {
                    "day": finished.date(),
                    "user_id": user,
                    "kind": kind,
                    "answers": 1,
                    "unknown": 0,
                    "prompt_tokens": 900,
                    "completion_tokens": 250,
                }
            )
    return {"ai_jobs": jobs, "ai_job_results": results, "ai_job_usage_days": usage}


def people_rows(users: int) -> list[dict[str, Any]]:
    return [
        {"user_id": f"user-{n:05d}", "pseudonym": f"p{n:039d}", "created_at": START}
        for n in range(users)
    ]


def counts(store_url: str) -> dict[str, int]:
    engine = create_store_engine(store_url)
    try:
        with engine.connect() as connection:
            return {
                name: int(
                    connection.execute(
                        select(func.count()).select_from(schema.metadata.tables[name])
                    ).scalar_one()
                )
                for name in TABLES
            }
    finally:
        engine.dispose()


def size_report(store_url: str) -> str:
    engine = create_store_engine(store_url)
    try:
        with engine.connect() as connection:
            if engine.dialect.name == "sqlite":
                path = Path(str(engine.url.database))
                wal = path.with_name(path.name + "-wal")
                page = connection.exec_driver_sql("PRAGMA page_size").scalar_one()
                free = connection.exec_driver_sql("PRAGMA freelist_count").scalar_one()
                wal_bytes = wal.stat().st_size if wal.exists() else 0
                return (
                    f"file {path.stat().st_size / 2**20:.0f} MiB + WAL {wal_bytes / 2**20:.0f}"
                    f" MiB, of which free pages {free * page / 2**20:.0f} MiB"
                )
            total = sum(
                connection.execute(
                    text("SELECT pg_total_relation_size(CAST(:t AS regclass))"), {"t": name}
                ).scalar_one()
                for name in TABLES
            )
            return f"tables with indexes {total / 2**20:.0f} MiB"
    finally:
        engine.dispose()


def run(backend: str, args: argparse.Namespace) -> None:
    with fresh_database(backend, args) as url:
        migrate.upgrade(url)  # a new PostgreSQL database is not upgraded by the store itself
        clock = DayClock()
        settings = Settings(
            database_url=url, data_dir=data_dir_for(url), retention_days=args.retention_days
        )
        store = JobStore(url, settings=settings, clock=clock)
        writer = create_store_engine(url)
        prune_seconds: list[tuple[int, float]] = []
        deleted = 0
        started = time.perf_counter()
        try:
            with writer.begin() as connection:
                connection.execute(insert(schema.people), people_rows(args.users))
            for day in range(args.days):
                rows = day_rows(day, args.users, args.result_bytes)
                with writer.begin() as connection:
                    for name, batch in rows.items():
                        if batch:
                            connection.execute(insert(schema.metadata.tables[name]), batch)
                clock.end_of(day)
                began = time.perf_counter()
                pruned = store.prune()
                took = time.perf_counter() - began
                if pruned.jobs:
                    prune_seconds.append((day, took))
                    deleted += pruned.jobs
                if day % 30 == 29 or day == args.days - 1:
                    print(
                        f"  [{backend}] day {day + 1}: prune {took:.2f} s, "
                        f"{pruned.jobs} jobs and {pruned.results} results deleted, "
                        f"{pruned.usage_rows} usage rows folded "
                        f"({time.perf_counter() - started:.0f} s so far)",
                        flush=True,
                    )
        finally:
            writer.dispose()
            store.close()
        found = counts(url)
        seconds = [s for _, s in prune_seconds]
        worst_day, worst = max(prune_seconds, key=lambda item: item[1], default=(0, 0.0))
        print(f"\n{backend}: {args.users} users x {len(KINDS)} scopes x {args.days} days")
        print(f"  rows at the end: {', '.join(f'{t} {n:,}' for t, n in found.items())}")
        print(f"  size at the end: {size_report(url)}")
        if seconds:
            print(
                f"  prune per day of data ({len(seconds)} days with something past "
                f"retention, {deleted:,} jobs deleted): median {percentile(seconds, 0.5):.2f} s,"
                f" p95 {percentile(seconds, 0.95):.2f} s, worst {worst:.2f} s (day {worst_day + 1})"
            )
        print(f"  whole run {time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", default="sqlite,postgresql")
    parser.add_argument("--users", type=int, default=1000)
    parser.add_argument("--days", type=int, default=365)
    parser.add_argument("--retention-days", type=float, default=90.0)
    parser.add_argument("--result-bytes", type=int, default=800, help="an insight's text")
    parser.add_argument("--postgres-url", default=DEFAULT_POSTGRES_URL)
    args = parser.parse_args()
    for backend in [b.strip() for b in args.backends.split(",") if b.strip()]:
        run(backend, args)


if __name__ == "__main__":
    main()
