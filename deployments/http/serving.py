"""The HTTP API on uvicorn (`insight-queue api`), slow and oversized clients cheap."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
from typing import Any

import anyio.to_thread
import click
import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

from deployments import processes
from deployments.http import create_app
from deployments.http.credentials import Credentials
from deployments.http.middleware import MAX_HEADER_BYTES
from deployments.triggers import Triggers
from queue_store import Settings

# Store calls at once in the threadpool: as many as the store's connection pool holds.
STORE_THREADS = 10
# An idle connection is kept past the longest Retry-After, so a screen's next
# poll does not race the server closing its connection.
KEEP_ALIVE_SECONDS = 75
GRACEFUL_STOP_SECONDS = 5
HEADER_SECONDS = 10.0  # for a request's headers to arrive whole
MAX_CONNECTIONS = 1000  # past it, the longest-idle connections are closed
HEADERS_TOO_LARGE = b"request header fields larger than 16 KB"


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, and what it lacks: a deadline for a request's headers (also the
    next on a kept-alive connection), a 431, and past `MAX_CONNECTIONS` the longest idle closed."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_deadline: asyncio.TimerHandle | None = None
        self._idle_since: float | None = time.monotonic()
        self._error_status: int | None = None
        next_event = self.conn.next_event

        def guarded_next_event() -> Any:
            try:
                return next_event()
            except h11.RemoteProtocolError as exc:
                self._error_status = exc.error_status_hint
                raise

        self.conn.next_event = guarded_next_event  # type: ignore[method-assign]

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._await_headers()
        if len(self.connections) > MAX_CONNECTIONS:
            self._close_longest_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self._headers_arrived()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._idle_since = None
        if self._header_deadline is None and self.conn.their_state is h11.IDLE:
            self._await_headers()  # the first bytes of the next request on this connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE:
            self._headers_arrived()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._idle_since = time.monotonic()

    def send_400_response(self, msg: str) -> None:
        if self._error_status != 431:
            super().send_400_response(msg)
            return
        headers = [(b"content-type", b"text/plain; charset=utf-8"), (b"connection", b"close")]
        reason = b"Request Header Fields Too Large"
        event = h11.Response(status_code=431, headers=headers, reason=reason)
        for part in (event, h11.Data(data=HEADERS_TOO_LARGE), h11.EndOfMessage()):
            self.transport.write(self.conn.send(part) or b"")
        self.transport.close()

    def _await_headers(self) -> None:
        self._header_deadline = self.loop.call_later(HEADER_SECONDS, self._too_slow)

    def _headers_arrived(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
            self._header_deadline = None

    def _too_slow(self) -> None:
        self._header_deadline = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def _close_longest_idle(self) -> None:
        idle = [
            (c._idle_since, c)
            for c in self.connections
            if isinstance(c, GuardedH11Protocol) and c._idle_since is not None
        ]
        idle.sort(key=lambda pair: pair[0])
        for _, connection in idle[: len(self.connections) - MAX_CONNECTIONS]:
            connection.transport.close()


def app_from_env() -> FastAPI:
    """The app for uvicorn's workers, from the environment, logs redacted."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = STORE_THREADS
    settings = Settings()
    logging.basicConfig(level=logging.WARNING, format=processes.LOG_FORMAT)
    triggers = Triggers.open(settings)
    triggers.runtime.redact_logs()
    return create_app(triggers, Credentials.load(settings, create=False))


def serve_api(settings: Settings, host: str, port: int, workers: int, *, verbose: bool) -> None:
    """`insight-queue api`: until SIGTERM or SIGINT (uvicorn's)."""
    credentials = Credentials.load(settings)
    kept = "made now and kept" if credentials.made else "kept"
    click.echo(
        f"insight-queue API at http://{host}:{port}; page at /queue. Credentials not set in "
        f"AI_API_* are {kept} in {credentials.path} (this account only)"
    )
    processes.export_to_children(settings)
    # With one process, SIGHUP stops it like SIGTERM; uvicorn's supervisor of
    # several restarts its workers on SIGHUP, as it documents.
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    uvicorn.run(
        "deployments.http.serving:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        http=GuardedH11Protocol,
        log_config=None,
        # Each worker process sets uvicorn's loggers to this level itself.
        log_level="info" if verbose else "warning",
        access_log=verbose,
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
