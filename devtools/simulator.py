"""A gateway simulator: a DEVELOPMENT TOOL that stands in for the LLM gateway.

It speaks the same OpenAI-compatible chat-completions protocol as the real
gateway, with the property that matters most to this project: a fixed number
of workers (4 by default), so requests beyond them wait in a backlog. It lets
a developer or a test watch what the queue does to a shared gateway (every
request is recorded with its times, and the peak number served at once) and
inject the failures the queue must survive.

It must never be mistaken for, or deployed as, a gateway: its answers are
canned text derived from the request, it has no authentication beyond an
optional fixed token, and anyone who can reach it can inject faults. It binds
to 127.0.0.1 unless told otherwise. It must not import the store or Prefect.

It is a Starlette app served by uvicorn (HTTP/1.1 through h11) on an event
loop in one background thread. Every answer carries `Connection: close`, so a
fault reaches the very next request instead of missing a pooled connection.

HTTP endpoints besides the chat-completions path:
    GET  /_sim/stats   {"workers", "latency", "in_flight", "waiting", "peak_in_flight",
                        "peak_occupancy", "min_occupancy_gap", "fault", "requests": [...]}
    POST /_sim/reset   forget the recorded requests and the peak; clear any fault
    POST /_sim/latency {"latency": 2 | [1, 3] | "1-3"}: seconds per answer from now on
    POST /_sim/fault   {"kind": ..., ...} as below; {"kind": "none"} clears

A fault is one JSON object (or the keyword arguments of `set_fault`):

    kind        status | hang | drop | close_mid_body | trickle | huge | huge_raw
                | echo_token | redirect | refuse | none
    requests    applies to this many matching requests, then ends
    seconds     ends after this long (optional; tests use `requests` or clear it)
    job         applies only to requests whose job label equals this text
    job_prefix  applies only to requests whose job label starts with this text

and, by kind:

    status      answer `status` (400-599, default 503) with an OpenAI-style
                error body and any extra `headers` ({"Retry-After": "30"}, ...)
    hang        hold the request on its worker until the client goes (not with
                finish_abandoned, below), the fault is set or cleared,
                `hold_seconds` pass, or the simulator stops; then answer
                normally (outcome "hung")
    drop        close the connection without a byte of answer
    close_mid_body  send 200 and a Content-Length, half the body, then close
    trickle     send 200, then the body one byte every `interval` seconds
                (default 2) until done, the client goes (not with
                finish_abandoned), or the fault changes (then the rest at once)
    huge        a valid completion whose content is `size` bytes (default
                50 MiB), streamed in chunks
    huge_raw    `size` bytes of non-JSON under a JSON content type
    echo_token  answer `status` (default 500) whose body echoes the bearer
                token received: plain, JSON-escaped with \\/, \\u00XX-escaped,
                URL-encoded (upper and lower hex), base64 of the token and of
                "user:<token>"; and the token in an `X-Echoed-Token` header
    redirect    answer `status` (301, 302, 303, 307 or 308; default 307) with
                `Location: location` (default another host)
    refuse      stop listening: connections are refused until the fault is
                cleared or replaced, or its `seconds` run out; then it listens
                again on the same port. Nothing listens while refusing, so
                refused attempts cannot be counted: `requests` and `job` are
                not accepted, and over HTTP `seconds` is required (the control
                endpoint is unreachable too, so nothing else could end it)

Faults other than refuse meet only the chat-completions path. `status`,
`drop`, `echo_token` and `redirect` are answered at the door, without a
worker; the others hold a worker like an answer does.

A request counts as in flight from when a worker takes it until its answer
has been completely written (handed to the kernel) or, unless workers finish
abandoned calls (below), the client has disconnected, whichever comes first;
its record's `ended` is that moment, and `disconnected` is when the server
saw the client go, if it did (recorded as soon as it is seen).

With `finish_abandoned=True` (`--finish-abandoned`) the workers are those of
a threaded gateway, whose threads go on with a call after its client has
gone: a request keeps the worker it took until its work is done, whatever
the client does, and only the simulator stopping ends it early. A normal
answer keeps its worker for its latency; a hang until its hold, a fault
change or its `seconds`; a trickle until its last byte would have gone at
its pace (the rest at once on a fault change); huge and huge_raw, written as
fast as the client reads, are done as soon as it has gone. A request still
in the backlog when its client leaves is served all the same once a worker
is free. A request worked to its end after its client went has the outcome
"abandoned" (the answer was not delivered), `ended` when its worker was
freed; answers whose client stayed are recorded as without the mode.

The records' (started, ended) spans are the gateway's occupancy, from the
simulator's own times rather than its counters or the connections:
`SimulatorStats.peak_occupancy` is the most that overlapped at any instant,
and `min_occupancy_gap` the smallest quiet time between the start of one and
the end of every earlier one (negative when they overlapped), as the
recorder measures connections.

A request body may carry `"sim_latency": <seconds>` to override the latency
for that request. A request is labelled in the records by its body's `"job"`
text, else its `X-Insight-Job` header (percent-decoded), else its first user
message.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import errno
import ipaddress
import itertools
import json
import logging
import random
import re
import signal
import socket
import threading
import time
import urllib.parse
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from types import FrameType
from typing import Any, Literal, Self, TypeVar, cast, get_args

import click
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from devtools.intervals import Span, gaps_between, peak_overlap
from devtools.listener import ThreadedListener

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765
DEFAULT_WORKERS = 4  # requests served at once, like the shared gateway
DEFAULT_PATH = "/v1/chat/completions"
JOB_HEADER = "X-Insight-Job"  # the gateway client's label for a call
DEFAULT_FAULT_STATUS = 503
DEFAULT_ECHO_STATUS = 500
DEFAULT_REDIRECT_STATUS = 307
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_REDIRECT_HOST = "http://gateway-moved.invalid"  # .invalid never resolves
DEFAULT_TRICKLE_INTERVAL = 2.0  # seconds between bytes of a trickled answer
DEFAULT_HUGE_BYTES = 50 * 1024 * 1024
HUGE_CHUNK_BYTES = 64 * 1024  # bytes per write of a huge answer
CLI_DEFAULT_LATENCY = "2"  # seconds; short enough to watch a demo drain
ECHO_USER = "user"  # the user name in the echoed "user:<token>" credential

MAX_BODY_BYTES = 10 * 1024 * 1024  # bytes; a chat request is a few kilobytes
MAX_RECORDS = 10_000  # requests kept; older ones are forgotten first
JOB_LABEL_CHARS = 200  # characters of a job hint or user message recorded
CONTENT_PREVIEW_CHARS = 80  # characters of the user message echoed in an answer
CALL_TIMEOUT = 10.0  # seconds to wait for the server thread to apply a change
GRACEFUL_SHUTDOWN_SECONDS = 5  # then uvicorn cancels what is still running
CLOSE_NOTICE_TIMEOUT = 5.0  # seconds to wait for a connection we closed to be gone
TICK_SECONDS = 0.1  # uvicorn's housekeeping tick (its date header)
RELISTEN_BIND_ATTEMPTS = 20  # tries to take the port back after a refusal
RELISTEN_BIND_PAUSE = 0.05  # seconds between those tries
LISTEN_BACKLOG = 128  # connections the kernel queues before accept
SERVER_NAME = "insight-queue-gateway-simulator"

FaultKind = Literal[
    "status",
    "hang",
    "drop",
    "close_mid_body",
    "trickle",
    "huge",
    "huge_raw",
    "echo_token",
    "redirect",
    "refuse",
]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

# The options each fault kind takes, besides kind, requests, seconds, job, job_prefix.
_KIND_OPTIONS: dict[str, frozenset[str]] = {
    "status": frozenset({"status", "headers"}),
    "hang": frozenset({"hold_seconds"}),
    "drop": frozenset(),
    "close_mid_body": frozenset(),
    "trickle": frozenset({"interval"}),
    "huge": frozenset({"size"}),
    "huge_raw": frozenset({"size"}),
    "echo_token": frozenset({"status"}),
    "redirect": frozenset({"status", "location"}),
    "refuse": frozenset(),
}
_COMMON_OPTIONS = frozenset({"kind", "requests", "seconds", "job", "job_prefix"})

# What became of a recorded request.
WAITING = "waiting"  # in the backlog, no worker yet
SERVING = "serving"  # a worker is on it
OK = "ok"
INJECTED_STATUS = "injected_status"
DROPPED = "dropped"
HUNG = "hung"  # held by a "hang" fault, then answered
CLOSED_MID_BODY = "closed_mid_body"
TRICKLED = "trickled"
HUGE = "huge"
HUGE_RAW = "huge_raw"
ECHOED_TOKEN = "echoed_token"
REDIRECTED = "redirected"
BAD_REQUEST = "bad_request"
UNAUTHORIZED = "unauthorized"
CLIENT_GONE = "client_gone"  # the client disconnected before its answer was written
ABANDONED = "abandoned"  # worked to the end, but its client had gone: not delivered
STOPPED = "stopped"  # the simulator stopped before answering

# Why a wait ended.
_STOP = "stop"
_GONE = "gone"
_SLOT = "slot"
_RELEASE = "release"
_TIMEOUT = "timeout"

_T = TypeVar("_T")


@dataclasses.dataclass(frozen=True)
class RequestRecord:
    """One chat-completions request as the simulator saw it.

    Times are `time.time()` wall-clock seconds, so other processes can line
    them up with their own logs. `started` is when a worker took the request
    (None if none did); `ended` is when its answer was completely written,
    the connection closed, or the client went (with `finish_abandoned`:
    when its worker was done with it); `disconnected` is when the
    server saw the client go (None if it did not); `status` is the HTTP
    status sent, None if none was.
    """

    id: int
    received: float
    started: float | None
    ended: float | None
    outcome: str
    status: int | None
    job: str | None
    disconnected: float | None = None

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class SimulatorStats:
    """The simulator's counters and records at one moment.

    `peak_in_flight` is counted as workers are taken; `peak_occupancy` and
    the occupancy gaps are worked out from the records' times instead.
    """

    workers: int
    latency: tuple[float, float]  # seconds per answer, minimum and maximum
    in_flight: int
    waiting: int
    peak_in_flight: int
    fault: dict[str, Any] | None
    requests: tuple[RequestRecord, ...]

    def occupancy(self) -> tuple[Span, ...]:
        """(started, ended) of each recorded request that took a worker, in
        order of start; ended is None while its worker is still on it."""
        spans = [(r.started, r.ended) for r in self.requests if r.started is not None]
        return tuple(sorted(spans, key=lambda span: span[0]))

    @property
    def peak_occupancy(self) -> int:
        """The most workers busy at once, from the records' own times."""
        return peak_overlap(self.occupancy())

    def occupancy_gaps(self, now: float | None = None) -> tuple[float, ...]:
        """For occupancy in order of start, the quiet time before each start
        since every earlier one ended (negative: they overlapped); one still
        running ends at `now` (default: the current `time.time()`)."""
        return gaps_between(self.occupancy(), time.time() if now is None else now)

    @property
    def min_occupancy_gap(self) -> float | None:
        """The smallest of `occupancy_gaps()`; None with fewer than two."""
        return min(self.occupancy_gaps(), default=None)

    def to_json(self) -> dict[str, Any]:
        return {
            "workers": self.workers,
            "latency": list(self.latency),
            "in_flight": self.in_flight,
            "waiting": self.waiting,
            "peak_in_flight": self.peak_in_flight,
            "peak_occupancy": self.peak_occupancy,
            "min_occupancy_gap": self.min_occupancy_gap,
            "fault": self.fault,
            "requests": [record.to_json() for record in self.requests],
        }


@dataclasses.dataclass(eq=False)
class _Fault:
    kind: FaultKind
    until: float | None  # time.monotonic() deadline
    requests_left: int | None
    job: str | None
    job_prefix: str | None
    status: int | None = None
    headers: tuple[tuple[str, str], ...] = ()
    hold_seconds: float | None = None
    interval: float = DEFAULT_TRICKLE_INTERVAL
    size: int = DEFAULT_HUGE_BYTES
    location: str | None = None

    def matches(self, job: str | None) -> bool:
        if self.job is not None and job != self.job:
            return False
        return self.job_prefix is None or (job is not None and job.startswith(self.job_prefix))

    def describe(self, now: float) -> dict[str, Any]:
        described: dict[str, Any] = {
            "kind": self.kind,
            "seconds_left": None if self.until is None else max(0.0, self.until - now),
            "requests_left": self.requests_left,
            "job": self.job,
            "job_prefix": self.job_prefix,
        }
        if self.kind in ("status", "echo_token", "redirect"):
            described["status"] = self.status
        if self.kind == "status":
            described["headers"] = dict(self.headers)
        if self.kind == "hang":
            described["hold_seconds"] = self.hold_seconds
        if self.kind == "trickle":
            described["interval"] = self.interval
        if self.kind in ("huge", "huge_raw"):
            described["size"] = self.size
        if self.kind == "redirect":
            described["location"] = self.location
        return described


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


def _number(spec: Mapping[str, Any], key: str, *, minimum: float, above: bool) -> float | None:
    value = spec.get(key)
    if value is None:
        return None
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not value < float("inf")
        or (value <= minimum if above else value < minimum)
    ):
        bound = f"above {minimum:g}" if above else f"{minimum:g} or more"
        raise ValueError(f"fault {key}: expected a number {bound}, got {value!r}")
    return float(value)


def _whole(spec: Mapping[str, Any], key: str, *, minimum: int) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"fault {key}: expected a whole number, at least {minimum}, got {value!r}")
    return value


def _text(spec: Mapping[str, Any], key: str) -> str | None:
    value = spec.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ValueError(f"fault {key}: expected non-empty text, got {value!r}")
    return value


def _header_pairs(value: object) -> tuple[tuple[str, str], ...]:
    if value is None:
        return ()
    if not isinstance(value, Mapping):
        raise ValueError("fault headers: expected an object of header names to values")
    pairs = []
    for name, text in value.items():
        if (
            not isinstance(name, str)
            or not name
            or any(not (c.isascii() and (c.isalnum() or c in "!#$%&'*+-.^_`|~")) for c in name)
        ):
            raise ValueError(f"fault headers: bad header name {name!r}")
        if not isinstance(text, str) or any(c in text for c in "\r\n\0"):
            raise ValueError(f"fault headers: bad value for {name}")
        try:
            text.encode("latin-1")
        except UnicodeEncodeError:
            raise ValueError(f"fault headers: value for {name} is not Latin-1") from None
        pairs.append((name, text))
    return tuple(pairs)


def parse_fault(spec: Mapping[str, Any], *, over_http: bool = False) -> _Fault | None:
    """A fault from its JSON form (see the module docstring); None for kind "none".

    Raises ValueError with a one-line reason for anything it does not accept.
    """
    kind = spec.get("kind", "none")
    if kind in (None, "none"):
        unknown = set(spec) - {"kind"}
        if unknown:
            raise ValueError(f"fault none: takes no options, got {', '.join(sorted(unknown))}")
        return None
    if kind not in FAULT_KINDS:
        raise ValueError(f"fault kind: expected one of {', '.join(FAULT_KINDS)}, got {kind!r}")
    unknown = set(spec) - _COMMON_OPTIONS - _KIND_OPTIONS[kind]
    if unknown:
        raise ValueError(f"fault {kind}: unknown option {', '.join(sorted(map(str, unknown)))}")
    seconds = _number(spec, "seconds", minimum=0, above=True)
    requests = _whole(spec, "requests", minimum=1)
    job, job_prefix = _text(spec, "job"), _text(spec, "job_prefix")
    if job is not None and job_prefix is not None:
        raise ValueError("fault: give job or job_prefix, not both")
    if kind == "refuse":
        if requests is not None or job is not None or job_prefix is not None:
            raise ValueError(
                "fault refuse: nothing listens while refusing, so it cannot count or "
                "filter requests; end it with seconds or by clearing it"
            )
        if over_http and seconds is None:
            raise ValueError("fault refuse: needs seconds when set over HTTP")
    until = None if seconds is None else time.monotonic() + seconds
    fault = _Fault(cast(FaultKind, kind), until, requests, job, job_prefix)

    status = _whole(spec, "status", minimum=0)
    if kind == "redirect":
        fault.status = DEFAULT_REDIRECT_STATUS if status is None else status
        if fault.status not in REDIRECT_STATUSES:
            raise ValueError(f"fault status: expected a redirect status, got {status!r}")
        fault.location = _text(spec, "location")
        if fault.location is not None and (
            any(c in fault.location for c in "\r\n\0") or not fault.location.isascii()
        ):
            raise ValueError("fault location: expected a URL in plain ASCII")
    elif kind in ("status", "echo_token"):
        default = DEFAULT_FAULT_STATUS if kind == "status" else DEFAULT_ECHO_STATUS
        fault.status = default if status is None else status
        if not 400 <= fault.status <= 599:
            raise ValueError(
                f"fault status: expected an HTTP error status, 400 to 599, got {status}"
            )
    fault.headers = _header_pairs(spec.get("headers"))
    fault.hold_seconds = _number(spec, "hold_seconds", minimum=0, above=False)
    interval = _number(spec, "interval", minimum=0, above=True)
    fault.interval = DEFAULT_TRICKLE_INTERVAL if interval is None else interval
    size = _whole(spec, "size", minimum=0)
    fault.size = DEFAULT_HUGE_BYTES if size is None else size
    return fault


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


def _json_bytes(payload: Any) -> bytes:
    return json.dumps(payload).encode()


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token_echo(token: str) -> bytes:
    """An error body carrying `token` in every encoding a careless log might keep."""
    url_upper = urllib.parse.quote(token, safe="")
    url_lower = re.sub(r"%[0-9A-F]{2}", lambda escape: escape.group(0).lower(), url_upper)
    utf16 = token.encode("utf-16-be")
    unicode_escaped = "".join(
        f"\\u{int.from_bytes(utf16[i : i + 2], 'big'):04x}" for i in range(0, len(utf16), 2)
    )
    plain = json.dumps(token, ensure_ascii=False)
    fields = [
        ("message", json.dumps(f"rejected bearer token {token}", ensure_ascii=False)),
        ("type", '"simulator_fault"'),
        ("token", plain),
        ("token_slash_escaped", plain.replace("/", "\\/")),
        ("token_unicode_escaped", f'"{unicode_escaped}"'),
        ("token_url_upper", json.dumps(url_upper)),
        ("token_url_lower", json.dumps(url_lower)),
        ("token_base64", json.dumps(base64.b64encode(token.encode()).decode())),
        (
            "credentials_base64",
            json.dumps(base64.b64encode(f"{ECHO_USER}:{token}".encode()).decode()),
        ),
    ]
    inner = ", ".join(f'"{name}": {value}' for name, value in fields)
    return ('{"error": {' + inner + "}}").encode()


def _pattern_chunks(pattern: bytes, size: int) -> Iterator[bytes]:
    """`size` bytes of `pattern` repeated, in chunks, never all in memory."""
    block = pattern * (HUGE_CHUNK_BYTES // len(pattern) + 1)
    block = block[:HUGE_CHUNK_BYTES]
    left = size
    while left > 0:
        chunk = block[: min(left, len(block))]
        left -= len(chunk)
        yield chunk


class _Config(uvicorn.Config):
    """uvicorn's settings, carrying the simulator's table of open connections."""

    def __init__(
        self, app: Any, connections: dict[tuple[str, int], _Connection], **kwargs: Any
    ) -> None:
        super().__init__(app, **kwargs)
        self.connections = connections


class _Connection(H11Protocol):
    """uvicorn's HTTP/1.1 connection, visible to the simulator's handler.

    ASGI has no way to close a connection without answering, or to know when
    an answer has left the process; this protocol lends the handler its
    transport (found by the client's address), notes when the connection was
    lost, and has the transport report "writable" only once its buffer is
    empty, so waiting for it means the answer was completely written.
    """

    lost_at: float | None = None  # time.time() when the connection was lost
    lost_error: Exception | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        transport.set_write_buffer_limits(high=0)
        if self.client is not None and isinstance(self.config, _Config):
            self.config.connections[self.client] = self

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost_at = time.time()
        self.lost_error = exc
        if self.client is not None and isinstance(self.config, _Config):
            connections = self.config.connections
            if connections.get(self.client) is self:
                del connections[self.client]
        super().connection_lost(exc)


class _Server(uvicorn.Server):
    """uvicorn's server, telling when it listens and stopping without a poll."""

    def __init__(self, config: uvicorn.Config, on_started: Callable[[], None]) -> None:
        super().__init__(config)
        self._on_started = on_started
        self._exit_requested: asyncio.Event | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self._exit_requested = asyncio.Event()
        await super().startup(sockets=sockets)
        self._on_started()

    async def main_loop(self) -> None:
        # uvicorn's own loop checks should_exit every tick; this one also
        # wakes at once when an exit is requested.
        assert self._exit_requested is not None
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._exit_requested.wait(), TICK_SECONDS)

    def request_exit(self) -> None:
        """Begin a graceful shutdown; call on the server's loop."""
        self.should_exit = True
        if self._exit_requested is not None:
            self._exit_requested.set()

    def protocol_factory(self) -> asyncio.Protocol:
        """A connection, built as uvicorn's own startup builds one."""
        return self.config.http_protocol_class(  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )


@dataclasses.dataclass(eq=False)
class _LoopState:
    """What lives on the server's event loop; touched only from it."""

    stopping: asyncio.Event
    release: asyncio.Event  # set, and replaced, at every fault change
    backlog: collections.deque[tuple[asyncio.Future[None], int]]
    refusal_timer: asyncio.TimerHandle | None = None
    background: set[asyncio.Task[None]] = dataclasses.field(default_factory=set)


@dataclasses.dataclass(eq=False)
class _Exchange:
    """One chat-completions request being served."""

    record_id: int
    connection: _Connection
    send: Send
    gone: asyncio.Event
    holds_worker: bool = False
    closed_by_server: bool = False
    status_sent: int | None = None


class GatewaySimulator(ThreadedListener):
    """A local stand-in for the LLM gateway, for development and tests only.

    `latency` is seconds per answer: a number, or a (minimum, maximum) range
    drawn uniformly. `token`, when given, is required as a bearer token.
    `finish_abandoned` makes its workers finish every call whatever the
    client does, as a threaded gateway does (see the module docstring).
    Start with `start()` or a `with` block; `stop()` ends the one thread it
    started.
    """

    what = "gateway simulator"

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
        finish_abandoned: bool = False,
    ) -> None:
        if workers < 1:
            raise ValueError("workers: expected at least 1")
        if not path.startswith("/") or path.startswith("/_sim/") or "{" in path:
            raise ValueError("path: expected an absolute path outside /_sim/")
        super().__init__(host, port)
        self._latency = _latency_range(latency)
        self._workers = workers
        self._path = path
        self._token = token
        self._random = random.Random(seed)
        self._finish_abandoned = finish_abandoned

        # Shared with other threads; every change notifies `_changed`.
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._in_flight = 0
        self._waiting = 0
        self._peak = 0
        self._ids = itertools.count(1)
        self._records: OrderedDict[int, RequestRecord] = OrderedDict()
        self._fault: _Fault | None = None
        self._listening = False

        self._connections: dict[tuple[str, int], _Connection] = {}
        self._app = self._build_app()
        self._server: _Server | None = None
        self._state: _LoopState | None = None

    # --- lifecycle ---------------------------------------------------------

    @property
    def workers(self) -> int:
        return self._workers

    def start(self) -> Self:
        """Listen, serving from a background thread; OSError if the port is taken."""
        super().start()
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

    async def _serve(self, sock: socket.socket) -> None:
        config = _Config(
            self._app,
            self._connections,
            host=self._host,
            port=self._port,
            http=_Connection,
            ws="none",
            lifespan="off",
            log_level="warning",
            log_config=None,
            proxy_headers=False,
            server_header=False,
            headers=[("server", SERVER_NAME)],
            backlog=LISTEN_BACKLOG,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
        self._server = _Server(config, on_started=self._mark_ready)
        self._state = _LoopState(
            stopping=asyncio.Event(),
            release=asyncio.Event(),
            backlog=collections.deque(),
        )
        with self._lock:
            self._listening = True
        await self._server.serve(sockets=[sock])

    def _served(self) -> None:
        with self._lock:
            self._listening = False
            self._changed.notify_all()

    def _request_stop(self) -> None:
        state, server = self._state, self._server
        if state is None or server is None:
            return
        state.stopping.set()
        if state.refusal_timer is not None:
            state.refusal_timer.cancel()
        server.request_exit()

    def _call_in_loop(self, make: Callable[[], Awaitable[_T]]) -> _T:
        """Run a coroutine on the server's loop from another thread and wait for it."""
        loop = self._loop
        assert loop is not None and self._state is not None
        if threading.current_thread() is self._thread:
            raise RuntimeError("call the simulator's control methods from another thread")

        async def call() -> _T:
            return await make()

        return asyncio.run_coroutine_threadsafe(call(), loop).result(CALL_TIMEOUT)

    def _running(self) -> bool:
        return self._thread is not None and self._state is not None and self._ready.is_set()

    # --- observation and control ------------------------------------------

    def stats(self) -> SimulatorStats:
        with self._lock:
            return self._stats_locked()

    def _stats_locked(self) -> SimulatorStats:
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

    def wait_for(
        self, predicate: Callable[[SimulatorStats], bool], timeout: float
    ) -> SimulatorStats:
        """Wait until `predicate(stats)` holds, woken by each change; TimeoutError if not."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                stats = self._stats_locked()
                if predicate(stats):
                    return stats
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"gateway simulator: condition not met in {timeout} s; "
                        f"in flight {stats.in_flight}, waiting {stats.waiting}, "
                        f"outcomes {[r.outcome for r in stats.requests[-10:]]}"
                    )
                self._changed.wait(left)

    def set_latency(self, latency: float | tuple[float, float]) -> None:
        """Seconds per answer for requests that start being served from now on."""
        checked = _latency_range(latency)
        with self._lock:
            self._latency = checked
            self._changed.notify_all()

    def reset(self) -> None:
        """Forget recorded requests and the peak, and clear any fault."""
        self._forget()
        self.clear_fault()

    def _forget(self) -> None:
        with self._lock:
            self._records.clear()
            self._peak = self._in_flight
            self._changed.notify_all()

    def set_fault(
        self,
        kind: FaultKind,
        *,
        requests: int | None = None,
        seconds: float | None = None,
        job: str | None = None,
        job_prefix: str | None = None,
        status: int | None = None,
        headers: Mapping[str, str] | None = None,
        hold_seconds: float | None = None,
        interval: float | None = None,
        size: int | None = None,
        location: str | None = None,
    ) -> None:
        """Inject a fault, replacing any current one (see the module docstring).

        Once this returns the fault is in force: a refusal has stopped
        listening, and requests held by the previous fault are released.
        """
        options = {
            "kind": kind,
            "requests": requests,
            "seconds": seconds,
            "job": job,
            "job_prefix": job_prefix,
            "status": status,
            "headers": None if headers is None else dict(headers),
            "hold_seconds": hold_seconds,
            "interval": interval,
            "size": size,
            "location": location,
        }
        fault = parse_fault({key: value for key, value in options.items() if value is not None})
        self._set(fault)

    def clear_fault(self) -> None:
        """End the current fault: release held requests, listen again if refusing."""
        self._set(None)

    def _set(self, fault: _Fault | None) -> None:
        if self._running():
            self._call_in_loop(lambda: self._apply_fault(fault))
            return
        if fault is not None and fault.kind == "refuse":
            raise RuntimeError("start the gateway simulator before refusing connections")
        with self._lock:
            self._fault = fault
            self._changed.notify_all()

    async def _apply_fault(self, fault: _Fault | None) -> None:
        """Put `fault` in force; on the server's loop."""
        state = self._state
        assert state is not None
        with self._lock:
            self._fault = fault
            self._changed.notify_all()
        # Any change of fault releases every held request, including those
        # caught by a fault that has since run out of requests.
        released, state.release = state.release, asyncio.Event()
        released.set()
        if state.refusal_timer is not None:
            state.refusal_timer.cancel()
            state.refusal_timer = None
        if fault is not None and fault.kind == "refuse":
            self._stop_listening()
            if fault.until is not None:
                state.refusal_timer = asyncio.get_running_loop().call_later(
                    max(0.0, fault.until - time.monotonic()), self._refusal_over, fault
                )
        else:
            await self._listen_again()
        logger.info("gateway simulator fault: %s", "cleared" if fault is None else fault.kind)

    def _current_fault(self) -> _Fault | None:
        """The fault in force, forgetting one whose time is up; holds `_lock`."""
        fault = self._fault
        if fault is not None and fault.until is not None and time.monotonic() >= fault.until:
            self._fault = fault = None
        return fault

    def _take_fault(self, job: str | None) -> tuple[_Fault | None, asyncio.Event]:
        """The fault this request meets, counted against its `requests`, and
        the event that releases a request it holds; on the server's loop."""
        state = self._state
        assert state is not None
        with self._lock:
            fault = self._current_fault()
            if fault is None or fault.kind == "refuse" or not fault.matches(job):
                return None, state.release
            if fault.requests_left is not None:
                fault.requests_left -= 1
                if fault.requests_left <= 0:
                    # Running out is not a release: the requests it caught
                    # stay held until the next fault change, their hold, or stop.
                    self._fault = None
                self._changed.notify_all()
            return fault, state.release

    # --- listening and refusing -------------------------------------------

    def _stop_listening(self) -> None:
        server = self._server
        assert server is not None
        for listener in server.servers:
            listener.close()  # accepted connections stay open
        with self._lock:
            self._listening = False
            self._changed.notify_all()
        logger.info("gateway simulator: refusing connections on port %d", self._port)

    async def _listen_again(self) -> None:
        server, state = self._server, self._state
        assert server is not None and state is not None
        with self._lock:
            if self._listening or state.stopping.is_set():
                return
        for attempt in range(RELISTEN_BIND_ATTEMPTS):
            try:
                sock = self._bind()
                break
            except OSError:
                if attempt + 1 == RELISTEN_BIND_ATTEMPTS:
                    logger.exception(
                        "gateway simulator: cannot listen on port %d again", self._port
                    )
                    return
                await asyncio.sleep(RELISTEN_BIND_PAUSE)
        listener = await asyncio.get_running_loop().create_server(
            server.protocol_factory, sock=sock, backlog=LISTEN_BACKLOG
        )
        server.servers.append(listener)  # closed by uvicorn's shutdown
        with self._lock:
            self._listening = True
            self._changed.notify_all()
        logger.info("gateway simulator listening again on %s", self.url)

    def _refusal_over(self, fault: _Fault) -> None:
        state = self._state
        assert state is not None
        state.refusal_timer = None
        with self._lock:
            if self._fault is fault:
                self._fault = None
            self._changed.notify_all()
        task = asyncio.get_running_loop().create_task(self._listen_again())
        state.background.add(task)
        task.add_done_callback(state.background.discard)

    # --- the HTTP app ---------------------------------------------------------

    def _build_app(self) -> Starlette:
        async def not_found(request: Request, exc: Exception) -> Response:
            status = exc.status_code if isinstance(exc, HTTPException) else 500
            return _json(
                status, _error_body(f"no {request.method} {request.url.path}", "not_found")
            )

        return Starlette(
            routes=[
                Route("/_sim/stats", self._http_stats, methods=["GET"]),
                Route("/_sim/reset", self._http_reset, methods=["POST"]),
                Route("/_sim/latency", self._http_latency, methods=["POST"]),
                Route("/_sim/fault", self._http_fault, methods=["POST"]),
                Route(self._path, _CompletionEndpoint(self)),
            ],
            exception_handlers={HTTPException: not_found},
        )

    async def _http_stats(self, request: Request) -> Response:
        return _json(200, self.stats().to_json())

    async def _http_reset(self, request: Request) -> Response:
        self._forget()
        await self._apply_fault(None)
        return _json(200, {"reset": True})

    async def _http_latency(self, request: Request) -> Response:
        try:
            spec = await _json_object(request)
            value = spec.get("latency")
            self.set_latency(
                parse_latency(value) if isinstance(value, str) else _latency_range(value)
            )
        except ValueError as exc:
            return _json(400, _error_body(str(exc), "invalid_request_error"))
        return _json(200, {"latency": list(self.stats().latency)})

    async def _http_fault(self, request: Request) -> Response:
        try:
            fault = parse_fault(await _json_object(request), over_http=True)
        except ValueError as exc:
            return _json(400, _error_body(str(exc), "invalid_request_error"))
        # Applied before answering, so the fault is in force once the caller
        # hears back; a refusal closes only the listener, not this connection.
        await self._apply_fault(fault)
        return _json(200, {"fault": None if fault is None else fault.describe(time.monotonic())})

    # --- serving a completion ---------------------------------------------------

    async def _completion(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = scope.get("client")
        connection = None if not client else self._connections.get((client[0], client[1]))
        if connection is None:  # not served by _Connection: cannot happen
            raise RuntimeError("gateway simulator: request on an unknown connection")
        if scope["method"] != "POST":
            await _send_json(send, 405, _error_body("use POST", "invalid_request_error"))
            return
        headers = {
            name.decode("latin-1").lower(): value.decode("latin-1")
            for name, value in scope["headers"]
        }
        received = time.time()
        raw = await self._read_body(receive, send, headers)
        if raw is None:
            return
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        job = self._job_label(body, headers)
        exchange = _Exchange(self._record(received, job), connection, send, asyncio.Event())
        watcher = asyncio.ensure_future(self._watch(exchange, receive))
        try:
            await self._serve_completion(exchange, body, headers, job)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
            if exchange.holds_worker:  # an exception on the way: never leak a worker
                self._finish(exchange, CLIENT_GONE, exchange.status_sent)

    async def _read_body(
        self, receive: Receive, send: Send, headers: Mapping[str, str]
    ) -> bytes | None:
        """The whole request body, or None after answering why not (or the client left).

        A body over the limit is read to its end and dropped before the 413:
        closing on a client still sending would reset the connection and
        lose the answer.
        """
        try:
            declared = int(headers.get("content-length") or 0)
        except ValueError:
            declared = -1
        if declared < 0:
            await _send_json(send, 400, _error_body("bad Content-Length", "invalid_request_error"))
            return None
        parts: list[bytes] = []
        size = 0
        too_large = declared > MAX_BODY_BYTES
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            too_large = too_large or size > MAX_BODY_BYTES
            if not too_large:
                parts.append(chunk)
            if not message.get("more_body", False):
                break
        if too_large:
            error = _error_body(f"body over {MAX_BODY_BYTES} bytes", "invalid_request_error")
            await _send_json(send, 413, error)
            return None
        return b"".join(parts)

    @staticmethod
    def _job_label(body: object, headers: Mapping[str, str]) -> str | None:
        if isinstance(body, dict) and isinstance(body.get("job"), str):
            return str(body["job"])
        header = headers.get(JOB_HEADER.lower())
        if header is not None:
            return urllib.parse.unquote(header)
        if isinstance(body, dict):
            return _first_user_text(body)
        return None

    async def _watch(self, exchange: _Exchange, receive: Receive) -> None:
        """Notice the client going: the request body is read, so the next
        message is the disconnect (or the end of the answer)."""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
        lost_at = exchange.connection.lost_at
        if lost_at is None:  # merely the answer completing
            return
        with self._lock:
            record = self._records.get(exchange.record_id)
            if not exchange.closed_by_server and record is not None and record.ended is None:
                # Shown at once: a worker may go on with the call long after.
                self._update(exchange.record_id, disconnected=lost_at)
                self._changed.notify_all()
        exchange.gone.set()

    async def _serve_completion(
        self,
        exchange: _Exchange,
        body: object,
        headers: Mapping[str, str],
        job: str | None,
    ) -> None:
        if self._token is not None and headers.get("authorization") != f"Bearer {self._token}":
            error = _error_body("bad bearer token", "authentication_error")
            await self._answer(exchange, 401, _json_bytes(error), UNAUTHORIZED)
            return
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            error = _error_body("body must be JSON with a messages list", "invalid_request_error")
            await self._answer(exchange, 400, _json_bytes(error), BAD_REQUEST)
            return

        fault, release = self._take_fault(job)
        kind = None if fault is None else fault.kind
        if fault is not None and await self._answered_at_once(exchange, fault, headers):
            return

        if not await self._take_worker(exchange):
            return
        answer = self._completion_body(exchange.record_id, body)
        if fault is None:
            why = await self._wait(exchange, self._latency_for(body))
            if await self._ended_early(exchange, why):
                return
            await self._answer(exchange, 200, _json_bytes(answer), OK)
        elif kind == "hang":
            deadlines = [] if fault.hold_seconds is None else [fault.hold_seconds]
            if fault.until is not None:
                deadlines.append(max(0.0, fault.until - time.monotonic()))
            why = await self._wait(exchange, min(deadlines, default=None), release=release)
            if await self._ended_early(exchange, why):
                return
            await self._answer(exchange, 200, _json_bytes(answer), HUNG)
        elif kind == "close_mid_body":
            payload = _json_bytes(answer)
            await self._start_answer(exchange, 200, len(payload))
            await exchange.send(
                {
                    "type": "http.response.body",
                    "body": payload[: len(payload) // 2],
                    "more_body": True,
                }
            )
            await self._close(exchange, CLOSED_MID_BODY)
        elif kind == "trickle":
            await self._trickle(exchange, _json_bytes(answer), fault.interval, release)
        elif kind == "huge":
            await self._stream_huge(exchange, answer, fault.size)
        else:
            await self._stream_chunks(
                exchange,
                fault.size,
                _pattern_chunks(b"\xff\xfe<not json> \x00{[", fault.size),
                HUGE_RAW,
            )

    async def _answered_at_once(
        self, exchange: _Exchange, fault: _Fault, headers: Mapping[str, str]
    ) -> bool:
        """Answer a fault that needs no worker (a drop, a status, an echo, a redirect)."""
        if fault.kind == "drop":
            # Closing without a byte of answer, as a crashed worker would.
            await self._close(exchange, DROPPED)
            return True
        if fault.kind not in ("status", "echo_token", "redirect"):
            return False
        assert fault.status is not None
        if fault.kind == "status":
            error = _error_body("simulated gateway fault", "simulator_fault", fault.status)
            extra = [
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in fault.headers
            ]
            await self._answer(exchange, fault.status, _json_bytes(error), INJECTED_STATUS, extra)
        elif fault.kind == "echo_token":
            authorization = headers.get("authorization", "")
            token = authorization[7:] if authorization[:7].lower() == "bearer " else authorization
            extra = [(b"x-echoed-token", token.encode("latin-1"))]
            await self._answer(exchange, fault.status, _token_echo(token), ECHOED_TOKEN, extra)
        else:
            location = fault.location or f"{DEFAULT_REDIRECT_HOST}{self._path}"
            moved = _error_body(f"moved to {location}", "redirect", fault.status)
            extra = [(b"location", location.encode("latin-1"))]
            await self._answer(exchange, fault.status, _json_bytes(moved), REDIRECTED, extra)
        return True

    async def _ended_early(self, exchange: _Exchange, why: str) -> bool:
        """Finish a request whose wait ended by stop or by its client going."""
        if why == _STOP:
            await self._close(exchange, STOPPED)
            return True
        if why == _GONE:
            self._finish(exchange, CLIENT_GONE, exchange.status_sent)
            return True
        return False

    async def _trickle(
        self, exchange: _Exchange, payload: bytes, interval: float, release: asyncio.Event
    ) -> None:
        await self._start_answer(exchange, 200, len(payload))
        position = 0
        while position < len(payload):
            released = release.is_set()
            step = len(payload) - position if released else 1
            chunk = payload[position : position + step]
            position += step
            if position == len(payload):
                await self._send_last(exchange, chunk, TRICKLED)
                return
            await exchange.send({"type": "http.response.body", "body": chunk, "more_body": True})
            why = await self._wait(exchange, interval, release=release)
            if await self._ended_early(exchange, why):
                return

    async def _stream_huge(self, exchange: _Exchange, answer: dict[str, Any], size: int) -> None:
        marker = "@@content@@"
        answer["choices"][0]["message"]["content"] = marker
        answer["usage"]["completion_tokens"] = size // 8
        answer["usage"]["total_tokens"] = answer["usage"]["prompt_tokens"] + size // 8
        prefix, suffix = (part.encode() for part in json.dumps(answer).split(marker, 1))
        chunks = itertools.chain([prefix], _pattern_chunks(b"insight ", size), [suffix])
        await self._stream_chunks(exchange, len(prefix) + size + len(suffix), chunks, HUGE)

    async def _stream_chunks(
        self, exchange: _Exchange, length: int, chunks: Iterator[bytes], outcome: str
    ) -> None:
        await self._start_answer(exchange, 200, length)
        for chunk in chunks:
            # uvicorn waits here while the previous chunk is still being written.
            await exchange.send({"type": "http.response.body", "body": chunk, "more_body": True})
            state = self._state
            assert state is not None
            if state.stopping.is_set():
                await self._close(exchange, STOPPED)
                return
            if exchange.connection.lost_at is not None:
                # Written as fast as the client reads: with no client, the
                # rest is done at once.
                self._finish(exchange, self._undelivered(exchange), exchange.status_sent)
                return
        await self._send_last(exchange, b"", outcome)

    async def _start_answer(
        self,
        exchange: _Exchange,
        status: int,
        length: int,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        exchange.status_sent = status
        await exchange.send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (b"content-length", str(length).encode()),
                    (b"connection", b"close"),
                    *extra,
                ],
            }
        )

    async def _answer(
        self,
        exchange: _Exchange,
        status: int,
        payload: bytes,
        outcome: str,
        extra: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """Send a whole answer; finished once it is written or the client went."""
        if exchange.connection.lost_at is not None:
            self._finish(exchange, self._undelivered(exchange), None)
            return
        await self._start_answer(exchange, status, len(payload), extra)
        await self._send_last(exchange, payload, outcome)

    async def _send_last(self, exchange: _Exchange, data: bytes, outcome: str) -> None:
        """Send the end of an answer; finished once it is written or the client went."""
        connection = exchange.connection
        # The transport reports "writable" only with an empty buffer, or once
        # the connection is lost.
        if connection.flow.write_paused:
            await connection.flow.drain()
        last = {"type": "http.response.body", "body": data, "more_body": False}
        # Writing is not paused, so uvicorn's send does not wait: the last
        # write and, when the kernel took it whole, the record of its end
        # happen under one hold of the lock. A client holding its whole
        # answer then never finds the request still in flight.
        with self._lock:
            await exchange.send(last)
            if self._written(connection) and connection.transport.get_write_buffer_size() == 0:
                self._finish_locked(exchange, outcome, exchange.status_sent)
                return
        if connection.flow.write_paused:
            await connection.flow.drain()
        outcome = outcome if self._written(connection) else self._undelivered(exchange)
        self._finish(exchange, outcome, exchange.status_sent)

    def _undelivered(self, exchange: _Exchange) -> str:
        """The outcome of an answer its client went away from."""
        return ABANDONED if self._finish_abandoned and exchange.holds_worker else CLIENT_GONE

    @staticmethod
    def _written(connection: _Connection) -> bool:
        """Whether uvicorn wrote the end of the answer and the connection
        was not lost to an error before the kernel had it all."""
        complete = connection.cycle is not None and connection.cycle.response_complete
        return complete and (connection.lost_at is None or connection.lost_error is None)

    async def _close(self, exchange: _Exchange, outcome: str) -> None:
        """Close the connection where it stands, and wait until it is gone."""
        exchange.closed_by_server = True
        exchange.connection.transport.close()  # writes what is buffered first
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(exchange.gone.wait(), CLOSE_NOTICE_TIMEOUT)
        self._finish(exchange, outcome, exchange.status_sent)

    async def _wait(
        self,
        exchange: _Exchange,
        timeout: float | None,
        *,
        release: asyncio.Event | None = None,
        slot: asyncio.Future[None] | None = None,
    ) -> str:
        """Wait for the first of: stop, the client going (unless workers
        finish abandoned calls), a worker slot, a release, or `timeout`
        seconds; says which (in that order of priority)."""
        state = self._state
        assert state is not None
        helpers: dict[asyncio.Future[Any], str] = {
            asyncio.ensure_future(state.stopping.wait()): _STOP,
        }
        if not self._finish_abandoned:
            helpers[asyncio.ensure_future(exchange.gone.wait())] = _GONE
        if release is not None:
            helpers[asyncio.ensure_future(release.wait())] = _RELEASE
        waits: dict[asyncio.Future[Any], str] = dict(helpers)
        if slot is not None:
            waits[slot] = _SLOT
        try:
            done, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for helper in helpers:
                helper.cancel()
        reasons = {waits[future] for future in done}
        for reason in (_STOP, _GONE, _SLOT, _RELEASE):
            if reason in reasons:
                return reason
        return _TIMEOUT

    async def _take_worker(self, exchange: _Exchange) -> bool:
        """Wait for a free worker, first come first served; False (and the
        request finished) when the simulator stops first, or the client goes
        unless workers finish abandoned calls."""
        state = self._state
        assert state is not None
        with self._lock:
            if self._in_flight < self._workers and not state.backlog:
                self._in_flight += 1
                self._peak = max(self._peak, self._in_flight)
                self._update(exchange.record_id, started=time.time(), outcome=SERVING)
                self._changed.notify_all()
                exchange.holds_worker = True
                return True
            slot: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            state.backlog.append((slot, exchange.record_id))
            self._waiting += 1
            self._changed.notify_all()
        why = await self._wait(exchange, None, slot=slot)
        handed = slot.done() and not slot.cancelled()
        if not handed:
            slot.cancel()
            with contextlib.suppress(ValueError):
                state.backlog.remove((slot, exchange.record_id))
        with self._lock:
            self._waiting -= 1
            self._changed.notify_all()
        exchange.holds_worker = handed
        if why == _SLOT:
            return True
        await self._ended_early(exchange, why)  # frees the slot if it was handed over
        return False

    def _finish(self, exchange: _Exchange, outcome: str, status: int | None) -> None:
        """Record the end of a request and free its worker, in one step."""
        with self._lock:
            self._finish_locked(exchange, outcome, status)

    def _finish_locked(self, exchange: _Exchange, outcome: str, status: int | None) -> None:
        """`_finish`, holding `_lock`."""
        connection = exchange.connection
        self._update(
            exchange.record_id,
            ended=time.time(),
            outcome=outcome,
            status=status,
            disconnected=None if exchange.closed_by_server else connection.lost_at,
        )
        if exchange.holds_worker:
            exchange.holds_worker = False
            self._hand_over_worker()
        self._changed.notify_all()

    def _hand_over_worker(self) -> None:
        """Give a freed worker to the longest waiting request; holds `_lock`."""
        state = self._state
        assert state is not None
        while state.backlog:
            slot, record_id = state.backlog.popleft()
            if not slot.done():
                slot.set_result(None)
                self._update(record_id, started=time.time(), outcome=SERVING)
                return
        self._in_flight -= 1

    def _latency_for(self, body: Mapping[str, Any]) -> float:
        override = body.get("sim_latency")
        if isinstance(override, int | float) and not isinstance(override, bool):
            return max(0.0, float(override))
        with self._lock:
            low, high = self._latency
            return low if low == high else self._random.uniform(low, high)

    @staticmethod
    def _completion_body(record_id: int, body: Mapping[str, Any]) -> dict[str, Any]:
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

    # --- records -------------------------------------------------------------

    def _record(self, received: float, job: str | None) -> int:
        with self._lock:
            record_id = next(self._ids)
            label = None if job is None else job[:JOB_LABEL_CHARS]
            self._records[record_id] = RequestRecord(
                record_id, received, None, None, WAITING, None, label
            )
            while len(self._records) > MAX_RECORDS:
                self._records.popitem(last=False)
            self._changed.notify_all()
            return record_id

    def _update(self, record_id: int, **changes: Any) -> None:
        """Replace fields of a record; holds `_lock`. Forgotten records are skipped."""
        record = self._records.get(record_id)
        if record is not None:
            self._records[record_id] = dataclasses.replace(record, **changes)


class _CompletionEndpoint:
    """The chat-completions path as a plain ASGI app (Starlette routes it as one)."""

    def __init__(self, simulator: GatewaySimulator) -> None:
        self._simulator = simulator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self._simulator._completion(scope, receive, send)


def _json(status: int, payload: Any) -> JSONResponse:
    return JSONResponse(payload, status_code=status, headers={"connection": "close"})


async def _send_json(send: Send, status: int, payload: Any) -> None:
    data = _json_bytes(payload)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


async def _json_object(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        spec = json.loads(raw or b"{}")
    except ValueError:
        raise ValueError("expected a JSON object") from None
    if not isinstance(spec, dict):
        raise ValueError("expected a JSON object")
    return spec


# --- the command line ------------------------------------------------------------

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    workers: int = DEFAULT_WORKERS,
    latency_min: float = 0.0,
    latency_max: float | None = None,
    *,
    finish_abandoned: bool = False,
    announce: Callable[[str], None] | None = None,
) -> None:
    """Serve a gateway simulator until SIGINT, SIGTERM or SIGHUP; call from the main thread.

    `finish_abandoned` is `GatewaySimulator`'s. `announce` receives one line
    with the URL once listening (default: the log).
    Raises OSError when the port cannot be had.
    """
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS}
    try:
        latency = (latency_min, latency_min if latency_max is None else latency_max)
        with GatewaySimulator(
            host, port, workers, latency, finish_abandoned=finish_abandoned
        ) as simulator:
            line = (
                f"gateway simulator (development tool, not a gateway) at {simulator.url}"
                f" with {workers} workers; stats at {simulator.url}/_sim/stats"
            )
            (announce or logger.warning)(line)
            stop.wait()  # a signal handler runs in this thread and sets it
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
@click.option(
    "--finish-abandoned",
    is_flag=True,
    help="Workers finish every call even when its client has gone, as a threaded gateway does.",
)
def gateway_sim_command(
    host: str, port: int, workers: int, latency: tuple[float, float], finish_abandoned: bool
) -> None:
    """Run a local gateway simulator (a development tool) until interrupted."""
    try:
        run(
            host,
            port,
            workers,
            latency[0],
            latency[1],
            finish_abandoned=finish_abandoned,
            announce=click.echo,
        )
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise click.ClickException(
                f"cannot listen on {host}:{port}: the port is taken (is another gateway "
                "simulator running?); pick another with --port, or --port 0 for any free one"
            ) from exc
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
