"""N5: adopting the original queue's `ai_jobs` table in place, on both backends.

The original wrote its own table: ids and text as TEXT, priority and attempts
as INTEGER, times as naive-UTC ISO text from `datetime.isoformat(timespec=
"seconds")`. `queue_store.migrate.upgrade` must keep every row and make them
behave under the new rules as they would have: priority then age, the dead
claim of a process that is gone, fingerprints, the failed cooldown.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, inspect, text

from queue_store import (
    INTERACTIVE,
    PREFETCH,
    JobStore,
    SchemaConflict,
    SchemaOutdated,
    Status,
    job_id,
    migrate,
    models,
)
from queue_store.engine import create_store_engine
from queue_store.rules import WORKER_LOST
from queue_store.schema import SCHEMA_REVISION
from tests.support.databases import FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import dump_tables
from tests.support.reads import listed_jobs, pending

ORIGINAL_DDL = """
CREATE TABLE ai_jobs (
    id TEXT PRIMARY KEY,
    user_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    subject TEXT NOT NULL,
    fingerprint TEXT,
    priority INTEGER NOT NULL DEFAULT 10,
    status TEXT NOT NULL DEFAULT 'pending',
    attempts INTEGER NOT NULL DEFAULT 0,
    error TEXT,
    holder TEXT,
    claimed_at TEXT,
    created_at TEXT,
    updated_at TEXT
)
"""
ORIGINAL_INDEX = "CREATE INDEX idx_ai_jobs_queue ON ai_jobs (status, priority, created_at)"

COLUMNS = [
    "id",
    "user_id",
    "kind",
    "subject",
    "fingerprint",
    "priority",
    "status",
    "attempts",
    "error",
    "holder",
    "claimed_at",
    "created_at",
    "updated_at",
]

U = "user-42"
OTHER = "user-7"
# The FakeClock's start: the moment the new code first runs against the old rows.
NOW = dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.UTC)


def iso(hour: int, minute: int = 0, second: int = 0) -> str:
    """A time on the day of the test as the original wrote it: naive UTC, 'T', seconds."""
    return dt.datetime(2026, 1, 5, hour, minute, second).isoformat(timespec="seconds")


@dataclasses.dataclass(frozen=True)
class Old:
    """One row the original left in its table."""

    user_id: str
    kind: str
    subject: str
    status: str
    priority: int
    attempts: int
    created_at: str
    updated_at: str
    fingerprint: str | None = None
    error: str | None = None
    holder: str | None = None
    claimed_at: str | None = None

    @property
    def id(self) -> str:
        return job_id(self.user_id, self.kind, self.subject)

    def values(self) -> dict[str, Any]:
        return {"id": self.id, **dataclasses.asdict(self)}


PREFETCH_OLDEST = Old(U, "sleep", "2026-01-01", "pending", PREFETCH, 0, iso(6), iso(6), "fp-a")
PREFETCH_NEWER = Old(U, "sleep", "2026-01-02", "pending", PREFETCH, 1, iso(7), iso(7, 30), "fp-b",
                     error="TimeoutError: read timed out")  # fmt: skip
INTERACTIVE_NEWEST = Old(U, "trends", "week", "pending", INTERACTIVE, 0, iso(8), iso(8, 55))
# Claimed ten minutes ago by a process that is gone: far past the 60 s lease,
# well inside the original's 1800 s claim timeout.
RUNNING_OLD = Old(U, "hrv", "2026-01-03", "running", PREFETCH, 1, iso(5), iso(8, 50), "fp-r",
                  holder="4242-139872", claimed_at=iso(8, 50))  # fmt: skip
DONE = Old(U, "sleep", "2025-12-31", "done", PREFETCH, 1, iso(4), iso(8, 10), "fp-done")
# Given up at 08:45: the 1800 s cooldown runs until 09:15.
FAILED = Old(U, "stress", "2026-01-04", "failed", PREFETCH, 3, iso(3), iso(8, 45), "fp-failed",
             error="HTTPStatusError: 500")  # fmt: skip
# Another user's last attempt, dead with its worker.
RUNNING_LAST = Old(OTHER, "sleep", "2026-01-04", "running", PREFETCH, 3, iso(2), iso(8, 30),
                   holder="99-1", claimed_at=iso(8, 30))  # fmt: skip

OLD_ROWS = [PREFETCH_OLDEST, PREFETCH_NEWER, INTERACTIVE_NEWEST, RUNNING_OLD, DONE, FAILED,
            RUNNING_LAST]  # fmt: skip


def _parse(value: str | None) -> dt.datetime | None:
    return dt.datetime.fromisoformat(value).replace(tzinfo=dt.UTC) if value else None


def _create_original(engine: Engine, rows: list[Old] = OLD_ROWS) -> None:
    with engine.begin() as connection:
        connection.execute(text(ORIGINAL_DDL))
        connection.execute(text(ORIGINAL_INDEX))
        for row in rows:
            connection.execute(
                text(
                    f"INSERT INTO ai_jobs ({', '.join(COLUMNS)}) "
                    f"VALUES ({', '.join(':' + c for c in COLUMNS)})"
                ),
                row.values(),
            )


@pytest.fixture
def engine(empty_database_url: str) -> Iterator[Engine]:
    engine = create_store_engine(empty_database_url)
    yield engine
    engine.dispose()


@pytest.fixture
def adopted(empty_database_url: str, engine: Engine, clock: FakeClock) -> Iterator[JobStore]:
    """The original's table with its rows, upgraded, and a store on the fake clock."""
    _create_original(engine)
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    settings = settings_for(database_url=empty_database_url)
    store = store_for(settings, clock=clock)
    yield store
    store.close()


def test_every_row_keeps_its_fields(adopted: JobStore) -> None:
    for old in OLD_ROWS:
        job = adopted.jobs([old.id])[old.id]
        assert job is not None, old
        assert (job.user_id, job.kind, job.subject) == (old.user_id, old.kind, old.subject)
        assert job.status == old.status
        assert job.priority == old.priority
        assert job.attempts == old.attempts
        assert job.fingerprint == old.fingerprint
        assert job.error == old.error
        assert job.holder == old.holder
        assert job.claimed_at == _parse(old.claimed_at)
        assert job.created_at == _parse(old.created_at)
        assert job.updated_at == _parse(old.updated_at)
        # Its age in the queue is its age in the original.
        assert job.queued_at == _parse(old.created_at)
        assert job.flow_run_id is None
        assert job.as_dict()["updated_at"] == models.iso(_parse(old.updated_at))
    assert pending(adopted) == 5
    assert pending(adopted, U) == 4


def test_list_jobs_shows_the_old_rows_in_worker_order(adopted: JobStore) -> None:
    listed = listed_jobs(adopted, U)
    assert [(e["kind"], e["subject"], e["status"]) for e in listed] == [
        ("hrv", "2026-01-03", "running"),
        ("trends", "week", "pending"),
        ("sleep", "2026-01-01", "pending"),
        ("sleep", "2026-01-02", "pending"),
        ("stress", "2026-01-04", "failed"),
        ("sleep", "2025-12-31", "done"),
    ]
    assert [e["interactive"] for e in listed] == [False, True, False, False, False, False]
    assert [e["attempts"] for e in listed] == [1, 0, 0, 1, 3, 1]
    assert listed[4]["error"] == "HTTPStatusError: 500"
    assert listed[0]["updated_at"] == "2026-01-05T08:50:00+00:00"


def test_claim_takes_the_interactive_job_then_oldest_first(adopted: JobStore) -> None:
    taken = []
    for _ in range(4):
        claim = adopted.claim_next("new-worker")
        assert claim.job is not None, claim
        taken.append((claim.job.subject, claim.job.attempts))
        adopted.finish(claim.job.id, claim.job.holder or "", result={"ok": True})
    # The old running row was dead, so it went back in line at its own age (05:00), its lost
    # claim not counted as an attempt (H2).
    assert taken == [("week", 1), ("2026-01-03", 1), ("2026-01-01", 1), ("2026-01-02", 2)]
    assert adopted.claim_next("new-worker").job is None


def test_the_old_running_claim_is_dead_and_taken_over(adopted: JobStore) -> None:
    claim = adopted.claim_next("new-worker")
    assert claim.job is not None and claim.job.id == INTERACTIVE_NEWEST.id
    # The claim above also reaped the gone process's row: it waits its turn again.
    released = adopted.jobs([RUNNING_OLD.id])[RUNNING_OLD.id]
    assert released is not None  # its lost claim is no spent attempt (H2)
    assert (released.status, released.holder, released.attempts) == (Status.PENDING, None, 0)
    lost = adopted.jobs([RUNNING_LAST.id])[RUNNING_LAST.id]
    assert lost is not None  # lost on its last allowed attempt (FIX4)
    assert (lost.status, lost.error, lost.holder) == (Status.FAILED, WORKER_LOST, None)
    adopted.finish(claim.job.id, claim.job.holder or "", result="ok")

    takeover = adopted.claim_next("new-worker")
    assert takeover.job is not None and takeover.job.id == RUNNING_OLD.id
    assert takeover.job.holder != RUNNING_OLD.holder
    assert takeover.job.attempts == 1
    assert adopted.finish(takeover.job.id, takeover.job.holder or "", result="x") == Status.DONE


def test_recover_releases_the_old_running_rows(adopted: JobStore) -> None:
    assert len(adopted.recover()) == 2
    released = adopted.jobs([RUNNING_OLD.id])[RUNNING_OLD.id]
    assert released is not None
    assert (released.status, released.holder, released.attempts) == (Status.PENDING, None, 0)
    lost = adopted.jobs([RUNNING_LAST.id])[RUNNING_LAST.id]
    assert lost is not None and lost.status == Status.FAILED
    assert adopted.recover() == []


def test_enqueue_on_the_old_running_row_requeues_it(adopted: JobStore) -> None:
    # Its claim is not live, so a poll does not answer "running" for ever.
    assert adopted.enqueue(U, "hrv", "2026-01-03", "fp-r", priority=INTERACTIVE) == "pending"
    job = adopted.jobs([RUNNING_OLD.id])[RUNNING_OLD.id]
    assert job is not None
    assert (job.status, job.priority, job.holder, job.attempts) == (
        Status.PENDING,
        INTERACTIVE,
        None,
        0,
    )


def test_done_row_answers_by_its_fingerprint(adopted: JobStore) -> None:
    assert adopted.enqueue(U, "sleep", "2025-12-31", "fp-done") == "done"
    assert adopted.enqueue(U, "sleep", "2025-12-31") == "done"
    job = adopted.jobs([DONE.id])[DONE.id]
    assert job is not None and job.status == Status.DONE
    assert adopted.enqueue(U, "sleep", "2025-12-31", "fp-new") == "pending"
    job = adopted.jobs([DONE.id])[DONE.id]
    assert job is not None
    assert (job.status, job.fingerprint, job.attempts) == (Status.PENDING, "fp-new", 0)
    assert job.queued_at == job.updated_at  # back in line now, not at its old age


def test_failed_row_waits_out_the_cooldown_from_its_old_time(
    adopted: JobStore, clock: FakeClock
) -> None:
    assert clock.now < NOW + dt.timedelta(seconds=1)
    assert adopted.enqueue(U, "stress", "2026-01-04", "fp-failed") == "failed"
    clock.advance(14 * 60 + 58)  # 09:14:58, two seconds before the cooldown ends
    assert adopted.enqueue(U, "stress", "2026-01-04", "fp-failed") == "failed"
    assert adopted.enqueue(U, "stress", "2026-01-04") == "failed"
    job = adopted.jobs([FAILED.id])[FAILED.id]
    assert job is not None and (job.status, job.attempts) == (Status.FAILED, 3)

    clock.advance(3)  # 09:15:01
    assert adopted.enqueue(U, "stress", "2026-01-04", "fp-failed", priority=INTERACTIVE) == (
        "pending"
    )
    job = adopted.jobs([FAILED.id])[FAILED.id]
    assert job is not None
    assert (job.status, job.attempts, job.error, job.priority) == (
        Status.PENDING,
        0,
        None,
        INTERACTIVE,
    )


def test_failed_row_with_a_new_fingerprint_requeues_at_once(adopted: JobStore) -> None:
    assert adopted.enqueue(U, "stress", "2026-01-04", "fp-changed") == "pending"


def test_a_store_on_an_empty_database_asks_for_the_upgrade(
    empty_database_url: str, engine: Engine
) -> None:
    settings = settings_for(database_url=empty_database_url)
    with pytest.raises(SchemaOutdated, match="insight-queue db upgrade"):
        store_for(settings, create=False)
    # The original's table alone is not this store's schema either.
    _create_original(engine)
    with pytest.raises(SchemaOutdated, match="insight-queue db upgrade"):
        store_for(settings, create=False)
    assert migrate.current_revision(engine) is None


def test_upgrade_is_idempotent(empty_database_url: str, engine: Engine) -> None:
    _create_original(engine)
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    once = dump_tables(engine)
    assert set(once) >= {"ai_jobs", "ai_job_results", "ai_job_gate"}
    assert len(once["ai_jobs"]) == len(OLD_ROWS)
    assert len(once["ai_job_gate"]) == 1
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    assert dump_tables(engine) == once
    with store_for(settings_for(empty_database_url)) as store:
        assert pending(store) == 5


def test_upgrade_of_an_empty_database_creates_the_store(
    empty_database_url: str, engine: Engine
) -> None:
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    with store_for(settings_for(empty_database_url)) as store:
        assert store.enqueue(U, "sleep", "d1") == "pending"
        assert listed_jobs(store, U)[0]["subject"] == "d1"


def test_an_ai_jobs_table_that_is_not_the_originals_is_refused_untouched(
    empty_database_url: str, engine: Engine
) -> None:
    with engine.begin() as connection:
        connection.execute(
            text("CREATE TABLE ai_jobs (id TEXT PRIMARY KEY, user_id TEXT, payload TEXT)")
        )
        connection.execute(
            text("INSERT INTO ai_jobs (id, user_id, payload) VALUES ('j1', 'u1', 'keep me')")
        )
    before = dump_tables(engine)
    with engine.connect() as connection:
        columns_before = [c["name"] for c in inspect(connection).get_columns("ai_jobs")]

    with pytest.raises(Exception, match="not the original") as refused:
        migrate.upgrade(empty_database_url)
    message = str(refused.value)
    for missing in ("kind", "subject", "status", "attempts", "claimed_at"):
        assert missing in message

    assert dump_tables(engine) == before  # no new table, no version row, same rows
    with engine.connect() as connection:
        assert [c["name"] for c in inspect(connection).get_columns("ai_jobs")] == columns_before
    # Opening a store never touches it either: SQLite's own upgrade refuses the same way.
    with pytest.raises((SchemaOutdated, SchemaConflict)):
        store_for(settings_for(empty_database_url))
    assert dump_tables(engine) == before


def test_a_database_one_revision_behind_is_refused_then_upgraded(
    empty_database_url: str,
) -> None:
    assert migrate.upgrade(empty_database_url, "0001") == "0001"
    with pytest.raises(SchemaOutdated) as refused:
        store_for(settings_for(empty_database_url), create=False)
    assert "revision 0001" in str(refused.value)
    assert "insight-queue db upgrade" in str(refused.value)
    assert migrate.upgrade(empty_database_url) == SCHEMA_REVISION
    store = store_for(settings_for(empty_database_url))
    assert store.enqueue("u", "k", "s") == "pending"
    store.close()


def test_sqlite_creates_and_upgrades_itself_postgresql_asks(
    backend: str, empty_database_url: str, engine: Engine
) -> None:
    """The embedded default needs no `db upgrade`; PostgreSQL keeps the explicit step."""
    assert migrate.upgrade(empty_database_url, "0001") == "0001"
    settings = settings_for(database_url=empty_database_url)
    if backend == "sqlite":
        with store_for(settings) as store:
            assert store.enqueue("u", "k", "s") == "pending"
        assert migrate.current_revision(engine) == SCHEMA_REVISION
    else:
        with pytest.raises(SchemaOutdated, match="insight-queue db upgrade"):
            store_for(settings)
        assert migrate.current_revision(engine) == "0001"


def test_a_read_only_store_creates_no_file(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'nowhere' / 'queue.db'}"
    with pytest.raises(SchemaOutdated, match="no queue at"):
        store_for(settings_for(url), create=False)
    assert not (tmp_path / "nowhere").exists()
