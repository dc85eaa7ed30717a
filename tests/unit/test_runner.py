"""One claimed job through the runner: what the store is told for every verdict, and the lease.

The store is `FakeWorkerStore` (tests/support/fake_store.py): it records what the runner tells
it and answers from the test's script, so a test asserts what the runner said (the verb, the
`Failure`, the message, the wait it asked for) and what it made of the answer (its `Report`).
What the store then does is its own rules', tested on SQLite and PostgreSQL in
tests/integration; the one test here that needs them (G2, a verdict drawn from other jobs'
answers) runs on a real SQLite store. The gateway is a `GatewayClient` over
`httpx.MockTransport` answering per job, and the generators are the test's own.
Faults come by count (the n-th renewal fails) or by event (a call that hangs until it is
cancelled, a build that waits for the test); deadlines are the settings' own, asserted with
wide margins.
"""

from __future__ import annotations

import asyncio
import threading
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from flows.ledger import Outcome, Report
from flows.registry import Registry
from queue_store import (
    ClaimLost,
    DatabaseError,
    Failure,
    Job,
    Renewal,
    Settings,
    Settlement,
    Status,
    Usage,
    WorkerStore,
)
from tests.support.databases import FakeClock
from tests.support.factories import gateway_client, job_runner, settings_for, store_for
from tests.support.fake_store import Call, FakeWorkerStore
from tests.support.reads import job_of
from tests.support.secrets import exposures

TOKEN = "sk-runner/9f8e+7d6c=5b4a"
WORKER = "runner-test@host:1:abc123"
USER = "u"
MAX_RESULT = 1024  # bytes: AI_JOB_MAX_RESULT_BYTES here
LATE = 10.0  # seconds: anything slower than this did not happen "at once"
DOWN = "heartbeat: the database cannot be reached (scripted)"

Handler = Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]


def completion(text: str = "an insight", **more: Any) -> httpx.Response:
    return httpx.Response(200, json={"choices": [{"message": {"content": text}}], **more})


class Gateway:
    """Answers by job label; records what it was asked, what the store had been told by then,
    and calls that were cancelled."""

    def __init__(self, store: FakeWorkerStore | None = None, default: Handler | None = None):
        self.routes: dict[str, Handler] = {}
        self.default = default or ok
        self.store = store
        self.asked: list[str] = []
        self.told_before: list[list[Call]] = []  # per request: the store's calls until then
        self.called = asyncio.Event()
        self.cancelled = asyncio.Event()

    def route(self, job: str, handler: Handler) -> None:
        self.routes[job] = handler

    async def __call__(self, request: httpx.Request) -> httpx.Response:
        job = urllib.parse.unquote(request.headers.get("X-Insight-Job", ""))
        self.asked.append(job)
        if self.store is not None:
            self.told_before.append(self.store.calls)
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


def prompt(user_id: str, subject: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"insight for {user_id}/{subject}"}]


def registry(build_gate: threading.Event | None = None) -> Registry:
    made = Registry()
    made.register_generator("ok", prompt)

    def broken_build(user_id: str, subject: str) -> list[dict[str, str]]:
        raise RuntimeError(f"no data for {subject}")

    def broken_parse(answer: Any) -> Any:
        return 1 / 0

    def leaky_build(user_id: str, subject: str) -> list[dict[str, str]]:
        raise RuntimeError(f"the data source refused {TOKEN}")

    def huge_result(answer: Any) -> Any:
        return {"text": "x" * (MAX_RESULT * 4)}

    def slow_build(user_id: str, subject: str) -> list[dict[str, str]]:
        assert build_gate is not None
        build_gate.wait(60)  # until the test lets it go
        return prompt(user_id, subject)

    made.register_generator("broken-build", broken_build)
    made.register_generator("leaky-build", leaky_build)
    made.register_generator("broken-parse", prompt, broken_parse)
    made.register_generator("huge-result", prompt, huge_result)
    made.register_generator("slow-build", slow_build)
    return made


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
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
    return settings_for(**values)


class Bench:
    """A scripted store, a gateway and a runner, for one test."""

    def __init__(
        self, settings: Settings | None = None, *, build_gate: threading.Event | None = None
    ) -> None:
        self.settings = settings or make_settings()
        self.store = FakeWorkerStore.of(self.settings)
        role: WorkerStore = self.store  # the fake plays the role the runner is given
        self.gateway = Gateway(self.store)
        client = gateway_client(self.settings, transport=httpx.MockTransport(self.gateway))
        self.runner = job_runner(role, self.settings, registry(build_gate), client)

    def claim(self, kind: str = "ok", subject: str = "d1", attempts: int = 1) -> tuple[Job, float]:
        """A job as `claim_next` hands it out, and the loop's time just before it was asked."""
        sent = asyncio.get_running_loop().time()
        job = self.store.claimed(kind, subject, user_id=USER, attempts=attempts, worker=WORKER)
        return job, sent

    async def run(self, kind: str = "ok", subject: str = "d1", attempts: int = 1) -> Report:
        return await self.runner.run(*self.claim(kind, subject, attempts))

    def told(self, report: Report) -> Call:
        """The one settlement the runner told the store (`finish` or `fail`), under the job's
        own claim; a `fail`'s Settlement is the report's."""
        settled = self.store.settlements()
        assert len(settled) == 1, settled
        call = settled[0]
        assert (call.job_id, call.holder) == (report.job.id, report.job.holder)
        if call.method == "fail" and isinstance(call.reply, Settlement):
            assert report.settlement == call.reply
        return call


@pytest.fixture
def bench() -> Bench:
    return Bench()


def go(coroutine: Coroutine[Any, Any, Any]) -> Any:
    return asyncio.run(coroutine)


def started_calls(told: list[Call]) -> list[Renewal | Exception]:
    """What the renewals that marked a call as started (H1) were answered."""
    return [call.reply for call in told if call.renewal and call.calling]


# --- done -----------------------------------------------------------------------------------


def test_an_answer_is_stored_and_the_job_done(bench: Bench) -> None:
    async def answered(request: httpx.Request) -> httpx.Response:
        return completion(usage={"prompt_tokens": 12, "completion_tokens": 34})

    bench.gateway.default = answered
    report = go(bench.run())
    assert (report.outcome, report.message, report.failure) == (Outcome.DONE, "done", None)
    assert report.succeeded and report.called and report.call_seconds is not None
    assert bench.gateway.asked == ["ok:d1"]
    # The call started right after a confirmed renewal (L2) that said so (H1).
    assert started_calls(bench.gateway.told_before[0]) == [Renewal.RENEWED]
    told = bench.told(report)
    assert (told.method, told.reply) == ("finish", Status.DONE)
    assert told.result == {"text": "an insight"}
    assert told.usage == Usage(12, 34) and told.duration is not None


def test_renewals_keep_a_call_longer_than_the_lease_alive() -> None:
    # The lease budget is 1 s; the gateway answers only after 30 renewals past the one right
    # before the call, 0.05 s apart (at least 1.5 s).
    budget = 1.0
    bench = Bench(
        make_settings(lease_seconds=1.5, lease_margin_seconds=0.5, heartbeat_seconds=0.05)
    )

    async def slow(request: httpx.Request) -> httpx.Response:
        while len(bench.store.renewed_at) < 31:
            await asyncio.sleep(0.01)
        return completion("slow but sure")

    bench.gateway.default = slow
    report = go(bench.run())
    assert report.outcome is Outcome.DONE, report
    assert report.call_seconds is not None and report.call_seconds > budget
    renewals = bench.store.renewals()
    assert len(renewals) >= 31 and all(r.reply is Renewal.RENEWED for r in renewals)
    told = bench.told(report)
    assert (told.method, told.result) == ("finish", {"text": "slow but sure"})


# --- recording the result -------------------------------------------------------------------


def test_a_takeover_before_the_result_is_recorded_records_nothing_more(bench: Bench) -> None:
    async def scenario() -> Report:
        job, sent = bench.claim()
        bench.store.script_finish(ClaimLost(job.id, job.holder or ""))
        return await bench.runner.run(job, sent)

    report = go(scenario())
    assert report.outcome is Outcome.LOST and report.failure is None
    assert report.message == "the claim was taken over before the result was recorded"
    told = bench.told(report)  # the refused finish, and no fail after it
    assert told.method == "finish" and isinstance(told.reply, ClaimLost)


def test_a_short_store_outage_while_recording_the_result_is_ridden_out(bench: Bench) -> None:
    # The call behind the result cost the shared gateway: the same finish is tried again.
    bench.store.script_finish(DatabaseError("finish: the database cannot be reached (scripted)"))
    report = go(bench.run())
    assert report.outcome is Outcome.DONE and report.message == "done"
    first, second = bench.store.settlements()
    assert (first.method, second.method) == ("finish", "finish")
    assert isinstance(first.reply, DatabaseError) and second.reply is Status.DONE
    assert first.result == second.result == {"text": "an insight"}
    assert first.holder == second.holder == report.job.holder


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
    bench.gateway.default = handler
    report = go(bench.run())
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.REJECTED
    assert report.settlement is not None and report.settlement.attempt_spent
    assert report.settlement.verdict == "attempt 1 spent"
    assert words in report.message
    told = bench.told(report)
    assert (told.method, told.failure) == ("fail", Failure.REJECTED)
    assert told.message == report.message
    assert told.duration is not None  # the call was made
    # Claiming stays open: the runner asks for no wait, and reports none.
    assert told.retry_after is None and report.pause_seconds is None


def test_the_last_allowed_attempt_fails_the_job_with_its_own_error(bench: Bench) -> None:
    async def scenario() -> list[Report]:
        bench.gateway.default = status(500, "boom for d1")
        return [
            await bench.run(attempts=attempt)
            for attempt in range(1, bench.settings.max_attempts + 1)
        ]

    reports = go(scenario())
    assert [r.outcome for r in reports] == [Outcome.REQUEUED, Outcome.REQUEUED, Outcome.FAILED]
    told = bench.store.settlements()
    assert [(c.method, c.failure) for c in told] == [("fail", Failure.REJECTED)] * 3
    assert [c.holder for c in told] == [r.job.holder for r in reports]  # each its own claim
    assert [c.reply.status for c in told] == [Status.PENDING, Status.PENDING, Status.FAILED]
    assert [r.settlement for r in reports] == [c.reply for c in told]
    assert all("boom for d1" in (c.message or "") for c in told)


def test_a_timeout_spends_the_attempt_and_pauses() -> None:
    settings = make_settings(
        gateway={"url": "http://gateway.test", "token": TOKEN, "read_timeout": 0.2}
    )
    bench = Bench(settings)
    bench.gateway.default = hang
    report = go(bench.run())
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.TIMEOUT
    assert "no complete answer within 0.2 s (received 0 bytes)" in report.message
    assert bench.gateway.cancelled.is_set()
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.TIMEOUT, report.message)
    # The store chooses the pause (the backoff here); the runner reports it.
    assert told.retry_after is None
    assert report.settlement is not None and report.settlement.attempt_spent
    assert report.pause_seconds == 30.0


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
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", failure, report.message)
    # An answer came (and may have cost tokens) only when parsing failed.
    assert told.answer is (failure is Failure.PARSE)
    assert (told.duration is not None) is (failure is Failure.PARSE)
    assert report.settlement is not None and report.settlement.attempt_spent


def test_a_result_too_large_to_store_spends_the_attempt(bench: Bench) -> None:
    report = go(bench.run("huge-result"))
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.PARSE
    assert "the result could not be stored" in report.message
    assert "AI_JOB_MAX_RESULT_BYTES" in report.message
    finished, failed = bench.store.settlements()  # refused once, not retried as an outage
    assert finished.method == "finish" and isinstance(finished.reply, ValueError)
    assert finished.result == {"text": "x" * (MAX_RESULT * 4)}
    assert (failed.method, failed.failure, failed.message) == (
        "fail",
        Failure.PARSE,
        report.message,
    )
    assert failed.holder == report.job.holder and failed.answer is True
    assert report.settlement == failed.reply and report.settlement.attempt_spent


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
    bench.gateway.default = status(429, "slow down", **headers)
    # The pause is the store's to keep: the runner itself does not wait it out.
    report = go(asyncio.wait_for(bench.run(), LATE))
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.RATE_LIMITED
    assert "rate limited (HTTP 429)" in report.message
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == (
        "fail",
        Failure.RATE_LIMITED,
        report.message,
    )
    # The wait asked for goes to the store, capped (G1); none asked, none passed on.
    assert told.retry_after == (pytest.approx(pause) if headers else None)
    assert report.settlement is not None and not report.settlement.attempt_spent
    assert report.pause_seconds == pytest.approx(pause)


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
    bench.gateway.default = handler
    report = go(bench.run())
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.REFUSED
    assert words in report.message
    # The message is the one reason the store shows operators while claiming is stopped (G4).
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.REFUSED, report.message)
    assert told.retry_after is None
    assert report.settlement is not None and not report.settlement.attempt_spent
    assert report.pause_seconds == 30.0


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
    bench: Bench, handler: Handler, words: str
) -> None:
    # N2: the store doubles the backoff, up to its longest; the runner reports each pause.
    settled = [
        Settlement(
            Status.PENDING, False, seconds, f"gateway unavailable; claiming paused {seconds:g} s"
        )
        for seconds in (30.0, 60.0, 120.0, 120.0)
    ]
    bench.store.script_fail(*settled)

    async def scenario() -> list[Report]:
        bench.gateway.default = handler
        return [await bench.run() for _ in settled]

    reports = go(scenario())
    assert [r.outcome for r in reports] == [Outcome.RELEASED] * 4
    assert [r.failure for r in reports] == [Failure.UNAVAILABLE] * 4
    assert [r.pause_seconds for r in reports] == [30.0, 60.0, 120.0, 120.0]
    assert [r.settlement for r in reports] == settled
    assert all(words in r.message for r in reports)
    told = bench.store.settlements()
    assert [(c.method, c.failure, c.retry_after) for c in told] == [
        ("fail", Failure.UNAVAILABLE, None)
    ] * 4
    assert [c.message for c in told] == [r.message for r in reports]


def test_a_job_failing_unavailable_while_others_are_answered_is_poisoned_not_an_outage(
    tmp_path: Path,
) -> None:
    # G2: d1's gateway call keeps failing 503; d2 is answered in between. The verdict is drawn
    # from what the store saw of other jobs, so this one runs on a real store.
    clock = FakeClock()
    settings = make_settings(database_url=f"sqlite:///{tmp_path / 'queue.db'}")
    gateway = Gateway()
    gateway.route("ok:d1", status(503, "d1 cannot be served"))
    client = gateway_client(settings, transport=httpx.MockTransport(gateway))
    with store_for(settings, clock=clock) as store:
        runner = job_runner(store, settings, registry(), client)

        async def next_job() -> Report:
            sent = asyncio.get_running_loop().time()
            claim = store.claim_next(WORKER)
            assert claim.job is not None, claim
            return await runner.run(claim.job, sent)

        async def scenario() -> list[Report]:
            store.enqueue(USER, "ok", "d1")
            store.enqueue(USER, "ok", "d2")
            first = await next_job()  # d1, the oldest
            clock.advance(first.pause_seconds or 0)
            second = await next_job()  # d2: d1 went behind it
            third = await next_job()  # d1 again
            return [first, second, third]

        first, second, third = go(scenario())
        assert first.job.subject == "d1"
        assert first.outcome is Outcome.RELEASED and first.failure is Failure.UNAVAILABLE
        assert second.outcome is Outcome.DONE and second.job.subject == "d2"
        assert third.job.subject == "d1"
        # The same failure, but the store spent the attempt: the runner follows its settlement.
        assert third.outcome is Outcome.REQUEUED and third.failure is Failure.UNAVAILABLE
        assert third.settlement is not None and third.settlement.pause_seconds is None
        assert third.settlement.verdict == "attempt 1 spent: not an outage, this job"
        job = job_of(store, USER, "ok", "d1")
        assert job is not None and (job.status, job.attempts) == (Status.PENDING, 1)
        assert job.error is not None
        assert job.error.startswith("the gateway answers other calls but keeps failing this one: ")
        assert "d1 cannot be served" in job.error
        assert not store.gate_state().paused  # the queue behind it keeps moving


# --- the lease ------------------------------------------------------------------------------


def test_a_takeover_mid_call_cancels_the_call_at_once_and_records_nothing() -> None:
    # Renewals come every 0.1 s; the lease's own deadline is 55 s away.
    bench = Bench(make_settings(lease_seconds=60.0))

    async def scenario() -> Report:
        bench.gateway.default = hang
        task = asyncio.create_task(bench.run())
        await bench.gateway.called.wait()
        # Another worker takes the job over: every renewal from the next one on finds it gone.
        bench.store.script_renewals(Renewal.LOST, from_nth=len(bench.store.renewals()) + 1)
        return await asyncio.wait_for(task, LATE)

    report = go(scenario())
    assert report.outcome is Outcome.LOST and report.failure is None
    assert report.message == "the claim was taken over by another worker"
    assert bench.gateway.cancelled.is_set()
    # Nothing written after the takeover: its renewal was the last word to the store.
    calls = bench.store.calls
    assert calls[-1].renewal and calls[-1].reply is Renewal.LOST
    assert [c.reply for c in calls].count(Renewal.LOST) == 1
    assert bench.store.settlements() == []


def test_a_lapse_mid_call_stops_the_call_and_keeps_the_attempt(bench: Bench) -> None:
    # Renewals come every 0.1 s; the lease's own deadline is 25 s away.
    async def scenario() -> Report:
        bench.gateway.default = hang
        task = asyncio.create_task(bench.run())
        await bench.gateway.called.wait()
        bench.store.script_renewals(Renewal.LAPSED, from_nth=len(bench.store.renewals()) + 1)
        return await asyncio.wait_for(task, LATE)

    report = go(scenario())
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.STOPPED
    assert report.message == "stopped the call: the claim lapsed before it could be renewed"
    assert bench.gateway.cancelled.is_set()
    assert [c.reply for c in bench.store.renewals()].count(Renewal.LAPSED) == 1
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.STOPPED, report.message)
    assert report.settlement is not None and not report.settlement.attempt_spent


def test_a_database_down_past_the_budget_stops_the_call_before_the_lease_could_lapse() -> None:
    lease, margin = 3.0, 1.5
    bench = Bench(
        make_settings(lease_seconds=lease, lease_margin_seconds=margin, heartbeat_seconds=0.2)
    )
    # Renewals 1 (right before the call) and 2 and 3 (heartbeats) work; then none does.
    bench.store.script_renewals(DatabaseError(DOWN), from_nth=4)

    async def scenario() -> tuple[Report, float]:
        bench.gateway.default = hang
        task = asyncio.create_task(bench.run())
        await bench.gateway.cancelled.wait()
        stopped = time.monotonic()
        return await task, stopped

    report, stopped = go(scenario())
    renewed_at = bench.store.renewed_at
    assert len(renewed_at) == 3 and len(bench.store.renewals()) > 3
    held = stopped - renewed_at[-1]
    # Stopped by its own deadline (L2: lease minus margin after the last confirmed
    # renewal was sent), so before anyone could take the claim over.
    assert lease - margin - 0.05 <= held < lease - 0.5, held
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.STOPPED
    assert report.message.startswith(
        "stopped the call before its claim could lapse: the claim could not be renewed "
        f"for 1.5 s ({DOWN})"
    )
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.STOPPED, report.message)
    assert report.settlement is not None and not report.settlement.attempt_spent


def test_a_build_past_the_deadline_never_starts_the_call() -> None:
    # The attempt's limit is 0.75 s after the claim (claim timeout minus the margin).
    settings = make_settings(
        claim_timeout_seconds=1.0, lease_margin_seconds=0.25, lease_seconds=30.0
    )
    gate = threading.Event()
    bench = Bench(settings, build_gate=gate)

    async def scenario() -> Report:
        try:
            return await asyncio.wait_for(bench.run("slow-build"), LATE)
        finally:
            gate.set()

    started = time.monotonic()
    report = go(scenario())
    took = time.monotonic() - started
    assert report.outcome is Outcome.REQUEUED and report.failure is Failure.BUILD
    assert report.message.startswith("prompt building ran past the attempt's deadline")
    assert not report.called and bench.gateway.asked == []
    assert started_calls(bench.store.calls) == []  # no call was marked started
    assert took >= 0.75 - 0.05
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.BUILD, report.message)
    assert report.settlement is not None and report.settlement.attempt_spent


def test_a_graceful_stop_settles_stopped_keeps_the_attempt_and_reraises(bench: Bench) -> None:
    async def scenario() -> None:
        bench.gateway.default = hang
        task = asyncio.create_task(bench.run())
        await bench.gateway.called.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    go(scenario())
    assert bench.gateway.cancelled.is_set()
    # The call was marked started before it was sent, so the store holds the gateway for it
    # from its start (H1: tests/integration/test_cut_calls.py).
    assert started_calls(bench.gateway.told_before[0]) == [Renewal.RENEWED]
    told = bench.store.settlements()
    assert [(c.method, c.failure, c.message) for c in told] == [
        ("fail", Failure.STOPPED, "stopped: the consumer is shutting down; the job was handed back")
    ]
    assert told[0].retry_after is None and told[0].duration is not None
    assert isinstance(told[0].reply, Settlement) and not told[0].reply.attempt_spent


def test_a_takeover_before_the_call_means_no_call() -> None:
    # No heartbeat while the prompt is built: the runner renews right before the call (L2),
    # and the claim is already gone (taken over while the prompt was being built).
    bench = Bench(make_settings(heartbeat_seconds=20.0))
    bench.store.script_renewals(Renewal.LOST, from_nth=1)
    report = go(bench.run())
    assert report.outcome is Outcome.LOST
    assert report.message == "the claim was taken over by another worker"
    assert bench.gateway.asked == [] and not report.called
    assert started_calls(bench.store.calls) == [Renewal.LOST]
    assert bench.store.settlements() == []


def test_a_store_down_right_before_the_call_means_no_call_and_no_attempt_spent() -> None:
    bench = Bench(make_settings(heartbeat_seconds=5.0, lease_seconds=30.0))
    bench.store.script_renewals(DatabaseError(DOWN), from_nth=1)
    report = go(bench.run())
    assert bench.gateway.asked == [] and not report.called
    assert report.outcome is Outcome.RELEASED and report.failure is Failure.STOPPED
    assert "could not be renewed" in report.message
    assert DOWN in report.message
    [renewal] = bench.store.renewals()
    assert renewal.calling and isinstance(renewal.reply, DatabaseError)
    told = bench.told(report)
    assert (told.method, told.failure, told.message) == ("fail", Failure.STOPPED, report.message)
    assert told.duration is None  # no call
    assert report.settlement is not None and not report.settlement.attempt_spent


# --- messages ---------------------------------------------------------------------------------


def test_a_token_echoed_by_the_gateway_never_reaches_the_report_or_the_store(bench: Bench) -> None:
    async def echo(request: httpx.Request) -> httpx.Response:
        return httpx.Response(500, content=f"bad key {request.headers['Authorization']}")

    bench.gateway.default = echo
    report = go(bench.run())
    assert "[redacted]" in report.message
    told = bench.told(report)
    assert told.message is not None and "[redacted]" in told.message
    assert exposures(report.message + repr(report) + repr(bench.store.calls), TOKEN) == []


def test_a_token_in_a_generators_error_never_reaches_the_report_or_the_store(
    bench: Bench,
) -> None:
    report = go(bench.run("leaky-build"))
    assert report.failure is Failure.BUILD and "[redacted]" in report.message
    told = bench.told(report)
    assert told.message is not None and "[redacted]" in told.message
    assert exposures(report.message + repr(report) + repr(bench.store.calls), TOKEN) == []
