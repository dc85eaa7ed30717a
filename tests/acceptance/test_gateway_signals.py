"""The gateway's signals, read by a real consumer process, measured at the gateway (G1-G5, N2).

Each scenario queues a few jobs in a real store (SQLite; PostgreSQL where it
costs little), puts the independent recorder (`devtools.recorder`, a TCP proxy)
in front of the gateway simulator or of fakellm (a third-party
OpenAI-compatible server), and runs `tests.support.worker` in a
process of its own until the queue is empty (or, for a refusal, until the
test stops it). `AI_JOB_CONCURRENCY` is 1, as for a project sharing the
gateway's four slots with two others: one call at a time makes every
connection at the recorder one call, in order, and every gap unambiguous; the
rate limit runs two consumer processes, so its pause must hold across the
deployment. Then it checks:

- what became of every job in the store: done once, or failed with its own
  error and its attempts spent, or kept its attempts;
- what the gateway saw, from the recorder alone: at most
  `AI_JOB_CONCURRENCY` connections open at once, at least
  `AI_JOB_GAP_SECONDS` between one closing and the next opening (less
  `GAP_SLACK`, 50 ms, for the recorder's own delay between a connection
  closing and it noting so), and no new call during a pause;
- for the 50 MB answers, the consumer's peak RSS (the kernel's high-water
  mark of its memory, VmHWM, which it reports as it exits), under the
  issue's 200 MiB.

Faults are set by count (`requests=`), per job (`job=`), or switched on an
event (the recorder having seen so many refused connections); none depends
on a wall-clock window. Every scenario prints one `FIGURES` line: the
numbers `RELIABILITY.md` quotes.
"""

from __future__ import annotations

import dataclasses
import email.utils
import itertools
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine

from devtools.recorder import UPSTREAM_REFUSED, ConnectionInterval, GatewayRecorder
from devtools.simulator import (
    CLIENT_GONE,
    CLOSED_MID_BODY,
    ECHOED_TOKEN,
    HUGE,
    HUGE_RAW,
    INJECTED_STATUS,
    OK,
    REDIRECTED,
    GatewaySimulator,
    RequestRecord,
)
from queue_store import Job, JobStore, Status
from queue_store.engine import normalise_url
from tests.support.databases import PostgresDatabases
from tests.support.factories import store_for
from tests.support.race_worker import dump_tables
from tests.support.reads import job_of, result_of
from tests.support.secrets import exposures
from tests.support.services import ROOT, run_cli, stop
from tests.support.settings import settings_from
from tests.support.third_party import FakeLLM, header_value
from tests.support.waiting import wait_for

pytestmark = [pytest.mark.slow]

# Random per run, with a character of every escaping kind: a find is never chance.
TOKEN = f'tok/{secrets.token_hex(8)}+q"u\\o<t>&{secrets.token_hex(4)}='
USER = "signals-user"
GAP = 0.3  # seconds: AI_JOB_GAP_SECONDS
GAP_SLACK = 0.05  # seconds the recorder may note a close after the store counted it
BACKOFF = 0.5  # seconds: AI_JOB_BACKOFF_SECONDS
BACKOFF_MAX = 2.0  # seconds: AI_JOB_BACKOFF_MAX_SECONDS
READ_TIMEOUT = 3.0  # seconds: AI_GATEWAY_READ_TIMEOUT
MAX_ATTEMPTS = 3
LATENCY = 0.2  # seconds per simulated answer
RSS_LIMIT = 200 * 1024 * 1024  # bytes: the bound for a consumer fed 50 MB answers
HUGE_BYTES = 50 * 1024 * 1024
RUN_LIMIT = 180.0  # seconds a consumer run may take before the test gives up on it
LATE = 5.0  # seconds: waits longer than asked by this much would be a fault


# --- the consumer process ------------------------------------------------------------------------


@dataclasses.dataclass
class ConsumerRun:
    returncode: int
    summary: dict[str, Any]
    stdout: str
    stderr: str
    max_rss_bytes: int
    seconds: float

    def reports(self, job: str) -> list[dict[str, Any]]:
        return [r for r in self.summary["reports"] if r["job"] == job]


class ConsumerProcess:
    """`tests.support.worker` in its own session; stopped by its PID."""

    def __init__(self, env: dict[str, str], directory: Path, log_level: str = "INFO") -> None:
        directory.mkdir(parents=True, exist_ok=True)
        self.out, self.err = directory / "consumer.out", directory / "consumer.err"
        self.started = time.monotonic()
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "tests.support.worker", "--log-level", log_level],
                env={**os.environ, **env},
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def finish(self, timeout: float = RUN_LIMIT) -> ConsumerRun:
        """Wait for it to exit; its summary carries its peak RSS."""
        deadline = time.monotonic() + timeout
        while True:
            pid, status, _ = os.wait4(self.process.pid, os.WNOHANG)
            if pid:
                self.process.returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the consumer ran past {timeout} s:\n{self.log()}")
            time.sleep(0.05)
        stdout = self.out.read_text()
        lines = stdout.strip().splitlines()
        assert self.process.returncode == 0 and lines, self.log()
        return ConsumerRun(
            returncode=self.process.returncode,
            summary=json.loads(lines[-1]),
            stdout=stdout,
            stderr=self.err.read_text(),
            max_rss_bytes=int(json.loads(lines[-1])["peak_rss_bytes"]),
            seconds=time.monotonic() - self.started,
        )

    def terminate(self, timeout: float = 30.0) -> ConsumerRun:
        """A graceful stop (SIGTERM), as a deployment stops a consumer."""
        os.kill(self.process.pid, signal.SIGTERM)
        return self.finish(timeout)

    def stop(self) -> None:
        if self.process.returncode is None and self.process.poll() is None:
            stop(self.process)

    def log(self) -> str:
        return f"{self.out.read_text()[-3000:]}\n{self.err.read_text()[-5000:]}"


# --- the gateway side ----------------------------------------------------------------------------


@pytest.fixture
def sim() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=LATENCY) as simulator:
        yield simulator


@pytest.fixture
def recorder(sim: GatewaySimulator) -> Iterator[GatewayRecorder]:
    with GatewayRecorder("127.0.0.1", sim.port) as recording:
        yield recording


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'queue.db'}"


def guarded(recorder: GatewayRecorder, concurrency: int = 1) -> tuple[int, float | None]:
    """The recorder's peak and smallest gap; both within the settings, or the test fails."""
    snapshot = recorder.wait_until_idle(10)
    assert snapshot.peak_in_flight <= concurrency, snapshot.peak_in_flight
    assert snapshot.min_gap is None or snapshot.min_gap >= GAP - GAP_SLACK, snapshot.gaps
    return snapshot.peak_in_flight, snapshot.min_gap


def calls(
    recorder: GatewayRecorder, sim: GatewaySimulator
) -> list[tuple[ConnectionInterval, RequestRecord]]:
    """Each connection the recorder saw with the request the simulator served on it.

    One call at a time, one connection per call: the n-th connection opened
    carried the n-th request received.
    """
    intervals = sorted(recorder.intervals(), key=lambda interval: interval.opened)
    records = sorted(sim.stats().requests, key=lambda record: record.received)
    assert len(intervals) == len(records), (len(intervals), len(records))
    return list(zip(intervals, records, strict=True))


# --- the store side ------------------------------------------------------------------------------


def env_for(database_url: str, gateway_url: str, data_dir: Path, **more: Any) -> dict[str, str]:
    values: dict[str, Any] = {
        "AI_JOB_DATABASE_URL": database_url,
        "AI_JOB_DATA_DIR": data_dir,
        "AI_GATEWAY_URL": gateway_url,
        "AI_GATEWAY_TOKEN": TOKEN,
        "AI_GATEWAY_READ_TIMEOUT": READ_TIMEOUT,
        "AI_GATEWAY_CONNECT_TIMEOUT": 1,
        "AI_JOB_CONCURRENCY": 1,
        "AI_JOB_GAP_SECONDS": GAP,
        "AI_JOB_BACKOFF_SECONDS": BACKOFF,
        "AI_JOB_BACKOFF_MAX_SECONDS": BACKOFF_MAX,
        "AI_JOB_MAX_ATTEMPTS": MAX_ATTEMPTS,
        "AI_JOB_HEARTBEAT_SECONDS": 0.5,
        "AI_JOB_LEASE_SECONDS": 10,
        "AI_JOB_POLL_SECONDS": 0.2,
        "AI_JOB_PLUGINS": "tests.support.plugins",
        "AI_JOBS": "true",
    }
    values.update(more)
    return {name: str(value) for name, value in values.items()}


@dataclasses.dataclass
class Queue:
    store: JobStore
    subjects: list[str]

    def job(self, subject: str) -> Job:
        found = job_of(self.store, USER, "ok", subject)
        assert found is not None, subject
        return found

    def jobs(self) -> dict[str, Job]:
        return {subject: self.job(subject) for subject in self.subjects}


class Scenario:
    """What one scenario starts on the store's side: its queue, and consumers over it.

    Each scenario queues jobs for USER in a store of its own, with the
    settings of `env_for`, and runs consumer processes against it; the
    fixture closes the stores and stops the consumers, by PID, at the end.
    """

    def __init__(self, directory: Path, database_url: str) -> None:
        self.directory = directory
        self.database_url = database_url
        self.started: list[ConsumerProcess] = []
        self.opened: list[JobStore] = []

    def queue(
        self,
        gateway_url: str,
        subjects: list[str],
        *,
        database_url: str | None = None,
        **more: Any,
    ) -> tuple[dict[str, str], Queue]:
        """The environment of this scenario's processes, and its queue of `subjects`."""
        url = database_url or self.database_url
        env = env_for(url, gateway_url, self.directory / "data", **more)
        settings = settings_from(env)
        store = store_for(settings)
        self.opened.append(store)
        for subject in subjects:  # in this order: the oldest is claimed first
            store.enqueue(USER, "ok", subject)
        return env, Queue(store, subjects)

    def consumer(
        self, env: dict[str, str], name: str = "consumer", log_level: str = "INFO"
    ) -> ConsumerProcess:
        consumer = ConsumerProcess(env, self.directory / name, log_level)
        self.started.append(consumer)
        return consumer

    def close(self) -> None:
        try:
            for consumer in self.started:
                consumer.stop()
        finally:
            for store in self.opened:
                store.close()


@pytest.fixture
def scenario(tmp_path: Path, sqlite_url: str) -> Iterator[Scenario]:
    """A scenario on SQLite, unless its queue is asked for on another database."""
    made = Scenario(tmp_path, sqlite_url)
    try:
        yield made
    finally:
        made.close()


def answered(records: Sequence[RequestRecord], job: str) -> list[RequestRecord]:
    return [r for r in records if r.job == job]


def figures(name: str, **values: Any) -> None:
    shown = ", ".join(f"{key}={value}" for key, value in values.items())
    print(f"\nFIGURES {name}: {shown}")


# --- G1: a rate limit, with each way of saying how long ------------------------------------------

FAR_DATE = "far-date"  # stands for an HTTP date an hour after the answer's own Date

RETRY_FORMS = [
    # headers the 429 carries, the pause the store must choose
    ({"Retry-After": "1"}, 1.0),
    ({"Retry-After": FAR_DATE}, BACKOFF_MAX),  # read against Date, then capped
    ({"Retry-After": "30"}, BACKOFF_MAX),  # capped by AI_JOB_BACKOFF_MAX_SECONDS
    ({"retry-after-ms": "1200"}, 1.2),
    ({"llm_provider-retry-after": "1"}, 1.0),
    ({"x-ratelimit-reset-requests": "1s500ms"}, 1.5),
    ({}, BACKOFF),  # none given: the backoff
]


def run_rate_limit(
    scenario: Scenario,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    headers: dict[str, str],
    pause: float,
    database_url: str | None = None,
) -> None:
    env, queue = scenario.queue(
        recorder.url, ["limited", "b", "c", "d", "e"], database_url=database_url
    )
    if headers.get("Retry-After") == FAR_DATE:
        headers = {"Retry-After": email.utils.formatdate(time.time() + 3600, usegmt=True)}
    sim.set_fault("status", status=429, headers=headers, job="ok:limited", requests=1)

    # Two consumer processes share the deployment: the pause must hold for both.
    started = [scenario.consumer(env, f"consumer-{n}") for n in (1, 2)]
    runs = [consumer.finish() for consumer in started]

    reports = [report for run in runs for report in run.summary["reports"]]
    limited = sorted(
        (report for report in reports if report["job"] == "ok:limited"),
        key=lambda report: report["call_started_at"],
    )
    assert [(r["outcome"], r["failure"], r["attempt_spent"]) for r in limited] == [
        ("released", "rate_limited", False),
        ("done", None, None),
    ]
    assert limited[0]["pause_seconds"] == pytest.approx(pause)
    # No attempt spent: every job done on its first attempt, answered once.
    pairs = calls(recorder, sim)
    for subject, job in queue.jobs().items():
        assert (job.status, job.attempts, job.error) == (Status.DONE, 1, None), subject
        served = [record for _, record in pairs if record.job == f"ok:{subject}"]
        assert [r.outcome for r in served if r.outcome == OK] == [OK], subject
    # At the gateway: the next call of either process came only once the pause was over.
    (index,) = [n for n, (_, record) in enumerate(pairs) if record.outcome == INJECTED_STATUS]
    refused, following = pairs[index][0], pairs[index + 1][0]
    assert refused.closed is not None
    waited = following.opened - refused.closed
    assert pause - GAP_SLACK <= waited < pause + LATE, waited
    peak, gap = guarded(recorder)
    figures(
        f"rate-limit {headers or 'none'} ({env['AI_JOB_DATABASE_URL'].split(':')[0]})",
        pause_chosen=limited[0]["pause_seconds"],
        next_call_after_s=round(waited, 3),
        attempts=[j.attempts for j in queue.jobs().values()],
        jobs_per_process=[run.summary["ran"] for run in runs],
        peak_in_flight=peak,
        min_gap_s=None if gap is None else round(gap, 3),
        calls=recorder.count,
    )


@pytest.mark.parametrize(
    ("headers", "pause"),
    RETRY_FORMS,
    ids=["seconds", "http-date", "capped", "ms", "llm-provider", "x-ratelimit-reset", "none"],
)
def test_a_rate_limit_pauses_everyone_for_the_time_asked_and_spends_nothing(
    headers: dict[str, str],
    pause: float,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    run_rate_limit(scenario, sim, recorder, headers, pause)


@pytest.fixture
def postgres_url(postgres: PostgresDatabases) -> Iterator[str]:
    url = postgres.migrated()
    try:
        yield url
    finally:
        postgres.drop(url)


def test_a_rate_limit_on_postgresql_too(
    postgres_url: str,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    run_rate_limit(scenario, sim, recorder, {"Retry-After": "1"}, 1.0, postgres_url)


# --- G2: one job the gateway keeps failing, while it answers the others --------------------------


def run_poisoned(
    scenario: Scenario,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    fault: dict[str, Any],
    words: str,
    outcome: str,
    database_url: str | None = None,
) -> None:
    others = [f"after-{n}" for n in range(6)]
    env, queue = scenario.queue(recorder.url, ["poisoned", *others], database_url=database_url)
    sim.set_fault(job="ok:poisoned", **fault)  # every call of that job, and no other

    run = scenario.consumer(env).finish()

    records = sim.stats().requests
    poisoned = queue.job("poisoned")
    assert (poisoned.status, poisoned.attempts) == (Status.FAILED, MAX_ATTEMPTS)
    assert poisoned.error is not None
    assert poisoned.error.startswith(
        "the gateway answers other calls but keeps failing this one: POST "
    ), poisoned.error
    assert words in poisoned.error
    # Its first failure looked like an outage (kept, paused); every later one
    # came after the gateway had answered others: spent.
    reports = run.reports("ok:poisoned")
    assert [r["attempt_spent"] for r in reports] == [False] + [True] * MAX_ATTEMPTS
    assert reports[0]["pause_seconds"] == BACKOFF
    assert all(r["pause_seconds"] is None for r in reports[1:])
    calls = answered(records, "ok:poisoned")
    assert len(calls) == 1 + MAX_ATTEMPTS and {r.outcome for r in calls} == {outcome}
    for subject in others:
        job = queue.job(subject)
        assert (job.status, job.attempts, job.error) == (Status.DONE, 1, None), subject
        assert [r.outcome for r in answered(records, f"ok:{subject}")] == [OK], subject
    peak, quiet = guarded(recorder)
    figures(
        f"poisoned job {fault['kind']} {fault.get('status', '')} "
        f"({env['AI_JOB_DATABASE_URL'].split(':')[0]})",
        calls_to_it=len(calls),
        spent=[r["attempt_spent"] for r in reports],
        pauses=[r["pause_seconds"] for r in reports],
        others_done=len(others),
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
        seconds=round(run.seconds, 1),
    )


def test_a_504_for_one_job_fails_that_job_and_the_queue_behind_drains(
    database_url: str,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    run_poisoned(
        scenario,
        sim,
        recorder,
        {"kind": "status", "status": 504},
        "gateway unavailable (HTTP 504)",
        INJECTED_STATUS,
        database_url,
    )


def test_a_connection_cut_mid_body_for_one_job_fails_that_job_and_the_queue_drains(
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    run_poisoned(
        scenario,
        sim,
        recorder,
        {"kind": "close_mid_body"},
        "connection closed mid-answer (HTTP 200, ",
        CLOSED_MID_BODY,
    )


# --- G3: an answer that never completes, and one far too large -----------------------------------


def test_a_trickle_ends_as_a_gateway_timeout_naming_the_bytes_received(
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    env, queue = scenario.queue(recorder.url, ["trickled", "b", "c"])
    # A byte every 0.2 s: each read is short, the whole answer would take a minute.
    sim.set_fault("trickle", interval=0.2, job="ok:trickled")

    run = scenario.consumer(env).finish()

    job = queue.job("trickled")
    assert (job.status, job.attempts) == (Status.FAILED, MAX_ATTEMPTS)
    assert job.error is not None and "worker lost" not in job.error
    assert f"no complete answer within {READ_TIMEOUT:g} s (received " in job.error, job.error
    assert "bytes, HTTP 200 headers)" in job.error
    reports = run.reports("ok:trickled")
    assert [r["failure"] for r in reports] == ["timeout"] * MAX_ATTEMPTS
    # A timeout pauses in case the gateway is still at it: 0.5, 1, 2 s.
    assert [r["pause_seconds"] for r in reports] == [BACKOFF, 2 * BACKOFF, BACKOFF_MAX]
    records = sim.stats().requests
    trickled = answered(records, "ok:trickled")
    assert len(trickled) == MAX_ATTEMPTS
    assert all(r.outcome == CLIENT_GONE and r.disconnected is not None for r in trickled)
    # At the gateway, each of those calls was held open until the call's deadline
    # (which also covers connecting, so the connection itself is a little shorter).
    held = [
        interval.seconds or 0.0
        for interval, record in calls(recorder, sim)
        if record.job == "ok:trickled"
    ]
    assert all(READ_TIMEOUT / 2 <= s < READ_TIMEOUT + LATE for s in held), held
    for subject in ("b", "c"):
        assert (queue.job(subject).status, queue.job(subject).attempts) == (Status.DONE, 1)
    peak, quiet = guarded(recorder)
    figures(
        "trickle",
        error=job.error[:120],
        held_s=[round(s, 2) for s in held],
        pauses=[r["pause_seconds"] for r in reports],
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )


@pytest.mark.parametrize("kind", ["huge", "huge_raw"])
def test_a_50_mb_answer_is_cut_off_and_the_consumer_stays_small(
    kind: str,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    env, queue = scenario.queue(recorder.url, ["huge", "b", "c"])
    sim.set_fault(kind, size=HUGE_BYTES, job="ok:huge")  # type: ignore[arg-type]

    run = scenario.consumer(env).finish()

    job = queue.job("huge")
    assert (job.status, job.attempts) == (Status.FAILED, MAX_ATTEMPTS)
    assert job.error is not None
    assert "answer larger than 1,048,576 bytes (AI_GATEWAY_MAX_ANSWER_BYTES); cut off" in job.error
    assert [r["failure"] for r in run.reports("ok:huge")] == ["rejected"] * MAX_ATTEMPTS
    for subject in ("b", "c"):
        assert (queue.job(subject).status, queue.job(subject).attempts) == (Status.DONE, 1)
    records = answered(sim.stats().requests, "ok:huge")
    assert len(records) == MAX_ATTEMPTS
    assert all(r.outcome in (CLIENT_GONE, HUGE, HUGE_RAW) for r in records)
    # The consumer read about a megabyte of each, never the 50.
    sent = max(i.bytes_from_upstream for i in recorder.intervals())
    assert sent < HUGE_BYTES / 2, sent
    assert run.max_rss_bytes < RSS_LIMIT, run.max_rss_bytes
    peak, quiet = guarded(recorder)
    figures(
        f"50 MB {kind}",
        peak_rss_mib=round(run.max_rss_bytes / 2**20, 1),
        largest_forwarded_mib=round(sent / 2**20, 1),
        attempts=job.attempts,
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )


# --- G4, G5: refused credentials and redirects stop the line, with one reason --------------------

REFUSALS: dict[str, tuple[dict[str, Any], str, str]] = {
    # the fault, the words of the one operator-facing reason
    "401-echoing-the-token": (
        {"kind": "echo_token", "status": 401},
        "the gateway refused our credentials (HTTP 401); check AI_GATEWAY_TOKEN",
        ECHOED_TOKEN,
    ),
    "redirect": (
        {"kind": "redirect", "status": 307, "location": "https://moved-gateway.invalid/v1"},
        "the gateway redirected to host moved-gateway.invalid (HTTP 307); set AI_GATEWAY_URL",
        REDIRECTED,
    ),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_a_refusal_spends_no_attempt_and_stops_claiming_with_one_operator_facing_error(
    case: str,
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    fault, words, outcome = REFUSALS[case]
    # A long backoff, so the stop is still in force while the commands look.
    env, queue = scenario.queue(
        recorder.url,
        ["first", "second", "third"],
        AI_JOB_BACKOFF_SECONDS=60,
        AI_JOB_BACKOFF_MAX_SECONDS=120,
    )
    sim.set_fault(**fault)  # every call

    consumer = scenario.consumer(env, log_level="DEBUG")
    wait_for(lambda: queue.store.gate_state().paused, 60, "claiming to stop")
    gate = queue.store.gate_state()
    shown = {
        "settings": run_cli("settings", env=env).stdout,
        "settings --json": run_cli("settings", "--json", env=env).stdout,
        "status": run_cli("status", USER, "ok", "first", env=env).stdout,
        "queue --json": run_cli("queue", "--json", env=env).stdout,
        "queue": run_cli("queue", env=env).stdout,
    }
    run = consumer.terminate()

    # One call reached the gateway; it was refused; nothing was spent.
    assert [r.outcome for r in sim.stats().requests] == [outcome]
    assert recorder.count == 1
    (report,) = run.summary["reports"]
    assert (report["outcome"], report["failure"], report["attempt_spent"]) == (
        "released",
        "refused",
        False,
    )
    assert report["pause_seconds"] == 60.0
    assert (
        report["verdict"] == "the gateway refused us; claiming stopped for 60 s until it is fixed"
    )
    for subject, job in queue.jobs().items():
        assert (job.status, job.attempts) == (Status.PENDING, 0), subject
    # The one reason, as the operator sees it everywhere.
    assert gate.pause_kind == "refused" and gate.pause_reason is not None
    reason = gate.pause_reason
    assert words in reason
    assert json.loads(shown["settings --json"])["gate"]["pause_reason"] == reason
    assert json.loads(shown["status"])["paused"]["pause_reason"] == reason
    assert json.loads(shown["queue --json"])["gate"]["pause_reason"] == reason
    for table in ("settings", "queue"):
        assert "claiming: PAUSED (refused)" in shown[table], shown[table]
        assert words in shown[table]
    assert words in run.stderr  # and in the consumer's log
    everything = "\n".join(
        [*shown.values(), run.stdout, run.stderr, dump_store(scenario.database_url)]
    )
    assert exposures(everything, TOKEN) == []
    if case.startswith("401"):
        assert "[redacted]" in reason  # the echoed token was there, and went
    peak, _ = guarded(recorder)
    figures(
        f"refused {case}",
        calls=recorder.count,
        attempts=[j.attempts for j in queue.jobs().values()],
        pause_chosen=report["pause_seconds"],
        reason=reason[:140],
        peak_in_flight=peak,
    )


def test_a_token_echoed_in_every_form_appears_nowhere(
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    marker = f"marker-{secrets.token_hex(6)}"
    env, queue = scenario.queue(recorder.url, [f"echo-{marker}", f"fine-{marker}"])
    # A 500 quoting the token plain, JSON-escaped, \u-escaped, URL-encoded and
    # in base64 (alone and as user:token), and in a response header.
    sim.set_fault("echo_token", status=500, job=f"ok:echo-{marker}")

    run = scenario.consumer(env, log_level="DEBUG").finish()

    echoed = queue.job(f"echo-{marker}")
    assert (echoed.status, echoed.attempts) == (Status.FAILED, MAX_ATTEMPTS)
    assert echoed.error is not None and "[redacted]" in echoed.error
    assert queue.job(f"fine-{marker}").status == Status.DONE
    assert [r.outcome for r in answered(sim.stats().requests, f"ok:echo-{marker}")] == [
        ECHOED_TOKEN
    ] * MAX_ATTEMPTS
    shown = {
        "consumer output": run.stdout + run.stderr,
        "store": dump_store(scenario.database_url),
        "settings": run_cli("settings", env=env).stdout,
        "settings --json": run_cli("settings", "--json", env=env).stdout,
        "jobs": run_cli("jobs", "--user", USER, env=env).stdout,
        "queue --json": run_cli("queue", "--json", env=env).stdout,
        "status": run_cli("status", USER, "ok", f"echo-{marker}", env=env).stdout,
    }
    # Positive controls: each source holds what the job wrote, so it was searched.
    for where in ("consumer output", "store", "jobs", "queue --json", "status"):
        assert marker in shown[where], where
    assert "DEBUG" in run.stderr and "x-echoed-token" in run.stderr.lower()
    assert "(set)" in shown["settings"]
    for where, text in shown.items():
        assert exposures(text, TOKEN) == [], where
    peak, quiet = guarded(recorder)
    figures(
        "token echoed in every form",
        echoed_calls=MAX_ATTEMPTS,
        sources_searched=len(shown),
        debug_log_lines=run.stderr.count("\n"),
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )


def dump_store(url: str) -> str:
    engine = create_engine(normalise_url(url))
    try:
        return repr(dump_tables(engine))
    finally:
        engine.dispose()


# --- N2: an outage spends nothing and backs off, doubling and capped -----------------------------


def test_an_outage_spends_no_attempt_and_backs_off_doubling_to_the_cap(
    sim: GatewaySimulator,
    recorder: GatewayRecorder,
    scenario: Scenario,
) -> None:
    refused_calls, unavailable_calls = 4, 2
    env, queue = scenario.queue(recorder.url, ["a", "b", "c", "d"])
    sim.set_fault("refuse")  # nothing listens behind the recorder

    consumer = scenario.consumer(env)

    def refused() -> int:
        return sum(i.closed_by == UPSTREAM_REFUSED for i in recorder.intervals())

    # Switched on events, each while the consumer waits out a pause.
    wait_for(lambda: refused() >= refused_calls, 60, "refused calls")
    sim.set_fault("status", status=503, requests=unavailable_calls)  # listening again
    run = consumer.finish()

    intervals = sorted(recorder.intervals(), key=lambda i: i.opened)
    records = sorted(sim.stats().requests, key=lambda r: r.received)
    outage = len(intervals) - len([r for r in records if r.outcome == OK])
    assert outage == refused() + unavailable_calls
    assert [r.outcome for r in records[:unavailable_calls]] == [INJECTED_STATUS] * 2
    assert [r.outcome for r in records[unavailable_calls:]] == [OK] * len(queue.subjects)
    # The pauses the store chose, and that the gateway saw kept.
    pauses = [r["pause_seconds"] for r in run.summary["reports"] if r["failure"] == "unavailable"]
    expected = [min(BACKOFF * 2**n, BACKOFF_MAX) for n in range(outage)]
    assert pauses == expected
    seen = [
        later.opened - (earlier.closed or 0.0) for earlier, later in itertools.pairwise(intervals)
    ]
    for waited, pause in zip(seen, expected, strict=False):
        assert waited >= pause - GAP_SLACK, (seen, expected)
    for subject, job in queue.jobs().items():
        assert (job.status, job.attempts, job.error) == (Status.DONE, 1, None), subject
    assert queue.store.gate_state().outages_in_a_row == 0
    peak, quiet = guarded(recorder)
    figures(
        "outage",
        refused=refused(),
        unavailable_503=unavailable_calls,
        pauses=pauses,
        waited_s=[round(s, 2) for s in seen[:outage]],
        attempts=[j.attempts for j in queue.jobs().values()],
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )


# --- a real third-party server: fakellm ----------------------------------------------------------


def fakellm_rules(limited_turns: int) -> list[dict[str, Any]]:
    return [
        {
            # fakellm counts a conversation's turns (its first user message
            # names the job), so the rule runs out by count.
            "name": "rate_limited_job",
            "when": {
                "header.x-insight-job": header_value("ok:limited"),
                "turn_in": [1, limited_turns],
            },
            "respond": {"status": 429, "error": "Rate limit reached for requests"},
        },
        {
            "name": "broken_job",
            "when": {"header.x-insight-job": header_value("ok:broken")},
            "respond": {"status": 500, "error": "The server had an error"},
        },
        {"name": "default", "respond": {"content": "an insight from a third-party server"}},
    ]


@pytest.fixture
def fakellm(tmp_path: Path) -> Iterator[FakeLLM]:
    with FakeLLM(tmp_path / "fakellm", fakellm_rules(2)) as server:
        yield server


def test_against_a_third_party_server_the_happy_path(
    fakellm: FakeLLM,
    scenario: Scenario,
) -> None:
    with GatewayRecorder(fakellm.host, fakellm.port) as recorder:
        env, queue = scenario.queue(recorder.url, ["a", "b", "c", "d"])
        run = scenario.consumer(env).finish()
        for subject, job in queue.jobs().items():
            assert (job.status, job.attempts) == (Status.DONE, 1), subject
            result = result_of(queue.store, USER, "ok", subject)
            assert result is not None
            assert result.output == {"text": "an insight from a third-party server"}
        assert run.summary["outcomes"] == {"done": 4}
        assert recorder.count == 4
        peak, quiet = guarded(recorder)
    figures(
        "fakellm happy path",
        calls=4,
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )


def test_against_a_third_party_server_a_429_and_a_500_for_one_job_each(
    fakellm: FakeLLM,
    scenario: Scenario,
) -> None:
    with GatewayRecorder(fakellm.host, fakellm.port) as recorder:
        env, queue = scenario.queue(recorder.url, ["a", "limited", "b", "broken", "c"])
        run = scenario.consumer(env).finish()

        limited = run.reports("ok:limited")
        assert [r["outcome"] for r in limited] == ["released", "released", "done"]
        # Two 429s in a row that name no wait: the second pause is twice the first.
        assert [r["pause_seconds"] for r in limited[:2]] == [BACKOFF, BACKOFF * 2]
        assert (queue.job("limited").status, queue.job("limited").attempts) == (
            Status.DONE,
            1,
        )
        broken = queue.job("broken")
        assert (broken.status, broken.attempts) == (Status.FAILED, MAX_ATTEMPTS)
        assert broken.error is not None
        assert "gateway refused the request (HTTP 500)" in broken.error
        assert "The server had an error" in broken.error
        assert [r["attempt_spent"] for r in run.reports("ok:broken")] == [True] * MAX_ATTEMPTS
        for subject in ("a", "b", "c"):
            assert (queue.job(subject).status, queue.job(subject).attempts) == (
                Status.DONE,
                1,
            )
        # One connection per call: 3 answered once, 3 for the limited job, 3 for the broken.
        assert recorder.count == 3 + 3 + MAX_ATTEMPTS
        # After each 429 the next call waited out the pause, at the server's door.
        intervals = sorted(recorder.intervals(), key=lambda i: i.opened)
        peak, quiet = guarded(recorder)
        waits = [
            later.opened - earlier.closed
            for earlier, later in itertools.pairwise(intervals)
            if earlier.closed is not None
        ]
        assert sum(w >= BACKOFF - GAP_SLACK for w in waits) >= 2, waits
    figures(
        "fakellm 429 and 500",
        limited_outcomes=[r["outcome"] for r in limited],
        pauses=[r["pause_seconds"] for r in limited[:2]],
        broken_attempts=broken.attempts,
        calls=3 + 3 + MAX_ATTEMPTS,
        peak_in_flight=peak,
        min_gap_s=None if quiet is None else round(quiet, 3),
    )
