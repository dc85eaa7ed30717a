"""A gateway simulator: a DEVELOPMENT TOOL that stands in for the LLM gateway.

It speaks the same OpenAI-compatible chat-completions protocol as the real
gateway, with the property that matters most to this project: a fixed number
of workers (4 by default), so requests beyond them wait in a backlog. It lets
a developer or a test watch what the queue does to a shared gateway (every
request is recorded with its times, and the peak number served at once) and
inject the failures the queue must survive: error statuses, hangs, dropped
connections and refused connections.

It must never be mistaken for, or deployed as, a gateway: its answers are
canned text derived from the request, it has no authentication beyond an
optional fixed token, and anyone who can reach it can inject faults. It binds
to 127.0.0.1 unless told otherwise. It must not import the store or Prefect.

HTTP endpoints besides the chat-completions path:
    GET  /_sim/stats   {"peak_in_flight", "in_flight", "waiting", "fault", "requests": [...]}
    POST /_sim/reset   forget the recorded requests and the peak; clear any fault
    POST /_sim/latency {"latency": 2 | [1, 3] | "1-3"}: seconds per answer from now on
    POST /_sim/fault   {"kind": "status" | "hang" | "drop" | "refuse" | "none", ...}

Fault fields: `seconds` (the fault lasts this long) and/or `requests` (it
applies to this many requests), whichever ends first, else until cleared;
`status` for "status" (default 503); `hold_seconds` for "hang": a hung
request holds its worker and answers after this long, or earlier when the
fault's `seconds` run out, when any fault is set or cleared, or at stop.
"refuse" stops listening for `seconds` (required), then listens again on the
same port. Every answer closes its connection, so a fault reaches the very
next request instead of missing a client's pooled connection.

A request body may carry `"sim_latency": <seconds>` to override the latency
for that request. A request is labelled in the records by its body's `"job"`
text, else its `X-Insight-Job` header (what the gateway client sends), else
its first user message.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.server
import ipaddress
import itertools
import json
import logging
import random
import signal
import socket
import socketserver
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from types import FrameType, TracebackType
from typing import Any, Literal, Self, cast, get_args

import click

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_WORKERS = 4  # requests served at once, like the shared gateway
DEFAULT_PATH = "/v1/chat/completions"
JOB_HEADER = "X-Insight-Job"  # the gateway client's label for a call
DEFAULT_FAULT_STATUS = 503
CLI_DEFAULT_LATENCY = "2"  # seconds; short enough to watch a demo drain

MAX_BODY_BYTES = 10 * 1024 * 1024  # bytes; a chat request is a few kilobytes
MAX_RECORDS = 10_000  # requests kept; older ones are forgotten first
JOB_LABEL_CHARS = 200  # characters of a job hint or user message recorded
CONTENT_PREVIEW_CHARS = 80  # characters of the user message echoed in an answer
REQUEST_READ_TIMEOUT = 30.0  # seconds a client may take to send its request
SHUTDOWN_POLL_INTERVAL = 0.05  # seconds; how quickly the accept loop notices a stop
STOP_JOIN_TIMEOUT = 5.0  # seconds to wait for each thread when stopping
RELISTEN_BIND_ATTEMPTS = 20  # tries to take the port back after a refusal
RELISTEN_BIND_PAUSE = 0.05  # seconds between those tries
LISTEN_BACKLOG = 128  # connections the kernel queues before accept
SIGNAL_POLL_INTERVAL = 0.5  # seconds between checks for SIGINT/SIGTERM in run()

FaultKind = Literal["status", "hang", "drop", "refuse"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

# What became of a recorded request.
WAITING = "waiting"  # in the backlog, no worker yet
SERVING = "serving"  # a worker is on it
OK = "ok"
INJECTED_STATUS = "injected_status"
DROPPED = "dropped"
HUNG = "hung"  # held by a "hang" fault, then answered
BAD_REQUEST = "bad_request"
UNAUTHORIZED = "unauthorized"
CLIENT_GONE = "client_gone"  # the answer could not be written
STOPPED = "stopped"  # the simulator stopped before answering


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One chat-completions request as the simulator saw it.

    Times are `time.time()` wall-clock seconds, so other processes can line
    them up with their own logs. `started` is when a worker took the request
    (None if none did); `status` is the HTTP status sent, None if none was.
    """

    id: int
    received: float
    started: float | None
    ended: float | None
    outcome: str
    status: int | None
    job: str | None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SimulatorStats:
    workers: int
    latency: tuple[float, float]  # seconds per answer, minimum and maximum
    in_flight: int
    waiting: int
    peak_in_flight: int
    fault: dict[str, Any] | None
    requests: tuple[RequestRecord, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "latency": list(self.latency),
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "peak_in_flight": self.peak_in_flight,
            "fault": self.fault,
            "requests": [record.to_json() for record in self.requests],
        }


@dataclasses.dataclass(eq=False)
class _Fault:
    kind: FaultKind
    status: int
    until: float | None  # time.monotonic() deadline
    requests_left: int | None
    hold_seconds: float | None

    def describe(self, now: float) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "status": self.status if self.kind == "status" else None,
            "seconds_left": None if self.until is None else max(0.0, self.until - now),
            "requests_left": self.requests_left,
            "hold_seconds": self.hold_seconds,
        }


def parse_latency(text: str) -> tuple[float, float]:
    """Seconds per answer from "2" (fixed) or "1-3" (uniform range)."""
    low, separator, high = text.strip().partition("-")
    try:
        minimum = float(low)
        maximum = float(high) if separator else minimum
    except ValueError:
        raise ValueError(f"latency: expected seconds like '2' or '1-3', got {text!r}") from None
    return _checked_latency(minimum, maximum)


def _checked_latency(minimum: float, maximum: float) -> tuple[float, float]:
    if not (0 <= minimum <= maximum < float("inf")):
        raise ValueError(f"latency: need 0 <= minimum <= maximum, got {minimum}..{maximum}")
    return minimum, maximum


def _latency_range(latency: object) -> tuple[float, float]:
    if isinstance(latency, tuple | list) and len(latency) == 2:
        low, high = latency
    elif isinstance(latency, int | float) and not isinstance(latency, bool):
        low = high = latency
    else:
        raise ValueError(f"latency: expected seconds or a (minimum, maximum) pair, got {latency!r}")
    if not all(isinstance(x, int | float) and not isinstance(x, bool) for x in (low, high)):
        raise ValueError(f"latency: expected numbers of seconds, got {latency!r}")
    return _checked_latency(float(low), float(high))


def _make_fault(
    kind: str,
    *,
    seconds: float | None,
    requests: int | None,
    status: int,
    hold_seconds: float | None,
) -> _Fault:
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind: expected one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    if seconds is not None and (isinstance(seconds, bool) or not 0 < seconds < float("inf")):
        raise ValueError("fault seconds: expected a number above 0")
    if requests is not None and (not isinstance(requests, int) or isinstance(requests, bool)):
        raise ValueError("fault requests: expected a whole number")
    if requests is not None and requests < 1:
        raise ValueError("fault requests: expected at least 1")
    if not isinstance(status, int) or isinstance(status, bool) or not 400 <= status <= 599:
        raise ValueError("fault status: expected an HTTP error status, 400 to 599")
    if hold_seconds is not None and (
        isinstance(hold_seconds, bool) or not 0 <= hold_seconds < float("inf")
    ):
        raise ValueError("fault hold_seconds: expected a number of seconds, 0 or more")
    if kind == "refuse" and seconds is None:
        # While refusing, the control endpoint is unreachable too: without a
        # deadline nothing over HTTP could end the refusal.
        raise ValueError("fault refuse: needs seconds")
    until = None if seconds is None else time.monotonic() + seconds
    return _Fault(cast(FaultKind, kind), status, until, requests, hold_seconds)


def _first_user_text(body: Mapping[str, Any]) -> str | None:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return None
    for message in messages:
        if isinstance(message, dict) and message.get("role") == "user":
            content = message.get("content")
            if isinstance(content, str):
                return content
    return None


def _words(body: Mapping[str, Any]) -> int:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return 0
    return sum(
        len(message["content"].split())
        for message in messages
        if isinstance(message, dict) and isinstance(message.get("content"), str)
    )


def _error_body(message: str, kind: str, code: int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "code": code}}


class _Server(http.server.ThreadingHTTPServer):
    # The simulator starts, tracks and joins the connection threads itself:
    # a refusal closes this server object while its requests are still served.
    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True  # take the same port back after a refusal
    request_queue_size = LISTEN_BACKLOG

    def __init__(
        self, address: tuple[str, int], family: socket.AddressFamily, simulator: GatewaySimulator
    ) -> None:
        self.address_family = family
        self.simulator = simulator
        super().__init__(address, _Handler)

    def server_bind(self) -> None:
        # HTTPServer.server_bind resolves the host's FQDN, which can stall on
        # DNS; the name is never used here.
        socketserver.TCPServer.server_bind(self)
        self.server_name = str(self.server_address[0])
        self.server_port = int(self.server_address[1])

    def process_request(self, request: Any, client_address: Any) -> None:
        self.simulator._serve_connection(self, request, client_address)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # Clients that hang up mid-answer are routine in fault tests.
        logger.debug("gateway simulator: error serving %s", client_address, exc_info=True)


class _Handler(http.server.BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = REQUEST_READ_TIMEOUT
    server_version = "insight-queue-gateway-simulator"

    def do_GET(self) -> None:
        self.server.simulator._route(self, "GET")

    def do_POST(self) -> None:
        self.server.simulator._route(self, "POST")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("gateway simulator: %s " + format, self.address_string(), *args)

    def send_json(self, status: int, payload: Any) -> bool:
        """Send one JSON answer and close; False when the client was gone."""
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(data)
        except OSError:
            self.close_connection = True
            return False
        return True

    def read_body(self) -> bytes | None:
        """The request body, or None after answering why it cannot be read."""
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.send_json(411, _error_body("send a Content-Length", "invalid_request_error"))
            return None
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if not 0 <= length <= MAX_BODY_BYTES:
            self.send_json(413, _error_body("bad or too large body", "invalid_request_error"))
            return None
        return self.rfile.read(length)


class GatewaySimulator:
    """A local stand-in for the LLM gateway, for development and tests only.

    `latency` is seconds per answer: a number, or a (minimum, maximum) range
    drawn uniformly. `token`, when given, is required as a bearer token.
    Start with `start()` or a `with` block; `stop()` ends every thread it
    started.
    """

    def __init__(
        self,
        host: str = DEFAULT_HOST,
        port: int = 0,
        workers: int = DEFAULT_WORKERS,
        latency: float | tuple[float, float] = 0.0,
        *,
        path: str = DEFAULT_PATH,
        token: str | None = None,
        seed: int | None = None,
    ) -> None:
        if workers < 1:
            raise ValueError("workers: expected at least 1")
        if not path.startswith("/") or path.startswith("/_sim/"):
            raise ValueError("path: expected an absolute path outside /_sim/")
        self._latency = _latency_range(latency)
        self._host = host
        self._port = port
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._workers = workers
        self._path = path
        self._token = token
        self._random = random.Random(seed)

        self._lock = threading.Lock()
        self._slot_freed = threading.Condition(self._lock)
        self._hang_released = threading.Condition(self._lock)
        self._in_flight = 0
        self._waiting = 0
        self._peak = 0
        self._ids = itertools.count(1)
        self._records: OrderedDict[int, RequestRecord] = OrderedDict()
        self._fault: _Fault | None = None
        self._fault_changes = 0  # set_fault/clear_fault calls; a change releases hangs

        # Opening and closing the listener happen under this lock, never
        # while holding `_lock` (order: _listener_lock, then _lock).
        self._listener_lock = threading.Lock()
        self._server: _Server | None = None
        self._serve_thread: threading.Thread | None = None
        self._relisten_thread: threading.Thread | None = None
        self._relisten_wakeup = threading.Event()
        self._started = False
        self._stopping = threading.Event()
        self._connections: dict[threading.Thread, socket.socket] = {}

    # --- lifecycle ---------------------------------------------------------

    @property
    def url(self) -> str:
        """Base URL to give a client as `AI_GATEWAY_URL`."""
        if not self._started:
            raise RuntimeError("the gateway simulator is not started")
        host = f"[{self._host}]" if self._family == socket.AF_INET6 else self._host
        return f"http://{host}:{self._port}"

    @property
    def port(self) -> int:
        return self._port

    @property
    def workers(self) -> int:
        return self._workers

    def start(self) -> Self:
        if self._started:
            raise RuntimeError("the gateway simulator was already started")
        with self._listener_lock:
            self._open_listener()
        self._started = True
        if not _is_loopback(self._host):
            logger.warning(
                "gateway simulator bound to %s: anyone who can reach it can inject faults",
                self._host,
            )
        logger.info(
            "gateway simulator (a development tool, not a gateway) listening on %s "
            "with %d workers, latency %s-%s s",
            self.url,
            self._workers,
            *self._latency,
        )
        return self

    def stop(self) -> None:
        """Stop listening, release held requests and join every thread started."""
        self._stopping.set()
        with self._lock:
            self._slot_freed.notify_all()
            self._hang_released.notify_all()
        self._relisten_wakeup.set()
        with self._listener_lock:
            self._close_listener()
            relisten = self._relisten_thread
        if relisten is not None:
            relisten.join(STOP_JOIN_TIMEOUT)
        with self._lock:
            connections = dict(self._connections)
        for connection in connections.values():
            # Wakes a handler blocked reading a request that will never come.
            with contextlib.suppress(OSError):
                connection.shutdown(socket.SHUT_RDWR)
        for thread in connections:
            thread.join(STOP_JOIN_TIMEOUT)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    # --- observation and control ------------------------------------------

    def stats(self) -> SimulatorStats:
        with self._lock:
            fault = self._current_fault()
            return SimulatorStats(
                workers=self._workers,
                latency=self._latency,
                in_flight=self._in_flight,
                waiting=self._waiting,
                peak_in_flight=self._peak,
                fault=None if fault is None else fault.describe(time.monotonic()),
                requests=tuple(self._records.values()),
            )

    def set_latency(self, latency: float | tuple[float, float]) -> None:
        """Seconds per answer for requests that start waiting from now on."""
        checked = _latency_range(latency)
        with self._lock:
            self._latency = checked

    def reset(self) -> None:
        """Forget recorded requests and the peak, and clear any fault."""
        with self._lock:
            self._records.clear()
            self._peak = self._in_flight
        self.clear_fault()

    def set_fault(
        self,
        kind: FaultKind,
        *,
        seconds: float | None = None,
        requests: int | None = None,
        status: int = DEFAULT_FAULT_STATUS,
        hold_seconds: float | None = None,
    ) -> None:
        """Inject a fault, replacing any current one (see the module docstring)."""
        fault = _make_fault(
            kind, seconds=seconds, requests=requests, status=status, hold_seconds=hold_seconds
        )
        self._apply_fault(fault)

    def clear_fault(self) -> None:
        """End the current fault: release hung requests, listen again if refusing."""
        self._apply_fault(None)

    def _apply_fault(self, fault: _Fault | None) -> None:
        with self._listener_lock:
            with self._lock:
                self._fault = fault
                # Any change of fault releases every hung request, including
                # those caught by a fault that has since run out of requests.
                self._fault_changes += 1
                self._hang_released.notify_all()
            self._relisten_wakeup.set()
            if fault is not None and fault.kind == "refuse" and not self._stopping.is_set():
                self._close_listener()
                if self._relisten_thread is None:
                    self._relisten_thread = threading.Thread(
                        target=self._relisten_when_due,
                        name="gateway-simulator-relisten",
                        daemon=True,
                    )
                    self._relisten_thread.start()
        logger.info("gateway simulator fault: %s", "cleared" if fault is None else fault.kind)

    def _current_fault(self) -> _Fault | None:
        """The fault in force, forgetting one whose time is up; holds `_lock`."""
        fault = self._fault
        if fault is not None and fault.until is not None and time.monotonic() >= fault.until:
            # Hung requests track the deadline themselves; nothing to release.
            self._fault = fault = None
        return fault

    def _take_fault(self) -> tuple[_Fault | None, int]:
        """The fault this request meets, counted against its `requests`, and
        the fault-change count that a hung request waits to see move."""
        with self._lock:
            fault = self._current_fault()
            if fault is None or fault.kind == "refuse":
                return None, self._fault_changes
            if fault.requests_left is not None:
                fault.requests_left -= 1
                if fault.requests_left <= 0:
                    # Running out is not a release: the requests it caught
                    # stay hung until the next fault change, their hold, or stop.
                    self._fault = None
            return fault, self._fault_changes

    # --- listening and refusing -------------------------------------------

    def _open_listener(self) -> None:
        """Listen on the host and port; holds `_listener_lock`."""
        # After a refusal the old socket may linger a moment; at start-up a
        # busy port is the caller's problem, reported at once.
        attempts = RELISTEN_BIND_ATTEMPTS if self._started else 1
        for attempt in range(attempts):
            try:
                server = _Server((self._host, self._port), self._family, self)
                break
            except OSError:
                if attempt + 1 == attempts:
                    raise
                self._stopping.wait(RELISTEN_BIND_PAUSE)
        self._port = int(server.server_address[1])
        self._server = server
        self._serve_thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": SHUTDOWN_POLL_INTERVAL},
            name=f"gateway-simulator-{self._port}",
            daemon=True,
        )
        self._serve_thread.start()

    def _close_listener(self) -> None:
        """Stop accepting and close the listening socket; holds `_listener_lock`."""
        server, thread = self._server, self._serve_thread
        self._server = self._serve_thread = None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(STOP_JOIN_TIMEOUT)

    def _refusal_left(self) -> float:
        """Seconds the current refusal still runs, 0 when none does."""
        with self._lock:
            fault = self._current_fault()
            if fault is None or fault.kind != "refuse" or fault.until is None:
                return 0.0
            return max(0.0, fault.until - time.monotonic())

    def _relisten_when_due(self) -> None:
        while not self._stopping.is_set():
            left = self._refusal_left()
            if left > 0:
                self._relisten_wakeup.wait(left)
                self._relisten_wakeup.clear()
                continue
            with self._listener_lock:
                # Checked again under the lock: a new refusal set meanwhile
                # finds this thread still registered and relies on it.
                if self._refusal_left() > 0:
                    continue
                self._relisten_thread = None
                if not self._stopping.is_set() and self._server is None:
                    try:
                        self._open_listener()
                    except OSError:
                        logger.exception(
                            "gateway simulator: cannot listen on port %d again", self._port
                        )
                        return
                    logger.info("gateway simulator listening again on %s", self.url)
                return

    # --- serving -------------------------------------------------------------

    def _serve_connection(self, server: _Server, request: Any, client_address: Any) -> None:
        def serve() -> None:
            try:
                server.finish_request(request, client_address)
            except Exception:  # noqa: BLE001 - one connection's failure is logged, not fatal
                server.handle_error(request, client_address)
            finally:
                server.shutdown_request(request)
                with self._lock:
                    self._connections.pop(thread, None)

        thread = threading.Thread(target=serve, name="gateway-simulator-request", daemon=True)
        # Registered and started in one step, so stop() never sees a thread
        # it cannot join yet.
        with self._lock:
            self._connections[thread] = request
            thread.start()

    def _route(self, handler: _Handler, method: str) -> None:
        path = handler.path.split("?", 1)[0]
        if method == "GET" and path == "/_sim/stats":
            handler.send_json(200, self.stats().to_json())
        elif method == "POST" and path == "/_sim/reset":
            if handler.read_body() is not None:
                self.reset()
                handler.send_json(200, {"reset": True})
        elif method == "POST" and path == "/_sim/latency":
            self._handle_latency_request(handler)
        elif method == "POST" and path == "/_sim/fault":
            self._handle_fault_request(handler)
        elif method == "POST" and path == self._path:
            self._handle_completion(handler)
        else:
            handler.send_json(404, _error_body(f"no {method} {path}", "not_found"))

    def _handle_latency_request(self, handler: _Handler) -> None:
        raw = handler.read_body()
        if raw is None:
            return
        try:
            spec = json.loads(raw or b"{}")
            value = spec.get("latency") if isinstance(spec, dict) else None
            self.set_latency(
                parse_latency(value) if isinstance(value, str) else _latency_range(value)
            )
        except ValueError as exc:
            handler.send_json(400, _error_body(str(exc), "invalid_request_error"))
            return
        handler.send_json(200, {"latency": list(self.stats().latency)})

    def _handle_fault_request(self, handler: _Handler) -> None:
        raw = handler.read_body()
        if raw is None:
            return
        try:
            spec = json.loads(raw or b"{}")
            if not isinstance(spec, dict):
                raise ValueError("expected a JSON object")
            kind = spec.get("kind", "none")
            fault = (
                None
                if kind in (None, "none")
                else _make_fault(
                    kind,
                    seconds=spec.get("seconds"),
                    requests=spec.get("requests"),
                    status=spec.get("status", DEFAULT_FAULT_STATUS),
                    hold_seconds=spec.get("hold_seconds"),
                )
            )
        except (ValueError, TypeError) as exc:
            handler.send_json(400, _error_body(str(exc), "invalid_request_error"))
            return
        # Applied before answering, so the fault is in force once the caller
        # hears back; a refusal closes only the listener, not this connection.
        self._apply_fault(fault)
        described = None if fault is None else fault.describe(time.monotonic())
        handler.send_json(200, {"fault": described})

    def _handle_completion(self, handler: _Handler) -> None:
        received = time.time()
        raw = handler.read_body()
        if raw is None:
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        job: str | None = None
        header = handler.headers.get(JOB_HEADER)
        if isinstance(body, dict) and isinstance(body.get("job"), str):
            job = body["job"]
        elif header is not None:
            job = urllib.parse.unquote(header)
        elif isinstance(body, dict):
            job = _first_user_text(body)
        job = None if job is None else job[:JOB_LABEL_CHARS]
        record_id = self._record(received, job)

        # Each answer is recorded, and its worker freed, just before it is
        # sent: a client holding its answer then finds the stats up to date.
        if self._token is not None and handler.headers.get("Authorization") != (
            f"Bearer {self._token}"
        ):
            error = _error_body("bad bearer token", "authentication_error")
            self._answer_and_record(handler, record_id, 401, error, UNAUTHORIZED)
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            error = _error_body("body must be JSON with a messages list", "invalid_request_error")
            self._answer_and_record(handler, record_id, 400, error, BAD_REQUEST)
            return

        fault, fault_changes = self._take_fault()
        if fault is not None and fault.kind == "drop":
            # Closing without a byte of answer, as a crashed worker would.
            handler.close_connection = True
            self._finish(record_id, DROPPED, None)
            return
        if fault is not None and fault.kind == "status":
            error = _error_body("simulated gateway fault", "simulator_fault", fault.status)
            self._answer_and_record(handler, record_id, fault.status, error, INJECTED_STATUS)
            return

        if not self._take_worker(record_id):
            handler.close_connection = True
            self._finish(record_id, STOPPED, None)
            return
        try:
            if fault is not None and fault.kind == "hang":
                self._hold(fault, fault_changes)
                outcome = HUNG
            else:
                self._stopping.wait(self._latency_for(body))
                outcome = OK
        finally:
            self._free_worker()
        if self._stopping.is_set():
            handler.close_connection = True
            self._finish(record_id, STOPPED, None)
            return
        self._answer_and_record(handler, record_id, 200, self._answer(record_id, body), outcome)

    def _answer_and_record(
        self, handler: _Handler, record_id: int, status: int, payload: Any, outcome: str
    ) -> None:
        self._finish(record_id, outcome, status)
        if not handler.send_json(status, payload):
            self._finish(record_id, CLIENT_GONE, None)

    def _latency_for(self, body: Mapping[str, Any]) -> float:
        override = body.get("sim_latency")
        if isinstance(override, int | float) and not isinstance(override, bool):
            return max(0.0, float(override))
        with self._lock:
            low, high = self._latency
            return low if low == high else self._random.uniform(low, high)

    def _answer(self, record_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
        user_text = _first_user_text(body)
        preview = "(no user message)" if user_text is None else user_text[:CONTENT_PREVIEW_CHARS]
        content = f"insight for {preview}"
        model = body.get("model")
        prompt_tokens = _words(body)
        completion_tokens = len(content.split())
        return {
            "id": f"chatcmpl-sim-{record_id}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model if isinstance(model, str) else "simulator",
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": "stop",
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def _take_worker(self, record_id: int) -> bool:
        """Wait for a free worker; False when the simulator stops first."""
        with self._lock:
            self._waiting += 1
            while self._in_flight >= self._workers and not self._stopping.is_set():
                self._slot_freed.wait()
            self._waiting -= 1
            if self._stopping.is_set():
                return False
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            self._update(record_id, started=time.time(), outcome=SERVING)
            return True

    def _free_worker(self) -> None:
        with self._lock:
            self._in_flight -= 1
            self._slot_freed.notify()

    def _hold(self, fault: _Fault, fault_changes: int) -> None:
        """Keep a hung request until its fault ends or changes, its hold is over, or stop."""
        now = time.monotonic()
        deadlines = [fault.until] if fault.until is not None else []
        if fault.hold_seconds is not None:
            deadlines.append(now + fault.hold_seconds)
        deadline = min(deadlines) if deadlines else None
        with self._lock:
            while self._fault_changes == fault_changes and not self._stopping.is_set():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return
                self._hang_released.wait(left)

    # --- records -------------------------------------------------------------

    def _record(self, received: float, job: str | None) -> int:
        with self._lock:
            record_id = next(self._ids)
            self._records[record_id] = RequestRecord(
                record_id, received, None, None, WAITING, None, job
            )
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
            return record_id

    def _update(self, record_id: int, **changes: Any) -> None:
        """Replace fields of a record; holds `_lock`. Forgotten records are skipped."""
        record = self._records.get(record_id)
        if record is not None:
            self._records[record_id] = dataclasses.replace(record, **changes)

    def _finish(self, record_id: int, outcome: str, status: int | None) -> None:
        with self._lock:
            self._update(record_id, ended=time.time(), outcome=outcome, status=status)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    workers: int = DEFAULT_WORKERS,
    latency_min: float = 0.0,
    latency_max: float | None = None,
    *,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve a gateway simulator until SIGINT or SIGTERM; call from the main thread.

    `announce` receives one line with the URL once listening (default: the log).
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        latency = (latency_min, latency_min if latency_max is None else latency_max)
        with GatewaySimulator(host, port, workers, latency) as simulator:
            line = (
                f"gateway simulator (development tool, not a gateway) at {simulator.url}"
                f" with {workers} workers; stats at {simulator.url}/_sim/stats"
            )
            (announce or logger.warning)(line)
            while not stop.wait(SIGNAL_POLL_INTERVAL):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _latency_option(
    context: click.Context, parameter: click.Parameter, value: str
) -> tuple[float, float]:
    try:
        return parse_latency(value)
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


@click.command(name="gateway-sim")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="Address to bind.")
@click.option(
    "--port",
    default=DEFAULT_PORT,
    show_default=True,
    type=click.IntRange(0, 65535),
    help="Port to listen on; 0 picks a free one.",
)
@click.option(
    "--workers",
    default=DEFAULT_WORKERS,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests served at once; the rest wait.",
)
@click.option(
    "--latency",
    default=CLI_DEFAULT_LATENCY,
    show_default=True,
    callback=_latency_option,
    help="Seconds per answer: '2', or a range such as '1-3'.",
)
def gateway_sim_command(host: str, port: int, workers: int, latency: tuple[float, float]) -> None:
    """Run a local gateway simulator (a development tool) until interrupted."""
    try:
        run(host, port, workers, latency[0], latency[1], announce=click.echo)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc}") from exc


def main(argv: Sequence[str] | None = None) -> int:
    """Run `gateway_sim_command` with these arguments; returns the exit status."""
    try:
        gateway_sim_command.main(
            args=None if argv is None else list(argv),
            prog_name="gateway-sim",
            standalone_mode=False,
        )
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.Abort:
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
