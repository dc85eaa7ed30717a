"""Screens take turns by user, at most `max_interactive` waiting each (A3), on SQLite and
PostgreSQL with the same assertions.

A screen's job is interactive: it goes before every prefetch job, and among interactive jobs
users take turns (the gate's `interactive_turn`), so one user's open screens never push
another user's new one behind all of theirs. A user has at most `AI_JOB_MAX_INTERACTIVE`
(default 8) interactive jobs waiting: past it, the one asked for longest ago falls back to
prefetch priority, in a prefetch turn of its user.
"""

from __future__ import annotations

import pytest

from queue_store import INTERACTIVE, PREFETCH, EnqueueRequest, Failure, JobStore, Status
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock
from tests.support.reads import job_of


def taken(store: JobStore) -> list[str]:
    """Every job, as `user:subject`, in the order the worker takes them (each done at once)."""
    order = []
    while (claim := store.claim_next("w")).job is not None:
        order.append(f"{claim.job.user_id}:{claim.job.subject}")
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    return order


def screens(store: JobStore, clock: FakeClock, user: str, *subjects: str) -> None:
    """A screen of `user` opens on each subject in turn, a second apart: its poll."""
    for subject in subjects:
        store.poll(user, "k", subject)
        clock.advance(1)


def waiting(store: JobStore, user: str) -> dict[str, int]:
    """The user's waiting jobs: subject -> priority."""
    return {
        e.job.subject: e.job.priority
        for e in store.list_jobs(user, limit=100)
        if e.job.status == Status.PENDING
    }


def subjects(prefix: str, count: int) -> list[str]:
    return [f"{prefix}{n}" for n in range(count)]


@pytest.mark.parametrize("order", ["fair", "fifo"])
def test_screens_of_users_take_turns_and_fifo_keeps_the_first_come_order(
    make_store: StoreFactory, clock: FakeClock, order: str
) -> None:
    store = make_store(order=order)
    screens(store, clock, "ann", *subjects("a", 5))
    screens(store, clock, "bob", *subjects("b", 2))
    screens(store, clock, "cid", "c0")
    store.enqueue("dee", "k", "backfill", None, PREFETCH)
    got = taken(store)
    if order == "fifo":
        assert got == [
            "ann:a0", "ann:a1", "ann:a2", "ann:a3", "ann:a4", "bob:b0", "bob:b1", "cid:c0",
            "dee:backfill",
        ]  # fmt: skip
    else:
        assert got == [
            "ann:a0", "bob:b0", "cid:c0", "ann:a1", "bob:b1", "ann:a2", "ann:a3", "ann:a4",
            "dee:backfill",
        ]  # fmt: skip


def test_a_user_with_8_waiting_screens_does_not_push_a_new_one_of_another_behind_all_8(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    screens(store, clock, "ann", *subjects("a", 8))
    screens(store, clock, "bob", "b0")
    state = store.poll("bob", "k", "b0")
    assert state.position is not None and state.position.ahead == 1
    assert taken(store)[:3] == ["ann:a0", "bob:b0", "ann:a1"]


def test_a_screen_that_opens_later_takes_the_turn_being_served(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    screens(store, clock, "ann", *subjects("a", 6))
    for expected in ("ann:a0", "ann:a1", "ann:a2"):  # the queue works a while
        claim = store.claim_next("w")
        assert claim.job is not None and f"ann:{claim.job.subject}" == expected
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    # Bob's first screen goes next, not after ann's three left; his second after her next.
    screens(store, clock, "bob", "b0", "b1")
    assert taken(store) == ["bob:b0", "ann:a3", "bob:b1", "ann:a4", "ann:a5"]


def test_prefetch_turns_are_their_own_whatever_screens_were_served(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    store.enqueue_many([EnqueueRequest("ann", "k", f"p{n}") for n in range(2)])
    store.enqueue_many([EnqueueRequest("bob", "k", f"q{n}") for n in range(2)])
    clock.advance(1)
    screens(store, clock, "cid", *subjects("c", 5))
    for n in range(5):  # serving cid's screens moves the screens' turn on to 4
        claim = store.claim_next("w")
        assert claim.job is not None and claim.job.subject == f"c{n}"
        store.finish(claim.job.id, claim.job.holder or "", result=None)
    # A backfill after it is dealt the prefetch turn being served: still the first.
    store.enqueue_many([EnqueueRequest("dee", "k", "r0")])
    assert taken(store) == ["ann:p0", "bob:q0", "dee:r0", "ann:p1", "bob:q1"]


@pytest.mark.parametrize("order", ["fair", "fifo"])
def test_the_ninth_waiting_screen_of_a_user_demotes_the_one_asked_for_longest_ago(
    make_store: StoreFactory, clock: FakeClock, order: str
) -> None:
    store = make_store(order=order)
    screens(store, clock, "ann", *subjects("a", 8))
    screens(store, clock, "bob", *subjects("b", 8))
    assert set(waiting(store, "ann").values()) == {INTERACTIVE}
    screens(store, clock, "ann", "a8")
    assert waiting(store, "ann") == {"a0": PREFETCH, **{f"a{n}": INTERACTIVE for n in range(1, 9)}}
    first = job_of(store, "ann", "k", "a0")
    assert first is not None and first.requested_at is None, "no screen is waiting on it"
    assert set(waiting(store, "bob").values()) == {INTERACTIVE}, "another user's count"
    got = taken(store)
    assert got.index("ann:a0") == len(got) - 1, "after every screen, as a prefetch job"


def test_the_demoted_screen_takes_a_prefetch_turn_after_its_users_prefetch_jobs(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    store.enqueue_many([EnqueueRequest("ann", "k", f"p{n}") for n in range(2)])
    store.enqueue_many([EnqueueRequest("bob", "k", f"q{n}") for n in range(2)])
    clock.advance(1)
    screens(store, clock, "ann", *subjects("a", 9))
    assert taken(store) == [
        *(f"ann:a{n}" for n in range(1, 9)),
        "ann:p0", "bob:q0", "ann:p1", "bob:q1", "ann:a0",
    ]  # fmt: skip


def test_a_demoted_screen_asked_for_again_is_a_screen_again_and_the_next_oldest_falls_back(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store()
    screens(store, clock, "ann", *subjects("a", 9))
    screens(store, clock, "ann", "a0")  # the person looks at it again
    assert waiting(store, "ann") == {
        "a1": PREFETCH,
        "a0": INTERACTIVE,
        **{f"a{n}": INTERACTIVE for n in range(2, 9)},
    }
    screens(store, clock, "ann", "a9")
    assert waiting(store, "ann")["a2"] == PREFETCH
    assert sum(p == INTERACTIVE for p in waiting(store, "ann").values()) == 8


def test_only_waiting_screens_count_and_the_cap_is_a_setting(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_interactive=3)
    screens(store, clock, "ann", *subjects("a", 3))
    claim = store.claim_next("w")  # a0 is running: no longer waiting
    assert claim.job is not None and claim.job.subject == "a0"
    screens(store, clock, "ann", "a3")
    assert waiting(store, "ann") == {"a1": INTERACTIVE, "a2": INTERACTIVE, "a3": INTERACTIVE}
    running = job_of(store, "ann", "k", "a0")
    assert running is not None and running.status == Status.RUNNING
    assert running.priority == INTERACTIVE, "a running job is not touched"
    screens(store, clock, "ann", "a4")
    assert waiting(store, "ann") == {
        "a1": PREFETCH,
        "a2": INTERACTIVE,
        "a3": INTERACTIVE,
        "a4": INTERACTIVE,
    }
    # Promoting a backfill's job to a screen counts like a new one.
    store.enqueue("ann", "k", "p0", None, PREFETCH)
    screens(store, clock, "ann", "p0")
    assert waiting(store, "ann")["a2"] == PREFETCH
    assert waiting(store, "ann")["p0"] == INTERACTIVE


def test_a_bulk_of_screens_keeps_the_cap_too(make_store: StoreFactory) -> None:
    store = make_store()
    store.enqueue_many([EnqueueRequest("ann", "k", f"a{n}", None, INTERACTIVE) for n in range(10)])
    assert sum(p == INTERACTIVE for p in waiting(store, "ann").values()) == 8


def test_failed_screens_put_back_keep_the_cap_and_take_turns(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(max_attempts=1)
    for subject in ("f0", "f1"):
        screens(store, clock, "ann", subject)
        claim = store.claim_next("w")
        assert claim.job is not None
        store.fail(claim.job.id, claim.job.holder or "", Failure.REJECTED, "HTTP 400")
    screens(store, clock, "bob", *subjects("b", 2))
    screens(store, clock, "ann", *subjects("a", 8))
    store.retry_failed("ann")
    assert sum(p == INTERACTIVE for p in waiting(store, "ann").values()) == 8
    got = taken(store)
    assert got[:3] == ["bob:b0", "ann:a0", "bob:b1"], got
