"""What the store keeps of a person, for how long, and forgetting them (D1-D4), on SQLite and
PostgreSQL with the same assertions.

D1 the files are the service account's alone; D2 retention deletes exactly what is past it
and keeps what a screen can still ask for, in chunks, beside a consumer and another pruner;
D3 `forget` removes every row of the user and nothing of anyone else, also mid-call; G5 an
answer quoting a secret is stored without it.
"""

from __future__ import annotations

import datetime as dt
import multiprocessing
import os
import stat
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, event, insert, select, text

from queue_store import (
    ClaimLost,
    Failure,
    JobStore,
    Status,
    Usage,
    job_id,
    schema,
)
from queue_store.privacy import NO_ONE, PRUNE_CHUNK
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import dump_tables
from tests.support.reads import engine_of, job_of, result_of

DAY = 86400.0
ALICE, BOB = "alice", "bob"


def done(store: JobStore, user: str, kind: str, subject: str, **kwargs: Any) -> str:
    """A job queued, claimed and finished with a result and its usage."""
    store.enqueue(user, kind, subject, "fp-1")
    claim = store.claim_next("w")
    assert claim.job is not None and claim.job.id == job_id(user, kind, subject)
    store.finish(
        claim.job.id,
        claim.job.holder or "",
        result={"text": f"{user}'s {kind} for {subject}"},
        usage=Usage(100, 20),
        **kwargs,
    )
    return claim.job.id


def failed(store: JobStore, user: str, kind: str, subject: str) -> str:
    """A job that spent its only attempt."""
    store.enqueue(user, kind, subject, "fp-1")
    claim = store.claim_next("w")
    assert claim.job is not None
    settled = store.fail(claim.job.id, claim.job.holder or "", Failure.BUILD, "no data")
    assert settled.status == Status.FAILED
    return claim.job.id


def rows(store: JobStore) -> dict[str, list[tuple[Any, ...]]]:
    engine = create_engine(engine_of(store).url)
    try:
        return dump_tables(engine)
    finally:
        engine.dispose()


def mentioning(dumped: dict[str, list[tuple[Any, ...]]], *words: str) -> dict[str, list[Any]]:
    """The rows, by table, in which any of these words appears in any column."""
    found: dict[str, list[Any]] = {}
    for table, table_rows in dumped.items():
        hits = [r for r in table_rows if any(w in repr(r) for w in words)]
        if hits:
            found[table] = hits
    return found


def usage_totals(store: JobStore) -> tuple[int, int, int]:
    with engine_of(store).connect() as connection:
        usage = schema.usage
        row = connection.execute(
            select(
                text("sum(answers)"), text("sum(prompt_tokens)"), text("sum(completion_tokens)")
            ).select_from(usage)
        ).one()
    return int(row[0] or 0), int(row[1] or 0), int(row[2] or 0)


# -- D1: the files ----------------------------------------------------------------------


@pytest.fixture
def umask_022() -> Iterator[None]:
    previous = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(previous)


def test_d1_the_embedded_store_is_readable_by_the_service_account_alone(
    tmp_path: Path, umask_022: None
) -> None:
    data = tmp_path / "data"
    data.mkdir(mode=0o755)
    os.chmod(data, 0o755)  # made by someone else, wide open
    settings = settings_for(data_dir=data)
    with store_for(settings) as store:
        done(store, ALICE, "sleep", "2026-11-30")
        files = sorted(data.glob("queue.db*"))
        names = {f.name for f in files}
        assert {"queue.db", "queue.db-wal", "queue.db-shm"} <= names, names
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in files}
        assert set(modes.values()) == {0o600}, modes
    assert stat.S_IMODE(data.stat().st_mode) == 0o700


def test_d1_a_shared_sticky_folder_named_as_the_data_directory_is_left_open_to_its_users(
    tmp_path: Path, umask_022: None
) -> None:
    """A data directory set to a folder like /tmp (world-writable, sticky) is not closed to
    everyone else; the store's own files in it are still the service account's alone."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with store_for(settings_for(data_dir=shared)) as store:
        done(store, ALICE, "sleep", "2026-11-30")
        modes = {f.name: stat.S_IMODE(f.stat().st_mode) for f in shared.glob("queue.db*")}
        assert modes and set(modes.values()) == {0o600}, modes
    assert stat.S_IMODE(shared.stat().st_mode) == 0o1777


# -- D2: retention ----------------------------------------------------------------------


def test_d2_prune_deletes_exactly_what_is_past_retention_and_keeps_what_a_screen_can_ask_for(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=1, retention_days=90)
    old_done = done(store, ALICE, "sleep", "2026-01-01")
    old_failed = failed(store, ALICE, "mood", "2026-01-01")
    asked_again = done(store, ALICE, "heart", "2026-01-01")
    short_lived = done(store, BOB, "steps", "2026-01-01")
    gone_user = done(store, "carol", "sleep", "2026-01-01")
    pseudonym_of_carol = store.jobs([gone_user])[gone_user].pseudonym
    assert pseudonym_of_carol is not None
    clock.advance(85 * DAY)
    recent = done(store, BOB, "sleep", "2026-03-27")
    clock.advance(10 * DAY)  # the first jobs are 95 days old, `recent` 10
    # The heart insight is asked for again with new data: queued, its old result stays
    # what the screen shows meanwhile.
    assert store.enqueue(ALICE, "heart", "2026-01-01", "fp-2") == Status.PENDING
    tokens_before = usage_totals(store)
    before = rows(store)

    preview = store.prune(by_kind={"steps": 120}, dry_run=True)
    assert rows(store) == before  # a dry run writes nothing
    pruned = store.prune(by_kind={"steps": 120})

    assert (pruned.jobs, pruned.results) == (3, 2)  # old_done, old_failed, carol's; 2 results
    assert (preview.jobs, preview.results) == (pruned.jobs, pruned.results)
    # Usage is folded at the default retention, whatever a kind keeps: it holds no text.
    assert pruned.usage_rows == 4 and pruned.people == 1
    for gone in (old_done, old_failed, gone_user):
        assert store.jobs([gone]) == {}
    assert result_of(store, ALICE, "sleep", "2026-01-01") is None
    kept = job_of(store, ALICE, "heart", "2026-01-01")
    assert kept is not None and kept.id == asked_again and kept.status == Status.PENDING
    result = result_of(store, ALICE, "heart", "2026-01-01")
    assert result is not None and result.output == {"text": "alice's heart for 2026-01-01"}
    assert job_of(store, BOB, "steps", "2026-01-01") is not None  # its kind keeps 120 days
    assert store.jobs([short_lived])[short_lived].status == Status.DONE
    assert store.jobs([recent])[recent].status == Status.DONE
    # Carol has nothing left: her pseudonym is no longer anyone's.
    assert store.user_of(pseudonym_of_carol) is None
    # Token usage: the same totals, the old days no one's.
    assert usage_totals(store) == tokens_before
    users_by_day = {(str(r[0]), r[1]) for r in rows(store)["ai_job_usage_days"]}
    assert {u for d, u in users_by_day if d < "2026-02-01"} == {NO_ONE}, users_by_day
    assert {u for d, u in users_by_day if d > "2026-02-01"} == {BOB}, users_by_day

    again = store.prune(by_kind={"steps": 120})
    assert (again.jobs, again.results, again.usage_rows, again.people) == (0, 0, 0, 0)


def _old_finished_rows(store: JobStore, count: int, finished: dt.datetime) -> list[str]:
    """`count` done jobs with results, finished at `finished`, written straight to the tables."""
    jobs: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for n in range(count):
        subject = f"2026-01-{n:05d}"
        jid = job_id(f"u{n % 7}", "sleep", subject)
        jobs.append(
            {
                "id": jid,
                "user_id": f"u{n % 7}",
                "kind": "sleep",
                "subject": subject,
                "priority": 10,
                "status": "done",
                "attempts": 1,
                "created_at": finished,
                "updated_at": finished,
                "finished_at": finished,
                "revision": 2,
            }
        )
        results.append(
            {
                "job_id": jid,
                "user_id": f"u{n % 7}",
                "kind": "sleep",
                "subject": subject,
                "output": {"text": "x"},
                "produced_at": finished,
            }
        )
    # And a day's usage of each: one user a row, so the days' totals must add up.
    usage = [
        {
            "day": finished.date() + dt.timedelta(days=n // 7),
            "user_id": f"u{n % 7}",
            "kind": "sleep",
            "answers": 1,
            "unknown": 0,
            "prompt_tokens": 10,
            "completion_tokens": 2,
        }
        for n in range(count)
    ]
    with engine_of(store).begin() as connection:
        connection.execute(insert(schema.jobs), jobs)
        connection.execute(insert(schema.results), results)
        connection.execute(insert(schema.usage), usage)
    return [str(j["id"]) for j in jobs]


def _prune_in_a_process(url: str, started: Any, go: Any, out: Any) -> None:
    try:
        with store_for(settings_for(url, retention_days=90)) as store:
            started.set()
            go.wait(30)
            out.put(store.prune().as_dict())
    except Exception as exc:  # noqa: BLE001 - reported to the parent
        out.put({"error": f"{type(exc).__name__}: {exc}"})


def test_d2_pruners_in_other_processes_work_in_chunks_beside_a_claiming_consumer(
    database_url: str, request: pytest.FixtureRequest
) -> None:
    """Two pruners in processes of their own and a consumer in this one, at once: every old
    job is deleted exactly once between them, in many short transactions, and every claim
    the consumer makes meanwhile goes through and keeps its job. Everyone on the real clock."""
    store = store_for(settings_for(database_url))
    request.addfinalizer(store.close)
    old = _old_finished_rows(store, PRUNE_CHUNK * 4 + 17, dt.datetime(2025, 1, 1, tzinfo=dt.UTC))
    for n in range(40):
        store.enqueue("live", "sleep", f"d{n}")
    context = multiprocessing.get_context("spawn")
    out = context.Queue()
    go = context.Event()
    starts = [context.Event() for _ in range(2)]
    pruners = [
        context.Process(target=_prune_in_a_process, args=(database_url, s, go, out)) for s in starts
    ]
    for process in pruners:
        process.start()
    try:
        for s in starts:
            assert s.wait(60), "a pruner did not start"
        go.set()
        claimed: list[str] = []
        while len(claimed) < 40:
            claim = store.claim_next("consumer")
            if claim.job is None:
                continue
            store.finish(claim.job.id, claim.job.holder or "", result={"text": "ok"})
            claimed.append(claim.job.id)
        reports = [out.get(timeout=120) for _ in pruners]
    finally:
        for process in pruners:
            process.join(60)
            if process.is_alive():
                process.kill()
    assert all("error" not in r for r in reports), reports
    assert sum(r["jobs"] for r in reports) == len(old)
    assert sum(r["results"] for r in reports) == len(old)
    # Every user's usage row folded once, into one total of no one a day, nothing lost.
    assert sum(r["usage_rows"] for r in reports) == len(old)
    assert usage_totals(store)[:2] == (
        len(old) + 40,
        len(old) * 10,
    )  # the live jobs: answers of unknown tokens
    folded = rows(store)["ai_job_usage_days"]
    assert {r[1] for r in folded if str(r[0]) < "2026-01-01"} == {NO_ONE}
    assert len([r for r in folded if str(r[0]) < "2026-01-01"]) == (len(old) + 6) // 7
    assert store.jobs(old) == {}
    assert {j.status for j in store.jobs(claimed).values()} == {Status.DONE}
    assert len(store.jobs(claimed)) == 40


def test_d2_prune_deletes_in_transactions_of_at_most_a_chunk(make_store: StoreFactory) -> None:
    store = make_store()
    old = _old_finished_rows(store, PRUNE_CHUNK * 3 + 1, dt.datetime(2025, 1, 1, tzinfo=dt.UTC))
    deletes: list[int] = []

    def watch(_conn: Any, _cursor: Any, statement: str, _params: Any, *_: Any) -> None:
        if statement.lstrip().upper().startswith("DELETE FROM AI_JOBS "):
            deletes.append(_cursor.rowcount)

    engine = engine_of(store)
    event.listen(engine, "after_cursor_execute", watch)
    try:
        pruned = store.prune(retention_days=90)
    finally:
        event.remove(engine, "after_cursor_execute", watch)
    assert pruned.jobs == len(old)
    assert len(deletes) >= 4 and max(deletes) <= PRUNE_CHUNK, deletes


# -- D3: forgetting ---------------------------------------------------------------------


def test_d3_forget_removes_every_row_of_the_user_and_nothing_of_another(
    make_store: StoreFactory,
) -> None:
    store = make_store(max_attempts=1)
    for user in (ALICE, BOB):
        done(store, user, "sleep", "2026-11-29")
        failed(store, user, "mood", "2026-11-29")
    for user in (ALICE, BOB):
        store.enqueue(user, "heart", "2026-11-30", "fp")
    alice_pseudonym = job_of(store, ALICE, "sleep", "2026-11-29").pseudonym  # type: ignore[union-attr]
    assert alice_pseudonym is not None
    before = rows(store)
    assert mentioning(before, ALICE)

    forgotten = store.forget(ALICE)

    assert (forgotten.jobs, forgotten.results, forgotten.usage_rows) == (3, 1, 1)
    assert forgotten.pseudonym == alice_pseudonym
    assert forgotten.history_pending == (alice_pseudonym,)
    after = rows(store)
    assert mentioning(after, ALICE) == {}
    # Bob's rows are what they were; the only row that names alice's pseudonym is the
    # erasure the run history still owes (the pseudonym no longer leads to anyone).
    assert mentioning(after, BOB) == mentioning(before, BOB)
    assert {t: len(r) for t, r in mentioning(after, alice_pseudonym).items()} == {
        "ai_job_erasures": 1
    }
    assert store.user_of(alice_pseudonym) is None

    again = store.forget(ALICE)  # idempotent
    assert (again.jobs, again.results, again.usage_rows, again.pseudonym) == (0, 0, 0, None)
    assert store.forget(erased=[alice_pseudonym]).history_pending == ()
    assert mentioning(rows(store), alice_pseudonym) == {}


def test_d3_forget_during_the_users_call_writes_no_result_and_the_gateway_stays_held(
    make_store: StoreFactory,
) -> None:
    store = make_store(gateway={"cut_hold_seconds": 600})
    store.enqueue(ALICE, "sleep", "2026-11-30")
    store.enqueue(BOB, "sleep", "2026-11-30")
    claim = store.claim_next("w")
    assert claim.job is not None and claim.job.user_id == ALICE
    store.heartbeat(claim.job.id, claim.job.holder or "", calling=True)

    forgotten = store.forget(ALICE)

    assert forgotten.calls_cut == 1
    with pytest.raises(ClaimLost):
        store.finish(claim.job.id, claim.job.holder or "", result={"text": "alice's answer"})
    assert mentioning(rows(store), ALICE, "alice's answer") == {}
    # The cut call still holds the gateway (H1): bob waits for it.
    assert [str(h.cause) for h in store.queue_view().holds] == ["cancelled"]
    assert store.claim_next("w2").job is None


# -- G5: an answer quoting a secret ------------------------------------------------------


def test_g5_an_answer_that_quotes_the_gateway_token_is_stored_without_it(
    make_store: StoreFactory,
) -> None:
    token = "sk-gateway-token-7f3a9c2e51"
    store = make_store(gateway={"token": token})
    store.enqueue(ALICE, "sleep", "d1")
    claim = store.claim_next("w")
    assert claim.job is not None
    answer = {"text": f"as the gateway (Bearer {token}) says", "nested": [token]}
    store.finish(claim.job.id, claim.job.holder or "", result=answer)
    assert token not in repr(rows(store))
    result = result_of(store, ALICE, "sleep", "d1")
    assert result is not None and "as the gateway" in result.output["text"]


def test_d3_forget_in_one_connection_while_another_claims_leaves_no_row_behind(
    make_store: StoreFactory,
) -> None:
    """A claim of the user's next job racing `forget` (separate stores, separate
    connections): whichever goes first, nothing of the user is left once both are done."""
    forgetter, consumer = make_store(), make_store()
    for n in range(20):
        consumer.enqueue(ALICE, "sleep", f"d{n}")
    barrier = threading.Barrier(2)
    outcome: dict[str, Any] = {}

    def claim() -> None:
        barrier.wait()
        found = consumer.claim_next("w")
        outcome["claimed"] = found.job
        if found.job is not None:
            try:
                consumer.finish(found.job.id, found.job.holder or "", result={"text": "late"})
            except ClaimLost:
                outcome["lost"] = True

    thread = threading.Thread(target=claim)
    thread.start()
    barrier.wait()
    forgetter.forget(ALICE)
    thread.join(30)
    assert not thread.is_alive()
    # Whichever went first, a result written after forget would name alice again.
    assert mentioning(rows(forgetter), ALICE) == {}
