"""The gateway client, the only code that talks to the LLM gateway: one request per call, its
answer read for what it says (G1-G5). It decides nothing about jobs (no retries, no store, no
Prefect), and no secret reaches a message, a repr or a body excerpt (G5)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import email.utils
import functools
import json
import logging
import re
import ssl
import time
import urllib.parse
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import httpx

from queue_store import Failure, Redactor, Usage
from queue_store.errors import SettingsError
from queue_store.settings import GatewaySettings

logger = logging.getLogger(__name__)

EXCERPT_CHARS = 300  # characters of a response body kept on an error
ERROR_BODY_BYTES = 16 * 1024  # bytes of an error answer read for its excerpt
EXCERPT_SECONDS = 5.0  # reading an excerpt: the status says enough; a stalled body is no timeout
USER_AGENT = "insight-queue"
# Labels a call for the gateway's logs without a body field, which strict servers reject.
JOB_HEADER = "X-Insight-Job"
JOB_HEADER_SAFE = ":/@-_.~"  # left readable; everything else is percent-encoded
UNAVAILABLE_STATUSES = frozenset({502, 503, 504})  # a proxy's, while the model server is away
REFUSED_STATUSES = frozenset({401, 403})
RATE_LIMITED_STATUS = 429
_TOKEN_CHARACTERS = re.compile(r"[!-~]*")  # printable ASCII, no space
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|h|m|s)")


@functools.cache
def _tls_context() -> ssl.SSLContext:
    """One TLS context per process, shared by every call (it costs ~17 ms of CPU to build)."""
    return httpx.create_ssl_context()


class GatewayError(Exception):
    """Carries the HTTP `status`, a redacted body `excerpt` and the `retry_after` asked for."""

    failure: ClassVar[Failure] = Failure.REJECTED  # the store's verdict on the attempt

    def __init__(
        self,
        message: str,
        status: int | None = None,
        excerpt: str = "",
        retry_after: float | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.excerpt = excerpt
        self.retry_after = retry_after

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickling (Prefect states, process pools) keeps every field.
        return (type(self), (str(self), self.status, self.excerpt, self.retry_after))


class GatewayUnavailable(GatewayError):  # unreachable, a dropped connection, 502/503/504
    failure = Failure.UNAVAILABLE


class GatewayRateLimited(GatewayError):  # 429, or 503 with a wait asked for (G1)
    failure = Failure.RATE_LIMITED


class GatewayRefused(GatewayError):  # 401/403 or a redirect (G4): every call would fail alike
    failure = Failure.REFUSED


class GatewayTimeout(GatewayError):  # no complete answer within the call's deadline (G3)
    failure = Failure.TIMEOUT


class GatewayRequestFailed(GatewayError):  # not sent: our side is misconfigured
    failure = Failure.BUILD


class GatewayRejected(GatewayError):  # another 4xx/5xx, no completion text, or too large
    failure = Failure.REJECTED


@dataclasses.dataclass(frozen=True)
class Completion:
    content: str
    raw: dict[str, Any] = dataclasses.field(repr=False)
    elapsed_seconds: float
    size_bytes: int = 0
    status: int = 200

    @property
    def usage(self) -> Usage | None:
        """The tokens OpenAI's `usage` says the answer used; None if it does not say."""
        found = self.raw.get("usage")
        if not isinstance(found, dict):
            return None
        counts: list[Any] = [found.get("prompt_tokens"), found.get("completion_tokens")]
        if all(type(n) is int and 0 <= n < 2**53 for n in counts):  # bool and float are not
            return Usage(*counts)
        return None


def parse_retry_after(headers: Mapping[str, str], now: float | None = None) -> float | None:
    """Seconds the gateway asks us to wait, the longest any header names (G1); None if none does."""
    lowered = {k.lower(): v.strip() for k, v in headers.items()}
    ms = _plain_number(lowered.get("retry-after-ms", "x"))
    found = [None if ms is None else ms / 1000]
    for name in ("retry-after", "llm_provider-retry-after", "x-litellm-retry-after"):
        if name in lowered:
            found.append(_retry_after(lowered[name], lowered.get("date"), now))
    for name in ("x-ratelimit-reset-requests", "x-ratelimit-reset-tokens"):
        found.append(_duration(lowered.get(name, "")))
    seconds = [s for s in found if s is not None]
    return max(seconds) if seconds else None


def _retry_after(value: str, server_date: str | None, now: float | None) -> float | None:
    """Seconds, or an HTTP date read against the answer's own `Date`."""
    if (plain := _plain_number(value)) is not None:
        return plain
    try:
        when = email.utils.parsedate_to_datetime(value).timestamp()
    except (TypeError, ValueError, IndexError):
        return None
    reference = now if now is not None else time.time()
    if server_date:
        with contextlib.suppress(TypeError, ValueError, IndexError):
            reference = email.utils.parsedate_to_datetime(server_date).timestamp()
    return max(0.0, when - reference)


def _duration(text: str) -> float | None:
    if (plain := _plain_number(text)) is not None:
        return plain
    total, position = 0.0, 0
    for match in _DURATION_PART.finditer(text):
        if match.start() != position:
            return None
        value, unit = float(match.group(1)), match.group(2)
        total += value * {"ms": 0.001, "s": 1, "m": 60, "h": 3600}[unit]
        position = match.end()
    return total if position == len(text) and position else None


def _plain_number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if 0 <= value < float("inf") else None


class _Borrowed(httpx.AsyncBaseTransport):
    """A transport lent to every call (each has its own client): closing one leaves it open."""

    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self._transport = transport

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        return await self._transport.handle_async_request(request)

    async def aclose(self) -> None:
        """The lender closes it."""


class GatewayClient:
    """Shared by one event loop's tasks; each call has its own connection, closed if cancelled."""

    def __init__(
        self,
        gateway: GatewaySettings,
        *,
        redactor: Redactor,
        call_timeout: float | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`call_timeout`: the whole call's deadline (default the read timeout, G3)."""
        parts = urllib.parse.urlsplit(gateway.url)
        token = gateway.token.get_secret_value()
        if not _TOKEN_CHARACTERS.fullmatch(token):  # else httpx would quote it in an error
            raise SettingsError("AI_GATEWAY_TOKEN: expected printable ASCII without spaces")
        # Credentials never ride in the URL we log; they become the auth header.
        host = parts.hostname or ""
        netloc = f"[{host}]" if ":" in host else host
        if parts.port is not None:
            netloc += f":{parts.port}"
        base = urllib.parse.urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
        self.url = base + gateway.path
        self._headers = {"User-Agent": USER_AGENT, "Accept": "application/json"}
        self._auth: httpx.Auth | None = None
        if token:
            self._headers["Authorization"] = f"Bearer {token}"
        elif parts.username is not None:
            self._auth = httpx.BasicAuth(
                urllib.parse.unquote(parts.username), urllib.parse.unquote(parts.password or "")
            )
        self._model = gateway.model
        self._transport = _Borrowed(transport) if transport is not None else None
        self._redact = redactor
        self._max_bytes = gateway.max_answer_bytes
        self.call_timeout = call_timeout if call_timeout is not None else gateway.read_timeout
        # Connecting, sending and waiting for the pool are short; the answer may take minutes.
        self._timeout = httpx.Timeout(gateway.connect_timeout, read=self.call_timeout)

    def __repr__(self) -> str:
        return f"GatewayClient(url={self.url!r}, model={self._model!r})"

    async def complete(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        job: str | None = None,
        timeout: float | None = None,
        **extra: Any,
    ) -> Completion:
        """`job` labels the call in `JOB_HEADER`; `timeout` may shorten it; `extra`: body fields."""
        if isinstance(messages, str | bytes) or not messages:
            raise ValueError("messages: expected a non-empty sequence of message objects")
        body: dict[str, Any] = {
            "model": self._model,
            **extra,
            "messages": [dict(m) for m in messages],
        }
        headers = {}
        if job is not None:
            headers[JOB_HEADER] = urllib.parse.quote(job, safe=JOB_HEADER_SAFE)
        budget = self.call_timeout if timeout is None else min(timeout, self.call_timeout)
        progress = _Progress()
        started = time.monotonic()
        try:
            async with asyncio.timeout(budget):
                completion = await self._call(body, headers, progress)
        except TimeoutError:
            got = f"received {progress.received:,} bytes"
            got += f", HTTP {progress.status} headers" if progress.status else ""
            what = f"no complete answer within {budget:g} s ({got})"
            raise GatewayTimeout(f"POST {self.url}: {what}", progress.status) from None
        elapsed = time.monotonic() - started
        logger.debug("gateway answered HTTP %d in %.1f s", completion.status, elapsed)
        return dataclasses.replace(completion, elapsed_seconds=elapsed)

    async def _call(
        self, body: dict[str, Any], headers: dict[str, str], progress: _Progress
    ) -> Completion:
        async with httpx.AsyncClient(
            transport=self._transport,
            timeout=self._timeout,
            follow_redirects=False,
            verify=_tls_context(),
            auth=self._auth,
            headers=self._headers,
        ) as http:
            try:
                async with http.stream("POST", self.url, json=body, headers=headers) as response:
                    progress.status = response.status_code
                    if not 200 <= response.status_code < 300:
                        excerpt = await self._read_excerpt(response, progress)
                        raise self._status_error(response, excerpt)
                    data = await self._read_capped(response, progress)
            except httpx.TransportError as exc:
                raise self._transport_error(exc, progress) from exc
        return self._parse(data, progress.status or 200)

    async def _read_capped(self, response: httpx.Response, progress: _Progress) -> bytes:
        chunks: list[bytes] = []
        async for chunk in response.aiter_bytes():
            progress.received += len(chunk)
            if progress.received > self._max_bytes:
                what = f"answer larger than {self._max_bytes:,} bytes (AI_GATEWAY_MAX_ANSWER_BYTES)"
                raise GatewayRejected(f"POST {self.url}: {what}; cut off", response.status_code)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _read_excerpt(self, response: httpx.Response, progress: _Progress) -> str:
        head = b""
        cut = False
        try:
            async with asyncio.timeout(EXCERPT_SECONDS):
                async for chunk in response.aiter_bytes():
                    progress.received += len(chunk)
                    head += chunk
                    if len(head) >= ERROR_BODY_BYTES:
                        cut = True
                        break
        except (httpx.TransportError, TimeoutError):
            cut = True  # the status says enough; a cut-off excerpt is still an excerpt
        return self._excerpt(head, cut)

    def _excerpt(self, data: bytes, cut: bool = False) -> str:
        """The start of a body on one line, secrets removed; `cut`: more of it followed."""
        cut = cut or len(data) > ERROR_BODY_BYTES
        # Redact before cutting, so a secret straddling the cut goes whole.
        text = self._redact(data[:ERROR_BODY_BYTES].decode("utf-8", errors="replace"))
        words = text.split()
        if cut and words and not text[-1:].isspace():
            # What was read ends mid-body, perhaps mid-secret, where nothing could recognise it;
            # squeezing blank space may bring that end into the excerpt, so its last word goes.
            words.pop()
        return " ".join(words)[:EXCERPT_CHARS]

    def _status_error(self, response: httpx.Response, excerpt: str) -> GatewayError:
        status = response.status_code
        where, http = f"POST {self.url}", f"(HTTP {status})"
        tail = f": {excerpt}" if excerpt else ""
        retry = parse_retry_after(response.headers)
        if status == RATE_LIMITED_STATUS or (status == 503 and retry is not None):
            asked = f"; it asks us to wait {retry:g} s" if retry is not None else ""
            message = f"{where}: rate limited {http}{asked}{tail}"
            return GatewayRateLimited(message, status, excerpt, retry)
        error: type[GatewayError] = GatewayRefused
        if status in UNAVAILABLE_STATUSES:
            error, what = GatewayUnavailable, f"gateway unavailable {http}{tail}"
        elif status in REFUSED_STATUSES:
            what = f"the gateway refused our credentials {http}; check AI_GATEWAY_TOKEN{tail}"
        elif 300 <= status < 400:
            location = urllib.parse.urljoin(self.url, response.headers.get("location", ""))
            host = self._redact(urllib.parse.urlsplit(location).hostname or "?")
            what = f"the gateway redirected to host {host} {http}; "
            what += "set AI_GATEWAY_URL to the address that answers"
        else:
            error, what = GatewayRejected, f"gateway refused the request {http}{tail}"
        return error(f"{where}: {what}", status, excerpt)

    def _transport_error(self, exc: httpx.TransportError, progress: _Progress) -> GatewayError:
        where, detail = f"POST {self.url}", self._redact(str(exc) or type(exc).__name__)
        # Not even connected (ConnectTimeout is a TimeoutException) or sent: away, not slow.
        if isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout | httpx.ProxyError):
            return GatewayUnavailable(f"{where}: cannot connect: {detail}")
        if isinstance(exc, httpx.WriteTimeout | httpx.PoolTimeout):
            return GatewayUnavailable(f"{where}: the request could not be sent in time: {detail}")
        received = f"{progress.received:,} bytes"
        if isinstance(exc, httpx.TimeoutException):
            what = f"no answer in time ({type(exc).__name__}; received {received})"
            return GatewayTimeout(f"{where}: {what}: {detail}", progress.status)
        if isinstance(exc, httpx.NetworkError | httpx.RemoteProtocolError):
            if progress.status is None:
                return GatewayUnavailable(f"{where}: connection lost before an answer: {detail}")
            what = f"connection closed mid-answer (HTTP {progress.status}, {received} received)"
            return GatewayUnavailable(f"{where}: {what}: {detail}", progress.status)
        # Our side is misconfigured: the attempt is spent, and it says nothing of the gateway.
        return GatewayRequestFailed(f"{where}: request failed: {detail}")

    def _parse(self, data: bytes, status: int) -> Completion:
        try:
            parsed = json.loads(data)
        except (ValueError, UnicodeDecodeError):
            excerpt = self._excerpt(data)
            raise GatewayRejected(
                f"POST {self.url}: answer is not JSON (HTTP {status}): {excerpt}", status, excerpt
            ) from None
        try:
            content = parsed["choices"][0]["message"]["content"]
        except (KeyError, IndexError, TypeError):
            content = None
        if not isinstance(content, str) or not isinstance(parsed, dict):
            what = "answer has no choices[0].message.content text"
            raise GatewayRejected(f"POST {self.url}: {what} (HTTP {status})", status)
        return Completion(content, parsed, 0.0, len(data), status)


@dataclasses.dataclass
class _Progress:  # what a call has received so far, for the message of a timeout
    status: int | None = None
    received: int = 0
