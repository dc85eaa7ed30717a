"""The gateway simulator over local HTTP, driven by plain httpx and raw sockets.

Every fault is injected by count (`requests=`) or by event (set, cleared,
a client closing); waits are on the simulator's own change notifications.
"""

from __future__ import annotations

import base64
import email.utils
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from click.testing import CliRunner

from deployments.processes import stop_group as stop_process_group
from devtools.simulator import (
    DEFAULT_HUGE_BYTES,
    DEFAULT_PORT,
    GatewaySimulator,
    RequestRecord,
    SimulatorStats,
    gateway_sim_command,
    parse_latency,
)
from tests.support.factories import settings_for

WAIT_LIMIT = 5.0  # seconds a test waits for something that should take far less
NOTICE_LIMIT = 0.1  # seconds within which a client's close must be noticed
PATH = "/v1/chat/completions"
PROJECT_ROOT = Path(__file__).resolve().parents[2]


def body(text: str = "sleep for user 42", **extra: Any) -> dict[str, Any]:
    return {
        "model": "small",
        "messages": [
            {"role": "system", "content": "You write short insights."},
            {"role": "user", "content": text},
        ],
        **extra,
    }


def post(
    simulator: GatewaySimulator,
    text: str = "sleep for user 42",
    *,
    headers: dict[str, str] | None = None,
    timeout: float = WAIT_LIMIT,
    **extra: Any,
) -> httpx.Response:
    return httpx.post(
        f"{simulator.url}{PATH}", json=body(text, **extra), headers=headers, timeout=timeout
    )


def open_request(port: int, payload: dict[str, Any], headers: dict[str, str] | None = None):
    """A raw connection that has sent one whole request; the test closes it."""
    data = json.dumps(payload).encode()
    lines = [
        f"POST {PATH} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_LIMIT)
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)
    return sock


class Call(threading.Thread):
    """One request in the background; `response` or `error` once joined."""

    def __init__(self, simulator: GatewaySimulator, text: str, **extra: Any) -> None:
        super().__init__(daemon=True)
        self.simulator, self.text, self.extra = simulator, text, extra
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = post(self.simulator, self.text, **self.extra)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc

    def result(self) -> httpx.Response:
        self.join(WAIT_LIMIT)
        assert not self.is_alive(), "the call did not end"
        assert self.error is None, repr(self.error)
        assert self.response is not None
        return self.response


def simulator_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gateway-simulator")}


def last(simulator: GatewaySimulator) -> RequestRecord:
    return simulator.stats().requests[-1]


def settled(stats: SimulatorStats) -> bool:
    return stats.in_flight == 0 and all(r.ended is not None for r in stats.requests)


@pytest.fixture
def simulator() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=0.02) as running:
        yield running
    assert not simulator_threads()


# --- answers and records ------------------------------------------------------


def test_answers_like_a_chat_completions_gateway(simulator: GatewaySimulator) -> None:
    answer = post(simulator, "sleep for user 42")

    assert answer.status_code == 200
    assert answer.headers["connection"] == "close"
    completion = answer.json()
    assert completion["object"] == "chat.completion"
    assert completion["model"] == "small"
    assert completion["choices"][0]["message"] == {
        "role": "assistant",
        "content": "insight for sleep for user 42",
    }
    assert completion["choices"][0]["finish_reason"] == "stop"
    usage = completion["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status, record.job) == ("ok", 200, "sleep for user 42")
    assert record.started is not None and record.ended is not None
    assert record.received <= record.started <= record.ended
    assert record.disconnected is None


def test_the_answer_is_deterministic(simulator: GatewaySimulator) -> None:
    first = post(simulator, "steps").json()["choices"][0]["message"]["content"]
    second = post(simulator, "steps").json()["choices"][0]["message"]["content"]
    assert first == second == "insight for steps"


def test_the_job_label_comes_from_the_body_then_the_header_then_the_user_message(
    simulator: GatewaySimulator,
) -> None:
    header = {"X-Insight-Job": "recovery:2024-05-01%20Zo%C3%AB"}
    post(simulator, "steps", job="steps:2024-05", headers=header)
    post(simulator, "steps", headers=header)
    post(simulator, "heart rate")
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert [r.job for r in stats.requests] == [
        "steps:2024-05",
        "recovery:2024-05-01 Zoë",
        "heart rate",
    ]


def test_latency_can_be_set_per_request(simulator: GatewaySimulator) -> None:
    post(simulator, sim_latency=0.3)
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert record.ended is not None and record.started is not None
    assert record.ended - record.started >= 0.3


def test_latency_can_be_changed_at_run_time(simulator: GatewaySimulator) -> None:
    simulator.set_latency(0.25)
    assert simulator.stats().latency == (0.25, 0.25)
    asked = time.monotonic()
    post(simulator)
    assert time.monotonic() - asked >= 0.25

    answer = httpx.post(f"{simulator.url}/_sim/latency", json={"latency": "0-0.01"})
    assert answer.json() == {"latency": [0.0, 0.01]}
    for bad in ([2, 1], True, "soon", None):
        reply = httpx.post(f"{simulator.url}/_sim/latency", json={"latency": bad})
        assert reply.status_code == 400
    assert simulator.stats().latency == (0.0, 0.01)


def _requests(count: int) -> Callable[[SimulatorStats], bool]:
    return lambda stats: len(stats.requests) == count


def test_at_most_workers_requests_are_served_at_once_the_rest_wait_in_order() -> None:
    with GatewaySimulator(workers=2) as simulator:
        simulator.set_fault("hang")  # every request held until cleared
        calls = []
        for number in range(8):
            calls.append(Call(simulator, f"job {number}"))
            # One at a time, so the order of arrival is known.
            simulator.wait_for(_requests(number + 1), WAIT_LIMIT)
        stats = simulator.wait_for(lambda s: s.waiting == 6, WAIT_LIMIT)
        assert stats.in_flight == stats.peak_in_flight == 2
        simulator.clear_fault()

        contents = [call.result().json()["choices"][0]["message"]["content"] for call in calls]
        assert contents == [f"insight for job {n}" for n in range(8)]
        stats = simulator.wait_for(settled, WAIT_LIMIT)
        assert stats.peak_in_flight == 2
        assert stats.in_flight == stats.waiting == 0
        assert {r.outcome for r in stats.requests} == {"hung"}
        assert max_overlap(stats.requests) == 2
        # First come, first served.
        started = [r.started or 0.0 for r in stats.requests]
        assert started == sorted(started)


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


def test_a_client_that_leaves_the_backlog_never_takes_a_worker() -> None:
    with GatewaySimulator(workers=1) as simulator:
        simulator.set_fault("hang")
        holder = open_request(simulator.port, body("holder"))
        simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)
        waiter = open_request(simulator.port, body("waiter"))
        simulator.wait_for(lambda s: s.waiting == 1, WAIT_LIMIT)

        waiter.close()
        stats = simulator.wait_for(lambda s: s.waiting == 0, WAIT_LIMIT)
        gone = stats.requests[1]
        assert (gone.job, gone.outcome, gone.started) == ("waiter", "client_gone", None)
        assert gone.disconnected is not None
        assert stats.in_flight == 1
        holder.close()
        simulator.wait_for(settled, WAIT_LIMIT)


def test_a_request_is_in_flight_until_its_client_leaves(simulator: GatewaySimulator) -> None:
    sock = open_request(simulator.port, body(sim_latency=60))
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)

    closed_at = time.time()
    sock.close()
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    record = stats.requests[0]
    assert (record.outcome, record.status) == ("client_gone", None)
    assert record.disconnected is not None and record.ended is not None
    assert record.disconnected - closed_at < NOTICE_LIMIT
    assert record.disconnected <= record.ended


# --- workers that finish abandoned calls ------------------------------------------------

CALL_SECONDS = 1.5  # latency of a call whose client leaves part way
LEAVE_AFTER = 0.2  # seconds into its call a client leaves
TIMER_SLACK = 0.05  # seconds a timer or a clock may be out by


def abandon(simulator: GatewaySimulator, text: str) -> int:
    """Send a call, leave once a worker has it, and wait until the simulator
    has seen the client go; the call's index in the records."""
    index = len(simulator.stats().requests)
    sock = open_request(simulator.port, body(text))
    simulator.wait_for(
        lambda s: len(s.requests) > index and s.requests[index].started is not None, WAIT_LIMIT
    )
    time.sleep(LEAVE_AFTER)
    sock.close()
    simulator.wait_for(lambda s: s.requests[index].disconnected is not None, WAIT_LIMIT)
    return index


def test_a_worker_finishes_a_call_whose_client_left() -> None:
    with GatewaySimulator(workers=1, latency=CALL_SECONDS, finish_abandoned=True) as simulator:
        abandon(simulator, "left")
        record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]

    assert (record.outcome, record.status) == ("abandoned", None)
    assert record.started is not None and record.ended is not None
    assert record.disconnected is not None
    assert record.started < record.disconnected < record.ended
    assert record.ended - record.started >= CALL_SECONDS - TIMER_SLACK


def test_a_call_arriving_meanwhile_waits_for_the_abandoned_one() -> None:
    with GatewaySimulator(workers=1, latency=CALL_SECONDS, finish_abandoned=True) as simulator:
        abandon(simulator, "left")
        assert post(simulator, "next", sim_latency=0).status_code == 200
        left, served = simulator.wait_for(settled, WAIT_LIMIT).requests

    assert (left.outcome, served.outcome) == ("abandoned", "ok")
    assert left.ended is not None and served.started is not None
    assert served.received < left.ended  # it came while the worker was still busy
    assert served.started >= left.ended  # and had that worker only once it was done


@pytest.mark.parametrize(("finish_abandoned", "peak"), [(True, 2), (False, 1)])
def test_an_abandoned_call_occupies_the_gateway_while_its_worker_is_on_it(
    finish_abandoned: bool, peak: int
) -> None:
    with GatewaySimulator(
        workers=2, latency=CALL_SECONDS, finish_abandoned=finish_abandoned
    ) as simulator:
        abandon(simulator, "left")
        if not finish_abandoned:
            simulator.wait_for(settled, WAIT_LIMIT)  # freed as its client went
        assert post(simulator, "next", sim_latency=0).status_code == 200
        stats = simulator.wait_for(settled, WAIT_LIMIT)

    assert stats.peak_occupancy == stats.peak_in_flight == peak
    gap = stats.min_occupancy_gap
    assert gap is not None and (gap < 0) == finish_abandoned
    outcome = "abandoned" if finish_abandoned else "client_gone"
    assert [r.outcome for r in stats.requests] == [outcome, "ok"]


def test_a_request_whose_client_left_the_backlog_is_still_served() -> None:
    with GatewaySimulator(workers=1, finish_abandoned=True) as simulator:
        simulator.set_fault("hang", requests=1)
        holder = Call(simulator, "holder")
        simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)
        waiter = open_request(simulator.port, body("waiter", sim_latency=LEAVE_AFTER))
        simulator.wait_for(lambda s: s.waiting == 1, WAIT_LIMIT)

        waiter.close()
        stats = simulator.wait_for(lambda s: s.requests[1].disconnected is not None, WAIT_LIMIT)
        assert (stats.waiting, stats.requests[1].started) == (1, None)
        simulator.clear_fault()
        assert holder.result().status_code == 200
        held, left = simulator.wait_for(settled, WAIT_LIMIT).requests

    assert (held.outcome, left.outcome) == ("hung", "abandoned")
    assert held.ended is not None and left.started is not None and left.ended is not None
    assert left.started >= held.ended
    assert left.ended - left.started >= LEAVE_AFTER - TIMER_SLACK


@pytest.mark.parametrize(
    ("fault", "status"), [({"kind": "hang"}, None), ({"kind": "trickle", "interval": 600}, 200)]
)
def test_a_held_call_keeps_its_worker_after_its_client_left_until_released(
    fault: dict[str, Any], status: int | None
) -> None:
    with GatewaySimulator(workers=1, finish_abandoned=True) as simulator:
        simulator.set_fault(**fault)
        index = abandon(simulator, "held")
        assert simulator.stats().in_flight == 1
        simulator.clear_fault()
        record = simulator.wait_for(settled, WAIT_LIMIT).requests[index]

    assert (record.outcome, record.status) == ("abandoned", status)


# --- occupancy ------------------------------------------------------------------------


def made_record(key: int, started: float | None, ended: float | None) -> RequestRecord:
    return RequestRecord(key, 0.0, started, ended, "ok", 200, None)


def stats_of(*records: RequestRecord) -> SimulatorStats:
    return SimulatorStats(4, (0.0, 0.0), 0, 0, 0, None, records)


def test_occupancy_is_worked_out_from_the_records_own_times() -> None:
    stats = stats_of(
        made_record(1, 0.0, 1.0),
        made_record(2, None, 0.2),  # answered at the door: it took no worker
        made_record(3, 0.5, 3.0),  # overlaps the first by 0.5 s
        made_record(4, 3.25, 4.0),  # 0.25 s after the third ended
        made_record(5, 5.0, 6.0),
    )
    assert stats.occupancy() == ((0.0, 1.0), (0.5, 3.0), (3.25, 4.0), (5.0, 6.0))
    assert stats.peak_occupancy == 2
    assert stats.occupancy_gaps() == (-0.5, 0.25, 1.0)
    assert stats.min_occupancy_gap == -0.5

    # Order of start, not of the records; an earlier long one covers a later gap.
    covered = stats_of(
        made_record(1, 2.0, 3.0), made_record(2, 0.0, 10.0), made_record(3, 4.0, 5.0)
    )
    assert covered.occupancy() == ((0.0, 10.0), (2.0, 3.0), (4.0, 5.0))
    assert (covered.occupancy_gaps(), covered.peak_occupancy) == ((-8.0, -6.0), 2)

    # A worker taken as another is freed follows it, it does not overlap it.
    handed_over = stats_of(made_record(1, 0.0, 1.0), made_record(2, 1.0, 2.0))
    assert (handed_over.occupancy_gaps(), handed_over.peak_occupancy) == ((0.0,), 1)

    # One still being worked on runs on: it overlaps whatever starts later.
    running = stats_of(made_record(1, 0.0, None), made_record(2, 5.0, 6.0))
    assert running.occupancy() == ((0.0, None), (5.0, 6.0))
    assert (running.occupancy_gaps(now=8.0), running.peak_occupancy) == ((-3.0,), 2)

    assert stats_of(made_record(1, 0.0, 1.0)).min_occupancy_gap is None
    assert stats_of().peak_occupancy == 0


def test_stats_report_the_occupancy_over_http(simulator: GatewaySimulator) -> None:
    for _ in range(2):
        assert post(simulator).status_code == 200
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert stats.peak_occupancy == 1
    assert stats.min_occupancy_gap is not None and stats.min_occupancy_gap >= 0

    shown = httpx.get(f"{simulator.url}/_sim/stats").json()
    assert (shown["peak_occupancy"], shown["min_occupancy_gap"]) == (1, stats.min_occupancy_gap)


# --- faults -----------------------------------------------------------------------


def test_status_fault_for_some_requests_then_recovery(simulator: GatewaySimulator) -> None:
    simulator.set_fault("status", status=503, requests=2)

    for _ in range(2):
        answer = post(simulator)
        assert answer.status_code == 503
        assert answer.json()["error"]["type"] == "simulator_fault"
    assert post(simulator).status_code == 200

    stats = simulator.wait_for(settled, WAIT_LIMIT)
    outcomes = [(r.outcome, r.status, r.started) for r in stats.requests]
    assert outcomes[:2] == [("injected_status", 503, None)] * 2
    assert outcomes[2][:2] == ("ok", 200)
    assert stats.fault is None


@pytest.mark.parametrize(
    ("status", "headers"),
    [
        (429, {"Retry-After": "30"}),
        (503, {"Retry-After": email.utils.formatdate(1_900_000_000, usegmt=True)}),
        (429, {"retry-after-ms": "1500"}),
        (429, {"llm_provider-retry-after": "60"}),
        (429, {"x-ratelimit-reset-requests": "2s", "x-ratelimit-remaining-requests": "0"}),
    ],
)
def test_status_fault_sends_extra_headers(
    simulator: GatewaySimulator, status: int, headers: dict[str, str]
) -> None:
    simulator.set_fault("status", status=status, headers=headers, requests=1)
    answer = post(simulator)
    assert answer.status_code == status
    for name, value in headers.items():
        assert answer.headers[name] == value
    assert answer.json()["error"]["code"] == status


def test_a_fault_can_poison_one_job_while_others_are_answered(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("status", status=500, job="steps:2024-05", requests=2)

    assert post(simulator, job="sleep:2024-05").status_code == 200
    assert post(simulator, job="steps:2024-05").status_code == 500
    assert post(simulator, headers={"X-Insight-Job": "steps:2024-05"}).status_code == 500
    # Other jobs did not spend the fault's count; now it is spent.
    assert post(simulator, job="steps:2024-05").status_code == 200
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert [(r.job, r.status) for r in stats.requests] == [
        ("sleep:2024-05", 200),
        ("steps:2024-05", 500),
        ("steps:2024-05", 500),
        ("steps:2024-05", 200),
    ]


def test_a_fault_can_apply_to_jobs_by_prefix(simulator: GatewaySimulator) -> None:
    answer = httpx.post(
        f"{simulator.url}/_sim/fault",
        json={"kind": "status", "status": 502, "job_prefix": "steps:"},
    )
    assert answer.json()["fault"]["job_prefix"] == "steps:"
    assert post(simulator, job="steps:2024-05").status_code == 502
    assert post(simulator, job="steps:2024-06").status_code == 502
    assert post(simulator, job="sleep:2024-05").status_code == 200
    assert post(simulator).status_code == 200  # labelled by its user message


def test_a_fault_set_over_http_is_in_force_once_answered(simulator: GatewaySimulator) -> None:
    answer = httpx.post(
        f"{simulator.url}/_sim/fault",
        json={"kind": "status", "status": 502, "requests": 1, "seconds": 600},
    )
    assert answer.status_code == 200
    fault = answer.json()["fault"]
    assert (fault["kind"], fault["status"], fault["requests_left"]) == ("status", 502, 1)
    assert 0 < fault["seconds_left"] <= 600
    assert post(simulator).status_code == 502
    assert post(simulator).status_code == 200


def test_dropped_connection(simulator: GatewaySimulator) -> None:
    simulator.set_fault("drop", requests=1)

    with pytest.raises(httpx.RemoteProtocolError, match="without sending a response"):
        post(simulator)
    assert post(simulator).status_code == 200
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert [(r.outcome, r.status) for r in stats.requests] == [("dropped", None), ("ok", 200)]


def test_close_mid_body_sends_headers_and_part_of_the_body(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("close_mid_body", requests=1)
    with (
        httpx.Client(timeout=WAIT_LIMIT) as client,
        client.stream("POST", f"{simulator.url}{PATH}", json=body()) as answer,
    ):
        assert answer.status_code == 200
        length = int(answer.headers["content-length"])
        received = bytearray()
        with pytest.raises(httpx.RemoteProtocolError, match="complete message body"):
            for chunk in answer.iter_raw():
                received += chunk
    assert 0 < len(received) < length
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("closed_mid_body", 200)
    assert record.started is not None


def test_trickle_sends_a_byte_then_the_rest_when_the_fault_is_cleared(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("trickle", interval=600, requests=1)
    with (
        httpx.Client(timeout=WAIT_LIMIT) as client,
        client.stream("POST", f"{simulator.url}{PATH}", json=body("steps")) as answer,
    ):
        assert answer.status_code == 200
        chunks = answer.iter_raw()
        first = next(chunks)
        assert first == b"{"  # then the next byte is 600 s away
        assert simulator.stats().in_flight == 1
        simulator.clear_fault()
        rest = b"".join(chunks)
    completion = json.loads(first + rest)
    assert completion["choices"][0]["message"]["content"] == "insight for steps"
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("trickled", 200)


def test_trickle_stops_when_the_client_leaves(simulator: GatewaySimulator) -> None:
    simulator.set_fault("trickle", interval=600)
    sock = open_request(simulator.port, body())
    assert sock.recv(1024).startswith(b"HTTP/1.1 200 ")
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)

    closed_at = time.time()
    sock.close()
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("client_gone", 200)
    assert record.disconnected is not None and record.disconnected - closed_at < NOTICE_LIMIT


def test_huge_answer_is_a_valid_completion(simulator: GatewaySimulator) -> None:
    size = 1_000_000
    simulator.set_fault("huge", size=size, requests=1)
    answer = post(simulator)
    assert answer.status_code == 200
    content = answer.json()["choices"][0]["message"]["content"]
    assert len(content) == size
    assert content.startswith("insight insight ")
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("huge", 200)


def test_huge_answer_of_50_mib_is_streamed_not_built_in_memory(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("huge", requests=1)
    tracemalloc.start()
    try:
        with (
            httpx.Client(timeout=WAIT_LIMIT * 4) as client,
            client.stream("POST", f"{simulator.url}{PATH}", json=body()) as answer,
        ):
            length = int(answer.headers["content-length"])
            received = 0
            head = tail = b""
            for chunk in answer.iter_raw():
                if len(head) < 200:
                    head = (head + chunk)[:200]
                received += len(chunk)
                tail = (tail + chunk)[-200:]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert received == length > DEFAULT_HUGE_BYTES
    assert head.startswith(b'{"id": "chatcmpl-sim-') and b'"content": "insight ' in head
    assert tail.endswith(b"}}")
    assert peak < 8 * 1024 * 1024, f"{peak} bytes allocated at once"


def test_huge_raw_answer_is_not_json(simulator: GatewaySimulator) -> None:
    simulator.set_fault("huge_raw", size=300_000, requests=1)
    answer = post(simulator)
    assert answer.status_code == 200
    assert answer.headers["content-type"] == "application/json"
    assert len(answer.content) == 300_000
    with pytest.raises(ValueError):
        json.loads(answer.content)
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("huge_raw", 200)


def test_echo_token_echoes_the_bearer_token_in_many_encodings(
    simulator: GatewaySimulator,
) -> None:
    token = "sk-test/abc+def="
    simulator.set_fault("echo_token", requests=1)
    answer = post(simulator, headers={"Authorization": f"Bearer {token}"})

    assert answer.status_code == 500
    assert answer.headers["x-echoed-token"] == token
    text = answer.text
    for encoded in (
        token,
        "sk-test\\/abc+def=",
        "\\u0073\\u006b\\u002d\\u0074",
        "sk-test%2Fabc%2Bdef%3D",
        "sk-test%2fabc%2bdef%3d",
        base64.b64encode(token.encode()).decode(),
        base64.b64encode(f"user:{token}".encode()).decode(),
    ):
        assert encoded in text, encoded
    error = answer.json()["error"]  # still valid JSON, every field the token
    assert error["token_slash_escaped"] == error["token_unicode_escaped"] == token
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert (record.outcome, record.status) == ("echoed_token", 500)


@pytest.mark.parametrize(
    ("spec", "status", "location"),
    [
        ({}, 307, "http://gateway-moved.invalid/v1/chat/completions"),
        (
            {"status": 301, "location": "http://127.0.0.2:9/v1/chat/completions"},
            301,
            "http://127.0.0.2:9/v1/chat/completions",
        ),
    ],
)
def test_redirect_points_at_another_host(
    simulator: GatewaySimulator, spec: dict[str, Any], status: int, location: str
) -> None:
    answer = httpx.post(f"{simulator.url}/_sim/fault", json={"kind": "redirect", **spec})
    assert answer.status_code == 200
    moved = post(simulator)  # httpx does not follow redirects unless asked
    assert moved.status_code == status
    assert moved.headers["location"] == location
    assert simulator.wait_for(settled, WAIT_LIMIT).requests[0].outcome == "redirected"


def test_hang_holds_its_worker_until_the_fault_is_cleared(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("hang", requests=1)
    hung = Call(simulator, "held")
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)
    # The fault's one request is spent: others are answered meanwhile.
    assert post(simulator).status_code == 200
    assert simulator.stats().in_flight == 1

    simulator.clear_fault()
    assert hung.result().status_code == 200
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert [r.outcome for r in stats.requests] == ["hung", "ok"]


def test_hang_with_a_hold_answers_late(simulator: GatewaySimulator) -> None:
    simulator.set_fault("hang", requests=1, hold_seconds=0.2)
    asked = time.monotonic()
    assert post(simulator).status_code == 200
    assert time.monotonic() - asked >= 0.2
    assert simulator.wait_for(settled, WAIT_LIMIT).requests[0].outcome == "hung"


def test_a_hung_request_ends_as_soon_as_its_client_leaves(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("hang", requests=1)
    sock = open_request(simulator.port, body(), {"X-Insight-Job": "steps:2024-05"})
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)

    closed_at = time.time()
    sock.close()
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    record = stats.requests[0]
    assert (record.job, record.outcome, record.status) == ("steps:2024-05", "client_gone", None)
    assert record.disconnected is not None and record.ended is not None
    assert record.disconnected - closed_at < NOTICE_LIMIT
    assert record.ended - record.disconnected < NOTICE_LIMIT


def test_a_read_timeout_frees_the_hung_worker(simulator: GatewaySimulator) -> None:
    simulator.set_fault("hang")
    with pytest.raises(httpx.ReadTimeout):
        post(simulator, timeout=0.2)
    # httpx closes the connection it gave up on; the simulator sees it go.
    record = simulator.wait_for(settled, WAIT_LIMIT).requests[0]
    assert record.outcome == "client_gone"


def test_refused_connections_until_cleared_then_listening_on_the_same_port(
    simulator: GatewaySimulator,
) -> None:
    port = simulator.port
    simulator.set_fault("refuse")
    assert simulator.stats().fault is not None

    for _ in range(3):
        with pytest.raises(httpx.ConnectError):
            post(simulator)
    simulator.clear_fault()
    assert post(simulator).status_code == 200
    assert simulator.port == port
    assert [r.outcome for r in simulator.stats().requests] == ["ok"]


def test_another_fault_ends_a_refusal(simulator: GatewaySimulator) -> None:
    simulator.set_fault("refuse")
    with pytest.raises(httpx.ConnectError):
        post(simulator)
    simulator.set_fault("status", status=503, requests=1)
    assert post(simulator).status_code == 503


def test_a_refusal_set_over_http_is_in_force_once_answered(
    simulator: GatewaySimulator,
) -> None:
    answer = httpx.post(f"{simulator.url}/_sim/fault", json={"kind": "refuse", "seconds": 600})
    assert answer.json()["fault"]["kind"] == "refuse"
    with pytest.raises(httpx.ConnectError):
        post(simulator)
    simulator.clear_fault()
    assert post(simulator).status_code == 200


def test_a_fault_that_runs_out_does_not_release_what_it_holds(
    simulator: GatewaySimulator,
) -> None:
    simulator.set_fault("hang", requests=2)
    first, second = Call(simulator, "a"), Call(simulator, "b")
    stats = simulator.wait_for(lambda s: s.in_flight == 2, WAIT_LIMIT)
    assert stats.fault is None  # spent
    assert post(simulator).status_code == 200
    assert simulator.stats().in_flight == 2
    simulator.clear_fault()
    assert first.result().status_code == second.result().status_code == 200


def test_a_required_token_is_checked() -> None:
    with GatewaySimulator(token="sim-token") as guarded:
        assert post(guarded).status_code == 401
        assert post(guarded, headers={"Authorization": "Bearer wrong"}).status_code == 401
        answer = post(guarded, headers={"Authorization": "Bearer sim-token"})
        assert answer.status_code == 200
        stats = guarded.wait_for(settled, WAIT_LIMIT)
        assert [r.outcome for r in stats.requests] == ["unauthorized"] * 2 + ["ok"]


def test_faults_can_be_set_before_start_except_a_refusal() -> None:
    simulator = GatewaySimulator()
    simulator.set_fault("status", status=502, requests=1)
    with pytest.raises(RuntimeError, match="start"):
        simulator.set_fault("refuse")
    with simulator:
        assert post(simulator).status_code == 502


# --- the control endpoints ------------------------------------------------------------


def test_stats_and_reset_over_http(simulator: GatewaySimulator) -> None:
    post(simulator, "heart rate")
    simulator.wait_for(settled, WAIT_LIMIT)

    stats = httpx.get(f"{simulator.url}/_sim/stats").json()
    assert (stats["workers"], stats["peak_in_flight"], stats["in_flight"]) == (4, 1, 0)
    assert stats["fault"] is None
    (record,) = stats["requests"]
    assert record["job"] == "heart rate"
    assert set(record) == {
        "id",
        "received",
        "started",
        "ended",
        "outcome",
        "status",
        "job",
        "disconnected",
    }

    simulator.set_fault("status", requests=5)
    assert httpx.post(f"{simulator.url}/_sim/reset").status_code == 200
    stats = httpx.get(f"{simulator.url}/_sim/stats").json()
    assert (stats["requests"], stats["peak_in_flight"], stats["fault"]) == ([], 0, None)


def test_fault_kind_none_clears_the_fault(simulator: GatewaySimulator) -> None:
    simulator.set_fault("status", status=503)
    assert httpx.get(f"{simulator.url}/_sim/stats").json()["fault"]["status"] == 503
    answer = httpx.post(f"{simulator.url}/_sim/fault", json={"kind": "none"})
    assert answer.json() == {"fault": None}
    assert simulator.stats().fault is None


@pytest.mark.parametrize(
    "spec",
    [
        {"kind": "explode"},
        {"kind": "status", "status": 200},
        {"kind": "status", "status": "503"},
        {"kind": "status", "seconds": -1},
        {"kind": "status", "seconds": "soon"},
        {"kind": "status", "headers": {"Bad Name": "1"}},
        {"kind": "status", "headers": {"Retry-After": "1\r\nX: y"}},
        {"kind": "status", "headers": ["Retry-After"]},
        {"kind": "drop", "requests": 0},
        {"kind": "drop", "requests": 1.5},
        {"kind": "drop", "status": 503},
        {"kind": "hang", "hold_seconds": -1},
        {"kind": "trickle", "interval": 0},
        {"kind": "huge", "size": -1},
        {"kind": "redirect", "status": 404},
        {"kind": "echo_token", "status": 302},
        {"kind": "status", "job": ""},
        {"kind": "status", "job": "a", "job_prefix": "b"},
        {"kind": "refuse"},
        {"kind": "refuse", "seconds": 5, "requests": 2},
        {"kind": "refuse", "seconds": 5, "job": "a"},
        {"kind": "none", "requests": 2},
        ["status"],
    ],
)
def test_a_bad_fault_is_refused_with_a_one_line_400(simulator: GatewaySimulator, spec: Any) -> None:
    answer = httpx.post(f"{simulator.url}/_sim/fault", json=spec)
    assert answer.status_code == 400
    assert "\n" not in answer.text
    assert answer.json()["error"]["message"]
    assert simulator.stats().fault is None


def test_a_bad_fault_is_a_value_error_in_python(simulator: GatewaySimulator) -> None:
    with pytest.raises(ValueError, match="requests"):
        simulator.set_fault("drop", requests=0)
    with pytest.raises(ValueError, match="refuse"):
        simulator.set_fault("refuse", requests=1)
    assert simulator.stats().fault is None


def test_bad_requests_and_unknown_paths(simulator: GatewaySimulator) -> None:
    completions = f"{simulator.url}{PATH}"
    assert httpx.post(completions, content=b"not json").status_code == 400
    assert httpx.post(completions, json={"model": "x"}).status_code == 400
    too_large = httpx.post(completions, content=b"x" * (10 * 1024 * 1024 + 1))
    assert too_large.status_code == 413
    assert httpx.get(completions).status_code == 405
    missing = httpx.get(f"{simulator.url}/nowhere")
    assert missing.status_code == 404
    assert missing.json()["error"]["type"] == "not_found"
    stats = simulator.wait_for(settled, WAIT_LIMIT)
    assert [r.outcome for r in stats.requests] == ["bad_request"] * 2


def test_a_custom_path_is_served() -> None:
    with GatewaySimulator(path="/api/chat") as simulator:
        assert httpx.post(f"{simulator.url}/api/chat", json=body()).status_code == 200
        assert post(simulator).status_code == 404


def test_stop_closes_waiting_and_hung_requests_and_joins_its_thread() -> None:
    simulator = GatewaySimulator(workers=1).start()
    simulator.set_fault("hang")
    calls = [Call(simulator, "held"), Call(simulator, "waiting")]
    simulator.wait_for(lambda s: s.in_flight == 1 and s.waiting == 1, WAIT_LIMIT)

    simulator.stop()

    for call in calls:
        call.join(WAIT_LIMIT)
        assert not call.is_alive()
        # Closed without an answer: to the client, the gateway went away.
        assert isinstance(call.error, httpx.RemoteProtocolError)
    assert not simulator_threads()
    stats = simulator.stats()
    assert {r.outcome for r in stats.requests} == {"stopped"}
    assert stats.in_flight == stats.waiting == 0
    simulator.stop()  # a second stop is harmless


def test_wait_for_says_when_the_condition_is_not_met(simulator: GatewaySimulator) -> None:
    with pytest.raises(TimeoutError, match="not met"):
        simulator.wait_for(lambda s: s.in_flight == 1, 0.05)


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
    for option in ("--host", "--port", "--workers", "--latency", str(DEFAULT_PORT)):
        assert option in shown.output
    assert runner.invoke(gateway_sim_command, ["--latency", "soon"]).exit_code == 2


@pytest.mark.parametrize(("args", "expected"), [([], False), (["--finish-abandoned"], True)])
def test_command_passes_on_finish_abandoned(
    monkeypatch: pytest.MonkeyPatch, args: list[str], expected: bool
) -> None:
    seen: dict[str, Any] = {}
    monkeypatch.setattr("devtools.simulator.run", lambda *_, **options: seen.update(options))
    result = CliRunner().invoke(gateway_sim_command, args)
    assert result.exit_code == 0, result.output
    assert seen["finish_abandoned"] is expected


def test_command_reports_a_taken_port() -> None:
    with GatewaySimulator() as busy:
        result = CliRunner().invoke(gateway_sim_command, ["--port", str(busy.port)])
    assert result.exit_code == 1
    assert f"cannot listen on 127.0.0.1:{busy.port}" in result.output
    assert "taken" in result.output


def start_command(*args: str) -> tuple[subprocess.Popen[str], str]:
    """`gateway-sim` in its own session; returns it and the URL it announced."""
    code = "import sys; from devtools.simulator import main; sys.exit(main(sys.argv[1:]))"
    process = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=PROJECT_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if "development tool" not in line:
        stop_process_group(process, 5)
        errors = process.stderr.read() if process.stderr is not None else ""
        raise AssertionError(f"no announcement: {line!r} {errors[-2000:]}")
    return process, line.split(" at ", 1)[1].split()[0]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_command_serves_until_a_stop_signal(sig: signal.Signals) -> None:
    process, url = start_command("--port", "0", "--latency", "0", "--workers", "2")
    try:
        assert url.startswith("http://127.0.0.1:")
        assert httpx.get(f"{url}/_sim/stats").json()["workers"] == 2
        assert httpx.post(f"{url}{PATH}", json=body()).status_code == 200
        process.send_signal(sig)
        assert process.wait(WAIT_LIMIT) == 0
    finally:
        stop_process_group(process, 5)


def test_command_listens_on_8765_when_it_is_free() -> None:
    with socket.socket() as probe:
        # Bind as the simulator does, so connections of a server just
        # stopped (TIME_WAIT) do not read as the port being in use.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(("127.0.0.1", DEFAULT_PORT))
        except OSError:
            pytest.skip(f"port {DEFAULT_PORT} is in use on this machine")
    try:
        process, url = start_command("--latency", "0")
    except AssertionError as exc:
        if "the port is taken" not in str(exc):
            raise
        pytest.skip(f"port {DEFAULT_PORT} was taken meanwhile")
    try:
        assert url == f"http://127.0.0.1:{DEFAULT_PORT}"
        # A second one says the port is taken.
        second = subprocess.run(
            [sys.executable, "-c", "from devtools.simulator import main; raise SystemExit(main())"],
            cwd=PROJECT_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        assert second.returncode == 1
        assert f"{DEFAULT_PORT}: the port is taken" in second.stderr
        process.send_signal(signal.SIGTERM)
        assert process.wait(WAIT_LIMIT) == 0
    finally:
        stop_process_group(process, 5)


def test_a_transport_lent_to_the_client_survives_its_calls(simulator: GatewaySimulator) -> None:
    """Calls sharing one transport: the quick one ending must not cut the slow one off."""
    import asyncio

    from flows.gateway import Completion
    from tests.support.factories import gateway_client

    async def both() -> list[Completion]:
        transport = httpx.AsyncHTTPTransport()
        client = gateway_client(settings_for(gateway={"url": simulator.url}), transport=transport)
        messages = [{"role": "user", "content": "sleep for user 42"}]
        try:
            return list(
                await asyncio.gather(
                    client.complete(messages, sim_latency=0.5),
                    client.complete(messages, sim_latency=0.05),
                )
            )
        finally:
            await transport.aclose()

    slow, quick = asyncio.run(both())
    assert slow.status == quick.status == 200
    assert slow.elapsed_seconds > quick.elapsed_seconds
