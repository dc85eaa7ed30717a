"""Bulk verbs and whole-queue reads: `enqueue_many`, `requeue`, `queue_view`, positions.

On SQLite and PostgreSQL with the same assertions.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, delete, text

from queue_store import (
    INTERACTIVE,
    PREFETCH,
    EnqueueRequest,
    Failure,
    InvalidArgument,
    JobStore,
    Status,
    bulk,
    job_id,
    schema,
)
from queue_store import store as store_module
from queue_store.store import BULK_CHUNK
from queue_store.views import RECENT_FAILURES
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock, per_test_database
from tests.support.factories import settings_for, store_for
from tests.support.reads import engine_of, listed_jobs, result_of, state_of

U, V, W = "user-u", "user-v", "user-w"
SETTINGS: dict[str, Any] = {
    "gap_seconds": 0.0,
    "concurrency": 5,
    "max_attempts": 1,
    "retry_after_seconds": 3600.0,
}


def _rows(store: JobStore) -> dict[str, dict[str, Any]]:
    engine = create_engine(store._engine.url)
    try:
        with engine.connect() as connection:
            return {
                row.id: dict(row._mapping)
                for row in connection.execute(text("SELECT * FROM ai_jobs"))
            }
    finally:
        engine.dispose()


def _versions(store: JobStore) -> dict[str, tuple[Any, ...]]:
    """Each row's revision and update time; on PostgreSQL also who wrote (xmin) or locked it."""
    engine = create_engine(store._engine.url)
    extra = ", xmin::text, xmax::text" if engine.dialect.name == "postgresql" else ""
    try:
        with engine.connect() as connection:
            return {
                row[0]: tuple(row[1:])
                for row in connection.execute(
                    text(f"SELECT id, revision, updated_at{extra} FROM ai_jobs")
                )
            }
    finally:
        engine.dispose()


def _means(store: JobStore) -> dict[str, float]:
    engine = create_engine(store._engine.url)
    try:
        with engine.connect() as connection:
            return {
                kind: float(mean)
                for kind, mean in connection.execute(
                    text("SELECT kind, mean_seconds FROM ai_job_kind_durations")
                )
            }
    finally:
        engine.dispose()


def _claim(store: JobStore) -> tuple[str, str]:
    job = store.claim_next("w").job
    assert job is not None
    return job.id, job.holder or ""


def _finish_next(store: JobStore, error: str | None = None) -> None:
    """The next job done, or failed with `error` (an attempt spent on a prompt not built)."""
    jid, holder = _claim(store)
    if error is None:
        store.finish(jid, holder, result="ok")
    else:
        store.fail(jid, holder, Failure.BUILD, error)


def _waiting_order(store: JobStore) -> list[str]:
    return [entry.job.id for entry in store.queue_view(limit=1000).waiting]


@pytest.fixture
def twin_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A second database at the current schema, on the backend under test."""
    with per_test_database(backend, tmp_path / "twin.db", request) as url:
        yield url


# -- enqueue_many is a sequence of enqueue calls ------------------------------------


def _prepare(store: JobStore, clock: FakeClock) -> None:
    """The same jobs, in every state an enqueue can meet, on any store."""

    def step() -> None:
        clock.advance(1)

    for subject in ("done-same", "done-stale"):
        store.enqueue(U, "sleep", subject, "fp1")
        _finish_next(store)
        step()
    store.enqueue(U, "sleep", "failed-cooling", "fp1")
    _finish_next(store, error="the gateway said no")  # one attempt allowed: failed
    step()
    store.enqueue(U, "trends", "w0", "ft")
    _finish_next(store)  # done: a supersede leaves it alone
    step()
    store.enqueue(U, "sleep", "running-live", "fp1", priority=INTERACTIVE)
    jid, _ = _claim(store)
    assert jid == job_id(U, "sleep", "running-live")
    step()
    store.enqueue(U, "sleep", "pending-promote", "fp1", priority=PREFETCH)
    store.enqueue(U, "sleep", "pending-interactive", "fp1", priority=INTERACTIVE)
    store.enqueue(U, "trends", "w1", "ft")  # superseded below
    store.enqueue(W, "trends", "w5", "ft")
    store.enqueue("someone-else", "trends", "w1", "ft")  # another user's: left alone
    step()


def _requests() -> list[EnqueueRequest]:
    # Two new keys given against the order of their ids: the queue must keep
    # the order given, not fall back on the id.
    later, earlier = sorted(["n1", "n3"], key=lambda s: job_id(U, "new", s))
    return [
        EnqueueRequest(U, "new", earlier, "f"),
        EnqueueRequest(U, "new", later, "f"),
        EnqueueRequest(U, "sleep", "done-same", "fp1"),  # R4: done
        EnqueueRequest(U, "sleep", "done-stale", "fp2"),  # stale: queued again
        EnqueueRequest(U, "sleep", "failed-cooling", "fp1"),  # R5: still cooling down
        EnqueueRequest(U, "sleep", "running-live", "fp9", INTERACTIVE),  # R3: left alone
        EnqueueRequest(U, "sleep", "pending-promote", None, INTERACTIVE),  # promoted
        EnqueueRequest(U, "sleep", "pending-interactive", None, PREFETCH),  # never demoted
        EnqueueRequest(U, "trends", "w2", "ft", supersede=True),  # drops w1, not done w0
        EnqueueRequest(U, "dup", "x", "fa", PREFETCH),  # new ...
        EnqueueRequest(U, "dup", "x", "fb", INTERACTIVE),  # ... then stale and promoted
        EnqueueRequest(V, "trends", "w3", supersede=True),  # new ...
        EnqueueRequest(V, "trends", "w4", supersede=True),  # ... and dropped by the next
        EnqueueRequest(W, "trends", "w6", supersede=True),  # drops w5 ...
        EnqueueRequest(W, "trends", "w5", "ft"),  # ... which comes back as a new job
        EnqueueRequest(U, "new", "n2", "f", INTERACTIVE),
        EnqueueRequest(U, "sleep", "done-stale", "fp2"),  # the same again: no change
        EnqueueRequest(U, "new", earlier, "f"),  # the same again: no change
    ]


def _one_by_one(store: JobStore, requests: list[EnqueueRequest]) -> list[Status]:
    statuses = []
    for r in requests:
        statuses.append(store.enqueue(r.user_id, r.kind, r.subject, r.fingerprint, r.priority))
        if r.supersede:  # R7, as written down: the user's other pending jobs of the kind go
            with engine_of(store).begin() as connection:
                connection.execute(
                    delete(schema.jobs).where(
                        schema.jobs.c.user_id == r.user_id,
                        schema.jobs.c.kind == r.kind,
                        schema.jobs.c.subject != r.subject,
                        schema.jobs.c.status == Status.PENDING,
                    )
                )
    return statuses


def _comparable(row: dict[str, Any]) -> dict[str, Any]:
    """A row without its times and claim token, which two runs cannot share: whether each is set."""
    shown = {}
    for name, value in row.items():
        if name.endswith("_at") or name in ("holder", "last_holder", "unavailable_since"):
            shown[name] = value is not None
        else:
            shown[name] = value
    return shown


@pytest.mark.parametrize("chunk", [BULK_CHUNK, 4], ids=["one-chunk", "chunks-of-4"])
def test_enqueue_many_does_what_the_same_enqueue_calls_do(
    database_url: str,
    twin_url: str,
    clock: FakeClock,
    chunk: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(store_module, "BULK_CHUNK", chunk)
    monkeypatch.setattr(store_module, "MAX_BULK_CHUNK", max(chunk, 6))
    twin_clock = FakeClock(clock.now)
    bulk_store = store_for(
        settings_for(database_url, **SETTINGS),
        clock=clock,
    )
    calls = store_for(
        settings_for(twin_url, **SETTINGS),
        clock=twin_clock,
    )
    try:
        _prepare(bulk_store, clock)
        _prepare(calls, twin_clock)
        assert {i: _comparable(r) for i, r in _rows(bulk_store).items()} == {
            i: _comparable(r) for i, r in _rows(calls).items()
        }
        requests = _requests()

        statuses = bulk_store.enqueue_many(requests)
        expected = _one_by_one(calls, requests)

        assert statuses == expected
        assert statuses == [
            "pending",
            "pending",
            "done",
            "pending",
            "failed",
            "running",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
            "pending",
        ]
        rows, twin_rows = _rows(bulk_store), _rows(calls)
        assert {i: _comparable(r) for i, r in rows.items()} == {
            i: _comparable(r) for i, r in twin_rows.items()
        }
        # The rules, spelled out.
        gone = [job_id(U, "trends", "w1"), job_id(V, "trends", "w3")]
        assert not set(gone) & set(rows)
        assert job_id("someone-else", "trends", "w1") in rows
        assert rows[job_id(U, "trends", "w0")]["status"] == "done"
        dup = rows[job_id(U, "dup", "x")]
        assert (dup["priority"], dup["fingerprint"], dup["revision"]) == (INTERACTIVE, "fb", 1)
        assert dup["requested_at"] is not None
        stale = rows[job_id(U, "sleep", "done-stale")]
        assert (stale["status"], stale["fingerprint"], stale["attempts"]) == ("pending", "fp2", 0)
        assert rows[job_id(U, "sleep", "pending-promote")]["priority"] == INTERACTIVE
        assert rows[job_id(U, "sleep", "pending-interactive")]["priority"] == INTERACTIVE
        assert rows[job_id(U, "sleep", "running-live")]["fingerprint"] == "fp1"
        back = rows[job_id(W, "trends", "w5")]
        assert (back["revision"], back["status"]) == (0, "pending")

        # The queue takes them in the same order, and the new ones in the order given.
        order = _waiting_order(bulk_store)
        assert order == _waiting_order(calls)
        given = [job_id(r.user_id, r.kind, r.subject) for r in requests[:2]]
        assert [jid for jid in order if jid in given] == given
        assert given[0] > given[1]  # so the id alone would have put them the other way
    finally:
        bulk_store.close()
        calls.close()


def test_a_users_scopes_keep_the_order_given_across_calls_and_chunks(
    store: JobStore, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "BULK_CHUNK", 3)
    monkeypatch.setattr(store_module, "MAX_BULK_CHUNK", 5)
    subjects = sorted((f"s{n:02d}" for n in range(12)), key=lambda s: job_id(U, "k", s))
    subjects.reverse()  # against the order of the ids
    store.enqueue_many([EnqueueRequest(U, "k", s) for s in subjects[:7]])
    clock.advance(1)
    store.enqueue_many([EnqueueRequest(U, "k", s) for s in subjects[7:]])
    listed = [entry["subject"] for entry in listed_jobs(store, U)]
    assert listed == subjects
    assert [entry["ahead"] for entry in listed_jobs(store, U)] == list(range(12))


def test_an_unchanged_batch_writes_nothing(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "sleep", "done", "fp")
    _finish_next(store)  # a done job in the batch too
    requests = [
        EnqueueRequest(f"user-{n % 7}", kind, f"d{n:03d}", f"fp-{n}")
        for n, kind in enumerate(["sleep", "heart", "mood"] * 40)
    ] + [EnqueueRequest(f"user-{n}", "trends", "w", "ft", supersede=True) for n in range(7)]
    requests.append(EnqueueRequest(U, "sleep", "done", "fp"))
    store.enqueue_many(requests)
    clock.advance(60)
    before = _versions(store)

    statuses = store.enqueue_many(requests)

    assert set(statuses[:-1]) == {Status.PENDING} and statuses[-1] == Status.DONE
    assert _versions(store) == before  # no row written, and none locked


def test_a_bad_item_is_refused_before_anything_is_written(store: JobStore) -> None:
    good = [EnqueueRequest(U, "k", f"s{n}") for n in range(BULK_CHUNK + 10)]
    with pytest.raises(InvalidArgument) as refused:
        store.enqueue_many([*good, EnqueueRequest("a|b", "k", "s")])
    assert refused.value.argument == "user_id"
    with pytest.raises(InvalidArgument) as refused:
        store.enqueue_many([*good, EnqueueRequest(U, "k", "s", priority=-1)])
    assert refused.value.argument == "priority"
    with pytest.raises(InvalidArgument) as refused:
        store.enqueue_many([*good, (U, "k", "s")])  # type: ignore[list-item]
    assert refused.value.argument == "requests"
    assert _rows(store) == {}


def _after_the_first_read(monkeypatch: pytest.MonkeyPatch, meddle: Callable[[], None]) -> list[int]:
    """Run `meddle` once, between enqueue_many's first read and its write; count the reads."""
    reads: list[int] = []
    plan = bulk.plan

    def meddling_plan(*args: Any, **kwargs: Any) -> bulk.Plan:
        reads.append(1)
        if len(reads) == 1:
            meddle()
        return plan(*args, **kwargs)

    monkeypatch.setattr(bulk, "plan", meddling_plan)
    return reads


def test_a_key_inserted_by_another_caller_meanwhile_is_decided_again(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = make_store(), make_store()

    def insert() -> None:
        other.enqueue(U, "k", "s", "theirs")

    reads = _after_the_first_read(monkeypatch, insert)

    assert store.enqueue_many([EnqueueRequest(U, "k", "s", "ours")]) == [Status.PENDING]

    assert len(reads) == 2
    row = _rows(store)[job_id(U, "k", "s")]
    assert (row["fingerprint"], row["revision"]) == ("ours", 1)  # theirs, then made stale


def test_a_row_claimed_meanwhile_is_decided_again(
    make_store: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, other = make_store(), make_store()
    store.enqueue(U, "k", "s", "fp1")

    def claim() -> None:
        _claim(other)

    reads = _after_the_first_read(monkeypatch, claim)

    assert store.enqueue_many([EnqueueRequest(U, "k", "s", "fp2")]) == [Status.RUNNING]

    assert len(reads) == 2
    row = _rows(store)[job_id(U, "k", "s")]
    assert (row["status"], row["fingerprint"]) == ("running", "fp1")  # R3: left alone


# -- requeue ------------------------------------------------------------------------


def test_requeue_by_kind_then_all_queues_finished_jobs_again(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(**SETTINGS)
    for kind in ("a", "b"):
        store.enqueue(U, kind, "done", "fp", priority=INTERACTIVE)
        _finish_next(store)
        store.enqueue(U, kind, "failed", "fp")
        _finish_next(store, error="no")
    store.enqueue(U, "a", "slow", "fp", priority=25)
    _finish_next(store)  # done at a lower priority than prefetch
    store.enqueue(U, "a", "live", "fp", priority=INTERACTIVE)
    store.enqueue(U, "b", "live", "fp", priority=INTERACTIVE)
    store.enqueue(U, "a", "waiting", "fp")
    running = {_claim(store)[0], _claim(store)[0]}
    assert running == {job_id(U, "a", "live"), job_id(U, "b", "live")}
    clock.advance(10)
    before = _rows(store)

    assert store.requeue(["a"]) == 3

    after = _rows(store)
    queued = {job_id(U, "a", s) for s in ("done", "failed", "slow")}
    for jid, row in after.items():
        if jid not in queued:
            assert row == before[jid]
            continue
        assert (row["status"], row["attempts"], row["error"]) == ("pending", 0, None)
        assert row["revision"] == before[jid]["revision"] + 1
        assert row["queued_at"] > before[jid]["queued_at"]
        assert row["fingerprint"] == "fp"
    # Promoted to prefetch at most, never demoted.
    assert after[job_id(U, "a", "done")]["priority"] == INTERACTIVE
    assert after[job_id(U, "a", "failed")]["priority"] == PREFETCH
    assert after[job_id(U, "a", "slow")]["priority"] == PREFETCH
    assert result_of(store, U, "a", "done") is not None  # the old result stays readable

    assert store.requeue() == 2  # b's done and failed; nothing running or pending
    statuses = {jid: row["status"] for jid, row in _rows(store).items()}
    assert sorted(statuses.values()) == ["pending"] * 6 + ["running"] * 2
    assert store.requeue() == 0


# -- queue_view -----------------------------------------------------------------------


def test_queue_view_shows_the_queue_in_worker_order_with_places_and_etas(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(concurrency=2, gap_seconds=5.0, default_duration_seconds=100.0)
    # Teach the store that "fast" takes 20 s.
    store.enqueue("teacher", "fast", "0")
    jid, holder = _claim(store)
    store.finish(jid, holder, result="x", duration_seconds=20.0)
    clock.advance(60)
    failing = make_store(max_attempts=1, gap_seconds=0.0)
    for n in range(RECENT_FAILURES + 3):
        failing.enqueue(V, "broken", f"f{n}")
        failed_id, failed_holder = _claim(failing)
        failing.fail(failed_id, failed_holder, Failure.BUILD, f"no {n}")
        clock.advance(1)
    clock.advance(60)
    store.enqueue(U, "slow", "first-running")
    store.enqueue(U, "fast", "second-running")
    first = _claim(store)[0]
    clock.advance(3)
    second = _claim(store)[0]
    clock.advance(4)
    waiting = [
        (W, "slow", "old", PREFETCH),
        (W, "fast", "newer", PREFETCH),
        (V, "fast", "screen", INTERACTIVE),
        (W, "slow", "newest", PREFETCH),
    ]
    for user, kind, subject, priority in waiting:
        store.enqueue(user, kind, subject, priority=priority)
        clock.advance(1)

    view = store.queue_view(limit=3)

    assert [e.job.id for e in view.running] == [first, second]  # in the order they were claimed
    assert view.running[0].running_seconds == pytest.approx(3 + 4 + 4, abs=0.01)
    assert view.running[1].eta_seconds == pytest.approx(20 - 8, abs=0.01)
    assert [e.job.subject for e in view.waiting] == ["screen", "old", "newer"]
    assert [e.place for e in view.waiting] == [1, 2, 3]
    # In flight: slow 100 - 11 and fast 20 - 8 left; then each job ahead, and a
    # gap after every call, shared by the two slots; then the job's own call.
    in_flight = (100 - 11) + (20 - 8)
    assert [e.eta_seconds for e in view.waiting] == pytest.approx(
        [
            (in_flight + 2 * 5) / 2 + 20,
            (in_flight + 20 + 3 * 5) / 2 + 100,
            (in_flight + 20 + 100 + 4 * 5) / 2 + 20,
        ],
        abs=0.01,
    )
    assert view.waiting_total == 4
    assert view.failed_total == RECENT_FAILURES + 3
    shown = [e.job.subject for e in view.recent_failures]
    assert shown == [f"f{n}" for n in range(RECENT_FAILURES + 2, 2, -1)]  # newest first
    assert all(e.job.error for e in view.recent_failures)


# -- positions ------------------------------------------------------------------------


@pytest.mark.parametrize("order", ["fair", "fifo"])
def test_positions_equal_a_count_of_the_queue_in_the_order_the_worker_takes(
    make_store: StoreFactory, clock: FakeClock, order: str
) -> None:
    store = make_store(concurrency=1, default_duration_seconds=50.0, order=order)
    for kind, seconds in {"a": 7.0, "b": 11.0}.items():
        store.enqueue("teacher", kind, "0")
        jid, holder = _claim(store)
        store.finish(jid, holder, result="x", duration_seconds=seconds)
    users = [U, V, W, "user-x"]
    priorities = [0, 3, 10, 20]
    requests = [
        EnqueueRequest(users[n % 4], "abc"[n % 3], f"s{n:03d}", priority=priorities[(n * 7) % 4])
        for n in range(150)
    ]
    store.enqueue_many(requests[:100])
    # Jobs queued again at one instant: their places are decided by the id alone.
    for _ in range(30):
        _finish_next(store)
    clock.advance(5)
    assert store.requeue() == 32  # and the two jobs that taught the means
    store.enqueue_many(requests[100:])
    # A user whose jobs sit only at the ends of the priorities.
    store.enqueue_many(
        [
            EnqueueRequest("edges", "a", "low", priority=0),
            EnqueueRequest("edges", "z", "hi", priority=20),  # a kind with no mean yet
        ]
    )

    means = _means(store)
    assert "z" not in means
    rows = [row for row in _rows(store).values() if row["status"] == "pending"]
    fair = order == "fair"
    # The rule as docs/rules.md writes it: priority, (the turn,) age, id.
    rows.sort(key=lambda r: (r["priority"], r["turn"] if fair else 0, r["queued_at"], r["id"]))
    pending = [(r["priority"], r["queued_at"], r["id"], r["kind"]) for r in rows]
    assert len({(p, q) for p, q, _, _ in pending}) < len(pending)  # ties of age exist
    assert fair == any(r["turn"] for r in rows)
    place = {jid: n for n, (_, _, jid, _) in enumerate(pending)}
    work = {}
    total = 0.0
    for _, _, jid, kind in pending:
        work[jid] = total
        total += means.get(kind, 50.0)

    for user in [*users, "edges"]:
        listed = listed_jobs(store, user)
        assert listed and all(entry["status"] == "pending" for entry in listed)
        for entry in listed:
            assert entry["ahead"] == place[entry["id"]], entry
            expected_eta = work[entry["id"]] + means.get(entry["kind"], 50.0)
            assert entry["eta_seconds"] == pytest.approx(expected_eta, abs=0.1)
        for entry in listed[:3]:
            state = state_of(store, user, entry["kind"], entry["subject"])
            assert state is not None and state.position is not None
            assert state.position.ahead == place[entry["id"]]
    view = store.queue_view(limit=1000)
    assert [e.job.id for e in view.waiting] == [jid for _, _, jid, _ in pending]
    # And the worker takes them in that very order.
    taken = []
    while (claim := store.claim_next("w")).job is not None:
        taken.append(claim.job.id)
        store.finish(claim.job.id, claim.job.holder or "", result="x")
    assert taken == [jid for _, _, jid, _ in pending]


def test_a_job_queued_at_a_moment_another_was_is_placed_by_its_id(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    # First come, first served: a tie of age is broken by the id (in the fair
    # order a user's own jobs keep the order they were queued in).
    store = make_store(order="fifo")
    fixed = dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.UTC)
    url = store._engine.url.render_as_string(hide_password=False)
    pinned = store_for(settings_for(url, order="fifo"), clock=lambda: fixed)
    try:
        subjects = [f"s{n}" for n in range(6)]
        for subject in subjects:
            pinned.enqueue(U, "k", subject)
        by_id = sorted(subjects, key=lambda s: job_id(U, "k", s))
        listed = listed_jobs(store, U)
        assert [entry["subject"] for entry in listed] == by_id
        assert [entry["ahead"] for entry in listed] == list(range(6))
        claimed = store.claim_next("w").job
        assert claimed is not None and claimed.subject == by_id[0]
    finally:
        pinned.close()
