"""Every numbered rule of the store, on SQLite and PostgreSQL with the same assertions."""

from __future__ import annotations

import datetime as dt

import pytest
from sqlalchemy import create_engine, text

from queue_store import (
    INTERACTIVE,
    PREFETCH,
    Blocked,
    ClaimLost,
    DatabaseError,
    EnqueueRequest,
    Failure,
    InvalidArgument,
    JobStore,
    Position,
    Renewal,
    Settings,
    Status,
    Usage,
    job_id,
)
from queue_store.rules import WORKER_LOST
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.reads import job_of, listed_jobs, pending, result_of, state_of

U = "user-1"


def _raw(store: JobStore, sql: str, **params: object) -> list[dict[str, object]]:
    engine = create_engine(store._engine.url)
    try:
        with engine.connect() as connection:
            return [dict(r._mapping) for r in connection.execute(text(sql), params)]
    finally:
        engine.dispose()


def _row(store: JobStore, kind: str, subject: str, user: str = U) -> dict[str, object]:
    rows = _raw(store, "SELECT * FROM ai_jobs WHERE id = :id", id=job_id(user, kind, subject))
    assert len(rows) == 1
    return rows[0]


def _claim_and_fail(store: JobStore, message: str = "boom") -> Status:
    claim = store.claim_next("w")
    assert claim.job is not None
    return store.fail(claim.job.id, claim.job.holder or "", Failure.BUILD, message).status


# -- R1, R2: enqueue is idempotent; a new key waits with no attempts -----------


def test_job_id_is_sha256_of_the_key() -> None:
    import hashlib

    assert job_id("u", "k", "s") == hashlib.sha256(b"u|k|s").hexdigest()[:64]


def test_new_key_is_inserted_pending_with_no_attempts(store: JobStore) -> None:
    assert store.enqueue(U, "sleep", "2026-01-04", "fp1") == "pending"
    row = _row(store, "sleep", "2026-01-04")
    assert row["status"] == "pending"
    assert row["attempts"] == 0
    assert row["priority"] == PREFETCH
    assert row["fingerprint"] == "fp1"


def test_enqueue_is_idempotent(store: JobStore) -> None:
    for _ in range(5):
        assert store.enqueue(U, "sleep", "d1", "fp") == "pending"
    assert pending(store) == 1


# -- R3: a running job with a live claim is left as it is ----------------------


def test_running_job_with_live_claim_is_left_alone(store: JobStore) -> None:
    store.enqueue(U, "sleep", "d1", "fp1")
    claim = store.claim_next("w")
    assert claim.job is not None
    before = _row(store, "sleep", "d1")
    assert store.enqueue(U, "sleep", "d1", "fp2", priority=INTERACTIVE) == "running"
    assert _row(store, "sleep", "d1") == before


# -- R4: a done job stays done until its data changes --------------------------


def test_done_job_is_done_until_its_fingerprint_changes(store: JobStore) -> None:
    store.enqueue(U, "sleep", "d1", "fp1")
    claim = store.claim_next("w")
    assert claim.job is not None
    store.finish(claim.job.id, claim.job.holder or "", result="text")
    assert store.enqueue(U, "sleep", "d1", "fp1") == "done"
    assert store.enqueue(U, "sleep", "d1") == "done"  # no fingerprint: not stale
    assert store.enqueue(U, "sleep", "d1", "fp2") == "pending"
    row = _row(store, "sleep", "d1")
    assert row["fingerprint"] == "fp2"
    assert row["attempts"] == 0


# -- R5: a job given up cools down, then is queued again -----------------------


def test_exhausted_job_stays_failed_for_the_cooldown_then_requeues_promoted(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=2, retry_after_seconds=1800)
    store.enqueue(U, "sleep", "d1", "fp")
    assert _claim_and_fail(store) == Status.PENDING  # attempt 1 of 2: re-queued
    assert _claim_and_fail(store) == Status.FAILED
    assert store.enqueue(U, "sleep", "d1", "fp") == "failed"
    clock.advance(1799)
    assert store.enqueue(U, "sleep", "d1", "fp", priority=INTERACTIVE) == "failed"
    clock.advance(2)
    assert store.enqueue(U, "sleep", "d1", "fp", priority=INTERACTIVE) == "pending"
    row = _row(store, "sleep", "d1")
    assert row["attempts"] == 0
    assert row["error"] is None
    assert row["priority"] == INTERACTIVE


def test_exhausted_job_with_new_fingerprint_requeues_at_once(make_store: StoreFactory) -> None:
    store = make_store(max_attempts=1)
    store.enqueue(U, "sleep", "d1", "fp1")
    assert _claim_and_fail(store) == Status.FAILED
    assert store.enqueue(U, "sleep", "d1", "fp2") == "pending"
    assert _row(store, "sleep", "d1")["attempts"] == 0


# -- R6: queued again, promoted, never demoted ---------------------------------


def test_priority_is_promoted_never_demoted(store: JobStore) -> None:
    store.enqueue(U, "sleep", "d1", priority=PREFETCH)
    store.enqueue(U, "sleep", "d1", priority=INTERACTIVE)
    assert _row(store, "sleep", "d1")["priority"] == INTERACTIVE
    store.enqueue(U, "sleep", "d1", priority=PREFETCH)
    assert _row(store, "sleep", "d1")["priority"] == INTERACTIVE


def test_fingerprint_kept_when_none_given_and_attempts_reset_only_when_stale(
    make_store: StoreFactory,
) -> None:
    store = make_store(max_attempts=3)
    store.enqueue(U, "sleep", "d1", "fp1")
    _claim_and_fail(store)
    assert _row(store, "sleep", "d1")["attempts"] == 1
    store.enqueue(U, "sleep", "d1")
    row = _row(store, "sleep", "d1")
    assert (row["fingerprint"], row["attempts"]) == ("fp1", 1)
    store.enqueue(U, "sleep", "d1", "fp2")
    row = _row(store, "sleep", "d1")
    assert (row["fingerprint"], row["attempts"]) == ("fp2", 0)


# -- R7: supersede drops the user's other waiting jobs of a kind ---------------


def test_supersede_drops_only_pending_jobs_of_that_kind_for_other_subjects(
    store: JobStore,
) -> None:
    store.enqueue(U, "trends", "old-1")
    store.enqueue(U, "trends", "old-2")
    store.enqueue(U, "trends", "current")
    store.enqueue(U, "sleep", "d1")
    store.enqueue("other-user", "trends", "old-1")
    claim = store.claim_next("w")  # old-1 is oldest: it is running now
    assert claim.job is not None and claim.job.subject == "old-1"
    # A backfill queuing the kind's one live subject drops old-2 only.
    store.enqueue_many([EnqueueRequest(U, "trends", "current", supersede=True)])
    subjects = {(j["kind"], j["subject"]) for j in listed_jobs(store, U)}
    assert subjects == {("trends", "old-1"), ("trends", "current"), ("sleep", "d1")}
    assert job_of(store, "other-user", "trends", "old-1") is not None


# -- R8, R9: the claim order, and attempts per round ---------------------------


def test_claim_order_is_priority_then_age(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "a", "1")
    clock.advance(1)
    store.enqueue(U, "b", "1")
    clock.advance(1)
    store.enqueue(U, "c", "1", priority=INTERACTIVE)
    clock.advance(1)
    store.enqueue(U, "a", "1", priority=5)  # promoted, keeps its age
    order = []
    while (claim := store.claim_next("w")).job is not None:
        order.append(claim.job.kind)
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    assert order == ["c", "a", "b"]


def _taken(store: JobStore) -> list[str]:
    """Every job, as `user:subject`, in the order the worker takes them (each done at once)."""
    order = []
    while (claim := store.claim_next("w")).job is not None:
        order.append(f"{claim.job.user_id}:{claim.job.subject}")
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    return order


def _sync(store: JobStore, user: str, scopes: int, clock: FakeClock) -> None:
    """A post-sync hook: the user's scopes queued at prefetch priority, in one call."""
    store.enqueue_many([EnqueueRequest(user, "k", f"s{n}") for n in range(scopes)])
    clock.advance(1)


@pytest.mark.parametrize("order", ["fair", "fifo"])
def test_fair_users_take_turns_and_fifo_keeps_the_first_come_order(
    make_store: StoreFactory, clock: FakeClock, order: str
) -> None:
    store = make_store(order=order)
    _sync(store, "ann", 3, clock)
    _sync(store, "bob", 3, clock)
    store.enqueue("cid", "k", "s0")  # one job at a time, as a screen would queue them
    clock.advance(1)
    store.enqueue("cid", "k", "s1")
    clock.advance(1)
    store.enqueue("dee", "k", "now", priority=INTERACTIVE)  # a screen: first, always
    taken = _taken(store)
    if order == "fifo":  # R8 exactly: priority, then age
        assert taken == [
            "dee:now", "ann:s0", "ann:s1", "ann:s2", "bob:s0", "bob:s1", "bob:s2",
            "cid:s0", "cid:s1",
        ]  # fmt: skip
    else:  # R8b: within a priority, users take turns, each in their own order
        assert taken == [
            "dee:now", "ann:s0", "bob:s0", "cid:s0", "ann:s1", "bob:s1", "cid:s1",
            "ann:s2", "bob:s2",
        ]  # fmt: skip


def test_a_user_who_syncs_late_waits_about_one_call_per_user_for_a_first_insight(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    for user in ("ann", "bob", "cid"):
        _sync(store, user, 8, clock)
    for _ in range(4):  # the queue works a while
        claim = store.claim_next("w")
        assert claim.job is not None
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    _sync(store, "late", 8, clock)
    taken = _taken(store)
    assert taken.index("late:s0") <= 3, taken  # within about one call per user
    assert [t for t in taken if t.startswith("late:")] == [f"late:s{n}" for n in range(8)]
    # A screen still goes first, whoever's turn it is.
    _sync(store, "ann", 0, clock)
    store.enqueue_many([EnqueueRequest("eve", "k", f"s{n}") for n in range(3)])
    store.enqueue("ann", "k", "screen", priority=INTERACTIVE)
    assert _taken(store)[0] == "ann:screen"


def test_a_job_that_goes_back_in_the_queue_takes_a_new_turn_but_a_refund_keeps_its_own(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=3)
    _sync(store, "ann", 2, clock)
    _sync(store, "bob", 2, clock)
    first = store.claim_next("w").job
    assert first is not None and (first.user_id, first.subject) == ("ann", "s0")
    # A rate limit hands it back in its place: it is taken again next.
    store.fail(first.id, first.holder or "", Failure.RATE_LIMITED, "429", retry_after=0)
    again = store.claim_next("w").job
    assert again is not None and again.id == first.id
    # A spent attempt queues it again in its old place too (R9); a stale
    # re-queue of a finished job takes the turn after its user's last.
    store.finish(again.id, again.holder or "", result=None)
    store.enqueue("ann", "k", "s0", "new-data")
    assert _taken(store) == ["bob:s0", "ann:s1", "bob:s1", "ann:s0"]


def test_a_job_gets_at_most_max_attempts(make_store: StoreFactory) -> None:
    store = make_store(max_attempts=3)
    store.enqueue(U, "sleep", "d1")
    statuses = [_claim_and_fail(store, f"attempt {n}") for n in range(1, 4)]
    assert statuses == [Status.PENDING, Status.PENDING, Status.FAILED]
    assert store.claim_next("w").job is None
    row = _row(store, "sleep", "d1")
    assert (row["status"], row["attempts"], row["error"]) == ("failed", 3, "attempt 3")


# -- R10: retry_failed puts a user's failed jobs back --------------------------


def test_retry_failed_requeues_every_failed_job_of_the_user(make_store: StoreFactory) -> None:
    store = make_store(max_attempts=1)
    for subject in ("1", "2"):
        store.enqueue(U, "sleep", subject)
        _claim_and_fail(store)
    store.enqueue("other", "sleep", "1")
    store.enqueue(U, "trends", "w1")
    done = store.retry_failed(U)
    assert (done.retried, done.pending) == (2, 3)  # retried, and the user's jobs waiting
    for subject in ("1", "2"):
        row = _row(store, "sleep", subject)
        assert (row["status"], row["attempts"], row["error"]) == ("pending", 0, None)


# -- R11: a user's queue in worker order ---------------------------------------


def test_list_jobs_is_in_worker_order_with_the_original_fields(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=1)
    store.enqueue(U, "failed", "1")
    _claim_and_fail(store, "gateway said no")
    store.enqueue(U, "done", "1")
    claim = store.claim_next("w")
    assert claim.job is not None
    store.finish(claim.job.id, claim.job.holder or "", result="ok")
    store.enqueue(U, "late", "1")
    clock.advance(1)
    store.enqueue(U, "later", "1")
    store.enqueue(U, "screen", "1", priority=INTERACTIVE)
    store.enqueue(U, "running", "1", priority=INTERACTIVE)
    running = store.claim_next("w")
    assert running.job is not None and running.job.kind == "screen"

    listed = listed_jobs(store, U, max_attempts=1)
    assert [j["kind"] for j in listed] == ["screen", "running", "late", "later", "failed", "done"]
    first = listed[0]
    assert set(first) >= {
        "kind",
        "subject",
        "status",
        "priority",
        "interactive",
        "attempts",
        "max_attempts",
        "error",
        "updated_at",
    }
    assert first["interactive"] is True and listed[2]["interactive"] is False
    assert listed[4]["error"] == "gateway said no"
    assert first["max_attempts"] == 1
    assert len(listed_jobs(store, U, limit=2)) == 2


def test_a_jobs_state_and_the_count_of_waiting_jobs(store: JobStore) -> None:
    """R11: one job's state as `status` reads it (nothing queued by the read), and how many
    jobs wait, for everyone and for one user."""
    assert state_of(store, U, "sleep", "d1") is None and job_of(store, U, "sleep", "d1") is None
    assert state_of(store, U, "sleep", "d1") is None  # the read queued nothing
    store.enqueue(U, "sleep", "d1")
    store.enqueue("other", "sleep", "d1")
    state = state_of(store, U, "sleep", "d1")
    assert state is not None
    shown = state.as_dict(3)
    assert (shown["status"], shown["priority"], shown["attempts"]) == ("pending", PREFETCH, 0)
    assert shown["max_attempts"] == 3
    assert store.queue_view(0).waiting_total == 2
    assert pending(store) == 2
    assert pending(store, U) == 1


# -- R12: AI_JOBS=false stops the consumer, never the store --------------------


def test_disabled_consumer_does_not_disable_the_store(make_store: StoreFactory) -> None:
    store = make_store(enabled=False)
    assert store.enqueue(U, "sleep", "d1") == "pending"
    assert store.claim_next("w").job is not None


# -- FIX1: counting calls in flight and claiming are one step ------------------


def test_concurrency_limit_holds_across_stores(make_store: StoreFactory) -> None:
    first, second = make_store(concurrency=1), make_store(concurrency=1)
    store = first
    store.enqueue(U, "a", "1")
    store.enqueue(U, "b", "1")
    assert first.claim_next("w1").job is not None
    blocked = second.claim_next("w2")
    assert blocked.job is None and blocked.blocked == Blocked.CONCURRENCY


def test_concurrency_two_allows_two(make_store: StoreFactory) -> None:
    store = make_store(concurrency=2)
    for kind in "abc":
        store.enqueue(U, kind, "1")
    assert store.claim_next("w1").job is not None
    assert store.claim_next("w2").job is not None
    assert store.claim_next("w3").blocked == Blocked.CONCURRENCY


# -- FIX2: a worker's writes are fenced by its claim's token -------------------


def test_taken_over_worker_changes_nothing(make_store: StoreFactory, clock: FakeClock) -> None:
    store = make_store(lease_seconds=60, heartbeat_seconds=5)
    store.enqueue(U, "sleep", "d1")
    old = store.claim_next("w1").job
    assert old is not None and old.holder
    clock.advance(61)
    new = store.claim_next("w2").job
    assert new is not None and new.id == old.id and new.holder != old.holder
    before = _row(store, "sleep", "d1")
    assert store.heartbeat(old.id, old.holder) is Renewal.LOST
    with pytest.raises(ClaimLost):
        store.finish(old.id, old.holder, result="late")
    with pytest.raises(ClaimLost):
        store.fail(old.id, old.holder, Failure.BUILD, "late")
    with pytest.raises(ClaimLost):
        store.fail(old.id, old.holder, Failure.STOPPED, "handed back")
    assert store.heartbeat(old.id, old.holder, flow_run_id="run-1") is Renewal.LOST
    assert _row(store, "sleep", "d1") == before
    assert result_of(store, U, "sleep", "d1") is None
    assert store.finish(new.id, new.holder or "", result="fresh") == Status.DONE


def test_a_new_claim_by_the_same_worker_name_gets_a_new_token(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    store.enqueue(U, "sleep", "d1")
    first = store.claim_next("w").job
    clock.advance(61)
    second = store.claim_next("w").job
    assert first is not None and second is not None
    assert first.holder != second.holder
    assert store.heartbeat(first.id, first.holder or "") is Renewal.LOST


# -- FIX3: a claim lives by its heartbeat --------------------------------------


def test_heartbeat_keeps_a_long_call_alive(make_store: StoreFactory, clock: FakeClock) -> None:
    store = make_store(lease_seconds=60, heartbeat_seconds=5, claim_timeout_seconds=1800)
    store.enqueue(U, "sleep", "d1")
    job = store.claim_next("w1").job
    assert job is not None and job.holder
    for _ in range(20):  # 20 minutes of heartbeats: far beyond the lease
        clock.advance(59)
        assert store.heartbeat(job.id, job.holder)
        assert store.enqueue(U, "sleep", "d1") == "running"
    assert store.claim_next("w2").blocked == Blocked.CONCURRENCY


def test_silent_claim_is_dead_after_the_lease(make_store: StoreFactory, clock: FakeClock) -> None:
    store = make_store(lease_seconds=60, heartbeat_seconds=5)
    store.enqueue(U, "sleep", "d1")
    store.enqueue(U, "sleep", "d2")
    assert store.claim_next("w1").job is not None
    clock.advance(59)
    assert store.claim_next("w2").blocked == Blocked.CONCURRENCY
    clock.advance(2)
    taken = store.claim_next("w2").job
    # H2: the lost claim spent no attempt; it is counted as a loss instead.
    assert taken is not None and taken.subject == "d1"
    assert (taken.attempts, taken.losses) == (1, 1)


def test_claim_timeout_bounds_an_attempt_even_with_heartbeats(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(lease_seconds=60, heartbeat_seconds=5, claim_timeout_seconds=300)
    store.enqueue(U, "sleep", "d1")
    job = store.claim_next("w1").job
    assert job is not None and job.holder
    for _ in range(5):
        clock.advance(50)
        assert store.heartbeat(job.id, job.holder)
    clock.advance(51)  # 301 s since the claim
    assert store.heartbeat(job.id, job.holder) is Renewal.LAPSED
    assert store.enqueue(U, "sleep", "d1") == "pending"


# -- FIX4: a last attempt lost with its worker fails the job -------------------


def test_last_attempt_dying_with_its_worker_fails_the_job(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """FIX4: the last allowed attempt lost with its worker fails the job "worker lost"."""
    store = make_store(max_attempts=2, lease_seconds=60)
    store.enqueue(U, "sleep", "d1")
    store.enqueue(U, "sleep", "d2")
    first = store.claim_next("w1").job  # attempt 1, spent by the gateway's refusal
    assert first is not None and first.holder
    store.fail(first.id, first.holder, Failure.REJECTED, "HTTP 400")
    second = store.claim_next("w2").job  # attempt 2, the last
    assert second is not None and second.subject == "d1" and second.attempts == 2
    clock.advance(61)
    nxt = store.claim_next("w3").job
    assert nxt is not None and nxt.subject == "d2"
    row = _row(store, "sleep", "d1")
    assert (row["status"], row["error"], row["attempts"]) == ("failed", WORKER_LOST, 2)


def test_a_lost_claim_spends_no_attempt_but_a_job_lost_too_often_fails(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """H2: a claim lost with its worker is not held against the job's attempts; a job whose
    claims are lost AI_JOB_MAX_ATTEMPTS times in a row fails, so one that kills its worker
    cannot loop."""
    store = make_store(max_attempts=3, lease_seconds=60)
    store.enqueue(U, "sleep", "d1")
    for loss in (1, 2):
        claimed = store.claim_next(f"w{loss}").job
        assert claimed is not None and claimed.attempts == 1
        clock.advance(61)
        assert store.recover() != []
        row = _row(store, "sleep", "d1")
        assert (row["status"], row["attempts"], row["losses"]) == ("pending", 0, loss)
    assert store.claim_next("w3").job is not None
    clock.advance(61)
    store.recover()
    row = _row(store, "sleep", "d1")
    assert (row["status"], row["attempts"], row["losses"]) == ("failed", 0, 3)
    assert row["error"] == "worker lost 3 times in a row: the job may be what stops its worker"
    # Given up like a job whose attempts are spent: polls report it failed during the cooldown.
    assert store.enqueue(U, "sleep", "d1") == Status.FAILED


def test_enqueue_of_a_dead_last_attempt_reports_failed_not_pending(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=1, lease_seconds=60)
    store.enqueue(U, "sleep", "d1")
    assert store.claim_next("w1").job is not None
    clock.advance(61)
    assert store.enqueue(U, "sleep", "d1") == "failed"
    assert _row(store, "sleep", "d1")["error"] == WORKER_LOST


# -- FIX5: recovery takes back dead claims only --------------------------------


def test_recover_releases_dead_and_own_claims_never_a_live_one(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(concurrency=3, lease_seconds=60)
    for subject in ("dead", "mine", "live"):
        store.enqueue(U, "sleep", subject)
    dead = store.claim_next("crashed").job
    clock.advance(50)
    mine = store.claim_next("me").job
    live = store.claim_next("other").job
    assert dead and mine and live
    clock.advance(20)  # only "dead" has a lapsed heartbeat
    assert len(store.recover("me")) == 2
    assert _row(store, "sleep", "dead")["status"] == "pending"
    assert _row(store, "sleep", "mine")["status"] == "pending"
    live_row = _row(store, "sleep", "live")
    assert (live_row["status"], live_row["holder"]) == ("running", live.holder)
    assert store.recover() == []


def test_recover_matches_the_worker_exactly_never_a_prefix_or_another_case(
    make_store: StoreFactory,
) -> None:
    store = make_store(concurrency=3, lease_seconds=60)
    for subject in ("a", "b", "c"):
        store.enqueue(U, "sleep", subject)
    held = [store.claim_next(name).job for name in ("web-1", "worker", "web")]
    assert all(held)
    for other in ("we", "WORKER", "Web", "web-", "work", "w_b", "_eb"):
        assert store.recover(other) == [], other
    # "web" is a worker of its own: only its claim comes back.
    assert [j.worker for j in store.recover("web")] == ["web"]
    rows = [store.jobs([job.id])[job.id] for job in held if job]
    assert {r.worker for r in rows if r and r.status == Status.RUNNING} == {"web-1", "worker"}
    # A claim's token is "<worker>/<nonce>": no name can hold the separator.
    for bad in ("web/1", "web%", "*", " web", ""):
        with pytest.raises(InvalidArgument) as refused:
            store.recover(bad)
        assert refused.value.argument == "worker"


# -- FIX6: the gap after a call is deployment-wide -----------------------------


def test_gap_is_global_across_stores(make_store: StoreFactory, clock: FakeClock) -> None:
    first, second = make_store(gap_seconds=20), make_store(gap_seconds=20)
    first.enqueue(U, "a", "1")
    first.enqueue(U, "b", "1")
    job = first.claim_next("w1").job
    assert job is not None
    first.finish(job.id, job.holder or "", result="x")
    clock.advance(5)
    blocked = second.claim_next("w2")
    assert blocked.blocked == Blocked.GAP
    assert blocked.retry_in is not None and 14 < blocked.retry_in <= 15
    clock.advance(15)
    assert second.claim_next("w2").job is not None


def test_gap_follows_failures_too(make_store: StoreFactory, clock: FakeClock) -> None:
    store = make_store(gap_seconds=20)
    store.enqueue(U, "a", "1")
    _claim_and_fail(store)
    assert store.claim_next("w").blocked == Blocked.GAP


# -- FIX7: a poll that changes nothing writes nothing --------------------------


def test_a_poll_that_changes_nothing_writes_nothing(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "sleep", "d1", "fp", priority=INTERACTIVE)
    before = _row(store, "sleep", "d1")
    clock.advance(3)
    for priority in (INTERACTIVE, PREFETCH):
        assert store.enqueue(U, "sleep", "d1", "fp", priority=priority) == "pending"
        assert store.enqueue(U, "sleep", "d1", priority=priority) == "pending"
    assert _row(store, "sleep", "d1") == before


def test_a_poll_on_a_done_job_writes_nothing(store: JobStore) -> None:
    store.enqueue(U, "sleep", "d1", "fp")
    job = store.claim_next("w").job
    assert job is not None
    store.finish(job.id, job.holder or "", result="x")
    before = _row(store, "sleep", "d1")
    assert store.enqueue(U, "sleep", "d1", "fp") == "done"
    assert _row(store, "sleep", "d1") == before


# -- FIX8: bad input is refused before the database ----------------------------


@pytest.mark.parametrize(
    ("arguments", "named"),
    [
        (("", "k", "s"), "user_id"),
        (("u", "", "s"), "kind"),
        (("u", "k", ""), "subject"),
        (("u" * 201, "k", "s"), "user_id"),
        ((1, "k", "s"), "user_id"),
        (("u", None, "s"), "kind"),
        (("u", "k", b"s"), "subject"),
        (("u", "k", "s", "f" * 201), "fingerprint"),
        (("u", "k", "s", 5), "fingerprint"),
        (("u", "k", "s", None, True), "priority"),
        (("u", "k", "s", None, -1), "priority"),
        (("u", "k", "s", None, 1.5), "priority"),
        (("u", "k", "s", None, "0"), "priority"),
        (("a|b", "k", "s"), "user_id"),  # would share an id with ("a", "b|k", "s")
        (("u", "k|x", "s"), "kind"),
    ],
)
def test_invalid_input_is_refused_before_the_database(
    store: JobStore, arguments: tuple[object, ...], named: str
) -> None:
    from queue_store import InvalidArgument

    with pytest.raises(InvalidArgument) as caught:
        store.enqueue(*arguments)  # type: ignore[arg-type]
    assert isinstance(caught.value, ValueError)
    assert caught.value.argument == named
    assert str(caught.value).startswith(named)
    assert pending(store) == 0


def test_database_errors_surface_as_the_stores_own(tmp_path: object) -> None:
    # The URL is handed to the store itself, not through settings whose redactor would hide
    # the password too: what is tested is the store's own wrapping of a driver error.
    store = JobStore(
        "postgresql://nobody:secret-password@127.0.0.1:1/none",
        settings=Settings(database_url="sqlite://"),
        check_schema=False,
    )
    with pytest.raises(DatabaseError) as caught:
        pending(store)
    assert "secret-password" not in str(caught.value)


def test_finish_refuses_a_result_it_cannot_store(store: JobStore) -> None:
    from queue_store import InvalidArgument

    store.enqueue(U, "sleep", "d1")
    job = store.claim_next("w").job
    assert job is not None and job.holder
    with pytest.raises(InvalidArgument):
        store.finish(job.id, job.holder, result={"not json": object()})
    assert _row(store, "sleep", "d1")["status"] == "running"


# -- N1: results, readable while a newer one is made ---------------------------


def test_previous_result_stays_readable_while_regenerating(
    store: JobStore, clock: FakeClock
) -> None:
    store.enqueue(U, "sleep", "d1", "fp1")
    job = store.claim_next("w").job
    assert job is not None
    clock.advance(42)
    store.finish(job.id, job.holder or "", result={"text": "first"})
    first = result_of(store, U, "sleep", "d1")
    assert first is not None
    assert (first.output, first.fingerprint) == ({"text": "first"}, "fp1")
    assert first.duration_seconds == pytest.approx(42, abs=0.01)

    assert store.enqueue(U, "sleep", "d1", "fp2") == "pending"
    assert result_of(store, U, "sleep", "d1") == first
    job = store.claim_next("w").job
    assert job is not None
    assert result_of(store, U, "sleep", "d1") == first  # running: still the old one
    store.fail(job.id, job.holder or "", Failure.REJECTED, "gateway error")
    assert result_of(store, U, "sleep", "d1") == first  # a failure keeps it too
    job = store.claim_next("w").job
    assert job is not None
    store.finish(job.id, job.holder or "", result={"text": "second"})
    second = result_of(store, U, "sleep", "d1")
    assert second is not None
    assert (second.output, second.fingerprint) == ({"text": "second"}, "fp2")
    assert second.produced_at > first.produced_at


# -- N2: an unreachable gateway spends no attempt (the store's side) -----------


def test_a_stop_hands_back_without_spending_the_attempt(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "a", "1")
    clock.advance(1)
    store.enqueue(U, "b", "1")
    job = store.claim_next("w").job
    assert job is not None and job.kind == "a" and job.attempts == 1
    store.fail(job.id, job.holder or "", Failure.STOPPED, "the consumer is stopping")
    row = _row(store, "a", "1")
    assert (row["status"], row["attempts"], row["holder"]) == ("pending", 0, None)
    again = store.claim_next("w").job
    assert again is not None and again.kind == "a"  # back in its old place


def test_outage_pauses_every_worker_with_growing_capped_backoff(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(backoff_seconds=10, backoff_max_seconds=35)
    other = make_store(backoff_seconds=10, backoff_max_seconds=35)
    store.enqueue(U, "a", "1")
    pauses = []
    for _ in range(4):
        job = store.claim_next("w1").job
        assert job is not None
        settled = store.fail(job.id, job.holder or "", Failure.UNAVAILABLE, "connect refused")
        assert settled.pause_seconds is not None and not settled.attempt_spent
        pauses.append(settled.pause_seconds)
        blocked = other.claim_next("w2")
        assert blocked.blocked == Blocked.PAUSED
        assert blocked.retry_in == pytest.approx(pauses[-1], abs=0.01)
        clock.advance(pauses[-1] + 0.001)
    assert pauses == [10, 20, 35, 35]
    job = other.claim_next("w2").job
    assert job is not None
    other.finish(job.id, job.holder or "", result="ok")
    assert store.gate_state().outages_in_a_row == 0
    store.enqueue(U, "b", "1")
    job = store.claim_next("w1").job
    assert job is not None
    again = store.fail(job.id, job.holder or "", Failure.UNAVAILABLE, "again")
    assert again.pause_seconds == 10


def test_rate_limits_that_name_no_wait_back_off_further_each_time(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(backoff_seconds=10, backoff_max_seconds=35)
    store.enqueue(U, "a", "1")

    def limited(retry_after: float | None = None) -> float | None:
        job = store.claim_next("w").job
        assert job is not None and job.attempts == 1
        settled = store.fail(
            job.id, job.holder or "", Failure.RATE_LIMITED, "HTTP 429", retry_after=retry_after
        )
        assert (settled.status, settled.attempt_spent) == (Status.PENDING, False)
        assert store.claim_next("w").blocked == Blocked.PAUSED
        assert settled.pause_seconds is not None
        clock.advance(settled.pause_seconds + 0.001)
        return settled.pause_seconds

    assert [limited() for _ in range(4)] == [10, 20, 35, 35]
    # A wait the gateway names is the wait taken, and grows nothing.
    assert limited(retry_after=3) == 3
    assert store.gate_state().outages_in_a_row == 4
    # An answer ends the streak.
    job = store.claim_next("w").job
    assert job is not None
    store.finish(job.id, job.holder or "", result="ok")
    store.enqueue(U, "b", "1")
    assert limited() == 10
    row = _row(store, "b", "1")
    assert (row["status"], row["attempts"]) == ("pending", 0)


def test_pause_and_resume(store: JobStore) -> None:
    store.enqueue(U, "a", "1")
    store.pause(600, "maintenance")
    claim = store.claim_next("w")
    assert claim.blocked == Blocked.PAUSED and claim.retry_in == pytest.approx(600, abs=1)
    assert store.gate_state().pause_reason == "maintenance"
    store.resume()
    assert store.claim_next("w").job is not None


# -- N3: a place in line and an ETA --------------------------------------------


def _position(store: JobStore, user_id: str, kind: str, subject: str) -> Position | None:
    state = state_of(store, user_id, kind, subject)
    return state.position if state else None


def test_position_and_eta(make_store: StoreFactory, clock: FakeClock) -> None:
    # First come, first served: the places below are R8's (the fair order has its tests).
    store = make_store(gap_seconds=10, default_duration_seconds=100, order="fifo")
    # Teach the store that "fast" takes 30 s.
    store.enqueue("x", "fast", "0")
    job = store.claim_next("w").job
    assert job is not None
    clock.advance(30)
    store.finish(job.id, job.holder or "", result="x")
    clock.advance(10)

    for kind in ("fast", "slow"):
        for n in range(2):
            store.enqueue("other", kind, str(n))
            clock.advance(1)
    store.enqueue(U, "slow", "mine")
    running = store.claim_next("w").job  # "fast 0" of the other user
    assert running is not None and running.kind == "fast"
    clock.advance(10)

    position = _position(store, U, "slow", "mine")
    assert position is not None
    assert (position.status, position.ahead, position.in_flight) == (Status.PENDING, 3, 1)
    # in flight: 30 - 10 = 20 left; ahead: fast 30 + slow 100 + slow 100;
    # a gap after each of the four calls before mine; then mine: 100.
    assert position.eta_seconds == pytest.approx(20 + 230 + 40 + 100, abs=0.1)

    store.enqueue(U, "slow", "mine", priority=INTERACTIVE)
    promoted = _position(store, U, "slow", "mine")
    assert promoted is not None and promoted.ahead == 0
    assert promoted.eta_seconds == pytest.approx(20 + 10 + 100, abs=0.1)

    listed = {j["subject"]: j for j in listed_jobs(store, U)}
    assert listed["mine"]["ahead"] == 0

    running_position = _position(store, "other", "fast", "0")
    assert running_position is not None and running_position.status == Status.RUNNING
    assert running_position.eta_seconds == pytest.approx(20, abs=0.1)
    assert _position(store, U, "nothing", "here") is None


def test_list_jobs_positions_count_the_users_own_earlier_jobs(
    store: JobStore, clock: FakeClock
) -> None:
    for n in range(3):
        store.enqueue(U, "k", str(n))
        clock.advance(1)
        store.enqueue("other", "k", str(n))
        clock.advance(1)
    listed = listed_jobs(store, U)
    assert [j["ahead"] for j in listed] == [0, 2, 4]


def test_clock_must_be_aware(database_url: str) -> None:
    from queue_store import InvalidArgument

    store = store_for(settings_for(database_url), clock=lambda: dt.datetime(2026, 1, 1))
    with pytest.raises(InvalidArgument):
        store.enqueue(U, "a", "1")
    store.close()


# -- N4: each attempt's run in the history -------------------------------------


def test_an_attempts_run_reaching_the_store_after_the_attempt_is_still_linked(
    store: JobStore, clock: FakeClock
) -> None:
    """N4: the run history may write an attempt's entry after the attempt ended (a slow
    Prefect): its worker's late word, fenced by the token of the claim that ended, links the
    job and the result that claim produced, and nothing of a newer claim's."""
    store.enqueue(U, "sleep", "d1", "fp1")
    first = store.claim_next("w1").job
    assert first is not None and first.holder
    store.finish(first.id, first.holder, result={"text": "one"})
    assert store.heartbeat(first.id, first.holder, flow_run_id="run-1") is Renewal.LOST
    done = job_of(store, U, "sleep", "d1")
    result = result_of(store, U, "sleep", "d1")
    assert done is not None and done.flow_run_id == "run-1"
    assert result is not None and result.flow_run_id == "run-1"

    clock.advance(5)
    store.enqueue(U, "sleep", "d1", "fp2")  # new data: made again
    second = store.claim_next("w2").job
    assert second is not None and second.holder
    # The first claim's word while a newer claim holds the job changes nothing.
    assert store.heartbeat(first.id, first.holder, flow_run_id="run-x") is Renewal.LOST
    running = job_of(store, U, "sleep", "d1")
    assert running is not None and running.flow_run_id == "run-1"
    store.fail(second.id, second.holder, Failure.REJECTED, "HTTP 400")
    assert store.heartbeat(second.id, second.holder, flow_run_id="run-2") is Renewal.LOST
    failed = job_of(store, U, "sleep", "d1")
    kept = result_of(store, U, "sleep", "d1")
    assert failed is not None and failed.flow_run_id == "run-2"
    # The result is the first claim's: its run stays the one that produced it.
    assert kept is not None and kept.flow_run_id == "run-1"


# -- consumers' presence ---------------------------------------------------------


def test_a_stable_worker_name_taken_up_by_a_new_process_describes_the_new_one(
    store: JobStore, clock: FakeClock
) -> None:
    """serve restarted after a crash keeps its worker name; the row must not keep the dead pid."""
    import os

    from sqlalchemy import update

    from queue_store.schema import workers

    store.presence("serve-main", "consumer")
    first = next(w for w in store.queue_view(0).workers if w.name == "serve-main")
    assert first.pid == os.getpid()
    # The row as a crashed process left it: another pid, an older start.
    with store._write("test") as connection:
        connection.execute(update(workers).values(pid=first.pid + 100_000))
    clock.advance(5)
    store.presence("serve-main", "consumer")
    again = next(w for w in store.queue_view(0).workers if w.name == "serve-main")
    assert again.pid == os.getpid()
    assert again.started_at > first.started_at
    # Seen again by the same process: its start stays.
    clock.advance(5)
    store.presence("serve-main", "consumer", {"lanes": 1})
    same = next(w for w in store.queue_view(0).workers if w.name == "serve-main")
    assert (same.pid, same.started_at) == (again.pid, again.started_at)
    assert same.seen_at > again.seen_at


# -- M1, M2: tallies and tokens ---------------------------------------------------


def test_tokens_are_kept_per_result_and_summed_per_user_and_kind_unknown_apart(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=3)
    for user, subject in (("ann", "d1"), ("ann", "d2"), ("bob", "d1")):
        store.enqueue(user, "sleep", subject)
    store.enqueue("ann", "hrv", "d1")
    said = {("ann", "d1"): Usage(100, 20), ("ann", "d2"): None, ("bob", "d1"): Usage(7, 3)}
    for _ in said:
        job = store.claim_next("w").job
        assert job is not None and job.kind == "sleep"
        used = said[(job.user_id, job.subject)]
        store.finish(job.id, job.holder or "", result="x", usage=used, duration_seconds=12.0)
    # A parse failure after an answer that said its usage: the tokens count too.
    job = store.claim_next("w").job
    assert job is not None and job.kind == "hrv"
    store.fail(
        job.id, job.holder or "", Failure.PARSE, "bad", answer=Usage(50, 0), duration_seconds=3
    )

    kept = result_of(store, "ann", "sleep", "d1")
    assert kept is not None and kept.as_dict()["usage"] == {
        "prompt_tokens": 100,
        "completion_tokens": 20,
    }
    unknown = result_of(store, "ann", "sleep", "d2")
    assert unknown is not None and unknown.as_dict()["usage"] is None  # unknown, not zero

    view = store.queue_view(10)
    rows = {(u.user_id, u.kind): u for u in view.usage}
    ann = rows[("ann", "sleep")]
    assert (ann.answers, ann.unknown, ann.prompt_tokens, ann.completion_tokens) == (2, 1, 100, 20)
    assert ann.described() == "120 (100 prompt + 20 completion); 1 answer(s) did not say"
    assert rows[("ann", "hrv")].described() == "50 (50 prompt + 0 completion)"
    assert (view.usage_total.answers, view.usage_total.unknown) == (4, 1)
    assert view.usage_total.prompt_tokens == 157
    assert view.as_dict()["usage"]["total"]["completion_tokens"] == 23
    # Only answers count: an attempt that never got one adds nothing.
    store.enqueue("cid", "sleep", "d1")
    job = store.claim_next("w").job
    assert job is not None
    store.fail(job.id, job.holder or "", Failure.UNAVAILABLE, "connect refused")
    assert store.queue_view(10).usage_total.answers == 4


def test_the_store_tallies_attempts_calls_and_screens_waits(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=1)
    store.enqueue("ann", "sleep", "d1", priority=INTERACTIVE)  # a screen asks
    clock.advance(7)
    job = store.claim_next("w").job
    assert job is not None
    clock.advance(30)
    store.finish(job.id, job.holder or "", result="x", duration_seconds=30.0)
    store.enqueue("ann", "sleep", "d2")
    job = store.claim_next("w").job
    assert job is not None
    store.fail(job.id, job.holder or "", Failure.REJECTED, "HTTP 400", duration_seconds=2.0)
    store.enqueue("ann", "hrv", "d1")
    job = store.claim_next("w").job
    assert job is not None
    store.fail(job.id, job.holder or "", Failure.BUILD, "no data")  # no call made

    seen = store.queue_view(0)
    kept = {(t.name, t.kind, t.outcome): t for t in seen.tallies}
    assert kept[("attempts", "sleep", "done")].count == 1
    assert kept[("attempts", "sleep", "rejected")].count == 1
    assert kept[("attempts", "hrv", "build")].count == 1
    calls = kept[("call_seconds", "sleep", "done")]
    assert (calls.count, calls.total) == (1, 30.0)
    assert calls.buckets == (0, 0, 0, 1, 1, 1, 1, 1, 1, 1)  # cumulative, 30 s <= 30
    assert ("call_seconds", "hrv", "build") not in kept  # no call, no call time
    wait = kept[("screen_wait_seconds", "sleep", "")]
    assert wait.count == 1 and wait.total == pytest.approx(7.0, abs=0.01)
    assert seen.in_flight == 0
    assert seen.waiting_by_class == {"interactive": (0, None), "prefetch": (0, None)}
    store.enqueue("bob", "sleep", "d1")
    clock.advance(60)
    waiting, oldest = store.queue_view(0).waiting_by_class["prefetch"]
    assert waiting == 1 and oldest is not None
    assert (store.queue_view(0).now - oldest).total_seconds() == pytest.approx(60, abs=0.01)
