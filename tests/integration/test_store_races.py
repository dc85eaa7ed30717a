"""Races between separate processes, on the real clock (FIX1, FIX2, FIX3).

Every worker here is its own `spawn`ed process with its own `JobStore` and its
own connections, as Prefect workers on several machines would be. The parent
only sets the stage, watches the table through a connection of its own and
checks what the workers report.
"""

from __future__ import annotations

import json
import multiprocessing
import queue
import time
from collections import Counter
from typing import Any

import pytest
from sqlalchemy import text

from queue_store import INTERACTIVE, PREFETCH, Failure, Renewal, Status, job_id
from queue_store.engine import create_store_engine
from tests.support.factories import settings_for, store_for
from tests.support.race_worker import actor, claim_loop, dump_tables

SPAWN = multiprocessing.get_context("spawn")

WORKERS = 8
JOBS = 40
HOLD_SECONDS = 0.02
USER = "race-user"


def _stop(processes: list[Any]) -> None:
    """Join what we started; anything still alive is ended by its own handle."""
    for process in processes:
        process.join(10)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)


def _max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The largest number of intervals that contain one same instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    # At equal times an end sorts before a start (-1 < 1): touching is not overlapping.
    current = peak = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("concurrency", [1, 2])
def test_claims_from_many_processes_respect_concurrency_and_take_each_job_once(
    database_url: str, concurrency: int
) -> None:
    settings: dict[str, Any] = {"concurrency": concurrency, "gap_seconds": 0.0}
    with store_for(settings_for(database_url, **settings)) as setup:
        for n in range(JOBS):
            setup.enqueue(USER, "race", f"s{n:02d}", priority=INTERACTIVE if n % 3 else PREFETCH)
    expected_ids = {job_id(USER, "race", f"s{n:02d}") for n in range(JOBS)}

    ready = SPAWN.Queue()
    out = SPAWN.Queue()
    start = SPAWN.Event()
    # With room for more than one, the first holders wait for each other.
    meet = (SPAWN.Value("i", 0), SPAWN.Event(), concurrency) if concurrency > 1 else None
    processes = [
        SPAWN.Process(
            target=claim_loop,
            args=(database_url, settings, f"w{i}", ready, start, out, HOLD_SECONDS, 60.0, meet),
            daemon=True,
        )
        for i in range(WORKERS)
    ]
    for process in processes:
        process.start()

    checker = create_store_engine(database_url)
    reports: dict[str, tuple[list[dict[str, Any]], str | None]] = {}
    samples: list[int] = []
    try:
        for _ in range(WORKERS):
            ready.get(timeout=60)
        start.set()
        deadline = time.monotonic() + 90
        with checker.connect() as connection:
            while len(reports) < WORKERS and time.monotonic() < deadline:
                samples.append(
                    connection.execute(
                        text("SELECT count(*) FROM ai_jobs WHERE status = 'running'")
                    ).scalar_one()
                )
                connection.rollback()  # a fresh snapshot for the next sample
                try:
                    name, records, error = out.get(timeout=0.002)
                except queue.Empty:
                    continue
                reports[name] = (records, error)
        with checker.connect() as connection:
            final = connection.execute(
                text("SELECT id, status, attempts, holder FROM ai_jobs")
            ).all()
            produced: dict[str, Any] = {
                row.job_id: row.output
                for row in connection.execute(text("SELECT job_id, output FROM ai_job_results"))
            }
    finally:
        start.set()
        _stop(processes)
        checker.dispose()

    assert len(reports) == WORKERS, f"only {sorted(reports)} reported back in time"
    errors = {name: error for name, (_, error) in reports.items() if error}
    assert not errors, errors

    records = [record for records, _ in reports.values() for record in records]
    claimed = Counter(record["job"] for record in records)
    # Every job was claimed once, by one holder, on its first attempt.
    assert set(claimed) == expected_ids
    assert [job for job, n in claimed.items() if n > 1] == []
    assert len({record["holder"] for record in records}) == JOBS
    assert {record["attempts"] for record in records} == {1}
    assert {record["finished_as"] for record in records} == {"done"}

    # The independent checker never saw more calls in flight than allowed, and
    # it did see work (so the sampling was not blind).
    assert len(samples) >= 20
    assert max(samples) <= concurrency, Counter(samples)
    assert max(samples) >= 1

    # The workers' own claim-to-finish intervals never overlapped beyond the limit...
    overlap = _max_overlap([(r["claimed"], r["finishing"]) for r in records])
    assert overlap <= concurrency
    if concurrency > 1:
        # ...and with room for two, two did run side by side: the guard is not
        # simply serialising everything.
        assert overlap == concurrency
    # The work really was shared between processes.
    assert len([name for name, (done, _) in reports.items() if done]) >= 2

    # Each job ended done exactly once, with the result of the one holder that ran it.
    assert len(final) == JOBS
    assert {(row.status, row.attempts, row.holder) for row in final} == {(Status.DONE, 1, None)}
    by_job = {record["job"]: record["holder"].split("/")[0] for record in records}
    outputs = {jid: json.loads(o) if isinstance(o, str) else o for jid, o in produced.items()}
    assert {jid: output["by"] for jid, output in outputs.items()} == by_job


class Remote:
    """A `JobStore` living in another process; `call` runs one method there."""

    def __init__(self, url: str, settings: dict[str, Any]) -> None:
        self.inbox = SPAWN.Queue()
        self.outbox = SPAWN.Queue()
        self.process = SPAWN.Process(
            target=actor, args=(url, settings, self.inbox, self.outbox), daemon=True
        )
        self.process.start()
        assert self.outbox.get(timeout=60) == ("ok", "ready")

    def send(self, method: str, *args: Any, **kwargs: Any) -> tuple[Any, ...]:
        self.inbox.put((method, args, kwargs))
        reply: tuple[Any, ...] = self.outbox.get(timeout=30)
        return reply

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        reply = self.send(method, *args, **kwargs)
        assert reply[0] == "ok", reply
        return reply[1]

    def refused(self, method: str, *args: Any, **kwargs: Any) -> str:
        """Run a call that must fail; returns the exception's class name."""
        reply = self.send(method, *args, **kwargs)
        assert reply[0] == "error", f"{method} should have failed, returned {reply[1]!r}"
        return str(reply[1])

    def close(self) -> None:
        if self.process.is_alive():
            self.inbox.put(None)
        _stop([self.process])


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_worker_whose_claim_was_taken_over_cannot_touch_the_job(database_url: str) -> None:
    lease: dict[str, Any] = {"lease_seconds": 1.0, "heartbeat_seconds": 0.2, "gap_seconds": 0.0}
    with store_for(settings_for(database_url, **lease)) as setup:
        setup.enqueue(USER, "race", "only", "fp-1")
    jid = job_id(USER, "race", "only")
    engine = create_store_engine(database_url)
    a = Remote(database_url, lease)
    b = Remote(database_url, lease)
    try:
        first = a.call("claim_next", "worker-a")
        assert first.job is not None and first.job.id == jid
        token_a = first.job.holder
        assert first.job.attempts == 1

        # While A heartbeats, its claim stays live past the lease: B gets nothing.
        until = time.monotonic() + 1.6
        while time.monotonic() < until:
            assert a.call("heartbeat", jid, token_a) == Renewal.RENEWED
            blocked = b.call("claim_next", "worker-b")
            assert blocked.job is None, "B took a job whose holder was still heartbeating"
            time.sleep(0.25)

        # A goes silent; after the lease B takes the job over.
        time.sleep(1.4)
        second = b.call("claim_next", "worker-b")
        assert second.job is not None and second.job.id == jid
        token_b = second.job.holder
        assert token_b != token_a
        assert second.job.attempts == 1  # the lost claim spent no attempt (H2)

        before = dump_tables(engine)

        # Every write A tries is fenced off, and A learns it lost the job.
        assert a.call("heartbeat", jid, token_a) == Renewal.LOST
        assert a.refused("finish", jid, token_a, result={"by": "a"}) == "ClaimLost"
        assert a.refused("fail", jid, token_a, Failure.BUILD, "gave up") == "ClaimLost"
        assert a.refused("fail", jid, token_a, Failure.STOPPED, "shutting down") == "ClaimLost"
        assert a.refused("fail", jid, token_a, Failure.UNAVAILABLE, "no gateway") == "ClaimLost"
        assert a.call("heartbeat", jid, token_a, flow_run_id="flow-run-a") == Renewal.LOST
        assert a.call("heartbeat", jid, token_a) == Renewal.LOST

        assert dump_tables(engine) == before
        row = a.call("jobs", [jid])[jid]
        assert (row.holder, row.status, row.attempts) == (token_b, Status.RUNNING, 1)
        assert row.flow_run_id is None
        assert a.call("poll", USER, "race", "only", queue=False).result is None

        # B, the rightful holder, carries on normally.
        assert b.call("heartbeat", jid, token_b) == Renewal.RENEWED
        assert b.call("heartbeat", jid, token_b, flow_run_id="flow-run-b") == Renewal.RENEWED
        assert b.call("finish", jid, token_b, result={"by": "b"}) == Status.DONE
        done = b.call("jobs", [jid])[jid]
        assert (done.status, done.attempts, done.holder) == (Status.DONE, 1, None)
        assert done.flow_run_id == "flow-run-b"
        assert b.call("poll", USER, "race", "only", queue=False).result.output == {"by": "b"}

        # A, late, still changes nothing.
        after_b = dump_tables(engine)
        assert a.refused("finish", jid, token_a, result={"by": "a"}) == "ClaimLost"
        assert a.call("heartbeat", jid, token_a) == Renewal.LOST
        assert dump_tables(engine) == after_b
    finally:
        a.close()
        b.close()
        engine.dispose()
