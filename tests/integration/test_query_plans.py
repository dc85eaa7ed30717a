"""The hot queries use indexes however large the backlog, once the database has statistics.

With every row pending, `ANALYZE` tells SQLite that `status = ?` matches the
whole table; without the partial index on running rows it would then scan
the queue on every claim. Places in line are read from the head of the queue
index (`ix_ai_jobs_queue`, which ends in the id that breaks ties of age), at
most `PLACE_BOUND + 1` entries of it: from that index alone, never by scanning
or sorting the table.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
from sqlalchemy import Engine, event, insert, text

from queue_store import EnqueueRequest, JobStore, job_id, migrate
from queue_store.places import PLACE_BOUND
from queue_store.schema import jobs
from tests.support.factories import settings_for, store_for
from tests.support.reads import engine_of, listed_jobs, state_of

BACKLOG = 5000
LISTED_USER = "listed"
LISTED_EVERY = 125  # the listed user's jobs are spread through the backlog


def _backlog(store: JobStore, *, analyse: bool = True) -> None:
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = []
    for n in range(BACKLOG):
        user = LISTED_USER if n % LISTED_EVERY == LISTED_EVERY // 2 else f"u{n % 50}"
        rows.append(
            {
                "id": job_id(user, "k", str(n)),
                "user_id": user,
                "kind": "k",
                "subject": str(n),
                "priority": 10,
                "status": "pending",
                "attempts": 0,
                "queued_at": start + dt.timedelta(seconds=n),
                "created_at": start,
                "updated_at": start,
                "revision": 0,
            }
        )
    with engine_of(store).begin() as connection:
        connection.execute(insert(jobs), rows)
        if analyse:
            connection.execute(text("ANALYZE"))


def _statements(engine: Engine, call: Callable[[], Any]) -> list[tuple[str, Any]]:
    """The SELECT and UPDATE statements `call` runs, with their parameters."""
    seen: list[tuple[str, Any]] = []

    def record(
        conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, executemany: bool
    ) -> None:
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE")):
            seen.append((statement, parameters))

    event.listen(engine, "before_cursor_execute", record)
    try:
        call()
    finally:
        event.remove(engine, "before_cursor_execute", record)
    return seen


def _plan(engine: Engine, statement: str, parameters: Any) -> str:
    with engine.connect() as connection:
        if engine.dialect.name == "sqlite":
            rows = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters)
            return "\n".join(str(row[-1]) for row in rows)
        rows = connection.exec_driver_sql(f"EXPLAIN {statement}", parameters)
        return "\n".join(str(row[0]) for row in rows)


def _scans_the_table(plan: str) -> bool:
    """Whether the plan reads ai_jobs other than through an index."""
    return "Seq Scan on ai_jobs" in plan or any(
        line.strip().startswith("SCAN ai_jobs") and "INDEX" not in line
        for line in plan.splitlines()
    )


def _sorts(plan: str) -> bool:
    return "TEMP B-TREE" in plan or "Sort Key" in plan


def _reads_only_the_queue_index(plan: str, index: str) -> bool:
    """Whether every read of ai_jobs is a range of this queue index that never visits the table."""
    reads = [
        line.strip()
        for line in plan.splitlines()
        if ("Scan" in line and " on ai_jobs" in line)
        or line.strip().startswith(("SEARCH ai_jobs", "SCAN ai_jobs"))
    ]
    return bool(reads) and all(
        f"Index Only Scan using {index} " in line or f"USING COVERING INDEX {index} " in line
        for line in reads
    )


# Each order reads the queue index in its own order.
INDEX = {"fair": "ix_ai_jobs_fair", "fifo": "ix_ai_jobs_queue"}


@pytest.fixture(params=list(INDEX))
def order(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def analysed_store(database_url: str, order: Literal["fair", "fifo"]) -> Iterator[JobStore]:
    settings = settings_for(database_url=database_url, order=order)
    store = store_for(settings)
    _backlog(store)
    yield store
    store.close()


def test_liveness_and_claim_queries_use_indexes_on_a_large_analysed_backlog(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    migrate.upgrade(url)
    store = store_for(settings_for(url))
    _backlog(store)

    statements = _statements(engine_of(store), lambda: store.claim_next("w"))

    for statement, parameters in statements:
        details = _plan(engine_of(store), statement, parameters)
        assert "SCAN ai_jobs" not in details.replace("SCAN ai_jobs USING", ""), (
            statement,
            details,
        )
    store.close()


def test_places_in_line_are_read_from_the_head_of_the_queue_index(
    analysed_store: JobStore, order: str
) -> None:
    store = analysed_store
    listed: list[dict[str, Any]] = []
    statements = _statements(
        engine_of(store), lambda: listed.extend(listed_jobs(store, LISTED_USER))
    )
    places = [n for n in range(BACKLOG) if n % LISTED_EVERY == LISTED_EVERY // 2]
    # Exact up to the bound; beyond it, "more than" the bound.
    assert [(e["ahead"], e["ahead_exact"]) for e in listed] == [
        (min(n, PLACE_BOUND), n <= PLACE_BOUND) for n in places
    ]

    heads = [
        (s, p) for s, p in statements if s.startswith("SELECT ai_jobs.id, ai_jobs.kind \nFROM")
    ]
    assert len(heads) == 1  # one statement for every place
    plan = _plan(engine_of(store), *heads[0])
    assert _reads_only_the_queue_index(plan, INDEX[order]), plan
    assert not _sorts(plan), plan


def test_one_place_at_the_back_reads_a_bounded_stretch_of_the_queue_index(
    analysed_store: JobStore, order: str
) -> None:
    store = analysed_store
    last = BACKLOG - 1
    found: list[Any] = []
    statements = _statements(
        engine_of(store), lambda: found.append(state_of(store, f"u{last % 50}", "k", str(last)))
    )
    state = found[0]
    assert state is not None and state.position is not None
    assert (state.position.ahead, state.position.ahead_exact) == (PLACE_BOUND, False)
    counts = [(s, p) for s, p in statements if "count(*)" in s and "LIMIT" in s]
    assert len(counts) == 1
    plan = _plan(engine_of(store), *counts[0])
    assert _reads_only_the_queue_index(plan, INDEX[order]), plan


def test_the_queue_view_reads_the_head_of_the_queue_in_index_order(
    analysed_store: JobStore, order: str
) -> None:
    store = analysed_store
    statements = _statements(engine_of(store), lambda: store.queue_view(limit=50))

    heads = [(s, p) for s, p in statements if "ORDER BY ai_jobs.priority" in s and "LIMIT" in s]
    assert len(heads) == 1
    plan = _plan(engine_of(store), *heads[0])
    assert INDEX[order] in plan, plan
    assert not _scans_the_table(plan), plan
    assert not _sorts(plan), plan


@pytest.mark.parametrize("analyse", [False, True], ids=["fresh", "analysed"])
def test_a_new_jobs_turn_is_read_from_its_users_entries_alone(
    database_url: str, analyse: bool
) -> None:
    """R8b: a backfill's turn is after its user's last waiting job. Before any ANALYZE (a
    bulk load into a new table) that read must not walk the fair index through the backlog."""
    settings = settings_for(database_url=database_url, order="fair")
    with store_for(settings) as store:
        _backlog(store, analyse=analyse)
        # A chunk's worth of users: the listed one, with jobs waiting, and new ones.
        users = [LISTED_USER, *(f"new-{n}" for n in range(60))]
        requests = [EnqueueRequest(user, "k", "new", priority=10) for user in users]
        one = _statements(
            engine_of(store), lambda: store.enqueue(LISTED_USER, "k", "1", priority=10)
        )
        many = _statements(engine_of(store), lambda: store.enqueue_many(requests))

        for statements in (one, many):
            turns = [(s, p) for s, p in statements if "max(CASE" in s]
            assert len(turns) == 1, [s for s, _ in statements]
            plan = _plan(engine_of(store), *turns[0])
            assert "ix_ai_jobs_user" in plan, plan
            assert "ix_ai_jobs_fair" not in plan and not _scans_the_table(plan), plan
