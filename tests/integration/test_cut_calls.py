"""A call cut on our side holds the gateway until the gateway is done with it (H1, H2).

On SQLite and PostgreSQL with the same assertions, on the store's clock (a fake one here). A
call starts at the renewal right before it (`heartbeat(calling=True)`); when it ends on our
side without the gateway's answer it holds one unit of AI_JOB_CONCURRENCY until its start plus
`AI_GATEWAY_CUT_HOLD_SECONDS`, and the gap counts from the hold's end. The job itself is free at
once. The processes and the gateway's own view of this are in tests/acceptance/test_cut_calls.py.
"""

from __future__ import annotations

from typing import Any

import pytest

from queue_store import INTERACTIVE, Blocked, Claim, Failure, Job, JobStore, Status
from queue_store.models import CutCause
from queue_store.rules import WORKER_LOST
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock
from tests.support.reads import state_of

U = "user-1"
HOLD = 100.0  # seconds: AI_GATEWAY_CUT_HOLD_SECONDS
GAP = 10.0


@pytest.fixture
def store(make_store: StoreFactory) -> JobStore:
    return make_store(gap_seconds=GAP, lease_seconds=60, gateway={"cut_hold_seconds": HOLD})


def calling(store: JobStore, worker: str = "w1") -> Job:
    """Claim the next job and start its call (the renewal right before the call)."""
    job = store.claim_next(worker).job
    assert job is not None and job.holder
    assert store.heartbeat(job.id, job.holder, calling=True)
    return job


def blocked(claim: Claim) -> tuple[Blocked | None, float | None]:
    return claim.blocked, None if claim.retry_in is None else round(claim.retry_in, 3)


def test_a_stopped_call_holds_the_gateway_until_its_start_plus_the_hold(
    store: JobStore, clock: FakeClock
) -> None:
    """H1: the job is free at once, the next call waits for the hold, then the gap."""
    store.enqueue(U, "sleep", "d1")
    store.enqueue(U, "sleep", "d2")
    job = calling(store)
    clock.advance(30)
    settled = store.fail(job.id, job.holder or "", Failure.STOPPED, "stopped: shutting down")
    assert (settled.status, settled.attempt_spent) == (Status.PENDING, False)
    # Handed back at once, and the store says why nothing can start yet.
    assert blocked(store.claim_next("w2")) == (Blocked.CONCURRENCY, 70.0)
    clock.advance(69)
    assert store.claim_next("w2").blocked is Blocked.CONCURRENCY
    clock.advance(1.5)  # the hold ended 0.5 s ago: the gap counts from its end
    assert blocked(store.claim_next("w2")) == (Blocked.GAP, 9.5)
    clock.advance(9.6)
    taken = store.claim_next("w2").job
    assert taken is not None and (taken.subject, taken.attempts) == ("d1", 1)


def test_a_call_lost_with_its_worker_holds_from_its_start_and_spends_no_attempt(
    store: JobStore, clock: FakeClock
) -> None:
    """H1, H2: the takeover finds the call in flight; its job waits for the hold."""
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(61)  # the lease lapses 61 s into the call
    assert store.claim_next("w2").blocked is Blocked.CONCURRENCY
    view = store.queue_view()
    assert [(h.cause, h.job and h.job.id) for h in view.holds] == [(CutCause.WORKER_LOST, job.id)]
    hold = view.holds[0]
    assert job.claimed_at is not None and hold.started_at >= job.claimed_at
    assert (hold.until - hold.started_at).total_seconds() == HOLD
    row = store.jobs([job.id])[job.id]
    assert (row.status, row.attempts, row.losses, row.holder) == (Status.PENDING, 0, 1, None)
    clock.advance(HOLD - 61 + GAP + 0.1)
    retried = store.claim_next("w2").job
    assert retried is not None and (retried.id, retried.attempts) == (job.id, 1)


def test_a_claim_that_never_started_its_call_holds_nothing(
    store: JobStore, clock: FakeClock
) -> None:
    store.enqueue(U, "sleep", "d1")
    job = store.claim_next("w1").job
    assert job is not None and job.holder
    assert store.heartbeat(job.id, job.holder)  # a renewal while the prompt is built
    store.fail(job.id, job.holder, Failure.STOPPED, "stopped before the call")
    clock.advance(GAP + 0.1)
    assert store.claim_next("w2").job is not None
    assert store.queue_view().holds == []


@pytest.mark.parametrize(
    "failure", [Failure.REJECTED, Failure.UNAVAILABLE, Failure.RATE_LIMITED, Failure.REFUSED]
)
def test_a_call_the_gateway_ended_holds_nothing(
    make_store: StoreFactory, clock: FakeClock, failure: Failure
) -> None:
    """Only a call cut on our side is held: the gateway answered, or closed it itself."""
    store = make_store(gateway={"cut_hold_seconds": HOLD}, backoff_seconds=0, gap_seconds=0)
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    store.fail(job.id, job.holder or "", failure, "the gateway said no", retry_after=0)
    store.resume()
    assert store.queue_view().holds == []
    assert store.claim_next("w2").job is not None


def test_an_answer_holds_nothing(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "sleep", "d1")
    store.enqueue(U, "sleep", "d2")
    job = calling(store)
    assert store.finish(job.id, job.holder or "", result={"text": "ok"}) is Status.DONE
    clock.advance(GAP + 0.1)
    assert store.claim_next("w2").job is not None


def test_our_timeout_holds_the_rest_of_the_hold_and_spends_the_attempt(
    store: JobStore, clock: FakeClock
) -> None:
    """H1 with N2: the gateway may still be working on a call we gave up on; a timeout spends
    the attempt (a job the gateway cannot finish in time must not loop)."""
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(40)
    settled = store.fail(job.id, job.holder or "", Failure.TIMEOUT, "no answer within 40 s")
    assert settled.attempt_spent and settled.status is Status.PENDING
    store.resume()  # lift the timeout's pause: what remains is the hold
    assert blocked(store.claim_next("w2")) == (Blocked.CONCURRENCY, 60.0)
    assert [h.cause for h in store.queue_view().holds] == [CutCause.TIMEOUT]


def test_a_hold_of_zero_heals_as_before(make_store: StoreFactory, clock: FakeClock) -> None:
    """AI_GATEWAY_CUT_HOLD_SECONDS=0: for a gateway that stops when its client goes."""
    store = make_store(gap_seconds=GAP, gateway={"cut_hold_seconds": 0})
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(30)
    store.fail(job.id, job.holder or "", Failure.STOPPED, "stopped: shutting down")
    assert blocked(store.claim_next("w2")) == (Blocked.GAP, 10.0)
    clock.advance(GAP + 0.1)
    assert store.claim_next("w2").job is not None


def test_a_hold_takes_one_unit_of_the_concurrency(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(concurrency=2, gateway={"cut_hold_seconds": HOLD})
    for subject in ("d1", "d2", "d3"):
        store.enqueue(U, "sleep", subject)
    job = calling(store)
    store.fail(job.id, job.holder or "", Failure.STOPPED, "stopped")
    second = store.claim_next("w2").job
    assert second is not None  # the hold and this call: two units
    assert store.claim_next("w3").blocked is Blocked.CONCURRENCY


def test_recovery_never_ends_a_hold_early(store: JobStore, clock: FakeClock) -> None:
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(61)
    assert [j.id for j in store.recover()] == [job.id]
    store.resume()
    assert store.recover() == []
    assert store.claim_next("w2").blocked is Blocked.CONCURRENCY
    assert len(store.queue_view().holds) == 1


def test_places_and_metrics_count_a_hold_as_a_call_in_flight(
    store: JobStore, clock: FakeClock
) -> None:
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(20)
    store.fail(job.id, job.holder or "", Failure.STOPPED, "stopped")
    state = state_of(store, U, "sleep", "d1")
    assert state is not None and state.position is not None
    assert state.position.in_flight == 1
    # The hold's 80 s left and a gap come before this job's own call.
    assert state.position.eta_seconds >= 80 + GAP
    view = store.queue_view(0)
    assert view.in_flight == 0 and len(view.holds) == 1
    assert view.holds[0].seconds_left(view.now) == pytest.approx(80, abs=0.1)


def test_a_stop_reported_after_the_takeover_keeps_the_attempt(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    """H2, whoever writes first: on its last allowed attempt a self-fenced worker's claim is
    taken over (FIX4 gives it up as lost); the worker's own report of the stop comes later,
    and puts the job back with that attempt kept."""
    store = make_store(max_attempts=2, lease_seconds=60, gateway={"cut_hold_seconds": HOLD})
    store.enqueue(U, "sleep", "d1")
    first = store.claim_next("w1").job
    assert first is not None
    store.fail(first.id, first.holder or "", Failure.REJECTED, "HTTP 400")
    job = calling(store)
    assert job.attempts == 2
    clock.advance(61)
    store.recover()
    lost = store.jobs([job.id])[job.id]
    assert (lost.status, lost.error) == (Status.FAILED, WORKER_LOST)
    settled = store.fail(job.id, job.holder or "", Failure.STOPPED, "stopped: lease at risk")
    assert (settled.status, settled.attempt_spent) == (Status.PENDING, False)
    back = store.jobs([job.id])[job.id]
    assert (back.status, back.attempts, back.losses, back.error) == (
        Status.PENDING,
        1,
        0,
        "stopped: lease at risk",
    )
    # The report was heard once: the same report again changes nothing.
    with pytest.raises(Exception, match="no longer held"):
        store.fail(job.id, job.holder or "", Failure.STOPPED, "again")
    # The hold from the takeover stands.
    assert [h.cause for h in store.queue_view().holds] == [CutCause.WORKER_LOST]


def test_a_screen_finds_the_job_of_a_cut_call_waiting_with_the_hold_in_its_eta(
    store: JobStore, clock: FakeClock
) -> None:
    store.enqueue(U, "sleep", "d1")
    job = calling(store)
    clock.advance(61)
    state = store.poll(U, "sleep", "d1")  # the screen's poll takes the lapsed claim back
    assert state.status is Status.PENDING and state.position is not None
    assert state.position.eta_seconds >= HOLD - 61
    stored: dict[str, Any] = store.jobs([job.id])[job.id].as_dict()
    assert stored["priority"] == INTERACTIVE and stored["attempts"] == 0
