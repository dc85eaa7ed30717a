"""The edge: what is refused before a route runs (inexact paths, oversized headers and bodies,
unknown hosts: DNS rebinding gets a 400), CORS for the app's own origins, and every refusal and
failure as one line of JSON, never a traceback (a host app adds those too)."""

from __future__ import annotations

import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from queue_store import InvalidArgument, Misconfigured, Status, Unavailable

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARACTERS = 300  # of a one-line error
STORE_DOWN_RETRY_SECONDS = 10
MAX_BODY_BYTES = 16 * 1024
TOO_LARGE = f"body: larger than {MAX_BODY_BYTES} bytes"
REALM = "insight-queue"
NO_STORE = {"Cache-Control": "no-store"}


class Refused(HTTPException):
    """A 4xx naming the field it is about; a 401 asks for a credential."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status, message, headers)
        self.field = field


def problem(
    status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    line = " ".join(message.split())
    if len(line) > MAX_MESSAGE_CHARACTERS:
        line = line[: MAX_MESSAGE_CHARACTERS - 1] + "…"
    body: dict[str, Any] = {"error": line} | ({"field": field} if field else {})
    return JSONResponse(body, status, {**NO_STORE, **(headers or {})})


def unavailable(error: str) -> JSONResponse:
    """The store cannot be reached: 503, status unknown, and when to try again."""
    body = {"status": str(Status.UNKNOWN), "error": " ".join(error.split())[:300]}
    headers = {**NO_STORE, "Retry-After": str(STORE_DOWN_RETRY_SECONDS)}
    return JSONResponse(body, 503, headers)


async def _store_error(
    request: Request, exc: InvalidArgument | Misconfigured | Unavailable
) -> Response:
    if isinstance(exc, InvalidArgument):
        return problem(422, str(exc), exc.argument)
    if isinstance(exc, Misconfigured):
        return problem(500, f"the server is misconfigured: {exc}")
    return unavailable(str(exc))


async def _http_error(request: Request, exc: HTTPException) -> Response:
    messages = {404: "no such route", 405: "method not allowed on this route"}
    if isinstance(exc, Refused):
        response = problem(exc.status_code, exc.detail, exc.field, exc.headers)
        if exc.status_code == 401:  # a bearer token, or Basic's (a browser prompts for those)
            response.headers.append("WWW-Authenticate", f'Bearer realm="{REALM}"')
            response.headers.append("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"')
        return response
    if exc.status_code == 400:  # FastAPI could not read the body
        return problem(400, "body: not valid JSON", "body")
    if exc.status_code == 413:
        return problem(413, TOO_LARGE, "body")
    message = messages.get(exc.status_code) or str(exc.detail)
    return problem(exc.status_code, message, headers=exc.headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
    first: Mapping[str, Any] = next(iter(exc.errors()), {})
    location = [str(p) for p in first.get("loc", ()) if p not in ("path", "query", "header")]
    if first.get("type") == "json_invalid":
        reason = first.get("ctx", {}).get("error", "")
        return problem(400, f"body: not valid JSON ({reason})", "body")
    field = location[-1] if location and not location[-1].isdigit() else "body"
    if field == "body" and len(location) > 1:
        field = location[1]
    return problem(422, f"{field}: {first.get('msg', 'invalid')}", field)


async def _internal_error(request: Request, exc: Exception) -> Response:
    logger.error("unexpected error while answering a request", exc_info=exc)
    return problem(500, "internal error; the server's log has the details")


HANDLERS: dict[type[Exception], Callable[[Request, Any], Awaitable[Response]]] = {
    InvalidArgument: _store_error,
    Misconfigured: _store_error,
    Unavailable: _store_error,
    HTTPException: _http_error,
    RequestValidationError: _validation_error,
    Exception: _internal_error,
}


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal and failure as one line of JSON."""
    for error, handler in HANDLERS.items():
        app.add_exception_handler(error, handler)


MAX_HEADER_BYTES = 16 * 1024
HEADERS_TOO_LARGE = f"headers: larger than {MAX_HEADER_BYTES} bytes in all"

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "[::1]")
# What a screen's page may send and read across origins.
CORS_HEADERS = ["Authorization", "Content-Type", "If-None-Match"]
CORS_EXPOSED = ["ETag", "Retry-After", "Server-Timing"]
CORS_MAX_AGE_SECONDS = 600
# Starlette decodes the path before routing, so `%2F` would split a value in
# two: `StrictPaths` routes with each encoded slash kept in its segment as NUL
# (which no key may hold) and marks the scope, and `path_text` turns it back.
SLASH = "\x00"
ENCODED_SLASHES = "insight_queue.encoded_slashes"


def add_edges(app: FastAPI, hosts: Sequence[str], origins: Sequence[str]) -> None:
    """The standalone app's middleware, outermost last: hosts, CORS, then paths and bodies."""
    app.add_middleware(StrictPaths)
    app.add_middleware(LimitedBodies)
    if origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(origins),
            allow_methods=["GET", "POST", "DELETE"],
            allow_headers=CORS_HEADERS,
            expose_headers=CORS_EXPOSED,
            max_age=CORS_MAX_AGE_SECONDS,
        )
    allowed = [*LOOPBACK_HOSTS, *hosts]
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=allowed, www_redirect=False)


class StrictPaths:
    """Paths and queries as exact text: invalid UTF-8 is refused, `%2F` stays in its value."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        query = bytes(scope.get("query_string", b"")).decode("latin-1")
        part = "path"
        try:
            segments = [urllib.parse.unquote_to_bytes(s).decode("utf-8") for s in raw.split(b"/")]
            part = "query"
            urllib.parse.parse_qsl(query, keep_blank_values=True, errors="strict")
        except UnicodeDecodeError:
            refusal = problem(400, f"{part}: not valid UTF-8 once percent-decoded", part)
            await refusal(scope, receive, send)
            return
        if any("/" in s for s in segments) and not any(SLASH in s for s in segments):
            scope = {
                **scope,
                "path": "/".join(s.replace("/", SLASH) for s in segments),
                ENCODED_SLASHES: True,
            }
        await self.app(scope, receive, send)


class LimitedBodies:
    """Headers (431) and bodies (413, before all is read) within bounds; nosniff on answers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0
        headers = sum(len(name) + len(value) + 4 for name, value in scope.get("headers", []))
        if headers > MAX_HEADER_BYTES:
            refusal = problem(431, HEADERS_TOO_LARGE, "headers", {"Connection": "close"})
            await refusal(scope, receive, send)
            return

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > MAX_BODY_BYTES:
                raise HTTPException(413, TOO_LARGE)
            return message

        async def nosniff(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", []).append((b"x-content-type-options", b"nosniff"))
            await send(message)

        declared = dict(scope.get("headers", [])).get(b"content-length", b"0")
        if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
            await problem(413, TOO_LARGE, "body")(scope, receive, nosniff)
            return
        await self.app(scope, limited, nosniff)
