"""The claim's queries use indexes however large the backlog, once SQLite has statistics.

With every row pending, `ANALYZE` tells SQLite that `status = ?` matches the
whole table; without the partial index on running rows it would then scan
the queue on every claim.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path
from typing import Any

from sqlalchemy import insert, text

from queue_store import JobStore, Settings, job_id, migrate
from queue_store.schema import jobs

BACKLOG = 5000


def test_liveness_and_claim_queries_use_indexes_on_a_large_analysed_backlog(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    migrate.upgrade(url)
    store = JobStore(url, settings=Settings(database_url=url, gap_seconds=0))
    start = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    rows = [
        {
            "id": job_id(f"u{n % 50}", "k", str(n)),
            "user_id": f"u{n % 50}",
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
        for n in range(BACKLOG)
    ]
    with store._engine.begin() as connection:
        connection.execute(insert(jobs), rows)
        connection.execute(text("ANALYZE"))

    statements: list[tuple[str, Any]] = []

    def record(conn, cursor, statement, parameters, context, executemany):
        if statement.lstrip().upper().startswith(("SELECT", "UPDATE")):
            statements.append((statement, parameters))

    from sqlalchemy import event

    event.listen(store._engine, "before_cursor_execute", record)
    assert store.claim_next("w").job is not None
    event.remove(store._engine, "before_cursor_execute", record)

    with store._engine.connect() as connection:
        for statement, parameters in statements:
            plan = connection.exec_driver_sql(f"EXPLAIN QUERY PLAN {statement}", parameters).all()
            details = " | ".join(str(row[-1]) for row in plan)
            assert "SCAN ai_jobs" not in details.replace("SCAN ai_jobs USING", ""), (
                statement,
                details,
            )
    store.close()
