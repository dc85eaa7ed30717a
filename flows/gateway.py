"""The gateway client: the only code that talks to the LLM gateway.

It sends one OpenAI-compatible chat-completions request per call and turns
every way that call can go wrong into one of a small tree of errors, so the
flows can decide with named predicates (`is_unavailable`, `is_timeout`, ...)
whether a failure means "the gateway is unreachable, pause and keep the
attempt" or "this attempt failed".

It must not decide anything about jobs: no retries, no backoff, no store
access, no Prefect. It must never let the bearer token reach a message, a repr
or a body excerpt.

Cancelling a call: httpx cannot interrupt a blocking read from another thread
(closing the client only makes the read fail once it wakes up). The flows run
`complete()` in a worker thread and *abandon* it when they stop waiting: they
call `close()` and move on. The abandoned thread ends at the latest when the
read timeout fires, which is never longer than one attempt may last
(`Settings.read_timeout`). If closing made its call fail, it raises
`GatewayAbandoned` rather than the misleading "connection lost" that the
closed socket produces, so an abandoned call is never mistaken for an outage.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from types import TracebackType
from typing import Any, NoReturn, Self

import httpx

from queue_store.errors import SettingsError
from queue_store.settings import Settings

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 300  # characters of a response body kept on an error
REDACTED = "[redacted]"
USER_AGENT = "insight-queue"
# Labels a call for the gateway's logs (and the simulator's records) without
# adding a body field, which strict OpenAI-compatible servers reject.
JOB_HEADER = "X-Insight-Job"
JOB_HEADER_SAFE = ":/@-_.~"  # left readable; everything else is percent-encoded

# Gateways and the proxies in front of them answer these while the model
# server is down, restarting or overloaded: an outage, not a bad request.
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})

_TOKEN_CHARACTERS = re.compile(r"[!-~]*")  # printable ASCII, no space


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process, shared by every client.

    Building one loads the CA bundle (about 17 ms of CPU), and the runner
    makes a client per job.
    """
    return httpx.create_ssl_context()


class GatewayError(Exception):
    """Base of every error the gateway client raises.

    `status` is the HTTP status when the gateway answered, else None;
    `excerpt` is the start of the answer's body (token removed), else "".
    """

    def __init__(self, message: str, status: int | None = None, excerpt: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.excerpt = excerpt

    def __reduce__(self) -> tuple[type[Self], tuple[str, int | None, str]]:
        # Prefect pickles a failed task's exception; the default reduction
        # would call __init__ with the message only and drop status/excerpt.
        return (type(self), (str(self), self.status, self.excerpt))


class GatewayUnavailable(GatewayError):
    """The gateway could not be reached or said it cannot serve right now.

    Connect errors, connections refused or dropped before an answer, and HTTP
    502/503/504. Such a failure should not spend a job's attempt.
    """


class GatewayTimeout(GatewayError):
    """The gateway accepted the call but did not answer within the read timeout."""


class GatewayRejected(GatewayError):
    """The gateway answered, but not with a usable completion.

    Any other 4xx/5xx status, a body that is not JSON, or JSON without
    `choices[0].message.content`. Retrying the same request will not help.
    """


class GatewayAbandoned(GatewayError):
    """The client was closed before or during the call; its outcome is discarded."""


def is_unavailable(exc: BaseException) -> bool:
    """True when the gateway is unreachable: pause, do not spend an attempt."""
    return isinstance(exc, GatewayUnavailable)


def is_timeout(exc: BaseException) -> bool:
    """True when the gateway took longer than the read timeout."""
    return isinstance(exc, GatewayTimeout)


def is_rejected(exc: BaseException) -> bool:
    """True when the gateway answered with something other than a completion."""
    return isinstance(exc, GatewayRejected)


def is_abandoned(exc: BaseException) -> bool:
    """True when the caller closed the client and no longer wants the outcome."""
    return isinstance(exc, GatewayAbandoned)


@dataclasses.dataclass(frozen=True)
class Completion:
    """A gateway's answer: the generated text, the whole JSON, and how long it took."""

    content: str
    raw: dict[str, Any] = dataclasses.field(repr=False)
    elapsed_seconds: float


class GatewayClient:
    """A synchronous client for one gateway, configured from `Settings`.

    Thread-safe: several threads may call `complete()` at once, and any thread
    may call `close()` (see the module docstring for what that does to a call
    in flight). Use it as a context manager or call `close()`.
    """

    def __init__(self, settings: Settings, *, transport: httpx.BaseTransport | None = None) -> None:
        # Fail at construction rather than on the first job, and without
        # echoing either value: the URL may carry credentials too.
        try:
            base = httpx.URL(settings.gateway_url)
        except httpx.InvalidURL:
            base = httpx.URL()
        if base.scheme not in ("http", "https") or not base.host:
            raise SettingsError("AI_GATEWAY_URL: expected an http:// or https:// URL with a host")
        token = settings.gateway_token.get()
        if not _TOKEN_CHARACTERS.fullmatch(token):
            # A control character would make httpx fail with the header, and
            # so the token, in its message.
            raise SettingsError("AI_GATEWAY_TOKEN: expected printable ASCII without spaces")
        self._url = httpx.URL(settings.gateway_url.rstrip("/") + settings.gateway_path)
        self._shown_url = str(self._url.copy_with(username=None, password=None))
        self._model = settings.gateway_model
        self._token = token
        self._closed = threading.Event()
        # A short connect/write/pool timeout and a long read timeout: the
        # gateway is either there within seconds or not at all, but one
        # generation may legitimately take many minutes.
        short = settings.gateway_connect_timeout
        timeout = httpx.Timeout(connect=short, read=settings.read_timeout, write=short, pool=short)
        self._http = httpx.Client(
            transport=transport,
            timeout=timeout,
            follow_redirects=False,
            verify=_tls_context(),
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
        )

    @property
    def url(self) -> str:
        """The endpoint's URL without any credentials, for logs."""
        return self._shown_url

    def __repr__(self) -> str:
        return f"GatewayClient(url={self._shown_url!r}, model={self._model!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        """Release the connections; a call still in flight ends as `GatewayAbandoned`."""
        self._closed.set()
        self._http.close()

    def complete(
        self, messages: Sequence[Mapping[str, Any]], *, job: str | None = None, **extra: Any
    ) -> Completion:
        """Send one chat-completions request and return the answer.

        `job` labels the call in the `X-Insight-Job` header (percent-encoded
        UTF-8). `extra` is merged into the JSON body (e.g. `temperature`, or
        `model` to override the configured one).
        Raises a `GatewayError` subclass for every failure of the call.
        """
        if isinstance(messages, str | bytes) or not messages:
            raise ValueError("messages: expected a non-empty sequence of message objects")
        if self._closed.is_set():
            raise GatewayAbandoned(f"gateway client for {self._shown_url} is closed")
        body: dict[str, Any] = {
            "model": self._model,
            **extra,
            "messages": [dict(m) for m in messages],
        }
        headers = {"Authorization": f"Bearer {self._token}"} if self._token else {}
        if job is not None:
            headers[JOB_HEADER] = urllib.parse.quote(job, safe=JOB_HEADER_SAFE)
        started = time.monotonic()
        try:
            response = self._http.post(self._url, json=body, headers=headers)
        except httpx.TransportError as exc:
            self._raise_transport_error(exc)
        except RuntimeError as exc:
            # httpx refuses to send on a client closed by another thread
            # between our check above and the send.
            if self._closed.is_set():
                raise GatewayAbandoned(f"gateway client for {self._shown_url} was closed") from exc
            raise
        content, raw = self._parse(response)
        elapsed = time.monotonic() - started
        logger.debug("gateway answered HTTP %d in %.1f s", response.status_code, elapsed)
        return Completion(content=content, raw=raw, elapsed_seconds=elapsed)

    def _raise_transport_error(self, exc: httpx.TransportError) -> NoReturn:
        where = f"POST {self._shown_url}"
        detail = self._redact(str(exc) or type(exc).__name__)
        if self._closed.is_set():
            raise GatewayAbandoned(f"{where}: abandoned, the client was closed") from exc
        # Order matters: ConnectTimeout is a TimeoutException, but a gateway
        # we cannot even connect to is an outage, not a slow answer.
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.ProxyError):
            raise GatewayUnavailable(f"{where}: cannot connect: {detail}") from exc
        if isinstance(exc, httpx.TimeoutException):
            kind = type(exc).__name__
            raise GatewayTimeout(f"{where}: no answer in time ({kind}): {detail}") from exc
        if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):
            raise GatewayUnavailable(
                f"{where}: connection lost before an answer: {detail}"
            ) from exc
        # Left over: our own side is misconfigured (unsupported scheme, a
        # protocol error while sending). Neither an outage nor the gateway's
        # verdict, so it is only the base error.
        raise GatewayError(f"{where}: request failed: {detail}") from exc

    def _parse(self, response: httpx.Response) -> tuple[str, dict[str, Any]]:
        status = response.status_code
        if status in UNAVAILABLE_STATUSES:
            raise self._answer_error(GatewayUnavailable, response, "gateway unavailable")
        if not 200 <= status < 300:
            raise self._answer_error(GatewayRejected, response, "gateway refused the request")
        try:
            parsed = response.json()
        except ValueError as exc:  # JSONDecodeError and UnicodeDecodeError
            raise self._answer_error(GatewayRejected, response, "answer is not JSON") from exc
        try:
            content = parsed["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str):
            raise self._answer_error(
                GatewayRejected, response, "answer has no choices[0].message.content text"
            )
        return content, parsed

    def _answer_error(
        self, kind: type[GatewayError], response: httpx.Response, why: str
    ) -> GatewayError:
        excerpt = self._excerpt(response)
        message = f"POST {self._shown_url}: {why} (HTTP {response.status_code})"
        return kind(f"{message}: {excerpt}" if excerpt else message, response.status_code, excerpt)

    def _excerpt(self, response: httpx.Response) -> str:
        # Redact before cutting, so a token straddling the cut is removed
        # whole; 4 bytes per character covers any UTF-8 text.
        head = response.content[: EXCERPT_CHARS * 4 + len(self._token.encode())]
        text = self._redact(head.decode("utf-8", errors="replace"))
        return text[:EXCERPT_CHARS].strip()

    def _redact(self, text: str) -> str:
        return text.replace(self._token, REDACTED) if self._token else text
