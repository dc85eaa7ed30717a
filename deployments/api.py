"""The HTTP API: a screen's poll, the post-sync hook, the operator's queue and actions, the page.

An ASGI app (`create_app`, served by `insight-queue api` on uvicorn), and a
router a host FastAPI app mounts behind its own auth (`insights_router`: the
host's dependency yields the calling user's id, so a user only ever sees their
own insights). Both go through the same `Triggers` as the Python API, so a
poll over HTTP and `request_insight` behave identically.

Routes of the app (JSON everywhere: snake_case keys, ISO 8601 UTC times):

    GET  /healthz                                       the store answers
    GET  /v1/users/{user_id}/insights/{kind}/{subject}  a screen's poll (?fingerprint=)
    POST /v1/users/{user_id}/backfills                  the post-sync hook {"sync_id": ...}
    GET  /v1/queue                                      operator: the whole queue (?limit=)
    POST /v1/pause                                      operator: {"seconds": ..., "reason": ...}
    POST /v1/resume                                     operator
    POST /v1/users/{user_id}/retry-failed               operator
    GET  /queue                                         operator: the page (?refresh=, ?limit=)

Access: operator routes need `AI_API_TOKEN` as a bearer token (or as the
password of HTTP Basic, for a browser); with no token set they are off.
Bound to anything but loopback, every route needs it, and the app refuses to
start without one. Tokens are compared in constant time.

Errors: bad input is a 4xx with one line of JSON, `{"error": ..., "field":
...}`; a store that cannot be reached is a 503 with `"status": "unknown"`;
nothing answers with a traceback. Store calls block, so they run in the
threadpool, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from types import FrameType
from typing import Any, Self, TypeVar

import anyio
import anyio.to_thread
import click
import uvicorn
from anyio.lowlevel import RunVar
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import SecretStr
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Receive, Scope, Send

from deployments import prefect_api, queue_page
from deployments.triggers import InsightState, Triggers
from queue_store import InvalidArgument, JobStore, SettingsError, Status, StoreError
from queue_store.cli import fails_cleanly, settings_from
from queue_store.models import iso

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_BODY_BYTES = 16 * 1024
MAX_MESSAGE_CHARACTERS = 300  # of a one-line error

# Retry-After for a job that is not finished: a quarter of its ETA, within
# these bounds. A screen then sees its result at most a quarter of the wait
# (and never more than half a minute) after it is ready.
RETRY_FRACTION = 0.25
RETRY_MIN_SECONDS = 2
RETRY_MAX_SECONDS = 30
STORE_DOWN_RETRY_SECONDS = 10

# The queue page: default refresh and its bounds (0 turns it off), rows shown.
REFRESH_SECONDS = 5
REFRESH_MIN_SECONDS = 2
REFRESH_MAX_SECONDS = 600
QUEUE_LIMIT = 50

GRACEFUL_STOP_SECONDS = 5
# An idle connection is kept this long: past the longest Retry-After, so a
# screen's next poll does not race the server closing its connection.
KEEP_ALIVE_SECONDS = 75
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

REALM = "insight-queue"
INSIGHT_PATH = "/v1/insights/{kind}/{subject}"
USER_INSIGHT_PATH = "/v1/users/{user_id}/insights/{kind}/{subject}"

NO_STORE = {"Cache-Control": "no-store"}
JSON_HEADERS = {"X-Content-Type-Options": "nosniff"}
_STYLE_HASH = base64.b64encode(hashlib.sha256(queue_page.STYLE.encode()).digest()).decode()
PAGE_HEADERS = {
    **NO_STORE,
    **JSON_HEADERS,
    "Content-Security-Policy": (
        f"default-src 'none'; style-src 'sha256-{_STYLE_HASH}'; base-uri 'none'; "
        "form-action 'none'; frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}

# Starlette decodes the path before routing, so `%2F` would split a value in
# two. `StrictPaths` routes on the path with each encoded slash kept inside its
# segment as this character (NUL, which no key may hold), and marks the scope
# so `path_value` turns it back into "/".
_SLASH = "\x00"
_ENCODED_SLASHES = "insight_queue.encoded_slashes"


# Store calls at once, each in a worker thread: as many as the store's
# connection pool holds (5 + 5 on PostgreSQL). More threads would only wait
# for a connection, and take turns at the interpreter with the event loop.
STORE_THREADS = 10
_store_threads: RunVar[anyio.CapacityLimiter] = RunVar("insight_queue_store_threads")
T = TypeVar("T")


async def in_thread(call: Callable[..., T], *args: Any) -> T:
    """A blocking store call, in a worker thread: never on the event loop."""
    try:
        limiter = _store_threads.get()
    except LookupError:
        limiter = anyio.CapacityLimiter(STORE_THREADS)
        _store_threads.set(limiter)
    return await anyio.to_thread.run_sync(functools.partial(call, *args), limiter=limiter)


class ApiConfigError(SettingsError):
    """The API cannot be served as asked (a non-loopback host without a token)."""


def one_line(message: str) -> str:
    """A message as one line of at most `MAX_MESSAGE_CHARACTERS`."""
    line = " ".join(message.split())
    if len(line) > MAX_MESSAGE_CHARACTERS:
        line = line[: MAX_MESSAGE_CHARACTERS - 1] + "…"
    return line


def problem(
    status: int,
    message: str,
    field: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> JSONResponse:
    """A refusal: one line of JSON, naming the field it is about where there is one."""
    body: dict[str, Any] = {"error": one_line(message)}
    if field is not None:
        body["field"] = field
    return JSONResponse(
        body, status_code=status, headers={**NO_STORE, **JSON_HEADERS, **(headers or {})}
    )


def unavailable(error: str) -> JSONResponse:
    """The store cannot be reached: 503, status unknown, and when to try again."""
    return JSONResponse(
        {"status": str(Status.UNKNOWN), "error": one_line(error)},
        status_code=503,
        headers={**NO_STORE, **JSON_HEADERS, "Retry-After": str(STORE_DOWN_RETRY_SECONDS)},
    )


class Refused(Exception):
    """A request refused with a 4xx (raised inside a handler, answered by `answered`)."""

    def __init__(
        self,
        status: int,
        message: str,
        field: str | None = None,
        *,
        challenge: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.field = field
        self.challenge = challenge

    def response(self) -> Response:
        response = problem(self.status, self.message, self.field)
        if self.challenge:
            add_challenges(response)
        return response


def add_challenges(response: Response) -> None:
    """Ask for a bearer token, or Basic credentials (a browser prompts for those)."""
    response.headers.append("WWW-Authenticate", f'Bearer realm="{REALM}"')
    response.headers.append("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"')


async def answered(call: Callable[[], Awaitable[Response]]) -> Response:
    """Run a handler; every error becomes its one-line answer, never a traceback."""
    try:
        return await call()
    except Refused as exc:
        return exc.response()
    except InvalidArgument as exc:
        return problem(422, str(exc), exc.argument)
    except StoreError as exc:
        if isinstance(exc, ValueError):  # a setting or a plugin: the server's fault
            logger.error("cannot answer: %s", exc)
            return problem(500, f"the server is misconfigured: {exc}")
        return unavailable(str(exc))
    except Exception:
        logger.exception("unexpected error while answering a request")
        return problem(500, "internal error; the server's log has the details")


# -- access -------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the API on this machine."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def presented_token(authorization: str | None) -> str | None:
    """The token in an Authorization header: a bearer token, or the password of Basic."""
    if not authorization:
        return None
    scheme, _, credentials = authorization.strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        return credentials or None
    if scheme.lower() == "basic":
        try:
            decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return None
        _, colon, password = decoded.partition(":")
        return password if colon and password else None
    return None


class Access:
    """Who may call what: the operator's token, and whether every route needs it."""

    def __init__(self, token: SecretStr, *, everywhere: bool) -> None:
        secret = token.get_secret_value()
        self._digest = _digest(secret) if secret else None
        self.everywhere = everywhere

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def allows(self, authorization: str | None) -> bool:
        """Whether the header carries the token (compared in constant time)."""
        given = presented_token(authorization)
        if self._digest is None or given is None:
            return False
        return hmac.compare_digest(_digest(given), self._digest)

    def require_operator(self, request: Request) -> None:
        if self._digest is None:
            raise Refused(403, "operator routes are off: set AI_API_TOKEN to use them")
        if not self.allows(request.headers.get("authorization")):
            raise Refused(
                401,
                "a valid token is required: Authorization: Bearer <AI_API_TOKEN>",
                "authorization",
                challenge=True,
            )


def _digest(token: str) -> bytes:
    # Digests of equal length: the comparison takes the same time whatever was sent.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


class TokenEverywhere:
    """Every request needs the token (the API is bound off loopback, or asked to)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app = app
        self.access = access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            authorization = _header(scope, b"authorization")
            if not self.access.allows(authorization):
                response = problem(
                    401,
                    "a valid token is required: Authorization: Bearer <AI_API_TOKEN>",
                    "authorization",
                )
                add_challenges(response)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _header(scope: Scope, name: bytes) -> str | None:
    for key, raw in scope.get("headers", []):
        if key.lower() == name:
            return bytes(raw).decode("latin-1")
    return None


# -- paths and query ------------------------------------------------------------------------


class StrictPaths:
    """Paths and query strings as exact text: invalid UTF-8 is refused, `%2F` stays in its value.

    Mount it on a host app that includes `insights_router`, so a kind or a
    subject holding an encoded slash reaches the right job.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("raw_path") or scope["path"].encode("utf-8")
        try:
            segments = [urllib.parse.unquote_to_bytes(s).decode("utf-8") for s in raw.split(b"/")]
        except UnicodeDecodeError:
            await problem(400, "path: not valid UTF-8 once percent-decoded", "path")(
                scope, receive, send
            )
            return
        try:
            urllib.parse.parse_qsl(
                bytes(scope.get("query_string", b"")).decode("latin-1"),
                keep_blank_values=True,
                errors="strict",
            )
        except UnicodeDecodeError:
            await problem(400, "query: not valid UTF-8 once percent-decoded", "query")(
                scope, receive, send
            )
            return
        if any("/" in s for s in segments) and not any(_SLASH in s for s in segments):
            scope = {
                **scope,
                "path": "/".join(s.replace("/", _SLASH) for s in segments),
                _ENCODED_SLASHES: True,
            }
        await self.app(scope, receive, send)


def path_value(request: Request, name: str) -> str:
    """A path parameter as the client meant it (an encoded slash is a slash)."""
    found = request.path_params.get(name)
    if not isinstance(found, str):
        raise Refused(404, f"{name}: missing from the path", name)
    if request.scope.get(_ENCODED_SLASHES):
        return found.replace(_SLASH, "/")
    return found


def query_value(request: Request, name: str) -> str | None:
    """A query parameter given at most once."""
    given = request.query_params.getlist(name)
    if len(given) > 1:
        raise Refused(422, f"{name}: given {len(given)} times; give it once", name)
    return given[0] if given else None


def whole_number(request: Request, name: str, default: int) -> int:
    given = query_value(request, name)
    if given is None:
        return default
    try:
        return int(given.strip(), 10)
    except ValueError:
        raise Refused(422, f"{name}: must be a whole number, got {given[:40]!r}", name) from None


def refresh_seconds(request: Request) -> int:
    """The page's `?refresh=`: 0 turns it off; other values are held within the bounds."""
    given = query_value(request, "refresh")
    if given is None:
        return REFRESH_SECONDS
    try:
        seconds = float(given.strip())
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        raise Refused(
            422, f"refresh: must be a number of seconds (0 turns it off), got {given[:40]!r}",
            "refresh",
        )  # fmt: skip
    if seconds == 0:
        return 0
    return int(min(max(math.ceil(seconds), REFRESH_MIN_SECONDS), REFRESH_MAX_SECONDS))


async def json_object(request: Request, fields: Sequence[str]) -> dict[str, Any]:
    """The request's JSON object (an empty body is `{}`), holding no field but `fields`."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
        raise Refused(413, f"body: larger than {MAX_BODY_BYTES} bytes", "body")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise Refused(413, f"body: larger than {MAX_BODY_BYTES} bytes", "body")
    if not body.strip():
        return {}
    try:
        payload = json.loads(bytes(body))
    except (ValueError, RecursionError) as exc:
        reason = exc.msg if isinstance(exc, json.JSONDecodeError) else type(exc).__name__
        raise Refused(400, f"body: not valid JSON ({reason})", "body") from None
    if not isinstance(payload, dict):
        raise Refused(422, f"body: must be a JSON object, got {type(payload).__name__}", "body")
    for key in payload:
        if key not in fields:
            expected = ", ".join(fields) or "none"
            raise Refused(
                422, f"{str(key)[:60]!r}: not a field here (expected: {expected})", str(key)[:60]
            )
    return payload


# -- a screen's poll ------------------------------------------------------------------------


def retry_after(state: InsightState) -> int | None:
    """Seconds until the next poll is worth making; None once the job is finished."""
    if state.status in (Status.DONE, Status.FAILED):
        return None
    if state.status == Status.UNKNOWN:
        return STORE_DOWN_RETRY_SECONDS
    if state.eta_seconds is None:
        return RETRY_MIN_SECONDS
    wait = min(max(state.eta_seconds * RETRY_FRACTION, RETRY_MIN_SECONDS), RETRY_MAX_SECONDS)
    return math.ceil(wait)


def etag(state: InsightState) -> str:
    """A weak ETag of what a screen shows: all of it but the ETA's countdown.

    The ETA (and a pause's seconds left) moves on every poll; status, place,
    result, freshness, pause reason and notes change only when something
    happened. A 304 still carries a fresh `Retry-After`.
    """
    stable = state.as_dict()
    stable.pop("eta_seconds", None)
    stable["paused"] = _without_countdown(state.paused)
    encoded = json.dumps(stable, sort_keys=True, separators=(",", ":"), default=str)
    return f'W/"{hashlib.sha256(encoded.encode()).hexdigest()[:32]}"'


def _without_countdown(paused: str | None) -> str | None:
    """`"operator for 120 s: reason"` -> `"operator: reason"`."""
    if paused is None:
        return None
    kind, found, rest = paused.partition(" for ")
    if not found:
        return paused
    _, found, reason = rest.partition(" s: ")
    return f"{kind}: {reason}" if found else paused


def etag_matches(if_none_match: str, tag: str) -> bool:
    """The weak comparison of RFC 9110: `W/` ignored, `*` matches anything."""
    wanted = tag.removeprefix("W/")
    for candidate in if_none_match.split(","):
        candidate = candidate.strip()
        if candidate == "*" or candidate.removeprefix("W/") == wanted:
            return True
    return False


def insight_response(state: InsightState, if_none_match: str | None) -> Response:
    """A poll's answer: 200 (or 304) with ETag and Retry-After, 503 when the store is down."""
    body = state.as_dict()
    if state.status == Status.UNKNOWN or state.error is not None:
        return JSONResponse(
            body,
            status_code=503,
            headers={
                **NO_STORE,
                **JSON_HEADERS,
                "Retry-After": str(STORE_DOWN_RETRY_SECONDS),
            },
        )
    headers = {"ETag": etag(state), "Cache-Control": "private, no-cache", **JSON_HEADERS}
    wait = retry_after(state)
    if wait is not None:
        headers["Retry-After"] = str(wait)
    if if_none_match and etag_matches(if_none_match, headers["ETag"]):
        return Response(status_code=304, headers=headers)
    return JSONResponse(body, headers=headers)


def checked_user(user_id: object) -> str:
    """The user id a dependency yielded: text (an int is taken as its digits)."""
    if isinstance(user_id, int) and not isinstance(user_id, bool):
        return str(user_id)
    if not isinstance(user_id, str):
        raise TypeError(f"the user dependency yielded {type(user_id).__name__}, not a user id")
    return user_id


TriggersSource = Triggers | Callable[[], Triggers]


def _resolve(source: TriggersSource) -> Triggers:
    return source if isinstance(source, Triggers) else source()


async def poll_insight(
    triggers: Triggers, request: Request, user_id: object, kind: str, subject: str
) -> Response:
    """What every poll route does: `request_insight` in the threadpool, then the answer."""
    user = checked_user(user_id)
    fingerprint = query_value(request, "fingerprint")
    started = time.perf_counter()
    state = await in_thread(triggers.request_insight, user, kind, subject, fingerprint)
    spent = (time.perf_counter() - started) * 1000
    response = insight_response(state, request.headers.get("if-none-match"))
    # How long the store took, waiting for a thread included: tells a slow
    # answer's cause (the store, or the way to and from it) at a glance.
    response.headers["Server-Timing"] = f"store;dur={spent:.1f}"
    return response


def insights_router(
    triggers: TriggersSource,
    current_user: Callable[..., Any],
    *,
    path: str = INSIGHT_PATH,
) -> APIRouter:
    """The screens' poll for a host app: `GET /v1/insights/{kind}/{subject}?fingerprint=`.

    `current_user` is the host's dependency that yields the calling user's id
    (after its own authentication); a user can only ever poll their own
    insights. `triggers` is a `Triggers`, or a function returning the one in
    force (`deployments.triggers.current`). Add `StrictPaths` to the host app
    so encoded slashes in a kind or subject reach the right job.
    """
    router = APIRouter()

    # A default rather than `Annotated[...]`: annotations are strings here, and
    # FastAPI could not resolve `current_user`, a local name, from one.
    @router.get(path, summary="A screen's poll")
    async def poll(request: Request, user_id: Any = Depends(current_user)) -> Response:  # noqa: B008
        return await answered(
            lambda: poll_insight(
                _resolve(triggers),
                request,
                user_id,
                path_value(request, "kind"),
                path_value(request, "subject"),
            )
        )

    return router


def path_user(request: Request) -> str:
    """The standalone app's user: the `{user_id}` of the path (the caller is trusted)."""
    return path_value(request, "user_id")


# -- the app ----------------------------------------------------------------------------------


@dataclasses.dataclass
class _Operator:
    triggers: Triggers
    access: Access
    ui_url: Callable[[], str | None]

    @property
    def store(self) -> JobStore:
        return self.triggers.store

    async def queue(self, request: Request) -> Response:
        self.access.require_operator(request)
        limit = whole_number(request, "limit", QUEUE_LIMIT)
        view = await in_thread(self.store.queue_view, limit)
        return JSONResponse(view.as_dict(), headers={**NO_STORE, **JSON_HEADERS})

    async def pause(self, request: Request) -> Response:
        self.access.require_operator(request)
        payload = await json_object(request, ("seconds", "reason"))
        if "seconds" not in payload:
            raise Refused(422, "seconds: required (how long to pause claiming)", "seconds")
        reason = payload.get("reason", "paused by an operator")

        def pause() -> dict[str, Any]:
            until = self.store.pause(payload["seconds"], reason)
            return {"paused_until": iso(until), "gate": self.store.gate_state().as_dict()}

        return JSONResponse(await in_thread(pause), headers={**NO_STORE, **JSON_HEADERS})

    async def resume(self, request: Request) -> Response:
        self.access.require_operator(request)
        await json_object(request, ())

        def resume() -> dict[str, Any]:
            self.store.resume()
            return {"gate": self.store.gate_state().as_dict()}

        return JSONResponse(await in_thread(resume), headers={**NO_STORE, **JSON_HEADERS})

    async def retry_failed(self, request: Request) -> Response:
        self.access.require_operator(request)
        user = path_value(request, "user_id")
        await json_object(request, ())

        def retry() -> dict[str, Any]:
            retried = self.store.retry_failed(user)
            return {"user_id": user, "retried": retried, "pending": self.store.pending_count(user)}

        return JSONResponse(await in_thread(retry), headers={**NO_STORE, **JSON_HEADERS})

    async def page(self, request: Request) -> Response:
        self.access.require_operator(request)
        refresh = refresh_seconds(request)
        limit = whole_number(request, "limit", QUEUE_LIMIT)

        def render() -> tuple[int, str]:
            try:
                view = self.store.queue_view(limit)
            except StoreError as exc:
                if isinstance(exc, ValueError):
                    raise
                shown = queue_page.render_unavailable(
                    one_line(str(exc)), refresh or REFRESH_SECONDS, dt.datetime.now(dt.UTC)
                )
                return 503, shown
            return 200, queue_page.render(view, ui_url=self.ui_url(), refresh=refresh)

        status, page = await in_thread(render)
        headers = dict(PAGE_HEADERS)
        if status == 503:
            headers["Retry-After"] = str(STORE_DOWN_RETRY_SECONDS)
        return HTMLResponse(page, status_code=status, headers=headers)


def create_app(
    triggers: Triggers,
    *,
    host: str = DEFAULT_HOST,
    require_token: bool = False,
    token: SecretStr | None = None,
    ui_url: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The standalone app, for serving on `host`.

    `token` defaults to `AI_API_TOKEN`; every route needs it when `host` is
    not loopback or `require_token` is set (behind a proxy), and then the app
    is refused without one. `ui_url` gives the Prefect UI's address for the
    page's links (default: `deployments.prefect_api.ui_url`).
    """
    settings = triggers.runtime.settings
    token = settings.api.token if token is None else token
    access = Access(token, everywhere=require_token or not is_loopback(host))
    check_exposure(host, access)
    operator = _Operator(triggers, access, ui_url or (lambda: prefect_api.ui_url(settings)))

    app = FastAPI(title="insight-queue", docs_url=None, redoc_url=None, openapi_url=None)
    _install_error_handlers(app)
    app.add_middleware(StrictPaths)
    if access.everywhere:
        app.add_middleware(TokenEverywhere, access=access)

    @app.get("/healthz")
    async def healthz() -> Response:
        async def check() -> Response:
            gate = await in_thread(triggers.store.gate_state)
            return JSONResponse(
                {"status": "ok", "now": iso(gate.now)}, headers={**NO_STORE, **JSON_HEADERS}
            )

        return await answered(check)

    app.include_router(insights_router(triggers, path_user, path=USER_INSIGHT_PATH))

    @app.post("/v1/users/{user_id}/backfills", status_code=202)
    async def backfill(request: Request) -> Response:
        async def start() -> Response:
            user = path_value(request, "user_id")
            payload = await json_object(request, ("sync_id",))
            state = await in_thread(triggers.trigger_backfill, user, payload.get("sync_id"))
            if state.error is not None and state.flow_run_id is None:
                return unavailable(state.error)
            body = {"status": "started" if state.flow_run_id else "queued", **state.as_dict()}
            return JSONResponse(body, status_code=202, headers={**NO_STORE, **JSON_HEADERS})

        return await answered(start)

    @app.get("/v1/queue")
    async def queue(request: Request) -> Response:
        return await answered(lambda: operator.queue(request))

    @app.post("/v1/pause")
    async def pause(request: Request) -> Response:
        return await answered(lambda: operator.pause(request))

    @app.post("/v1/resume")
    async def resume(request: Request) -> Response:
        return await answered(lambda: operator.resume(request))

    @app.post("/v1/users/{user_id}/retry-failed")
    async def retry_failed(request: Request) -> Response:
        return await answered(lambda: operator.retry_failed(request))

    @app.get("/queue")
    async def page(request: Request) -> Response:
        return await answered(lambda: operator.page(request))

    return app


def check_exposure(host: str, access: Access) -> None:
    """Refuse to serve off loopback (or where asked to) without a token."""
    if access.everywhere and not access.configured:
        where = "a non-loopback address" if not is_loopback(host) else "--require-token"
        raise ApiConfigError(
            f"AI_API_TOKEN: must be set to serve on {host} ({where}): every route then "
            "needs it as a bearer token"
        )


def _install_error_handlers(app: FastAPI) -> None:
    """FastAPI's and Starlette's own refusals in the same one-line form."""

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        messages = {404: "no such route", 405: "method not allowed on this route"}
        message = messages.get(exc.status_code) or str(exc.detail)
        return problem(exc.status_code, message, headers=exc.headers)

    async def validation_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        errors: Sequence[Any] = exc.errors()
        first = errors[0] if errors else {}
        location = [str(part) for part in first.get("loc", ()) if part not in ("path", "query")]
        field = location[-1] if location else "request"
        return problem(422, f"{field}: {first.get('msg', 'invalid')}", field)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return problem(500, "internal error; the server's log has the details")

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(Exception, internal_error)


# -- serving ------------------------------------------------------------------------------------


class _Server(uvicorn.Server):
    """uvicorn, stopped cleanly by SIGTERM, SIGINT or SIGHUP (a second one forces it)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def stop(signum: int, frame: FrameType | None) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

        previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def bind(host: str, port: int) -> socket.socket:
    """A listening-ready TCP socket on host:port (0: any free port). Raises OSError."""
    family, kind, protocol, _, address = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, protocol)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


class ApiServer:
    """An app served by uvicorn on a socket bound at construction.

    `run()` serves in this thread until SIGTERM, SIGINT or SIGHUP (the
    command); `start()`/`stop()` serve from a background thread (tests,
    benchmarks, screenshots).
    """

    def __init__(
        self, app: ASGIApp, host: str = DEFAULT_HOST, port: int = 0, *, access_log: bool = False
    ) -> None:
        self._socket = bind(host, port)
        self.host = host
        self.port = int(self._socket.getsockname()[1])
        config = uvicorn.Config(
            app,
            log_config=None,
            access_log=access_log,
            lifespan="off",
            server_header=False,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
        )
        self._server = _Server(config)
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def run(self) -> None:
        try:
            self._server.run(sockets=[self._socket])
        finally:
            self._socket.close()

    def start(self, timeout: float = 10.0) -> Self:
        self._thread = threading.Thread(target=self.run, name="insight-queue-api", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the API did not start at {self.url}")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@click.command("api")
@click.option(
    "--host",
    default=DEFAULT_HOST,
    show_default=True,
    help="address to bind; anything but loopback needs AI_API_TOKEN on every route",
)
@click.option(
    "--port",
    type=click.IntRange(0, 65535),
    default=DEFAULT_PORT,
    show_default=True,
    help="port to listen on (0: any free one)",
)
@click.option(
    "--require-token",
    is_flag=True,
    help="need AI_API_TOKEN on every route even on loopback (behind a proxy)",
)
@click.pass_context
@fails_cleanly
def api_command(ctx: click.Context, host: str, port: int, require_token: bool) -> None:
    """Serve the HTTP API and the queue page until SIGTERM, SIGINT or SIGHUP."""
    from flows.runtime import Runtime

    settings = settings_from(ctx)
    check_exposure(
        host, Access(settings.api.token, everywhere=require_token or not is_loopback(host))
    )
    runtime = Runtime.from_env(settings)
    try:
        app = create_app(Triggers(runtime), host=host, require_token=require_token)
        try:
            server = ApiServer(
                app, host, port, access_log=bool(ctx.find_root().params.get("verbose"))
            )
        except OSError as exc:
            click.echo(f"error: cannot listen on {host}:{port}: {exc.strerror or exc}", err=True)
            sys.exit(1)
        operator = (
            ""
            if settings.api.token.get_secret_value()
            else " (operator routes off: no AI_API_TOKEN)"
        )
        click.echo(f"insight-queue API at {server.url}; queue page {server.url}/queue{operator}")
        server.run()
    finally:
        runtime.close()


__all__ = [
    "Access",
    "ApiConfigError",
    "ApiServer",
    "StrictPaths",
    "api_command",
    "create_app",
    "insights_router",
]
