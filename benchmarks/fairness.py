"""How long each user waits for a first insight when many sync at once: fair against fifo.

`--users` users (default 100) each sync in turn, the same morning: a backfill
queues each user's `--scopes` scopes (default 8) in one `enqueue_many` call,
one user after the other. Then a worker takes every job in the order the
store hands them out (`claim_next`, each finished at once), and for every
user the script notes the call that brought its first insight, and its last.
It prints, for `AI_JOB_ORDER=fair` and `fifo`, on SQLite (and PostgreSQL with
`--backends sqlite,postgresql`): the worst and the median first insight, in
calls, and what that is in time at `--call-minutes` a call (default 2). A
screen opened during the backfill is taken next in both orders (checked).

Run from the repository root:

    .venv/bin/python benchmarks/fairness.py
    .venv/bin/python benchmarks/fairness.py --users 1000 --backends sqlite,postgresql
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections.abc import Sequence
from pathlib import Path

if not __package__:  # run as a script: the store benchmark's helpers are a sibling module
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.store import DEFAULT_POSTGRES_URL, postgres_database, sqlite_database
from queue_store import INTERACTIVE, EnqueueRequest, JobStore, Settings, migrate


def run(url: str, order: str, users: int, scopes: int) -> tuple[list[int], list[int], int]:
    """Every user's first and last insight, in calls; and the call that served a screen."""
    migrate.upgrade(url)
    settings = Settings(database_url=url, gap_seconds=0.0, order=order)
    with JobStore(url, settings=settings) as store:
        for u in range(users):
            user = f"user-{u:04d}"
            store.enqueue_many([EnqueueRequest(user, f"kind-{k}", "today") for k in range(scopes)])
        first: dict[str, int] = {}
        last: dict[str, int] = {}
        screen_at = -1
        call = 0
        while (claim := store.claim_next("bench")).job is not None:
            call += 1
            job = claim.job
            first.setdefault(job.user_id, call)
            last[job.user_id] = call
            if job.subject == "screen":
                screen_at = call
            store.finish(job.id, job.holder or "", result="x")
            if call == users:  # well into the backfill, a screen opens
                store.enqueue("user-0000", "screen", "screen", priority=INTERACTIVE)
    return sorted(first.values()), sorted(last.values()), screen_at - users


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=100)
    parser.add_argument("--scopes", type=int, default=8)
    parser.add_argument("--call-minutes", type=float, default=2.0)
    parser.add_argument("--backends", default="sqlite")
    parser.add_argument(
        "--postgres-url", default=os.environ.get("AI_JOB_TEST_POSTGRES_URL") or DEFAULT_POSTGRES_URL
    )
    args = parser.parse_args(argv)
    print(
        f"{args.users} users x {args.scopes} scopes, synced one after the other; "
        f"a call takes {args.call_minutes:g} min"
    )
    print("\n| backend | order | worst first insight | median first | worst last | screen taken |")
    print("|---|---|---:|---:|---:|---:|")
    for backend in args.backends.split(","):
        for order in ("fair", "fifo"):
            database = (
                sqlite_database() if backend == "sqlite" else postgres_database(args.postgres_url)
            )
            with database as url:
                first, last, screen = run(url, order, args.users, args.scopes)

            def shown(calls: float) -> str:
                hours = calls * args.call_minutes / 60
                return f"call {calls:,.0f} ({hours:.1f} h)"

            print(
                f"| {backend} | {order} | {shown(first[-1])} | {shown(statistics.median(first))} "
                f"| {shown(last[-1])} | {'next' if screen == 1 else f'after {screen} calls'} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
