"""The gateway-side recorder in front of the simulator and of a third-party server.

Waits are on the recorder's and the simulator's own events; overlaps are
made by holding connections open (a hang fault, raw sockets), never by timing.
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from devtools.recorder import (
    CLIENT,
    STOPPED,
    UPSTREAM,
    UPSTREAM_REFUSED,
    ConnectionInterval,
    GatewayRecorder,
    gaps,
)
from devtools.simulator import GatewaySimulator
from tests.support.third_party import (
    BROKEN_JOB,
    DEFAULT_CONTENT,
    RATE_LIMITED_JOB,
    FakeLLM,
    header_value,
)

WAIT_LIMIT = 5.0  # seconds a test waits for something that should take far less
NOTICE_LIMIT = 0.1  # seconds within which a close must reach the other side
PATH = "/v1/chat/completions"


def body(text: str = "sleep for user 42") -> dict[str, Any]:
    return {"model": "small", "messages": [{"role": "user", "content": text}]}


def post(url: str, text: str = "sleep for user 42", **kwargs: Any) -> httpx.Response:
    """One call on a connection of its own, closed after the answer."""
    return httpx.post(f"{url}{PATH}", json=body(text), timeout=WAIT_LIMIT, **kwargs)


def open_request(port: int, text: str = "held", headers: dict[str, str] | None = None):
    """A raw connection that has sent one whole request; the test closes it."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_LIMIT)
    send_request(sock, text, headers)
    return sock


def send_request(
    sock: socket.socket, text: str = "held", headers: dict[str, str] | None = None
) -> None:
    data = json.dumps(body(text)).encode()
    lines = [
        f"POST {PATH} HTTP/1.1",
        "Host: 127.0.0.1",
        "Content-Type: application/json",
        f"Content-Length: {len(data)}",
        *(f"{name}: {value}" for name, value in (headers or {}).items()),
    ]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + data)


def read_all(sock: socket.socket) -> bytes:
    received = bytearray()
    while chunk := sock.recv(65536):
        received += chunk
    return bytes(received)


class Call(threading.Thread):
    def __init__(self, url: str, text: str) -> None:
        super().__init__(daemon=True)
        self.url, self.text = url, text
        self.response: httpx.Response | None = None
        self.error: BaseException | None = None
        self.start()

    def run(self) -> None:
        try:
            self.response = post(self.url, self.text)
        except Exception as exc:  # noqa: BLE001 - the test asserts on it
            self.error = exc

    def status(self) -> int:
        self.join(WAIT_LIMIT)
        assert not self.is_alive() and self.error is None, repr(self.error)
        assert self.response is not None
        return self.response.status_code


def recorder_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith("gateway-recorder")}


@pytest.fixture
def simulator() -> Iterator[GatewaySimulator]:
    with GatewaySimulator(workers=4, latency=0.02) as running:
        yield running


@pytest.fixture
def recorder(simulator: GatewaySimulator) -> Iterator[GatewayRecorder]:
    with GatewayRecorder("127.0.0.1", simulator.port) as running:
        yield running
    assert not recorder_threads()


@pytest.fixture(scope="module")
def fakellm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FakeLLM]:
    with FakeLLM(tmp_path_factory.mktemp("fakellm")) as server:
        yield server


# --- the arithmetic ---------------------------------------------------------------


def interval(key: int, opened: float, closed: float | None) -> ConnectionInterval:
    return ConnectionInterval(key, opened, opened + 1000, closed)


def test_gaps_are_measured_from_the_latest_earlier_close() -> None:
    intervals = [
        interval(1, 0.0, 1.0),
        interval(2, 0.5, 3.0),  # overlaps the first by 0.5 s
        interval(3, 3.25, 4.0),  # 0.25 s after the second closed
        interval(4, 5.0, 6.0),
    ]
    assert gaps(intervals) == (-0.5, 0.25, 1.0)
    # Order of opening, not of the list; an earlier long one covers a later gap.
    assert gaps([intervals[3], interval(5, 0.0, 10.0), intervals[0]]) == (-1.0, -5.0)
    # A connection still open closes "now" for the arithmetic.
    assert gaps([interval(1, 0.0, None), interval(2, 1.0, 2.0)], now=4.0) == (-3.0,)
    assert gaps([interval(1, 0.0, 1.0)]) == ()


# --- in front of the simulator ------------------------------------------------------


def test_sequential_calls_have_positive_gaps_and_a_peak_of_one(
    simulator: GatewaySimulator, recorder: GatewayRecorder
) -> None:
    for number in range(3):
        assert post(recorder.url, f"job {number}").status_code == 200

    snapshot = recorder.wait_for_closed(3, WAIT_LIMIT)
    assert (snapshot.count, snapshot.in_flight, snapshot.peak_in_flight) == (3, 0, 1)
    assert len(snapshot.gaps) == 2 and all(gap > 0 for gap in snapshot.gaps)
    assert snapshot.min_gap == min(snapshot.gaps) == recorder.min_gap
    for seen in snapshot.intervals:
        assert seen.closed is not None and seen.closed_at is not None
        assert seen.opened < seen.closed and seen.opened_at < seen.closed_at
        assert seen.closed_by in (CLIENT, UPSTREAM)
        assert seen.bytes_from_client > 0 and seen.bytes_from_upstream > 0
    # The recorder and the simulator agree on how many calls there were.
    assert [r.outcome for r in simulator.stats().requests] == ["ok"] * 3


def test_overlapping_calls_show_as_negative_gaps_and_the_peak_of_connections() -> None:
    with GatewaySimulator(workers=1) as narrow, GatewayRecorder("127.0.0.1", narrow.port) as rec:
        narrow.set_fault("hang")
        calls = [Call(rec.url, f"job {n}") for n in range(3)]
        snapshot = rec.wait_for_connections(3, WAIT_LIMIT)
        narrow.wait_for(lambda s: s.in_flight == 1 and s.waiting == 2, WAIT_LIMIT)
        assert rec.in_flight == 3

        narrow.clear_fault()
        assert [call.status() for call in calls] == [200] * 3
        snapshot = rec.wait_until_idle(WAIT_LIMIT)
        # Three connections were open at once, though one worker served them.
        assert snapshot.peak_in_flight == 3
        assert narrow.stats().peak_in_flight == 1
        assert len(snapshot.gaps) == 2 and all(gap < 0 for gap in snapshot.gaps)
        assert snapshot.min_gap is not None and snapshot.min_gap < 0


def test_a_client_aborting_a_hung_call_is_seen_at_once_on_both_sides(
    simulator: GatewaySimulator, recorder: GatewayRecorder
) -> None:
    simulator.set_fault("hang")
    sock = open_request(recorder.port)
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)

    closed, closed_at = time.monotonic(), time.time()
    sock.close()
    (seen,) = recorder.wait_for_closed(1, WAIT_LIMIT).intervals
    assert seen.closed is not None and seen.client_ended is not None
    assert seen.closed_by == CLIENT
    assert seen.closed - closed < NOTICE_LIMIT
    # The recorder closed the server's side too, and the server noticed.
    record = simulator.wait_for(lambda s: s.in_flight == 0, WAIT_LIMIT).requests[0]
    assert record.outcome == "client_gone" and record.disconnected is not None
    assert record.disconnected - closed_at < NOTICE_LIMIT


def test_the_server_closing_without_an_answer_closes_the_client(
    simulator: GatewaySimulator, recorder: GatewayRecorder
) -> None:
    simulator.set_fault("drop", requests=1)
    with pytest.raises(httpx.RemoteProtocolError):
        post(recorder.url)
    (seen,) = recorder.wait_for_closed(1, WAIT_LIMIT).intervals
    assert seen.closed_by == UPSTREAM
    assert seen.bytes_from_upstream == 0


def test_a_refusing_server_resets_the_client(
    simulator: GatewaySimulator, recorder: GatewayRecorder
) -> None:
    simulator.set_fault("refuse")
    with pytest.raises(httpx.TransportError):
        post(recorder.url)
    (seen,) = recorder.wait_for_closed(1, WAIT_LIMIT).intervals
    assert seen.closed_by == UPSTREAM_REFUSED
    assert recorder.in_flight == 0

    simulator.clear_fault()
    assert post(recorder.url).status_code == 200


def test_stop_closes_open_connections_and_joins_its_thread(simulator: GatewaySimulator) -> None:
    recorder = GatewayRecorder("127.0.0.1", simulator.port).start()
    simulator.set_fault("hang")
    sock = open_request(recorder.port)
    simulator.wait_for(lambda s: s.in_flight == 1, WAIT_LIMIT)

    recorder.stop()

    assert not recorder_threads()
    (seen,) = recorder.intervals()
    assert seen.closed_by == STOPPED and recorder.in_flight == 0
    with sock, contextlib.suppress(ConnectionResetError):
        assert read_all(sock) == b""  # closed without an answer
    simulator.wait_for(lambda s: s.in_flight == 0, WAIT_LIMIT)
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{recorder.url}/_sim/stats")
    recorder.stop()  # a second stop is harmless


def test_reset_forgets_closed_connections(recorder: GatewayRecorder) -> None:
    post(recorder.url)
    recorder.wait_for_closed(1, WAIT_LIMIT)
    recorder.reset()
    snapshot = recorder.snapshot()
    assert (snapshot.count, snapshot.peak_in_flight, snapshot.intervals) == (0, 0, ())
    assert snapshot.min_gap is None


def test_a_wait_that_is_not_met_says_so(recorder: GatewayRecorder) -> None:
    with pytest.raises(TimeoutError, match="1 connections"):
        recorder.wait_for_connections(1, 0.05)


# --- half-close, against a server that answers after the end of the request -------


class AnswerAfterEnd:
    """A TCP server for one connection: reads to the end, then says how much."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.thread = threading.Thread(target=self.serve, daemon=True)
        self.thread.start()

    def serve(self) -> None:
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                received = read_all(conn)
                conn.sendall(f"got {len(received)}".encode())

    def close(self) -> None:
        self.listener.close()
        self.thread.join(WAIT_LIMIT)


@pytest.mark.parametrize(("half_close", "answer"), [(True, b"got 5"), (False, b"")])
def test_a_client_half_close(half_close: bool, answer: bytes) -> None:
    server = AnswerAfterEnd()
    try:
        with GatewayRecorder("127.0.0.1", server.port, half_close=half_close) as recorder:
            sock = socket.create_connection(("127.0.0.1", recorder.port), timeout=WAIT_LIMIT)
            with sock:
                sock.sendall(b"hello")
                sock.shutdown(socket.SHUT_WR)
                # Forwarded as a half-close, the server still answers; by
                # default the end of the client's stream closes both sides.
                assert read_all(sock) == answer
            (seen,) = recorder.wait_for_closed(1, WAIT_LIMIT).intervals
            assert seen.closed_by == CLIENT
            assert seen.bytes_from_client == 5
    finally:
        server.close()


# --- in front of a third-party server ------------------------------------------------


def test_in_front_of_fakellm_sequential_calls(fakellm: FakeLLM) -> None:
    with GatewayRecorder(fakellm.host, fakellm.port) as recorder:
        answers = [
            post(recorder.url),
            post(recorder.url, headers={"X-Insight-Job": header_value(RATE_LIMITED_JOB)}),
            post(recorder.url, headers={"X-Insight-Job": header_value(BROKEN_JOB)}),
        ]
        assert [a.status_code for a in answers] == [200, 429, 500]
        assert answers[0].json()["choices"][0]["message"]["content"] == DEFAULT_CONTENT

        snapshot = recorder.wait_for_closed(3, WAIT_LIMIT)
        assert (snapshot.count, snapshot.peak_in_flight) == (3, 1)
        assert snapshot.min_gap is not None and snapshot.min_gap > 0


def test_in_front_of_fakellm_overlapping_connections(fakellm: FakeLLM) -> None:
    with GatewayRecorder(fakellm.host, fakellm.port) as recorder:
        # Both connections are open before either asks: they overlap whatever the timing.
        first = socket.create_connection(("127.0.0.1", recorder.port), timeout=WAIT_LIMIT)
        second = socket.create_connection(("127.0.0.1", recorder.port), timeout=WAIT_LIMIT)
        recorder.wait_for_connections(2, WAIT_LIMIT)
        for sock in (first, second):
            send_request(sock, headers={"Connection": "close"})
        with first, second:
            assert read_all(first).startswith(b"HTTP/1.1 200 ")
            assert read_all(second).startswith(b"HTTP/1.1 200 ")
        snapshot = recorder.wait_until_idle(WAIT_LIMIT)
        assert snapshot.peak_in_flight == 2
        assert snapshot.min_gap is not None and snapshot.min_gap < 0


def test_in_front_of_fakellm_a_client_close_is_seen_at_once(fakellm: FakeLLM) -> None:
    with GatewayRecorder(fakellm.host, fakellm.port) as recorder:
        sock = socket.create_connection(("127.0.0.1", recorder.port), timeout=WAIT_LIMIT)
        recorder.wait_for_connections(1, WAIT_LIMIT)
        closed = time.monotonic()
        sock.close()
        (seen,) = recorder.wait_for_closed(1, WAIT_LIMIT).intervals
        assert seen.closed_by == CLIENT
        assert seen.closed is not None and seen.closed - closed < NOTICE_LIMIT


def test_the_fakellm_helper_writes_its_rules(fakellm: FakeLLM) -> None:
    assert Path(fakellm.config).read_text().count("x-insight-job") == 2
    assert header_value("recovery:2024-05-01 Zoë") == "recovery:2024-05-01%20Zo%C3%AB"
