"""The gateway client over `httpx.MockTransport`: every signal read for what it is (G1-G5, N2).

No network and no sockets: each test hands the client an async handler that
answers as a gateway would, and checks the completion or the error, its
`failure` (what the store is told), its message and what it kept of the body.
Deadlines are the client's own settings; nothing waits on a wall-clock fault.
"""

from __future__ import annotations

import asyncio
import base64
import json
import pickle
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import httpx
import pytest
from pydantic import SecretStr

from flows import gateway
from flows.gateway import (
    ERROR_BODY_BYTES,
    EXCERPT_CHARS,
    EXCERPT_SECONDS,
    JOB_HEADER,
    Completion,
    GatewayClient,
    GatewayError,
    GatewayRateLimited,
    GatewayRefused,
    GatewayRejected,
    GatewayRequestFailed,
    GatewayTimeout,
    GatewayUnavailable,
    parse_retry_after,
)
from queue_store import Failure, Settings, SettingsError, Usage
from tests.support.echo import echo_body, echo_forms
from tests.support.factories import gateway_client, settings_for
from tests.support.secrets import exposures

# Every character that has an escape of its own somewhere: JSON, URLs, base64.
TOKEN = 'sk-live/Q7+x=y&z%w"q\\<t>~9'
MESSAGES = [
    {"role": "system", "content": "You write short insights."},
    {"role": "user", "content": "sleep for user 42"},
]
URL = "http://gateway.test/v1/chat/completions"

T = TypeVar("T")
Handler = Callable[[httpx.Request], Coroutine[None, None, httpx.Response]]


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coroutine)


def settings(**overrides: Any) -> Settings:
    """Settings for these tests; `gateway_<name>` overrides the gateway's `<name>`."""
    gateway: dict[str, Any] = {
        "url": "http://gateway.test",
        "token": SecretStr(TOKEN),
        "model": "test-model",
    }
    for name in [n for n in overrides if n.startswith("gateway_")]:
        gateway[name.removeprefix("gateway_")] = overrides.pop(name)
    return settings_for(gateway=gateway, **overrides)


def answer(content: Any = "an insight", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}}],
        **extra,
    }


def client_for(handler: Handler, **overrides: Any) -> GatewayClient:
    return gateway_client(settings(**overrides), transport=httpx.MockTransport(handler))


async def complete(handler: Handler, **overrides: Any) -> Completion:
    return await client_for(handler, **overrides).complete(MESSAGES, job="sleep:2024-05")


def failure(handler: Handler, **overrides: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        run(complete(handler, **overrides))
    return caught.value


def responding(status: int, body: bytes | str = b"", **headers: str) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers=headers)

    return handler


def raising(exc_type: type[httpx.TransportError], message: str = "boom") -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


class Stream:
    """A response body served chunk by chunk, recording how far it was read and if closed."""

    def __init__(
        self,
        chunks: list[bytes],
        *,
        then: BaseException | None = None,
        forever: bool = False,
        every: float = 0.0,
    ) -> None:
        self.chunks = chunks
        self.then = then
        self.forever = forever
        self.every = every
        self.pulled = 0
        self.closed = asyncio.Event()

    async def __aiter__(self) -> AsyncIterator[bytes]:
        try:
            for chunk in self.chunks:
                self.pulled += 1
                yield chunk
                if self.every:
                    await asyncio.sleep(self.every)
            if self.then is not None:
                raise self.then
            while self.forever:
                if self.every:
                    self.pulled += 1
                    yield b" "
                    await asyncio.sleep(self.every)
                else:
                    await asyncio.Event().wait()  # never set: the answer never ends
        finally:
            self.closed.set()

    def handler(self, status: int = 200, **headers: str) -> Handler:
        async def handler(request: httpx.Request) -> httpx.Response:
            return httpx.Response(status, content=self.__aiter__(), headers=headers)

        return handler


# --- a completion and the request that asked for it ---------------------------------------


@pytest.mark.parametrize(
    ("usage", "expected"),
    [
        ({"prompt_tokens": 120, "completion_tokens": 45, "total_tokens": 165}, Usage(120, 45)),
        ({"prompt_tokens": 0, "completion_tokens": 0}, Usage(0, 0)),
        (None, None),
        ({}, None),
        ({"total_tokens": 9}, None),
        ({"prompt_tokens": 1, "completion_tokens": "45"}, None),
        ({"prompt_tokens": True, "completion_tokens": 1}, None),
        ({"prompt_tokens": 1.5, "completion_tokens": 1}, None),
        ({"prompt_tokens": -1, "completion_tokens": 1}, None),
        ({"prompt_tokens": 2**60, "completion_tokens": 1}, None),
        ("lots", None),
    ],
)
def test_an_answer_says_its_usage_or_it_is_unknown_never_zero(
    usage: Any, expected: Usage | None
) -> None:
    body = answer("ok") if usage is None else answer("ok", usage=usage)
    completion = Completion("ok", body, 0.1)
    assert completion.usage == expected


def test_an_answer_gives_its_text_json_size_and_time() -> None:
    seen: list[httpx.Request] = []
    payload = json.dumps(answer("sleep was steady", usage={"total_tokens": 9})).encode()

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, content=payload)

    async def go() -> Completion:
        client = client_for(handler)
        return await client.complete(MESSAGES, job="sleep:2024-05 Zoë", temperature=0.2)

    completion = run(go())
    assert completion.content == "sleep was steady"
    assert completion.raw["usage"] == {"total_tokens": 9}
    assert completion.size_bytes == len(payload)
    assert completion.status == 200
    assert completion.elapsed_seconds >= 0
    assert "choices" not in repr(completion)
    (request,) = seen
    assert (request.method, str(request.url)) == ("POST", URL)
    assert json.loads(request.content) == {
        "model": "test-model",
        "temperature": 0.2,
        "messages": MESSAGES,
    }
    assert request.headers["Authorization"] == f"Bearer {TOKEN}"
    assert request.headers[JOB_HEADER] == "sleep:2024-05%20Zo%C3%AB"
    assert request.headers["Accept"] == "application/json"


def test_an_empty_text_is_an_answer() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json=answer(""))

    assert run(complete(handler)).content == ""


def test_no_authorization_without_a_token() -> None:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    run(complete(handler, gateway_token=SecretStr("")))
    assert "Authorization" not in seen[0].headers


@pytest.mark.parametrize(
    ("base", "path", "expected"),
    [
        ("http://gateway.test", "/api/chat", "http://gateway.test/api/chat"),
        ("http://gateway.test/", "/api/chat", "http://gateway.test/api/chat"),
        ("https://gateway.test/llm/", "/v1/chat/completions",
         "https://gateway.test/llm/v1/chat/completions"),
        ("http://gateway.test:8765", "/v1/chat/completions",
         "http://gateway.test:8765/v1/chat/completions"),
        ("http://[::1]:8765", "/v1/chat/completions", "http://[::1]:8765/v1/chat/completions"),
    ],
)  # fmt: skip
def test_the_endpoint_is_the_base_url_plus_the_path(base: str, path: str, expected: str) -> None:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    run(complete(handler, gateway_url=base, gateway_path=path))
    assert str(seen[0].url) == expected


@pytest.mark.parametrize("messages", [[], "hello", b"hello"])
def test_messages_must_be_a_non_empty_sequence(messages: Any) -> None:
    client = client_for(responding(200))
    with pytest.raises(ValueError, match="messages"):
        run(client.complete(messages))


def test_a_token_with_a_control_character_is_refused_without_showing_it() -> None:
    with pytest.raises(SettingsError) as caught:
        gateway_client(settings(gateway_token=SecretStr("abcdef\nghijkl")))
    assert "AI_GATEWAY_TOKEN" in str(caught.value)
    assert "abcdef" not in str(caught.value) and "ghijkl" not in str(caught.value)


# --- every status, and what the store is told -------------------------------------------------

STATUS_TABLE = [
    # status, headers, error type, failure, words in the message
    (429, {}, GatewayRateLimited, Failure.RATE_LIMITED, "rate limited (HTTP 429)"),
    (429, {"Retry-After": "7"}, GatewayRateLimited, Failure.RATE_LIMITED, "wait 7 s"),
    (503, {"Retry-After": "3"}, GatewayRateLimited, Failure.RATE_LIMITED, "limited (HTTP 503)"),
    (503, {}, GatewayUnavailable, Failure.UNAVAILABLE, "gateway unavailable (HTTP 503)"),
    (502, {}, GatewayUnavailable, Failure.UNAVAILABLE, "gateway unavailable (HTTP 502)"),
    (504, {}, GatewayUnavailable, Failure.UNAVAILABLE, "gateway unavailable (HTTP 504)"),
    (502, {"Retry-After": "3"}, GatewayUnavailable, Failure.UNAVAILABLE, "HTTP 502"),
    (401, {}, GatewayRefused, Failure.REFUSED, "refused our credentials (HTTP 401)"),
    (403, {}, GatewayRefused, Failure.REFUSED, "refused our credentials (HTTP 403)"),
    (400, {}, GatewayRejected, Failure.REJECTED, "refused the request (HTTP 400)"),
    (404, {}, GatewayRejected, Failure.REJECTED, "HTTP 404"),
    (413, {}, GatewayRejected, Failure.REJECTED, "HTTP 413"),
    (422, {}, GatewayRejected, Failure.REJECTED, "HTTP 422"),
    (500, {}, GatewayRejected, Failure.REJECTED, "HTTP 500"),
    (501, {}, GatewayRejected, Failure.REJECTED, "HTTP 501"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("status", "headers", "error_type", "verdict", "words"),
    STATUS_TABLE,
    ids=[f"{row[0]}{'-retry-after' if row[1] else ''}" for row in STATUS_TABLE],
)
def test_each_status_is_read_for_what_it_is(
    status: int,
    headers: dict[str, str],
    error_type: type[GatewayError],
    verdict: Failure,
    words: str,
) -> None:
    error = failure(responding(status, '{"error": {"message": "nope"}}', **headers))
    assert type(error) is error_type
    assert error.failure is verdict
    assert error.status == status
    assert words in str(error)
    assert str(error).startswith(f"POST {URL}: ")
    assert "nope" in error.excerpt and "nope" in str(error)
    if verdict is Failure.REFUSED:
        assert "AI_GATEWAY_TOKEN" in str(error)


def test_a_rate_limit_carries_the_wait_asked_for() -> None:
    error = failure(responding(429, "slow down", **{"retry-after-ms": "1500"}))
    assert isinstance(error, GatewayRateLimited)
    assert error.retry_after == pytest.approx(1.5)
    assert "wait 1.5 s" in str(error)
    plain = failure(responding(429, "slow down"))
    assert isinstance(plain, GatewayRateLimited) and plain.retry_after is None
    assert "wait" not in str(plain)


@pytest.mark.parametrize(
    "body",
    [b"not json at all", b'{"choices": [', b"\xff\xfe\x00garbage", b""],
    ids=["text", "truncated", "binary", "empty"],
)
def test_an_answer_that_is_not_json_is_rejected(body: bytes) -> None:
    error = failure(responding(200, body))
    assert type(error) is GatewayRejected and error.failure is Failure.REJECTED
    assert error.status == 200
    assert "answer is not JSON (HTTP 200)" in str(error)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"choices": []},
        {"choices": [{}]},
        {"choices": [{"message": {}}]},
        {"choices": [{"message": {"content": None}}]},
        {"choices": [{"message": {"content": ["parts"]}}]},
        {"choices": "nope"},
        [answer()],
        "just a string",
        None,
    ],
)
def test_json_without_a_text_is_rejected(payload: Any) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=json.dumps(payload))

    error = failure(handler)
    assert type(error) is GatewayRejected
    assert "no choices[0].message.content text (HTTP 200)" in str(error)


def test_the_excerpt_is_the_start_of_the_body_on_one_line() -> None:
    error = failure(responding(500, "first\n\tsecond  " + "x" * 10_000))
    assert error.excerpt == ("first second " + "x" * EXCERPT_CHARS)[:EXCERPT_CHARS]
    assert len(str(error)) < EXCERPT_CHARS + 200


def test_an_error_body_is_read_only_as_far_as_its_excerpt_needs() -> None:
    stream = Stream([b"e" * 4096] * 1000)  # 4 MB
    error = failure(stream.handler(500))
    assert type(error) is GatewayRejected
    assert stream.pulled <= ERROR_BODY_BYTES // 4096 + 1
    assert stream.closed.is_set()


@pytest.mark.parametrize(
    ("status", "error_type", "headers"),
    [
        (429, GatewayRateLimited, {"Retry-After": "2"}),
        (401, GatewayRefused, {}),
        (503, GatewayUnavailable, {}),
    ],
)
def test_an_error_body_that_never_ends_still_gives_the_status_verdict(
    status: int,
    error_type: type[GatewayError],
    headers: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The status line is the signal; a stalled error body must not turn a
    # rate limit (attempt kept) into a timeout (attempt spent).
    assert EXCERPT_SECONDS < 60.0
    monkeypatch.setattr(gateway, "EXCERPT_SECONDS", 0.3)
    stream = Stream([b'{"error": "slow down", '], forever=True)
    started = time.monotonic()
    error = failure(stream.handler(status, **headers), gateway_read_timeout=60.0)
    assert type(error) is error_type, error
    assert error.status == status
    assert "slow down" in error.excerpt
    assert time.monotonic() - started < 0.3 + LATE
    assert stream.closed.is_set()
    if isinstance(error, GatewayRateLimited):
        assert error.retry_after == 2.0


# --- redirects: refused, naming only the host ---------------------------------------------------


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
def test_a_redirect_is_refused_naming_only_the_host(status: int) -> None:
    location = "https://alice:hunter22@moved.example:8443/private/path?key=abc123#frag"
    error = failure(responding(status, "moved", location=location))
    assert type(error) is GatewayRefused and error.failure is Failure.REFUSED
    assert error.status == status
    assert f"redirected to host moved.example (HTTP {status})" in str(error)
    assert "AI_GATEWAY_URL" in str(error)
    for hidden in ("alice", "hunter22", "private", "abc123", "frag", "8443"):
        assert hidden not in str(error), hidden


def test_a_relative_redirect_names_the_gateway_host() -> None:
    error = failure(responding(307, "", location="/v2/chat/completions"))
    assert "redirected to host gateway.test (HTTP 307)" in str(error)


def test_a_redirect_is_not_followed() -> None:
    seen: list[str] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(str(request.url))
        return httpx.Response(307, headers={"location": "http://gateway.test/elsewhere"})

    failure(handler)
    assert seen == [URL]


# --- the connection: refused, cut, slow -------------------------------------------------------


@pytest.mark.parametrize("exc_type", [httpx.ConnectError, httpx.ConnectTimeout, httpx.ProxyError])
def test_a_gateway_that_cannot_be_reached_is_unavailable(
    exc_type: type[httpx.TransportError],
) -> None:
    error = failure(raising(exc_type, "[Errno 111] Connection refused"))
    assert type(error) is GatewayUnavailable and error.failure is Failure.UNAVAILABLE
    assert error.status is None and error.excerpt == ""
    assert f"POST {URL}: cannot connect: [Errno 111] Connection refused" == str(error)
    assert isinstance(error.__cause__, exc_type)


@pytest.mark.parametrize("exc_type", [httpx.RemoteProtocolError, httpx.ReadError])
def test_a_connection_lost_before_an_answer_is_unavailable(
    exc_type: type[httpx.TransportError],
) -> None:
    error = failure(raising(exc_type, "Server disconnected without sending a response."))
    assert type(error) is GatewayUnavailable
    assert "connection lost before an answer" in str(error)


def test_an_answer_cut_mid_body_is_unavailable_with_the_bytes_received() -> None:
    cut = httpx.RemoteProtocolError("peer closed connection without sending complete message body")
    stream = Stream([b'{"choices": [', b'{"message": '], then=cut)
    error = failure(stream.handler(200))
    assert type(error) is GatewayUnavailable and error.failure is Failure.UNAVAILABLE
    assert error.status == 200
    assert "connection closed mid-answer (HTTP 200, 25 bytes received)" in str(error)


def test_an_httpx_read_timeout_is_a_timeout_with_the_bytes_received() -> None:
    stream = Stream([b"{" * 10], then=httpx.ReadTimeout("timed out"))
    error = failure(stream.handler(200))
    assert type(error) is GatewayTimeout and error.failure is Failure.TIMEOUT
    assert "ReadTimeout; received 10 bytes" in str(error)


def test_a_request_our_side_cannot_send_spends_the_attempt_as_our_failure() -> None:
    """Not the gateway's answer: no evidence it is up (the outage rules must not count it)."""
    error = failure(raising(httpx.UnsupportedProtocol, "Request URL has an unsupported protocol"))
    assert type(error) is GatewayRequestFailed and error.failure is Failure.BUILD
    assert "request failed" in str(error)


def test_a_request_the_gateway_would_not_take_in_time_is_unavailable() -> None:
    for kind in (httpx.WriteTimeout, httpx.PoolTimeout):
        error = failure(raising(kind, "timed out"))
        assert type(error) is GatewayUnavailable and error.failure is Failure.UNAVAILABLE


# --- one deadline for the whole call (G3) ----------------------------------------------------

BUDGET = 0.5  # seconds: AI_GATEWAY_READ_TIMEOUT in these tests
LATE = 5.0  # seconds past the deadline that would mean it was not kept


def timed_failure(handler: Handler, **overrides: Any) -> tuple[GatewayError, float]:
    started = time.monotonic()
    error = failure(handler, **{"gateway_read_timeout": BUDGET, **overrides})
    return error, time.monotonic() - started


def test_an_answer_that_never_ends_times_out_naming_the_bytes_received() -> None:
    stream = Stream([b'{"choices": ', b"[{"], forever=True)
    error, took = timed_failure(stream.handler(200))
    assert type(error) is GatewayTimeout and error.failure is Failure.TIMEOUT
    assert str(error) == (
        f"POST {URL}: no complete answer within {BUDGET:g} s (received 14 bytes, HTTP 200 headers)"
    )
    assert error.status == 200
    assert BUDGET <= took < BUDGET + LATE
    assert stream.closed.is_set()


def test_a_trickle_that_keeps_every_read_short_still_meets_the_one_deadline() -> None:
    # A byte every 20 ms: no single read waits long, only the whole call does.
    stream = Stream([b"{"], forever=True, every=0.02)
    error, took = timed_failure(stream.handler(200))
    assert type(error) is GatewayTimeout
    assert "no complete answer within 0.5 s (received " in str(error)
    assert stream.pulled >= 2
    assert f"received {stream.pulled:,} bytes" in str(error)
    assert BUDGET <= took < BUDGET + LATE


def test_a_gateway_that_never_answers_times_out_with_nothing_received() -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        await asyncio.Event().wait()
        raise AssertionError("unreachable")

    error, took = timed_failure(handler)
    assert type(error) is GatewayTimeout
    assert error.status is None
    assert str(error).endswith("(received 0 bytes)")
    assert BUDGET <= took < BUDGET + LATE


def test_a_shorter_timeout_for_one_call_wins_but_never_a_longer_one() -> None:
    stream = Stream([], forever=True)
    client = client_for(stream.handler(200), gateway_read_timeout=BUDGET)
    with pytest.raises(GatewayTimeout, match=r"within 0\.2 s"):
        run(client.complete(MESSAGES, timeout=0.2))
    with pytest.raises(GatewayTimeout, match=r"within 0\.5 s"):
        run(client.complete(MESSAGES, timeout=60))


def test_the_call_deadline_is_capped_by_the_claim_timeout_minus_the_margin() -> None:
    client = client_for(
        responding(200),
        gateway_read_timeout=2000.0,
        claim_timeout_seconds=900.0,
        lease_margin_seconds=30.0,
        lease_seconds=120.0,
    )
    assert client.call_timeout == 870.0


def test_cancelling_the_call_closes_the_answer_at_once() -> None:
    stream = Stream([b"{"], forever=True)

    async def go() -> None:
        client = client_for(stream.handler(200))
        call = asyncio.create_task(client.complete(MESSAGES))
        while stream.pulled == 0:
            await asyncio.sleep(0.01)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert stream.closed.is_set()

    run(go())


# --- the size cap (G3) ---------------------------------------------------------------------

CAP = 1024  # bytes: the smallest AI_GATEWAY_MAX_ANSWER_BYTES allowed


def test_an_answer_over_the_cap_is_cut_off_without_reading_the_rest() -> None:
    stream = Stream([b"x" * 512] * 100_000)  # 50 MB, never produced
    error = failure(stream.handler(200), gateway_max_answer_bytes=CAP)
    assert type(error) is GatewayRejected and error.failure is Failure.REJECTED
    assert str(error) == (
        f"POST {URL}: answer larger than 1,024 bytes (AI_GATEWAY_MAX_ANSWER_BYTES); cut off"
    )
    assert error.status == 200
    assert stream.pulled == 3  # the chunk that went over, and no more
    assert stream.closed.is_set()


def test_an_answer_of_exactly_the_cap_is_read() -> None:
    body = json.dumps(answer("")).encode()
    padded = body[:-1] + b" " * (CAP - len(body)) + b"}"
    assert len(padded) == CAP

    async def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=padded)

    assert run(complete(handler, gateway_max_answer_bytes=CAP)).size_bytes == CAP


def test_a_huge_body_that_is_not_json_is_cut_off_too() -> None:
    stream = Stream([b"\xff\xfe<not json>" * 100] * 1000)
    error = failure(stream.handler(200), gateway_max_answer_bytes=CAP)
    assert "larger than 1,024 bytes" in str(error) and "cut off" in str(error)


# --- Retry-After in every form (G1) ---------------------------------------------------------

SERVER_DATE = "Wed, 21 Oct 2015 07:28:00 GMT"


@pytest.mark.parametrize(
    ("headers", "seconds"),
    [
        ({"Retry-After": "30"}, 30.0),
        ({"Retry-After": "0"}, 0.0),
        ({"Retry-After": "1.5"}, 1.5),
        ({"retry-after": " 12 "}, 12.0),
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:30 GMT", "Date": SERVER_DATE}, 30.0),
        ({"Retry-After": "Wed, 21 Oct 2015 07:30:00 GMT", "date": SERVER_DATE}, 120.0),
        ({"Retry-After": "Wed, 21 Oct 2015 07:27:00 GMT", "Date": SERVER_DATE}, 0.0),
        ({"retry-after-ms": "1500"}, 1.5),
        ({"Retry-After-Ms": "20"}, 0.02),
        ({"llm_provider-retry-after": "12"}, 12.0),
        ({"x-litellm-retry-after": "4"}, 4.0),
        ({"x-ratelimit-reset-requests": "6m0s"}, 360.0),
        ({"x-ratelimit-reset-requests": "20ms"}, 0.02),
        ({"x-ratelimit-reset-requests": "1s"}, 1.0),
        ({"x-ratelimit-reset-requests": "1h2m3.5s"}, 3723.5),
        ({"x-ratelimit-reset-requests": "2.5"}, 2.5),
        ({"x-ratelimit-reset-tokens": "500ms"}, 0.5),
        ({"Retry-After": "2", "x-ratelimit-reset-requests": "6m0s", "retry-after-ms": "10"}, 360.0),
    ],
)
def test_parse_retry_after_reads_every_form(headers: dict[str, str], seconds: float) -> None:
    assert parse_retry_after(httpx.Headers(headers)) == pytest.approx(seconds)
    assert parse_retry_after(headers) == pytest.approx(seconds)


def test_an_http_date_without_the_answer_s_date_is_read_against_now() -> None:
    reference = 1445412480.0  # SERVER_DATE
    headers = {"Retry-After": "Wed, 21 Oct 2015 07:28:45 GMT"}
    assert parse_retry_after(headers, now=reference) == pytest.approx(45.0)


def test_an_unreadable_date_header_falls_back_to_now() -> None:
    headers = {"Retry-After": "Wed, 21 Oct 2015 07:28:45 GMT", "Date": "yesterday"}
    assert parse_retry_after(headers, now=1445412480.0) == pytest.approx(45.0)


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Retry-After": "soon"},
        {"Retry-After": ""},
        {"Retry-After": "-5"},
        {"Retry-After": "nan"},
        {"Retry-After": "inf"},
        {"Retry-After": "1e999"},
        {"Retry-After": "30, 40"},
        {"retry-after-ms": "-1"},
        {"retry-after-ms": "nan"},
        {"retry-after-ms": "inf"},
        {"llm_provider-retry-after": "later"},
        {"x-ratelimit-reset-requests": "6x"},
        {"x-ratelimit-reset-requests": "m"},
        {"x-ratelimit-reset-requests": "5 s"},
        {"x-ratelimit-reset-requests": "s5"},
        {"x-ratelimit-reset-requests": "-1s"},
        {"x-ratelimit-reset-requests": "inf"},
        {"x-ratelimit-reset-requests": "nan"},
        {"x-ratelimit-reset-requests": "infinity"},
        {"x-ratelimit-reset-tokens": ""},
    ],
)
def test_parse_retry_after_ignores_garbage(headers: dict[str, str]) -> None:
    assert parse_retry_after(headers) is None


# --- secrets never leak (G5) ------------------------------------------------------------------


def texts_of(error: GatewayError) -> str:
    copy = pickle.loads(pickle.dumps(error))
    return "\n".join(
        [str(error), repr(error), error.excerpt, repr(error.args), str(copy), copy.excerpt]
    )


def echoing(status: int, **headers: str) -> Handler:
    async def handler(request: httpx.Request) -> httpx.Response:
        authorization = request.headers["Authorization"]
        token = authorization.removeprefix("Bearer ")
        body = echo_body(token) + f" header: {authorization}"
        return httpx.Response(status, content=body, headers={"X-Echo": "yes", **headers})

    return handler


ECHOES = {
    "401": echoing(401),
    "403": echoing(403),
    "429": echoing(429, **{"Retry-After": "1"}),
    "400": echoing(400),
    "500": echoing(500),
    "502": echoing(502),
    "503": echoing(503),
    "307": echoing(307, location="http://moved.example/?t=" + TOKEN.replace('"', "")),
    "200-not-json": echoing(200),
}


@pytest.mark.parametrize("handler", list(ECHOES.values()), ids=list(ECHOES))
def test_an_echoed_token_in_any_form_never_reaches_an_error(handler: Handler) -> None:
    error = failure(handler)
    assert exposures(texts_of(error), TOKEN) == []
    assert "[redacted]" in error.excerpt or error.status == 307


@pytest.mark.parametrize("name", list(echo_forms(TOKEN)))
def test_each_echoed_form_alone_is_redacted(name: str) -> None:
    form = echo_forms(TOKEN)[name]
    error = failure(responding(500, f"bad key {form} given"))
    assert exposures(texts_of(error), TOKEN) == [], error.excerpt
    assert error.excerpt.startswith("bad key ") and "[redacted]" in error.excerpt


@pytest.mark.parametrize(
    "exc_type", [httpx.ConnectError, httpx.ReadError, httpx.ReadTimeout, httpx.UnsupportedProtocol]
)
def test_a_token_in_a_transport_error_never_reaches_an_error(
    exc_type: type[httpx.TransportError],
) -> None:
    error = failure(raising(exc_type, f"proxy said: Bearer {TOKEN} / {echo_body(TOKEN)}"))
    assert exposures(texts_of(error), TOKEN) == []


def test_a_token_straddling_the_excerpt_cut_goes_whole() -> None:
    body = "y" * (EXCERPT_CHARS - 8) + TOKEN + " and more"
    error = failure(responding(500, body))
    assert exposures(texts_of(error), TOKEN) == []


def test_a_token_straddling_the_read_limit_after_blank_space_goes_whole() -> None:
    # 16 kB of indentation, then the token across the end of what is read:
    # once blank space is squeezed, what was cut of it would sit in the excerpt.
    for split in (4, len(TOKEN) // 2, len(TOKEN) - 2):
        body = " " * (ERROR_BODY_BYTES - split) + TOKEN + " tail"
        for status in (500, 200):
            error = failure(responding(status, body))
            assert exposures(texts_of(error), TOKEN) == [], (split, status, error.excerpt)


# --- credentials in AI_GATEWAY_URL (G5) --------------------------------------------------------

USER, PASSWORD = "alice", "pa/ss:w0rd@x"
CREDENTIALED = f"http://{USER}:pa%2Fss%3Aw0rd%40x@gateway.test:8080/base"


def test_url_credentials_are_sent_as_basic_auth_and_never_shown() -> None:
    seen: list[httpx.Request] = []

    async def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    client = client_for(handler, gateway_url=CREDENTIALED, gateway_token=SecretStr(""))
    run(client.complete(MESSAGES))
    (request,) = seen
    expected = base64.b64encode(f"{USER}:{PASSWORD}".encode()).decode()
    assert request.headers["Authorization"] == f"Basic {expected}"
    assert str(request.url) == "http://gateway.test:8080/base/v1/chat/completions"
    assert client.url == "http://gateway.test:8080/base/v1/chat/completions"
    for shown in (client.url, repr(client), str(request.url)):
        assert exposures(shown, PASSWORD) == [] and USER not in shown


@pytest.mark.parametrize("status", [401, 500])
def test_url_credentials_echoed_back_are_redacted(status: int) -> None:
    async def handler(request: httpx.Request) -> httpx.Response:
        authorization = request.headers["Authorization"]
        body = f"{authorization} for {CREDENTIALED} {echo_body(PASSWORD)}"
        return httpx.Response(status, content=body)

    error = failure(handler, gateway_url=CREDENTIALED, gateway_token=SecretStr(""))
    text = texts_of(error)
    assert exposures(text, PASSWORD, f"{USER}:{PASSWORD}") == [], error.excerpt


def test_url_credentials_in_a_connect_error_are_redacted() -> None:
    handler = raising(httpx.ConnectError, f"cannot reach {CREDENTIALED}")
    error = failure(handler, gateway_url=CREDENTIALED, gateway_token=SecretStr(""))
    assert exposures(texts_of(error), PASSWORD) == []
    assert "alice" not in str(error)


def test_the_client_repr_and_url_hold_no_token() -> None:
    client = client_for(responding(200))
    assert exposures(repr(client) + client.url + repr(vars(client).get("url")), TOKEN) == []


# --- errors travel whole -------------------------------------------------------------------


@pytest.mark.parametrize(
    "error",
    [
        GatewayUnavailable("down", 503, "busy"),
        GatewayRateLimited("slow", 429, "later", 2.5),
        GatewayRefused("no", 401, "bad key"),
        GatewayTimeout("late", 200),
        GatewayRejected("odd", 500, "oops"),
    ],
)
def test_errors_survive_pickling(error: GatewayError) -> None:
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is type(error)
    assert (str(copy), copy.status, copy.excerpt, copy.failure) == (
        str(error),
        error.status,
        error.excerpt,
        error.failure,
    )
    if isinstance(error, GatewayRateLimited):
        assert isinstance(copy, GatewayRateLimited) and copy.retry_after == 2.5
