"""Unit tests of the gateway client against `httpx.MockTransport`: no network."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from flows.gateway import (
    EXCERPT_CHARS,
    JOB_HEADER,
    Completion,
    GatewayAbandoned,
    GatewayClient,
    GatewayError,
    GatewayRejected,
    GatewayTimeout,
    GatewayUnavailable,
    is_abandoned,
    is_rejected,
    is_timeout,
    is_unavailable,
)
from queue_store.errors import SettingsError
from queue_store.settings import Secret, Settings

TOKEN = "sk-test-7f3a9c0d1e2b4a5f"
MESSAGES = [
    {"role": "system", "content": "You write short insights."},
    {"role": "user", "content": "sleep for user 42"},
]

Handler = Callable[[httpx.Request], httpx.Response]


def make_settings(**overrides: Any) -> Settings:
    values: dict[str, Any] = {
        "gateway_url": "http://gateway.test",
        "gateway_token": Secret(TOKEN),
        "gateway_model": "test-model",
    }
    values.update(overrides)
    return Settings(**values)


def answer(content: Any = "an insight", **extra: Any) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": "test-model",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": content},
                "finish_reason": "stop",
            }
        ],
        **extra,
    }


def client_for(handler: Handler, **overrides: Any) -> GatewayClient:
    return GatewayClient(make_settings(**overrides), transport=httpx.MockTransport(handler))


def call(handler: Handler, **overrides: Any) -> Completion:
    with client_for(handler, **overrides) as client:
        return client.complete(MESSAGES)


def failure(handler: Handler, **overrides: Any) -> GatewayError:
    with pytest.raises(GatewayError) as caught:
        call(handler, **overrides)
    return caught.value


def raising(exc_type: type[httpx.TransportError], message: str = "boom") -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        raise exc_type(message, request=request)

    return handler


def responding(status: int, body: bytes | str = b"", **headers: str) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(status, content=body, headers=headers)

    return handler


# --- success ---------------------------------------------------------------


def test_success_returns_content_raw_json_and_elapsed_time() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer("sleep was steady", usage={"total_tokens": 9}))

    with client_for(handler) as client:
        completion = client.complete(MESSAGES, temperature=0.2)

    assert completion.content == "sleep was steady"
    assert completion.raw["usage"] == {"total_tokens": 9}
    assert completion.elapsed_seconds >= 0
    (request,) = seen
    assert request.method == "POST"
    assert str(request.url) == "http://gateway.test/v1/chat/completions"
    assert json.loads(request.content) == {
        "model": "test-model",
        "messages": MESSAGES,
        "temperature": 0.2,
    }


def test_extra_may_override_the_model() -> None:
    bodies: list[dict[str, Any]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(200, json=answer())

    with client_for(handler) as client:
        client.complete(MESSAGES, model="other-model")

    assert bodies[0]["model"] == "other-model"
    assert bodies[0]["messages"] == MESSAGES


def test_an_empty_content_string_is_a_valid_answer() -> None:
    assert call(lambda request: httpx.Response(200, json=answer(""))).content == ""


def test_completion_repr_leaves_out_the_raw_json() -> None:
    completion = call(lambda request: httpx.Response(200, json=answer("short")))
    assert "choices" not in repr(completion)


# --- request shape ---------------------------------------------------------


def test_bearer_token_is_sent_when_set() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    call(handler)
    assert seen[0].headers["Authorization"] == f"Bearer {TOKEN}"


def test_a_job_label_travels_in_a_header_not_the_body() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    with client_for(handler) as client:
        client.complete(MESSAGES, job="sleep:2024-05-01 Zoë")

    assert seen[0].headers[JOB_HEADER] == "sleep:2024-05-01%20Zo%C3%AB"
    assert "job" not in json.loads(seen[0].content)


def test_no_authorization_header_without_a_token() -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    call(handler, gateway_token=Secret(""))
    assert "Authorization" not in seen[0].headers


@pytest.mark.parametrize(
    ("base", "path", "expected"),
    [
        ("http://gateway.test", "/api/chat", "http://gateway.test/api/chat"),
        ("http://gateway.test/", "/api/chat", "http://gateway.test/api/chat"),
        (
            "https://gateway.test/llm",
            "/v1/chat/completions",
            "https://gateway.test/llm/v1/chat/completions",
        ),
        (
            "http://gateway.test:8765",
            "/v1/chat/completions",
            "http://gateway.test:8765/v1/chat/completions",
        ),
    ],
)
def test_endpoint_is_base_url_plus_configured_path(base: str, path: str, expected: str) -> None:
    seen: list[httpx.Request] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=answer())

    call(handler, gateway_url=base, gateway_path=path)
    assert str(seen[0].url) == expected


def test_timeouts_are_short_to_connect_and_long_to_read_capped_by_the_claim_timeout() -> None:
    seen: list[dict[str, float]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return httpx.Response(200, json=answer())

    call(
        handler,
        gateway_connect_timeout=3.0,
        gateway_read_timeout=2000.0,
        claim_timeout_seconds=900.0,
    )
    assert seen[0] == {"connect": 3.0, "read": 900.0, "write": 3.0, "pool": 3.0}


def test_credentials_in_the_url_are_not_shown() -> None:
    client = client_for(responding(200), gateway_url="http://user:hunter2@gateway.test")
    with client:
        assert "hunter2" not in client.url
        assert "hunter2" not in repr(client)


@pytest.mark.parametrize("url", ["gateway.test", "ftp://gateway.test", "http://", ""])
def test_an_unusable_url_fails_at_construction(url: str) -> None:
    with pytest.raises(SettingsError, match="AI_GATEWAY_URL"):
        GatewayClient(make_settings(gateway_url=url))


def test_a_token_with_control_characters_fails_without_showing_it() -> None:
    with pytest.raises(SettingsError) as caught:
        GatewayClient(make_settings(gateway_token=Secret("abc\ndef")))
    assert "abc" not in str(caught.value)


@pytest.mark.parametrize("messages", [[], "hello"])
def test_messages_must_be_a_non_empty_sequence(messages: Any) -> None:
    with client_for(responding(200)) as client, pytest.raises(ValueError, match="messages"):
        client.complete(messages)


# --- errors: unavailable ----------------------------------------------------


@pytest.mark.parametrize(
    "exc_type",
    [httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError],
    ids=["connect-refused", "connect-timeout", "dropped", "reset"],
)
def test_connection_failures_before_an_answer_are_unavailable(
    exc_type: type[httpx.TransportError],
) -> None:
    error = failure(raising(exc_type, "[Errno 111] Connection refused"))
    assert isinstance(error, GatewayUnavailable)
    assert error.status is None
    assert error.excerpt == ""
    assert "Connection refused" in str(error)
    assert "http://gateway.test/v1/chat/completions" in str(error)
    assert isinstance(error.__cause__, exc_type)


@pytest.mark.parametrize("status", [502, 503, 504])
def test_gateway_statuses_that_mean_an_outage_are_unavailable(status: int) -> None:
    error = failure(responding(status, "<html>upstream down</html>"))
    assert isinstance(error, GatewayUnavailable)
    assert error.status == status
    assert error.excerpt == "<html>upstream down</html>"
    assert f"HTTP {status}" in str(error)
    assert is_unavailable(error)


# --- errors: timeout --------------------------------------------------------


@pytest.mark.parametrize("exc_type", [httpx.ReadTimeout, httpx.WriteTimeout, httpx.PoolTimeout])
def test_timeouts_after_connecting_are_timeouts(exc_type: type[httpx.TransportError]) -> None:
    error = failure(raising(exc_type, "timed out"))
    assert isinstance(error, GatewayTimeout)
    assert error.status is None
    assert exc_type.__name__ in str(error)
    assert is_timeout(error)
    assert not is_unavailable(error)


# --- errors: rejected -------------------------------------------------------


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422, 429, 500, 501, 302])
def test_other_statuses_are_rejected(status: int) -> None:
    error = failure(responding(status, '{"error": {"message": "nope"}}'))
    assert isinstance(error, GatewayRejected)
    assert error.status == status
    assert "nope" in error.excerpt
    assert f"HTTP {status}" in str(error)
    assert is_rejected(error)
    assert not is_unavailable(error)


@pytest.mark.parametrize(
    "body",
    [b"not json at all", b'{"choices": [', b"\xff\xfe\x00garbage"],
    ids=["text", "truncated", "binary"],
)
def test_a_body_that_is_not_json_is_rejected(body: bytes) -> None:
    error = failure(responding(200, body))
    assert isinstance(error, GatewayRejected)
    assert error.status == 200
    assert "not JSON" in str(error)


@pytest.mark.parametrize(
    "payload",
    [
        {},
        {"choices": []},
        {"choices": [{}]},
        {"choices": [{"message": {}}]},
        {"choices": [{"message": {"role": "assistant", "content": None}}]},
        {"choices": [{"message": {"content": ["parts"]}}]},
        {"choices": "nope"},
        [answer()],
        "just a string",
    ],
)
def test_json_without_choices_message_content_is_rejected(payload: Any) -> None:
    error = failure(lambda request: httpx.Response(200, json=payload))
    assert isinstance(error, GatewayRejected)
    assert "choices[0].message.content" in str(error)


def test_the_excerpt_is_the_start_of_the_body() -> None:
    error = failure(responding(500, "x" * 10_000))
    assert error.excerpt == "x" * EXCERPT_CHARS
    assert len(str(error)) < EXCERPT_CHARS + 200


def test_a_transport_error_of_our_own_side_is_only_a_gateway_error() -> None:
    error = failure(raising(httpx.UnsupportedProtocol))
    assert type(error) is GatewayError
    assert not (is_unavailable(error) or is_timeout(error) or is_rejected(error))


def test_predicates_reject_unrelated_exceptions() -> None:
    for predicate in (is_unavailable, is_timeout, is_rejected, is_abandoned):
        assert not predicate(ValueError("x"))
        assert not predicate(GatewayError("x"))


# --- the token never leaks --------------------------------------------------


def echoing(status: int) -> Handler:
    def handler(request: httpx.Request) -> httpx.Response:
        echoed = {"error": f"bad key: {request.headers['Authorization']}", "token": TOKEN}
        return httpx.Response(status, json=echoed)

    return handler


@pytest.mark.parametrize(
    "handler",
    [
        echoing(401),
        echoing(503),
        echoing(200),
        responding(500, f"{'y' * (EXCERPT_CHARS - 5)}{TOKEN}"),
        raising(httpx.ConnectError, f"proxy said Bearer {TOKEN}"),
        raising(httpx.ReadTimeout, TOKEN),
    ],
    ids=["401-echo", "503-echo", "200-echo", "at-the-cut", "connect", "timeout"],
)
def test_the_token_never_appears_in_an_error(handler: Handler) -> None:
    error = failure(handler)
    for text in (str(error), repr(error), error.excerpt, repr(error.args)):
        assert TOKEN not in text
        assert TOKEN[:12] not in text


def test_the_token_is_not_in_the_client_repr() -> None:
    with client_for(responding(200)) as client:
        assert TOKEN not in repr(client)
        assert TOKEN not in repr(vars(client).get("_url"))


def test_errors_survive_pickling_with_status_and_excerpt() -> None:
    error = failure(responding(503, "busy"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is GatewayUnavailable
    assert (str(copy), copy.status, copy.excerpt) == (str(error), 503, "busy")


# --- closing and abandoning ---------------------------------------------------


def test_a_closed_client_refuses_calls_as_abandoned() -> None:
    client = client_for(responding(200))
    client.close()
    with pytest.raises(GatewayAbandoned) as caught:
        client.complete(MESSAGES)
    assert is_abandoned(caught.value)
    assert not is_unavailable(caught.value)


def test_a_call_whose_client_is_closed_midway_is_abandoned_not_unavailable() -> None:
    holder: list[GatewayClient] = []

    def handler(request: httpx.Request) -> httpx.Response:
        # What another thread's close() does to a blocked read: the read
        # fails on a closed socket once it wakes up.
        holder[0].close()
        raise httpx.ReadError("[Errno 9] Bad file descriptor", request=request)

    client = client_for(handler)
    holder.append(client)
    with pytest.raises(GatewayAbandoned):
        client.complete(MESSAGES)
