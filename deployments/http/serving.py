"""`insight-queue api` and `token`: the HTTP API on uvicorn, slow and oversized clients cheap."""

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

from deployments.cli import LOG_FORMAT, command, settings_from
from deployments.http.app import create_app
from deployments.http.credentials import Credentials
from deployments.http.edges import MAX_HEADER_BYTES
from deployments.render import printable
from deployments.triggers import Triggers
from queue_store import Settings

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
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
        self._headers_arrived()
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
    logging.basicConfig(level=logging.WARNING, format=LOG_FORMAT)
    triggers = Triggers.open(settings)
    triggers.runtime.redact_logs()
    return create_app(triggers, Credentials.load(settings, create=False))


@command("api")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="address to bind")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="server processes (uvicorn's); one core serves about a few hundred polls a second",
)
def api_command(ctx: click.Context, host: str, port: int, workers: int) -> None:
    """Serve the HTTP API and the queue page until SIGTERM or SIGINT. Every route needs a
    credential; those not set are made once and kept in the data directory, as this prints."""
    settings = settings_from(ctx)
    verbose = bool(ctx.find_root().params.get("verbose"))
    credentials = Credentials.load(settings)
    kept = "made now and kept" if credentials.made else "kept"
    click.echo(
        f"insight-queue API at http://{host}:{port}; page at /queue. Credentials not set in "
        f"AI_API_* are {kept} in {credentials.path} (this account only)"
    )
    os.environ.update(settings.to_env())  # for uvicorn's worker processes
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


DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
MAX_TOKEN_SECONDS = 30 * 86400


def _duration(ctx: click.Context, param: click.Parameter, value: str) -> float:
    """A duration such as 30s, 15m, 1h or 2d (a bare number is seconds)."""
    text = value.strip().lower()
    unit = DURATION_UNITS.get(text[-1:])
    try:
        seconds = float(text[:-1] if unit else text) * (unit or 1)
    except ValueError:
        message = f"{value!r} is not a duration such as 30s, 15m, 1h or 2d"
        raise click.BadParameter(message) from None
    if not 0 < seconds <= MAX_TOKEN_SECONDS:
        raise click.BadParameter(f"{value!r}: between 1 s and {MAX_TOKEN_SECONDS // 86400} days")
    return seconds


@command("token")
@click.argument("user_id")
@click.option(
    "--ttl",
    default="1h",
    show_default=True,
    metavar="DURATION",
    callback=_duration,
    help="how long it holds",
)
def token_command(ctx: click.Context, user_id: str, ttl: float) -> None:
    """Print a screen's token for USER, on its last line (for tests and small deployments),
    signed with AI_API_SCREEN_SECRET or the secret `insight-queue api` keeps."""
    credentials = Credentials.load(settings_from(ctx))
    token = credentials.screens.issue(user_id, ttl)
    click.echo(f"a screen token for {printable(user_id)}, valid {ttl:g} s:", err=True)
    click.echo(token)
