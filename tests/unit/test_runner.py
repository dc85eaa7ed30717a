"""One claimed job, without Prefect: what the runner tells the store for each outcome."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from flows import registry
from flows.gateway import GatewayClient
from flows.runner import Heartbeat, JobRunner, Outcome
from queue_store import Blocked, Job, JobStore, Settings, migrate

Handler = Callable[[httpx.Request], httpx.Response]


def answer(text: str = "an insight") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": text}}]})


@pytest.fixture(autouse=True)
def kinds() -> Iterator[None]:
    registry.clear()
    registry.register_generator("ok", lambda user, subject: [{"role": "user", "content": subject}])
    registry.register_generator(
        "bad-parse",
        lambda user, subject: [{"role": "user", "content": subject}],
        lambda answer: 1 / 0,
    )
    registry._loaded = True  # no plugin modules: only what is registered here
    yield
    registry.clear()


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    url = f"sqlite:///{tmp_path / 'q.db'}"
    migrate.upgrade(url)
    return Settings(
        database_url=url,
        gap_seconds=0,
        heartbeat_seconds=0.1,
        lease_seconds=1,
        backoff_seconds=30,
        gateway_url="http://gateway.test",
    )


@pytest.fixture
def store(settings: Settings) -> Iterator[JobStore]:
    with JobStore(settings.database_url, settings=settings) as opened:
        yield opened


def runner_for(store: JobStore, settings: Settings, handler: Handler) -> JobRunner:
    return JobRunner(
        store, settings, lambda: GatewayClient(settings, transport=httpx.MockTransport(handler))
    )


def claim(store: JobStore, kind: str = "ok", subject: str = "d1") -> Job:
    store.enqueue("u", kind, subject)
    job = store.claim_next("test").job
    assert job is not None
    return job


def test_an_answer_is_stored_and_the_job_done(store: JobStore, settings: Settings) -> None:
    job = claim(store)
    report = runner_for(store, settings, lambda request: answer("sleep well")).run(job)
    assert report.outcome == Outcome.DONE
    result = store.result_of("u", "ok", "d1")
    assert result is not None and result.output == {"text": "sleep well"}


def test_the_request_carries_the_job_label(store: JobStore, settings: Settings) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return answer()

    runner_for(store, settings, handler).run(claim(store))
    assert seen[0].headers["X-Insight-Job"] == "ok:d1"


@pytest.mark.parametrize("status", [502, 503, 504])
def test_an_unreachable_gateway_spends_no_attempt_and_pauses_everyone(
    store: JobStore, settings: Settings, status: int
) -> None:
    job = claim(store)
    report = runner_for(store, settings, lambda request: httpx.Response(status)).run(job)
    assert report.outcome == Outcome.RELEASED
    assert report.pause_seconds == pytest.approx(30)
    again = store.job("u", "ok", "d1")
    assert again is not None and (again.status, again.attempts) == ("pending", 0)
    assert store.claim_next("another").blocked == Blocked.PAUSED


def test_a_connection_refused_is_an_outage_too(store: JobStore, settings: Settings) -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    report = runner_for(store, settings, refuse).run(claim(store))
    assert report.outcome == Outcome.RELEASED
    assert store.gate_state().outages_in_a_row == 1


@pytest.mark.parametrize(
    "handler",
    [
        lambda request: httpx.Response(400, json={"error": "bad prompt"}),
        lambda request: httpx.Response(500),
        lambda request: httpx.Response(200, text="not json"),
    ],
    ids=["400", "500", "malformed"],
)
def test_other_failures_spend_the_attempt_and_requeue(
    store: JobStore, settings: Settings, handler: Handler
) -> None:
    report = runner_for(store, settings, handler).run(claim(store))
    assert report.outcome == Outcome.REQUEUED
    job = store.job("u", "ok", "d1")
    assert job is not None and (job.status, job.attempts) == ("pending", 1)
    assert job.error


def test_a_read_timeout_spends_the_attempt_and_pauses(store: JobStore, settings: Settings) -> None:
    def slow(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("no answer", request=request)

    report = runner_for(store, settings, slow).run(claim(store))
    assert report.outcome == Outcome.REQUEUED
    assert "no answer in time" in (report.error or "")
    # The gateway may still be busy with the call we gave up on: pause.
    assert report.pause_seconds == pytest.approx(30)
    assert store.claim_next("another").blocked == Blocked.PAUSED


def test_an_unknown_kind_fails_its_job_not_the_runner(store: JobStore, settings: Settings) -> None:
    report = runner_for(store, settings, lambda request: answer()).run(claim(store, "nope"))
    assert report.outcome == Outcome.REQUEUED
    assert "no generator is registered for kind 'nope'" in (report.error or "")


def test_a_generator_that_cannot_parse_fails_its_job(store: JobStore, settings: Settings) -> None:
    report = runner_for(store, settings, lambda request: answer()).run(claim(store, "bad-parse"))
    assert report.outcome == Outcome.REQUEUED
    assert "ZeroDivisionError" in (report.error or "")


def test_the_last_failed_attempt_fails_the_job(store: JobStore, settings: Settings) -> None:
    runner = runner_for(store, settings, lambda request: httpx.Response(500))
    outcomes = []
    for _ in range(settings.max_attempts):
        job = store.claim_next("test").job if outcomes else claim(store)
        assert job is not None
        outcomes.append(runner.run(job).outcome)
    assert outcomes == [Outcome.REQUEUED, Outcome.REQUEUED, Outcome.FAILED]


def test_a_lost_claim_abandons_the_call_and_records_nothing(
    store: JobStore, settings: Settings
) -> None:
    release = threading.Event()

    def hang(request: httpx.Request) -> httpx.Response:
        release.wait(10)
        return answer("too late")

    job = claim(store)
    lost = threading.Event()
    threading.Timer(0.3, lost.set).start()
    started = time.monotonic()
    report = runner_for(store, settings, hang).run(job, lost)
    release.set()
    assert report.outcome == Outcome.LOST
    assert time.monotonic() - started < 5
    assert store.result_of("u", "ok", "d1") is None
    row = store.job("u", "ok", "d1")
    assert row is not None and row.status == "running"  # untouched: someone else's now


def test_an_attempt_past_the_claim_timeout_is_abandoned_and_spent(
    tmp_path: Path, settings: Settings
) -> None:
    import dataclasses

    short = dataclasses.replace(settings, claim_timeout_seconds=0.5)
    release = threading.Event()
    with JobStore(short.database_url, settings=short) as store:
        job = claim(store)
        report = runner_for(store, short, lambda request: (release.wait(10), answer())[1]).run(job)
        release.set()
        assert report.outcome == Outcome.REQUEUED
        assert "AI_JOB_CLAIM_TIMEOUT" in (report.error or "")


def test_heartbeat_notices_a_takeover(store: JobStore, settings: Settings) -> None:
    job = claim(store)
    with Heartbeat(store, job, 0.1) as beat:
        time.sleep(0.3)
        assert not beat.lost.is_set()
        store.recover("test")  # our own worker name: as if we had restarted
        assert beat.lost.wait(2)
