"""The gateway simulator, driven by the real gateway client over local HTTP."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from flows.gateway import (
    GatewayAbandoned,
    GatewayClient,
    GatewayRejected,
    GatewayTimeout,
    GatewayUnavailable,
)
from flows.simulator import GatewaySimulator, RequestRecord, gateway_sim_command, parse_latency
from queue_store.settings import Secret, Settings

WAIT_LIMIT = 5.0  # seconds a test waits for something that should take far less
PROJECT_ROOT = Path(__file__).resolve().parent.parent


def messages(text: str = "sleep for user 42") -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "You write short insights."},
        {"role": "user", "content": text},
    ]


def make_client(simulator: GatewaySimulator, **overrides: Any) -> GatewayClient:
    values: dict[str, Any] = {"gateway_url": simulator.url, "gateway_read_timeout": 5.0}
    values.update(overrides)
    return GatewayClient(Settings(**values))


def eventually(check: Callable[[], bool]) -> None:
    deadline = time.monotonic() + WAIT_LIMIT
    while not check():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def succeeds(client: GatewayClient) -> bool:
    try:
        client.complete(messages("probe"))
    except GatewayUnavailable:
        return False
    return True


def simulator_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gateway-simulator")}


@pytest.fixture
def simulator() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=0.05) as running:
        yield running
    assert not simulator_threads()


@pytest.fixture
def client(simulator: GatewaySimulator) -> Iterator[GatewayClient]:
    with make_client(simulator) as gateway:
        yield gateway


# --- answers and records ------------------------------------------------------


def test_answers_like_a_chat_completions_gateway(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    completion = client.complete(messages("sleep for user 42"), model="small")

    assert completion.content == "insight for sleep for user 42"
    assert completion.raw["object"] == "chat.completion"
    assert completion.raw["model"] == "small"
    assert completion.raw["choices"][0]["finish_reason"] == "stop"
    (record,) = simulator.stats().requests
    assert (record.outcome, record.status, record.job) == ("ok", 200, "sleep for user 42")
    assert record.started is not None and record.ended is not None
    assert record.received <= record.started <= record.ended


def test_the_answer_is_deterministic_and_the_job_hint_labels_the_record(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    first = client.complete(messages("steps"), job="steps:2024-05")
    second = client.complete(messages("steps"), job="steps:2024-05")

    assert first.content == second.content == "insight for steps"
    assert [record.job for record in simulator.stats().requests] == ["steps:2024-05"] * 2


def test_the_client_job_label_names_the_record(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    client.complete(messages(), job="recovery:2024-05-01 Zoë")
    assert [r.job for r in simulator.stats().requests] == ["recovery:2024-05-01 Zoë"]


def test_latency_can_be_set_per_request(simulator: GatewaySimulator, client: GatewayClient) -> None:
    client.complete(messages(), sim_latency=0.3)
    (record,) = simulator.stats().requests
    assert record.ended is not None and record.started is not None
    assert record.ended - record.started >= 0.3


def test_latency_can_be_changed_at_run_time(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    simulator.set_latency(0.25)
    assert simulator.stats().latency == (0.25, 0.25)
    assert client.complete(messages()).elapsed_seconds >= 0.25

    answer = httpx.post(f"{simulator.url}/_sim/latency", json={"latency": "0-0.01"})
    assert answer.json() == {"latency": [0.0, 0.01]}
    assert httpx.post(f"{simulator.url}/_sim/latency", json={"latency": [2, 1]}).status_code == 400
    assert httpx.post(f"{simulator.url}/_sim/latency", json={"latency": True}).status_code == 400
    assert simulator.stats().latency == (0.0, 0.01)


def test_at_most_workers_requests_are_served_at_once() -> None:
    with GatewaySimulator(workers=2, latency=0.2) as simulator, make_client(simulator) as client:
        barrier = threading.Barrier(8)
        results: list[str] = []
        errors: list[BaseException] = []

        def call(number: int) -> None:
            barrier.wait()
            try:
                results.append(client.complete(messages(f"job {number}")).content)
            except Exception as exc:  # noqa: BLE001 - reported by the assertion below
                errors.append(exc)

        threads = [threading.Thread(target=call, args=(n,)) for n in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(WAIT_LIMIT)

        assert not errors
        assert sorted(results) == sorted(f"insight for job {n}" for n in range(8))
        stats = simulator.stats()
        assert stats.peak_in_flight == 2
        assert stats.in_flight == stats.waiting == 0
        assert max_overlap(stats.requests) == 2


def max_overlap(records: tuple[RequestRecord, ...]) -> int:
    events: list[tuple[float, int]] = []
    for record in records:
        assert record.started is not None and record.ended is not None
        events += [(record.started, 1), (record.ended, -1)]
    # Ends sort before starts at the same instant: a freed worker is reused.
    running = peak = 0
    for _, change in sorted(events):
        running += change
        peak = max(peak, running)
    return peak


# --- faults -----------------------------------------------------------------------


def test_status_fault_for_some_requests_then_recovery(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    simulator.set_fault("status", status=503, requests=2)

    for _ in range(2):
        with pytest.raises(GatewayUnavailable) as caught:
            client.complete(messages())
        assert caught.value.status == 503
    assert client.complete(messages()).content

    outcomes = [(r.outcome, r.status) for r in simulator.stats().requests]
    assert outcomes == [("injected_status", 503)] * 2 + [("ok", 200)]


def test_status_fault_for_some_seconds_set_over_http(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    answer = httpx.post(
        f"{simulator.url}/_sim/fault", json={"kind": "status", "status": 502, "seconds": 0.3}
    )
    assert answer.status_code == 200
    assert answer.json()["fault"]["kind"] == "status"

    with pytest.raises(GatewayUnavailable) as caught:
        client.complete(messages())
    assert caught.value.status == 502
    eventually(lambda: succeeds(client))


def test_dropped_connection_is_unavailable(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    simulator.set_fault("drop", requests=1)

    with pytest.raises(GatewayUnavailable) as caught:
        client.complete(messages())
    assert caught.value.status is None
    assert client.complete(messages()).content
    assert [r.outcome for r in simulator.stats().requests] == ["dropped", "ok"]


def test_refused_connections_then_listening_again_on_the_same_port(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    port = simulator.port
    simulator.set_fault("refuse", seconds=0.3)

    with pytest.raises(GatewayUnavailable, match="cannot connect"):
        client.complete(messages())
    eventually(lambda: succeeds(client))
    assert simulator.port == port
    assert simulator.stats().fault is None


def test_refusal_set_over_http_is_in_force_once_answered(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    answer = httpx.post(f"{simulator.url}/_sim/fault", json={"kind": "refuse", "seconds": 0.3})
    assert answer.json()["fault"]["kind"] == "refuse"
    with pytest.raises(GatewayUnavailable, match="cannot connect"):
        client.complete(messages())
    eventually(lambda: succeeds(client))


def test_clearing_a_refusal_listens_again_at_once(
    simulator: GatewaySimulator, client: GatewayClient
) -> None:
    simulator.set_fault("refuse", seconds=60)
    with pytest.raises(GatewayUnavailable):
        client.complete(messages())
    simulator.clear_fault()
    eventually(lambda: succeeds(client))


def test_hang_beyond_the_read_timeout_is_a_timeout(simulator: GatewaySimulator) -> None:
    simulator.set_fault("hang", requests=1)
    with make_client(simulator, gateway_read_timeout=0.2) as client:
        with pytest.raises(GatewayTimeout):
            client.complete(messages())
        # The hung request still holds its worker; the others serve on.
        assert client.complete(messages()).content
    assert simulator.stats().in_flight == 1

    simulator.clear_fault()
    eventually(lambda: simulator.stats().in_flight == 0)
    assert simulator.stats().requests[0].outcome in ("hung", "client_gone")


def test_hang_with_a_hold_answers_late(simulator: GatewaySimulator, client: GatewayClient) -> None:
    simulator.set_fault("hang", requests=1, hold_seconds=0.2)
    completion = client.complete(messages())
    assert completion.elapsed_seconds >= 0.2
    assert simulator.stats().requests[0].outcome == "hung"


def test_closing_the_client_abandons_a_hung_call(simulator: GatewaySimulator) -> None:
    simulator.set_fault("hang", requests=1)
    client = make_client(simulator, gateway_read_timeout=0.5)
    outcome: list[BaseException] = []

    def call() -> None:
        try:
            client.complete(messages())
        except Exception as exc:  # noqa: BLE001 - the assertion below names the type
            outcome.append(exc)

    thread = threading.Thread(target=call)
    thread.start()
    eventually(lambda: simulator.stats().in_flight == 1)
    client.close()
    thread.join(WAIT_LIMIT)

    assert not thread.is_alive()
    assert [type(exc) for exc in outcome] == [GatewayAbandoned]


def test_a_required_token_is_checked(simulator: GatewaySimulator) -> None:
    with GatewaySimulator(token="sim-token") as guarded:
        with make_client(guarded) as client, pytest.raises(GatewayRejected) as caught:
            client.complete(messages())
        assert caught.value.status == 401
        with make_client(guarded, gateway_token=Secret("sim-token")) as client:
            assert client.complete(messages()).content


# --- the control endpoints ------------------------------------------------------------


def test_stats_and_reset_over_http(simulator: GatewaySimulator, client: GatewayClient) -> None:
    client.complete(messages("heart rate"))

    stats = httpx.get(f"{simulator.url}/_sim/stats").json()
    assert stats["peak_in_flight"] == 1
    assert stats["in_flight"] == 0
    assert stats["fault"] is None
    (record,) = stats["requests"]
    assert record["job"] == "heart rate"
    assert set(record) == {"id", "received", "started", "ended", "outcome", "status", "job"}

    assert httpx.post(f"{simulator.url}/_sim/reset").status_code == 200
    stats = httpx.get(f"{simulator.url}/_sim/stats").json()
    assert (stats["requests"], stats["peak_in_flight"]) == ([], 0)


def test_fault_kind_none_clears_the_fault(simulator: GatewaySimulator) -> None:
    simulator.set_fault("status", status=503)
    assert httpx.get(f"{simulator.url}/_sim/stats").json()["fault"]["status"] == 503
    assert httpx.post(f"{simulator.url}/_sim/fault", json={"kind": "none"}).status_code == 200
    assert simulator.stats().fault is None


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "explode"},
        {"kind": "status", "status": 200},
        {"kind": "status", "seconds": -1},
        {"kind": "status", "seconds": "soon"},
        {"kind": "drop", "requests": 0},
        {"kind": "refuse"},
        ["status"],
    ],
)
def test_a_bad_fault_is_refused_with_400(simulator: GatewaySimulator, spec: Any) -> None:
    answer = httpx.post(f"{simulator.url}/_sim/fault", json=spec)
    assert answer.status_code == 400
    assert simulator.stats().fault is None


def test_bad_requests_and_unknown_paths(simulator: GatewaySimulator) -> None:
    completions = f"{simulator.url}/v1/chat/completions"
    assert httpx.post(completions, content=b"not json").status_code == 400
    assert httpx.post(completions, json={"model": "x"}).status_code == 400
    assert httpx.get(f"{simulator.url}/nowhere").status_code == 404
    assert [r.outcome for r in simulator.stats().requests] == ["bad_request"] * 2


def test_a_custom_path_is_served() -> None:
    with GatewaySimulator(path="/api/chat") as simulator:
        with make_client(simulator, gateway_path="/api/chat") as client:
            assert client.complete(messages()).content
        with make_client(simulator) as client, pytest.raises(GatewayRejected) as caught:
            client.complete(messages())
        assert caught.value.status == 404


def test_stop_releases_waiting_and_hung_requests_and_joins_every_thread() -> None:
    simulator = GatewaySimulator(workers=1).start()
    simulator.set_fault("hang", requests=1)
    client = make_client(simulator, gateway_read_timeout=5.0)
    failures: list[Exception] = []

    def call() -> None:
        try:
            client.complete(messages())
        except GatewayUnavailable as exc:
            failures.append(exc)

    callers = [threading.Thread(target=call) for _ in range(2)]
    for caller in callers:
        caller.start()
    eventually(lambda: simulator.stats().waiting == 1)

    simulator.stop()

    for caller in callers:
        caller.join(WAIT_LIMIT)
        assert not caller.is_alive()
    client.close()
    # Closed without an answer: to the client, the gateway went away.
    assert len(failures) == 2
    assert not simulator_threads()
    assert {r.outcome for r in simulator.stats().requests} == {"stopped"}


# --- configuration and the command line ----------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("2", (2.0, 2.0)), ("1-3", (1.0, 3.0)), ("0.5", (0.5, 0.5)), (" 0-0 ", (0.0, 0.0))],
)
def test_parse_latency(text: str, expected: tuple[float, float]) -> None:
    assert parse_latency(text) == expected


@pytest.mark.parametrize("text", ["", "fast", "3-1", "-1", "1-", "inf"])
def test_parse_latency_rejects_nonsense(text: str) -> None:
    with pytest.raises(ValueError, match="latency"):
        parse_latency(text)


def test_command_help_and_bad_latency() -> None:
    runner = CliRunner()
    shown = runner.invoke(gateway_sim_command, ["--help"])
    assert shown.exit_code == 0
    for option in ("--host", "--port", "--workers", "--latency"):
        assert option in shown.output
    assert runner.invoke(gateway_sim_command, ["--latency", "soon"]).exit_code == 2


def test_command_reports_a_busy_port() -> None:
    with GatewaySimulator() as busy:
        result = CliRunner().invoke(gateway_sim_command, ["--port", str(busy.port)])
    assert result.exit_code == 1
    assert "cannot listen" in result.output


def test_command_serves_until_sigterm() -> None:
    code = "import sys; from flows.simulator import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--port", "0", "--latency", "0", "--workers", "2"],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "development tool" in line
        url = line.split(" at ", 1)[1].split()[0]
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/_sim/stats").json()["workers"] == 2
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_LIMIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
