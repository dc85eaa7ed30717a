"""One claimed job through the runner: what the store is told for every verdict, and the lease.

A real SQLite store in a temporary directory, a `GatewayClient` over
`httpx.MockTransport` answering per job, and a registry of test generators.
Faults come by count (the store's n-th renewal fails) or by event (a call
that hangs until it is cancelled, a build that waits for the test); deadlines
are the settings' own, asserted with wide margins.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from flows.ledger import Outcome, Report
from flows.registry import Registry
from queue_store import (
    Blocked,
    DatabaseError,
    Failure,
    Job,
    JobStore,
    PauseKind,
    Renewal,
    Settings,
    Status,
)
from tests.support.databases import FakeClock
from tests.support.factories import gateway_client, job_runner
from tests.support.reads import job_of, result_of
from tests.support.secrets import exposures

TOKEN = "sk-runner/9f8e+7d6c=5b4a"
WORKER = "runner-test@host:1:abc123"
USER = "u"
MAX_RESULT = 1024  # bytes: AI_JOB_MAX_RESULT_BYTES here
LATE = 10.0  # seconds: anything slower than this did not happen "at once"

Handler = Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]


def completion(text: str = "an insight") -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": text}}]})


class Gateway:
    """Answers by job label; records what it was asked, and calls that were cancelled."""

    def __init__(self, default: Handler | None = None) -> None:
        self.routes: dict[str, Handler] = {}
        self.default = default or ok
        self.asked: list[str] = []
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()

    def route(self, job: str, handler: Handler) -> None:
        self.routes[job] = handler

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        job = urllib.parse.unquote(request.headers.get("X-Insight-Job", ""))
        self.asked.append(job)
        self.called.set()
        try:
            return await self.routes.get(job, self.default)(request)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise


async def ok(request: httpx.Request) -> httpx.Response:
    return completion()


def status(code: int, body: str = '{"error": {"message": "nope"}}', **headers: str) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(code, content=body, headers=headers)

    return handler


async def hang(request: httpx.Request) -> httpx.Response:
    await asyncio.Event().wait()  # until the call is cancelled
    raise AssertionError("unreachable")


async def refuse(request: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("[Errno 111] Connection refused", request=request)


class Store(JobStore):
    """A real store whose renewals can be made to fail from the n-th on (by count)."""

    def __init__(
        self,
        settings: Settings,
        fail_renewals_after: int | None = None,
        clock: FakeClock | None = None,
    ) -> None:
        super().__init__(settings.database_url, settings=settings, clock=clock)
        self.fail_renewals_after = fail_renewals_after
        self.renewals = 0
        self.renewed_at: list[float] = []  # monotonic send time of each renewal confirmed

    def heartbeat(
        self, jid: str, holder: str, *, calling: bool = False, flow_run_id: str | None = None
    ) -> Renewal:
        if flow_run_id is not None:
            return super().heartbeat(jid, holder, flow_run_id=flow_run_id)
        self.renewals += 1
        if self.fail_renewals_after is not None and self.renewals > self.fail_renewals_after:
            raise DatabaseError("heartbeat: the database cannot be reached (injected)")
        sent = time.monotonic()
        renewal = super().heartbeat(jid, holder, calling=calling)
        if renewal:
            self.renewed_at.append(sent)
        return renewal


@contextlib.contextmanager
def opened(settings: Settings, **options: Any) -> Iterator[Store]:
    store = Store(settings, **options)
    try:
        yield store
    finally:
        store.close()


def prompt(user_id: str, subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"insight for {user_id}/{subject}"}]


def registry(build_gate: threading.Event | None = None) -> Registry:
    made = Registry()
    made.register_generator("ok", prompt)

    def broken_build(user_id: str, subject: str) -> list[dict[str, str]]:
        raise RuntimeError(f"no data for {subject}")

    def broken_parse(answer: Any) -> Any:
        return 1 / 0

    def huge_result(answer: Any) -> Any:
        return {"text": "x" * (MAX_RESULT * 4)}

    def slow_build(user_id: str, subject: str) -> list[dict[str, str]]:
        assert build_gate is not None
        build_gate.wait(60)  # until the test lets it go
        return prompt(user_id, subject)

    made.register_generator("broken-build", broken_build)
    made.register_generator("broken-parse", prompt, broken_parse)
    made.register_generator("huge-result", prompt, huge_result)
    made.register_generator("slow-build", slow_build)
    return made


def make_settings(tmp_path: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "database_url": f"sqlite:///{tmp_path / 'queue.db'}",
        "gap_seconds": 0.0,
        "heartbeat_seconds": 0.1,
        "lease_seconds": 30.0,
        "lease_margin_seconds": 5.0,
        "claim_timeout_seconds": 120.0,
        "backoff_seconds": 30.0,
        "backoff_max_seconds": 120.0,
        "max_attempts": 3,
        "max_result_bytes": MAX_RESULT,
        "gateway": {"url": "http://gateway.test", "token": SecretStr(TOKEN), "read_timeout": 60.0},
    }
    values.update(overrides)
    return Settings(**values)


class Bench:
    """A store, a gateway and a runner, for one test."""

    def __init__(
        self,
        settings: Settings,
        store: Store,
        *,
        build_gate: threading.Event | None = None,
    ) -> None:
        self.settings = settings
        self.store = store
        self.gateway = Gateway()
        client = gateway_client(settings, transport=httpx.MockTransport(self.gateway))
        self.runner = job_runner(store, settings, registry(build_gate), client)

    def claim(self, kind: str = "ok", subject: str = "d1") -> tuple[Job, float]:
        self.store.enqueue(USER, kind, subject)
        return self.claim_next()

    def claim_next(self) -> tuple[Job, float]:
        sent = asyncio.get_running_loop().time()
        claim = self.store.claim_next(WORKER)
        assert claim.job is not None, claim
        return claim.job, sent

    async def run(self, kind: str = "ok", subject: str = "d1") -> Report:
        job, sent = self.claim(kind, subject)
        return await self.runner.run(job, sent)

    def job(self, kind: str = "ok", subject: str = "d1") -> Job:
        found = job_of(self.store, USER, kind, subject)
        assert found is not None
        return found


@pytest.fixture
def bench(tmp_path: Path) -> Iterator[Bench]:
    settings = make_settings(tmp_path)
    with opened(settings) as store:
        yield Bench(settings, store)


def go(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coroutine)


# --- done -----------------------------------------------------------------------------------


def test_an_answer_is_stored_and_the_job_done(bench: Bench) -> None:
    async def scenario() -> Report:
        bench.gateway.default = ok
        return await bench.run()

    report = go(scenario())
    assert (report.outcome, report.message, report.failure) == (Outcome.DONE, "done", None)
    assert report.succeeded and report.called and report.call_seconds is not None
    assert bench.gateway.asked == ["ok:d1"]
    job = bench.job()
    assert (job.status, job.attempts, job.error, job.holder) == (Status.DONE, 1, None, None)
    result = result_of(bench.store, USER, "ok", "d1")
    assert result is not None and result.output == {"text": "an insight"}


def test_renewals_keep_a_call_longer_than_the_lease_alive(tmp_path: Path) -> None:
    # The lease budget is 2 s; the gateway answers only after 40 renewals (~4 s).
    settings = make_settings(tmp_path, lease_seconds=2.5, lease_margin_seconds=0.5)
    with opened(settings) as store:
        bench = Bench(settings, store)

        async def slow(request: httpx.Request) -> httpx.Response:
            while store.renewals < 40:
                await asyncio.sleep(0.05)
            return completion("slow but sure")

        async def scenario() -> Report:
            bench.gateway.default = slow
            return await bench.run()

        report = go(scenario())
        assert report.outcome is Outcome.DONE, report
        assert report.call_seconds is not None and report.call_seconds > 2.0


# --- attempts spent ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("handler", "words"),
    [
        (status(500, "upstream broke"), "gateway refused the request (HTTP 500): upstream broke"),
        (status(400, "bad prompt"), "(HTTP 400): bad prompt"),
        (status(200, "not json"), "answer is not JSON (HTTP 200): not json"),
        (status(200, '{"choices": []}'), "no choices[0].message.content text"),
    ],
    ids=["500", "400", "not-json", "no-text"],
)  # fmt: skip
def test_an_unusable_answer_spends_the_attempt_and_queues_again(
    bench: Bench, handler: Handler, words: str
) -> None:
    async def scenario() -> Report:
        bench.gateway.default = handler
        return await bench.run()

    report = go(scenario())
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.REJECTED
    assert report.settlement is not None and report.settlement.attempt_spent
    assert report.settlement.verdict == "attempt 1 spent"
    assert report.pause_seconds is None
    assert words in report.message
    job = bench.job()
    assert (job.status, job.attempts) == (Status.PENDING, 1)
    assert job.error == report.message
    assert bench.store.claim_next("another").job is not None  # claiming stays open


def test_the_last_allowed_attempt_fails_the_job_with_its_own_error(bench: Bench) -> None:
    async def scenario() -> list[Report]:
        bench.gateway.default = status(500, "boom for d1")
        reports = [await bench.run()]
        for _ in range(bench.settings.max_attempts - 1):
            job, sent = bench.claim_next()
            reports.append(await bench.runner.run(job, sent))
        return reports

    reports = go(scenario())
    assert [r.outcome for r in reports] == [Outcome.REQUEUED, Outcome.REQUEUED, Outcome.FAILED]
    job = bench.job()
    assert (job.status, job.attempts) == (Status.FAILED, 3)
    assert job.error is not None and "boom for d1" in job.error


def test_a_timeout_spends_the_attempt_and_pauses(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, gateway={"url": "http://gateway.test", "token": TOKEN, "read_timeout": 0.5}
    )
    with opened(settings) as store:
        bench = Bench(settings, store)

        async def scenario() -> Report:
            bench.gateway.default = hang
            return await bench.run()

        report = go(scenario())
        assert report.outcome is Outcome.REQUEUED and report.failure is Failure.TIMEOUT
        assert "no complete answer within 0.5 s (received 0 bytes)" in report.message
        assert report.pause_seconds == 30.0
        assert "claiming paused 30 s in case the gateway is still working on it" in (
            report.settlement.verdict if report.settlement else ""
        )
        assert bench.gateway.cancelled.is_set()
        gate = store.gate_state()
        assert gate.pause_kind is PauseKind.TIMEOUT and gate.paused
        assert (
            bench.job().status,
            bench.job().attempts,
        ) == (Status.PENDING, 1)


@pytest.mark.parametrize(
    ("kind", "failure", "words"),
    [
        ("broken-build", Failure.BUILD, "generator 'broken-build' failed building the prompt: "
         "RuntimeError: no data for d1"),
        ("unknown-kind", Failure.BUILD, "no generator is registered for kind 'unknown-kind'"),
        ("broken-parse", Failure.PARSE, "generator 'broken-parse' failed parsing the answer: "
         "ZeroDivisionError"),
    ],
)  # fmt: skip
def test_a_generator_failure_spends_the_attempt(
    bench: Bench, kind: str, failure: Failure, words: str
) -> None:
    report = go(bench.run(kind))
    assert report.outcome is Outcome.REQUEUED and report.failure is failure
    assert words in report.message
    assert report.called is (failure is Failure.PARSE)
    assert bench.gateway.asked == ([f"{kind}:d1"] if failure is Failure.PARSE else [])
    assert bench.job(kind).attempts == 1


def test_a_result_too_large_to_store_spends_the_attempt(bench: Bench) -> None:
    started = time.monotonic()
    report = go(bench.run("huge-result"))
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.PARSE
    assert "the result could not be stored" in report.message
    assert "AI_JOB_MAX_RESULT_BYTES" in report.message
    assert time.monotonic() - started < LATE  # refused at once, not retried as an outage
    job = bench.job("huge-result")
    assert (job.status, job.attempts, job.holder) == (Status.PENDING, 1, None)
    assert result_of(bench.store, USER, "huge-result", "d1") is None


# --- attempts kept: rate limits, refusals, outages ------------------------------------------------


@pytest.mark.parametrize(
    ("headers", "pause"),
    [
        ({"Retry-After": "7"}, 7.0),
        ({"retry-after-ms": "2500"}, 2.5),
        ({"x-ratelimit-reset-requests": "1m0s"}, 60.0),
        ({}, 30.0),  # none given: the backoff
        ({"Retry-After": "3600"}, 120.0),  # capped by AI_JOB_BACKOFF_MAX_SECONDS
        ({"Retry-After": "999999999999"}, 120.0),  # longer than the store takes, still capped
    ],
)
def test_a_rate_limit_keeps_the_attempt_and_pauses_for_the_time_asked(
    bench: Bench, headers: dict[str, str], pause: float
) -> None:
    async def scenario() -> Report:
        bench.gateway.default = status(429, "slow down", **headers)
        return await bench.run()

    started = time.monotonic()
    report = go(scenario())
    assert time.monotonic() - started < LATE
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.RATE_LIMITED
    assert report.pause_seconds == pytest.approx(pause)
    assert report.settlement is not None
    assert report.settlement.verdict == f"rate limited; claiming paused {pause:g} s"
    assert "rate limited (HTTP 429)" in report.message
    job = bench.job()
    assert (job.status, job.attempts) == (Status.PENDING, 0)
    blocked = bench.store.claim_next("another")
    assert blocked.blocked is Blocked.PAUSED
    assert blocked.retry_in is not None and pause - 1 < blocked.retry_in <= pause
    gate = bench.store.gate_state()
    assert gate.pause_kind is PauseKind.RATE_LIMIT


@pytest.mark.parametrize(
    ("handler", "words"),
    [
        (status(401, "invalid key"), "refused our credentials (HTTP 401); check AI_GATEWAY_TOKEN"),
        (status(403, "forbidden"), "refused our credentials (HTTP 403)"),
        (status(307, "", location="https://new-gateway.example/v1"),
         "redirected to host new-gateway.example (HTTP 307)"),
    ],
    ids=["401", "403", "redirect"],
)  # fmt: skip
def test_a_refusal_keeps_the_attempt_and_stops_the_line_with_one_reason(
    bench: Bench, handler: Handler, words: str
) -> None:
    async def scenario() -> Report:
        bench.gateway.default = handler
        return await bench.run()

    report = go(scenario())
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.REFUSED
    assert words in report.message
    assert report.settlement is not None
    assert report.settlement.verdict == (
        "the gateway refused us; claiming stopped for 30 s until it is fixed"
    )
    job = bench.job()
    assert (job.status, job.attempts) == (Status.PENDING, 0)
    gate = bench.store.gate_state()
    assert gate.paused and gate.pause_kind is PauseKind.REFUSED
    assert gate.pause_reason is not None and words in gate.pause_reason
    assert bench.store.claim_next("another").blocked is Blocked.PAUSED


@pytest.mark.parametrize(
    ("handler", "words"),
    [
        (refuse, "cannot connect: [Errno 111] Connection refused"),
        (status(502), "gateway unavailable (HTTP 502)"),
        (status(503), "gateway unavailable (HTTP 503)"),
        (status(504), "gateway unavailable (HTTP 504)"),
    ],
    ids=["refused", "502", "503", "504"],
)
def test_an_outage_keeps_the_attempt_and_backs_off_doubling(
    tmp_path: Path, handler: Handler, words: str
) -> None:
    settings = make_settings(tmp_path)
    clock = FakeClock()
    with opened(settings, clock=clock) as store:
        bench = Bench(settings, store)

        async def scenario() -> list[Report]:
            bench.gateway.default = handler
            reports = [await bench.run()]
            for _ in range(3):
                assert store.claim_next("another").blocked is Blocked.PAUSED
                clock.advance(reports[-1].pause_seconds or 0)  # the pause runs out
                reports.append(await bench.runner.run(*bench.claim_next()))
            return reports

        reports = go(scenario())
        assert [r.outcome for r in reports] == [Outcome.RELEASED] * 4
        assert [r.failure for r in reports] == [Failure.UNAVAILABLE] * 4
        assert [r.pause_seconds for r in reports] == [30.0, 60.0, 120.0, 120.0]
        assert all(words in r.message for r in reports)
        assert reports[0].settlement is not None
        assert reports[0].settlement.verdict == "gateway unavailable; claiming paused 30 s"
        job = bench.job()
        assert (job.status, job.attempts) == (Status.PENDING, 0)
        assert job.unavailable_since is not None
        gate = store.gate_state()
        assert gate.outages_in_a_row == 4 and gate.pause_kind is PauseKind.OUTAGE


def test_a_job_failing_unavailable_while_others_are_answered_is_poisoned_not_an_outage(
    tmp_path: Path,
) -> None:
    # G2: d1's gateway call keeps failing 503; d2 is answered in between.
    clock = FakeClock()
    settings = make_settings(tmp_path)
    with opened(settings, clock=clock) as store:
        bench = Bench(settings, store)

        async def scenario() -> list[Report]:
            bench.gateway.route("ok:d1", status(503, "d1 cannot be served"))
            store.enqueue(USER, "ok", "d1")
            store.enqueue(USER, "ok", "d2")
            first = await bench.runner.run(*bench.claim_next())  # d1, the oldest
            clock.advance(first.pause_seconds or 0)
            second = await bench.runner.run(*bench.claim_next())  # d2: d1 went behind it
            third = await bench.runner.run(*bench.claim_next())  # d1 again
            return [first, second, third]

        first, second, third = go(scenario())
        assert first.job.subject == "d1"
        assert first.outcome is Outcome.RELEASED and first.failure is Failure.UNAVAILABLE
        assert second.outcome is Outcome.DONE and second.job.subject == "d2"
        assert third.job.subject == "d1"
        assert third.outcome is Outcome.REQUEUED and third.failure is Failure.UNAVAILABLE
        assert third.settlement is not None and third.settlement.pause_seconds is None
        assert third.settlement.verdict == "attempt 1 spent: not an outage, this job"
        job = bench.job("ok", "d1")
        assert (job.status, job.attempts) == (Status.PENDING, 1)
        assert job.error is not None
        assert job.error.startswith("the gateway answers other calls but keeps failing this one: ")
        assert "d1 cannot be served" in job.error
        assert not store.gate_state().paused  # the queue behind it keeps moving


# --- the lease ------------------------------------------------------------------------------


def test_a_takeover_mid_call_cancels_the_call_at_once_and_records_nothing(bench: Bench) -> None:
    async def scenario() -> tuple[Report, float, Job]:
        bench.gateway.default = hang
        job, sent = bench.claim()
        task = asyncio.create_task(bench.runner.run(job, sent))
        await bench.gateway.called.wait()
        # Another worker takes the job over (here: our own worker name recovered).
        await asyncio.to_thread(bench.store.recover, WORKER)
        taken = time.monotonic()
        after_takeover = bench.job()
        report = await task
        return report, time.monotonic() - taken, after_takeover

    report, took, after_takeover = go(scenario())
    assert report.outcome is Outcome.LOST and report.failure is None
    assert report.message == "the claim was taken over by another worker"
    assert bench.gateway.cancelled.is_set()
    # Renewals come every 0.1 s; the lease's own deadline is 25 s away.
    assert took < LATE
    assert bench.job() == after_takeover  # nothing written after the takeover
    assert result_of(bench.store, USER, "ok", "d1") is None


def test_a_database_down_past_the_budget_stops_the_call_before_the_lease_could_lapse(
    tmp_path: Path,
) -> None:
    lease, margin = 6.0, 3.0
    settings = make_settings(
        tmp_path, lease_seconds=lease, lease_margin_seconds=margin, heartbeat_seconds=0.2
    )
    # Renewals 1 (right before the call) and 2 and 3 (heartbeats) work; then none does.
    with opened(settings, fail_renewals_after=3) as store:
        bench = Bench(settings, store)

        async def scenario() -> tuple[Report, float]:
            bench.gateway.default = hang
            task = asyncio.create_task(bench.runner.run(*bench.claim()))
            await bench.gateway.cancelled.wait()
            stopped = time.monotonic()
            return await task, stopped

        report, stopped = go(scenario())
        assert len(store.renewed_at) == 3 and store.renewals > 3
        held = stopped - store.renewed_at[-1]
        # Stopped by its own deadline (lease minus margin after the last confirmed
        # renewal was sent), so before anyone could take the claim over.
        assert lease - margin - 0.05 <= held < lease - 0.5, held
        assert report.outcome is Outcome.RELEASED and report.failure is Failure.STOPPED
        assert report.message.startswith(
            "stopped the call before its claim could lapse: the claim could not be renewed "
            "for 3 s (heartbeat: the database cannot be reached (injected))"
        )
        job = bench.job()
        assert (job.status, job.attempts, job.holder) == (Status.PENDING, 0, None)


def test_a_build_past_the_deadline_never_starts_the_call(tmp_path: Path) -> None:
    settings = make_settings(
        tmp_path, claim_timeout_seconds=2.0, lease_margin_seconds=0.5, lease_seconds=30.0
    )
    gate = threading.Event()
    with opened(settings) as store:
        bench = Bench(settings, store, build_gate=gate)

        async def scenario() -> Report:
            try:
                return await bench.run("slow-build")
            finally:
                gate.set()

        started = time.monotonic()
        report = go(scenario())
        took = time.monotonic() - started
        assert report.outcome is Outcome.REQUEUED and report.failure is Failure.BUILD
        assert report.message.startswith("prompt building ran past the attempt's deadline")
        assert not report.called and bench.gateway.asked == []
        assert 1.5 - 0.05 <= took < LATE
        assert bench.job("slow-build").attempts == 1


def test_a_graceful_stop_settles_stopped_keeps_the_attempt_and_reraises(bench: Bench) -> None:
    async def scenario() -> None:
        bench.gateway.default = hang
        task = asyncio.create_task(bench.runner.run(*bench.claim()))
        await bench.gateway.called.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    go(scenario())
    assert bench.gateway.cancelled.is_set()
    job = bench.job()
    assert (job.status, job.attempts, job.holder) == (Status.PENDING, 0, None)
    assert job.error == "stopped: the consumer is shutting down; the job was handed back"
    assert not bench.store.gate_state().paused
    # The job is free at once, but the gateway may still work on the stopped call: the next
    # call waits for the hold, the read timeout from the call's start (H1).
    claim = bench.store.claim_next("another")
    assert claim.blocked is Blocked.CONCURRENCY and claim.retry_in is not None
    assert 55 < claim.retry_in <= 60
    assert [str(h.cause) for h in bench.store.queue_view().holds] == ["stopped"]


def test_a_takeover_before_the_call_means_no_call(tmp_path: Path) -> None:
    gate = threading.Event()
    settings = make_settings(tmp_path)
    with opened(settings) as store:
        bench = Bench(settings, store, build_gate=gate)

        async def scenario() -> Report:
            task = asyncio.create_task(bench.run("slow-build"))
            while job_of(bench.store, USER, "slow-build", "d1") is None:
                await asyncio.sleep(0.01)
            # Taken over while the prompt is being built; the runner renews right
            # before the call and finds the claim gone.
            await asyncio.to_thread(bench.store.recover, WORKER)
            gate.set()
            return await task

        report = go(scenario())
        assert report.outcome is Outcome.LOST
        assert bench.gateway.asked == [] and not report.called


def test_a_store_down_right_before_the_call_means_no_call_and_no_attempt_spent(
    tmp_path: Path,
) -> None:
    settings = make_settings(tmp_path, heartbeat_seconds=5.0, lease_seconds=30.0)
    with opened(settings, fail_renewals_after=0) as store:
        bench = Bench(settings, store)
        report = go(bench.run())
        assert bench.gateway.asked == [] and not report.called
        assert report.outcome is Outcome.RELEASED and report.failure is Failure.STOPPED
        assert "could not be renewed" in report.message
        assert "injected" in report.message
        job = bench.job()
        assert (job.status, job.attempts) == (Status.PENDING, 0)


# --- messages ---------------------------------------------------------------------------------


def test_a_token_echoed_by_the_gateway_never_reaches_the_report_or_the_store(bench: Bench) -> None:
    async def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, content=f"bad key {request.headers['Authorization']}")

    async def scenario() -> Report:
        bench.gateway.default = echo
        return await bench.run()

    report = go(scenario())
    assert "[redacted]" in report.message
    assert (
        exposures(
            report.message + repr(report) + str(bench.job().error),
            TOKEN,
        )
        == []
    )
