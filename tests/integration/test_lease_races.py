"""Counting, reaping, claiming and renewing never interleave into two live claims (L3).

Forced orderings of the interleavings that once broke the limit, and a
randomised harness: actor processes, each with its own store and connection,
run claim/heartbeat/settle/enqueue/recover calls in random order and in
parallel, on a clock only the test moves. After every round, the test checks
the lease from the workers' side: a worker may be calling until its last
confirmed renewal (or claim) plus the lease minus the margin. No two workers
may believe so at once above the limit.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import random
import threading
from typing import Any

import pytest
from sqlalchemy import text

from queue_store import INTERACTIVE, Blocked, Failure, Renewal, Status
from queue_store.engine import SQLITE_BEGIN, create_store_engine
from tests.conftest import StoreFactory
from tests.support.databases import FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import actor
from tests.support.reads import state_of

SPAWN = multiprocessing.get_context("spawn")
U = "user"


# -- forced orderings ------------------------------------------------------------


def test_a_lapsed_claim_is_never_revived_and_the_next_claim_takes_it_back(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(lease_seconds=10, heartbeat_seconds=1, concurrency=1)
    other = make_store(lease_seconds=10, heartbeat_seconds=1, concurrency=1)
    store.enqueue(U, "k", "a")
    store.enqueue(U, "k", "b")
    held = store.claim_next("w1").job
    assert held is not None and held.holder
    clock.advance(10.5)
    # Nobody took it back yet, but the renewal comes too late: it stays dead.
    assert store.heartbeat(held.id, held.holder) is Renewal.LAPSED
    row = store.jobs([held.id])[held.id]
    assert (
        row is not None and row.status == Status.RUNNING and row.heartbeat_at == held.heartbeat_at
    )
    # Its worker stopped by its own deadline: it is no call in flight. The
    # next claim takes the job back and hands it out again; the lost claim
    # spent no attempt (H2), so it is attempt 1 again.
    waiting = state_of(other, U, "k", "b")
    assert waiting is not None and waiting.position is not None
    assert waiting.position.in_flight == 0
    taken = other.claim_next("w2").job
    assert taken is not None and (taken.id, taken.attempts, taken.losses) == (held.id, 1, 1)
    assert store.heartbeat(held.id, held.holder) is Renewal.LOST


def test_a_renewal_moves_the_revision_so_a_screens_write_cannot_requeue_a_live_job(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(lease_seconds=10, heartbeat_seconds=1)
    store.enqueue(U, "k", "a")
    held = store.claim_next("w1").job
    assert held is not None and held.holder
    before = store.jobs([held.id])[held.id]
    clock.advance(9)
    assert store.heartbeat(held.id, held.holder) is Renewal.RENEWED
    after = store.jobs([held.id])[held.id]
    assert before is not None and after is not None and after.updated_at == before.updated_at
    # A screen's poll right after the renewal sees a live claim: nothing changes.
    clock.advance(9)
    assert store.enqueue(U, "k", "a", "new-data", INTERACTIVE) == Status.RUNNING
    assert store.jobs([held.id])[held.id] == after


def test_a_lapsed_claim_found_by_a_screen_is_taken_back_and_restarts_the_gap(
    make_store: StoreFactory, clock: FakeClock
) -> None:
    store = make_store(lease_seconds=10, heartbeat_seconds=1, gap_seconds=30)
    store.enqueue(U, "k", "a")
    held = store.claim_next("w1").job
    assert held is not None
    clock.advance(11)
    assert store.enqueue(U, "k", "a", priority=INTERACTIVE) == Status.PENDING
    job = store.jobs([held.id])[held.id]
    # Taken back without spending the attempt (H2).
    assert job is not None and (job.status, job.holder, job.attempts) == (Status.PENDING, None, 0)
    assert job.priority == INTERACTIVE
    blocked = store.claim_next("w2")
    assert blocked.blocked is Blocked.GAP and blocked.retry_in is not None
    assert blocked.retry_in > 29


@pytest.mark.timeout(120)
def test_a_renewal_waits_for_a_claim_that_holds_the_gate(database_url: str) -> None:
    """The gate lock serialises them: a heartbeat cannot land between a count and a reap."""
    settings = settings_for(database_url=database_url)
    store = store_for(settings)
    store.enqueue(U, "k", "a")
    held = store.claim_next("w1").job
    assert held is not None and held.holder
    engine = create_store_engine(database_url)
    finished = threading.Event()
    result: list[Renewal] = []

    def renew() -> None:
        result.append(store.heartbeat(held.id, held.holder or ""))
        finished.set()

    with engine.connect() as plain:
        sqlite = engine.dialect.name == "sqlite"
        connection = plain.execution_options(**{SQLITE_BEGIN: "IMMEDIATE"}) if sqlite else plain
        connection.begin()
        if not sqlite:
            connection.execute(text("SELECT * FROM ai_job_gate WHERE id = 1 FOR UPDATE"))
        worker = threading.Thread(target=renew)
        worker.start()
        assert not finished.wait(1.0), "the renewal did not wait for the gate"
        connection.rollback()
    worker.join(30)
    assert result == [Renewal.RENEWED]
    engine.dispose()
    store.close()


# -- the randomised harness ------------------------------------------------------------


LEASE = 10.0
MARGIN = 2.0


@dataclasses.dataclass
class Belief:
    """What a worker knows of its claim: it may call until `until` (shared seconds)."""

    job: str
    holder: str
    until: float


class Actor:
    def __init__(self, name: str, url: str, settings: dict[str, Any], shared: Any) -> None:
        self.name = name
        self.inbox = SPAWN.Queue()
        self.outbox = SPAWN.Queue()
        self.process = SPAWN.Process(
            target=actor, args=(url, settings, self.inbox, self.outbox, shared), daemon=True
        )
        self.process.start()
        assert self.outbox.get(timeout=60) == ("ok", "ready")
        self.belief: Belief | None = None

    def send(self, method: str, *args: Any, **kwargs: Any) -> None:
        self.inbox.put((method, args, kwargs))

    def receive(self) -> tuple[Any, ...]:
        reply: tuple[Any, ...] = self.outbox.get(timeout=60)
        return reply

    def close(self) -> None:
        if self.process.is_alive():
            self.inbox.put(None)
        self.process.join(10)
        if self.process.is_alive():
            self.process.kill()


def _round(actors: list[Actor], rng: random.Random, now: float, keys: int) -> None:
    """One round: some actors each run one random call, all at once."""
    chosen = rng.sample(actors, rng.randint(1, len(actors)))
    sent = [(a, _send_one(a, rng, now, keys)) for a in chosen]
    for a, op in sent:
        reply = a.receive()
        if reply[0] != "ok":
            if reply[1] == "ClaimLost":
                a.belief = None
                continue
            raise AssertionError(f"{a.name} {op}: {reply}")
        _believe(a, op, reply[1], now)


def _send_one(a: Actor, rng: random.Random, now: float, keys: int) -> str:
    """Send one random call the actor may make now; returns which."""
    held = a.belief
    choices = ["enqueue", "recover"]
    if held is None or held.until <= now:
        # One claim per worker: a new one only once its last could be over.
        choices.append("claim")
    if held is not None:
        choices += ["heartbeat", "heartbeat", "finish", "fail"]
    op = rng.choice(choices)
    if op == "claim":
        a.send("claim_next", a.name)
    elif op == "enqueue":
        a.send("enqueue", U, "k", f"s{rng.randrange(keys)}", None, rng.choice([0, 10]))
    elif op == "recover":
        a.send("recover")
    elif held is not None and op == "heartbeat":
        a.send("heartbeat", held.job, held.holder)
    elif held is not None and op == "finish":
        a.send("finish", held.job, held.holder, result=None)
    elif held is not None:
        a.send("fail", held.job, held.holder, Failure.STOPPED, "handed back")
    return op


def _believe(a: Actor, op: str, value: Any, now: float) -> None:
    """What the actor believes it holds after its call answered `value`."""
    if op == "claim" and value.job is not None:
        assert a.belief is None or a.belief.until <= now
        a.belief = Belief(value.job.id, value.job.holder, now + LEASE - MARGIN)
    elif op == "heartbeat" and a.belief is not None:
        if value is Renewal.RENEWED or value == Renewal.RENEWED:
            a.belief.until = now + LEASE - MARGIN
        else:
            a.belief = None
    elif op in ("finish", "fail"):
        a.belief = None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("concurrency", [1, 2])
def test_random_interleavings_never_give_more_live_claims_than_the_limit(
    database_url: str, backend: str, concurrency: int
) -> None:
    settings = {
        "gap_seconds": 0.0,
        "concurrency": concurrency,
        "lease_seconds": LEASE,
        "lease_margin_seconds": MARGIN,
        "heartbeat_seconds": 1.0,
        "claim_timeout_seconds": 60.0,
        "max_attempts": 1000,
    }
    shared = SPAWN.Value("d", 0.0)
    actors = [Actor(f"w{n}", database_url, settings, shared) for n in range(4)]
    checked = 0
    try:
        for seed in range(12 if backend == "sqlite" else 6):
            rng = random.Random(seed * 7919 + concurrency)
            for _ in range(40):
                with shared.get_lock():
                    shared.value += rng.choice([0.0, 0.5, 3.0, 6.0, 9.0, 11.0])
                now = shared.value
                _round(actors, rng, now, keys=5)
                believing = [a for a in actors if a.belief is not None and a.belief.until > now]
                assert len(believing) <= concurrency, (
                    f"seed {seed}: {[(a.name, a.belief) for a in believing]} may all be calling"
                )
                checked += 1
    finally:
        for a in actors:
            a.close()
    assert checked > 0
