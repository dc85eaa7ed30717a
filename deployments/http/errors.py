"""Refusals and failures as one line of JSON, never a traceback (a host app adds them too)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse, Response

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
