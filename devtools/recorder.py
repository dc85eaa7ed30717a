"""A gateway-side recorder: a TCP proxy that times every connection through it.

A DEVELOPMENT TOOL for tests and benchmarks. Put it between a client and any
HTTP server (the gateway simulator, or a third-party OpenAI-compatible
server): the client talks to `recorder.url`, the recorder forwards bytes both
ways unchanged, and records for each client connection when it opened and
when it closed, with `time.monotonic()` (for arithmetic) and `time.time()`
(to line up with other logs). It knows nothing about HTTP, the store or the
gateway client, so what it reports is independent of the project's own
bookkeeping:

- `peak_in_flight`: the most connections open at once;
- `intervals()`: each connection's open and close times;
- `gaps()`: for connections in order of opening, the quiet time between the
  close of every earlier connection and the opening of the next (negative
  means they overlapped), and `min_gap`, their smallest.

A connection is open from when the recorder accepts it until the recorder
closes both sides. By default an end of stream from either side (the client
closing its socket, or the server closing after its answer) closes the other
side at once, after forwarding what was already received, so "the client
closed" reaches the server within milliseconds. With `half_close=True` the
end of stream is forwarded as a half-close instead, and the connection stays
open until both directions have ended. A reset or error on either side
aborts both at once.

A proxy has accepted a connection before it can try the server: when the
server refuses, the recorder resets the client's connection (the client sees
a reset, not a refusal) and records it with `closed_by == "upstream_refused"`.

One connection can carry several HTTP requests (keep-alive): the recorder
measures connections. The simulator closes every connection after one
answer; with other servers, send `Connection: close` or use a fresh client
connection per call to measure calls.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from devtools.intervals import gaps_between
from devtools.listener import ThreadedListener

logger = logging.getLogger(__name__)

CHUNK_BYTES = 64 * 1024  # bytes read from a side at a time
LISTEN_BACKLOG = 128

# Why a connection ended: which side ended first, and how.
CLIENT = "client"  # the client ended its side (end of stream)
UPSTREAM = "upstream"  # the server ended its side
CLIENT_RESET = "client_reset"  # the client's side failed (reset, broken pipe)
UPSTREAM_RESET = "upstream_reset"
UPSTREAM_REFUSED = "upstream_refused"  # the server could not be reached
STOPPED = "stopped"  # the recorder stopped while it was open


@dataclasses.dataclass(frozen=True)
class ConnectionInterval:
    """One client connection through the recorder.

    `opened`/`closed` are `time.monotonic()` seconds, `opened_at`/`closed_at`
    the same moments in `time.time()`; `closed` is None while it is open.
    `client_ended`/`upstream_ended` are when each side's end of stream (or
    failure) arrived, monotonic, None if it did not. `closed_by` says which
    side ended first and how (see the module's constants).
    """

    id: int
    opened: float
    opened_at: float
    closed: float | None = None
    closed_at: float | None = None
    closed_by: str | None = None
    client_ended: float | None = None
    upstream_ended: float | None = None
    bytes_from_client: int = 0
    bytes_from_upstream: int = 0

    @property
    def seconds(self) -> float | None:
        """How long it was open; None while it is."""
        return None if self.closed is None else self.closed - self.opened


@dataclasses.dataclass(frozen=True)
class RecorderSnapshot:
    count: int  # connections accepted so far
    in_flight: int  # connections open now
    peak_in_flight: int
    intervals: tuple[ConnectionInterval, ...]  # in order of opening
    gaps: tuple[float, ...]
    min_gap: float | None  # None with fewer than two connections


def gaps(intervals: Sequence[ConnectionInterval], now: float | None = None) -> tuple[float, ...]:
    """For intervals in order of opening, each one's opening minus the latest
    close among those opened before it; negative means they overlapped.

    A connection still open counts as closing at `now` (default: the current
    monotonic time), so a later one overlapping it gets a negative gap.
    """
    current = time.monotonic() if now is None else now
    ordered = sorted(intervals, key=lambda interval: (interval.opened, interval.id))
    return gaps_between(((interval.opened, interval.closed) for interval in ordered), current)


@dataclasses.dataclass(eq=False)
class _Pair:
    """A live connection: the client's side and, once connected, the server's."""

    interval: ConnectionInterval
    client: asyncio.StreamWriter
    upstream: asyncio.StreamWriter | None = None


class GatewayRecorder(ThreadedListener):
    """A recording TCP proxy in front of `upstream_host:upstream_port`.

    Start with `start()` or a `with` block; `stop()` closes every connection
    and joins the one thread it started.
    """

    what = "gateway recorder"

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        half_close: bool = False,
    ) -> None:
        super().__init__(host, port)
        self._upstream = (upstream_host, upstream_port)
        self._half_close = half_close

        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ids = itertools.count(1)
        self._intervals: dict[int, ConnectionInterval] = {}
        self._in_flight = 0
        self._peak = 0
        self._count = 0

        self._stop_requested: asyncio.Event | None = None
        self._pairs: dict[int, _Pair] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    # --- lifecycle ---------------------------------------------------------

    def _request_stop(self) -> None:
        if self._stop_requested is not None:
            self._stop_requested.set()

    async def _serve(self, sock: socket.socket) -> None:
        self._stop_requested = asyncio.Event()
        server = await asyncio.start_server(self._accepted, sock=sock, backlog=LISTEN_BACKLOG)
        self._mark_ready()
        await self._stop_requested.wait()
        server.close()
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    # --- observation ---------------------------------------------------------

    def snapshot(self) -> RecorderSnapshot:
        with self._lock:
            return self._snapshot_locked()

    def _snapshot_locked(self) -> RecorderSnapshot:
        intervals = tuple(self._intervals.values())
        found = gaps(intervals)
        return RecorderSnapshot(
            count=self._count,
            in_flight=self._in_flight,
            peak_in_flight=self._peak,
            intervals=intervals,
            gaps=found,
            min_gap=min(found, default=None),
        )

    def intervals(self) -> tuple[ConnectionInterval, ...]:
        with self._lock:
            return tuple(self._intervals.values())

    def gaps(self) -> tuple[float, ...]:
        return gaps(self.intervals())

    @property
    def min_gap(self) -> float | None:
        return min(self.gaps(), default=None)

    @property
    def peak_in_flight(self) -> int:
        with self._lock:
            return self._peak

    @property
    def in_flight(self) -> int:
        with self._lock:
            return self._in_flight

    @property
    def count(self) -> int:
        with self._lock:
            return self._count

    def reset(self) -> None:
        """Forget closed connections and the peak; open ones stay recorded."""
        with self._lock:
            self._intervals = {
                key: interval
                for key, interval in self._intervals.items()
                if interval.closed is None
            }
            self._count = len(self._intervals)
            self._peak = self._in_flight
            self._changed.notify_all()

    def wait_until(
        self, predicate: Callable[[RecorderSnapshot], bool], timeout: float, what: str = ""
    ) -> RecorderSnapshot:
        """Wait until `predicate(snapshot)` holds, woken by every connection
        opening or closing; TimeoutError if it does not within `timeout`."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                snapshot = self._snapshot_locked()
                if predicate(snapshot):
                    return snapshot
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(
                        f"gateway recorder: {what or 'condition'} not reached in {timeout} s "
                        f"({snapshot.count} connections, {snapshot.in_flight} open)"
                    )
                self._changed.wait(left)

    def wait_for_connections(self, count: int, timeout: float) -> RecorderSnapshot:
        """Wait until `count` connections have been accepted in all."""
        return self.wait_until(lambda s: s.count >= count, timeout, f"{count} connections")

    def wait_for_closed(self, count: int, timeout: float) -> RecorderSnapshot:
        """Wait until `count` connections have closed in all."""
        return self.wait_until(
            lambda s: sum(i.closed is not None for i in s.intervals) >= count,
            timeout,
            f"{count} closed connections",
        )

    def wait_until_idle(self, timeout: float) -> RecorderSnapshot:
        """Wait until no connection is open."""
        return self.wait_until(lambda s: s.in_flight == 0, timeout, "no open connection")

    # --- forwarding --------------------------------------------------------------

    def _update(self, key: int, **changes: Any) -> None:
        """Replace fields of an interval; holds `_lock`."""
        interval = self._intervals.get(key)
        if interval is not None:
            self._intervals[key] = dataclasses.replace(interval, **changes)

    async def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        with self._lock:
            key = next(self._ids)
            interval = ConnectionInterval(key, time.monotonic(), time.time())
            self._intervals[key] = interval
            self._count += 1
            self._in_flight += 1
            self._peak = max(self._peak, self._in_flight)
            self._changed.notify_all()
        pair = _Pair(interval, writer)
        self._pairs[key] = pair
        closed_by = STOPPED
        try:
            closed_by = await self._forward(key, pair, reader)
        finally:
            self._close_pair(key, pair, closed_by)
            self._pairs.pop(key, None)
            self._tasks.discard(task)

    async def _forward(self, key: int, pair: _Pair, client_reader: asyncio.StreamReader) -> str:
        try:
            upstream_reader, pair.upstream = await asyncio.open_connection(*self._upstream)
        except OSError:
            _reset(pair.client)
            return UPSTREAM_REFUSED
        ended: list[str] = []  # how each direction ended, in order
        up = asyncio.ensure_future(self._pump(key, client_reader, pair.upstream, CLIENT, ended))
        down = asyncio.ensure_future(self._pump(key, upstream_reader, pair.client, UPSTREAM, ended))
        try:
            done, _ = await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            for pump in done:
                pump.result()  # anything but the connection's own failure is a bug: raise it
            first = ended[0]
            if self._half_close and first in (CLIENT, UPSTREAM):
                for pump in (up, down):
                    await pump
                if ended[1] in (CLIENT_RESET, UPSTREAM_RESET):
                    return ended[1]
            return first
        finally:
            for pump in (up, down):
                pump.cancel()
            await asyncio.gather(up, down, return_exceptions=True)

    async def _pump(
        self,
        key: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        source: str,
        ended: list[str],
    ) -> None:
        """Copy one direction until its end of stream; appends how it ended."""
        ended.append(await self._copy(key, reader, writer, source))

    async def _copy(
        self,
        key: int,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        source: str,
    ) -> str:
        counter = "bytes_from_client" if source == CLIENT else "bytes_from_upstream"
        end_field = "client_ended" if source == CLIENT else "upstream_ended"
        target_reset = UPSTREAM_RESET if source == CLIENT else CLIENT_RESET
        source_reset = CLIENT_RESET if source == CLIENT else UPSTREAM_RESET
        total = 0
        while True:
            try:
                data = await reader.read(CHUNK_BYTES)
            except OSError:
                self._mark(key, end_field)
                return source_reset
            if not data:
                self._mark(key, end_field)
                if self._half_close and writer.can_write_eof():
                    with contextlib.suppress(OSError):
                        writer.write_eof()
                return source
            total += len(data)
            with self._lock:
                self._update(key, **{counter: total})
            try:
                writer.write(data)
                await writer.drain()
            except OSError:
                return target_reset

    def _mark(self, key: int, field: str) -> None:
        with self._lock:
            self._update(key, **{field: time.monotonic()})
            self._changed.notify_all()

    def _close_pair(self, key: int, pair: _Pair, closed_by: str) -> None:
        """Close both sides (abort them after a failure) and record the close."""
        writers = [pair.client] + ([] if pair.upstream is None else [pair.upstream])
        for writer in writers:
            if closed_by in (CLIENT, UPSTREAM):
                writer.close()  # what is already buffered is still delivered
            else:
                writer.transport.abort()
        with self._lock:
            self._update(key, closed=time.monotonic(), closed_at=time.time(), closed_by=closed_by)
            self._in_flight -= 1
            self._changed.notify_all()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close a connection with a reset, as near as a proxy can come to a refusal."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()
