"""The HTTP API: a screen's poll, the post-sync hook, the operator's queue and actions, the page.

A FastAPI app (`create_app`) and a router a host app mounts behind its own auth
(`insights_router`), both on `Triggers`. Who may call what: README, "HTTP API"; requests
that change state are refused from other sites, and bodies are JSON only. Errors are one
line of JSON, never a traceback; store calls run in the threadpool, never on the event loop.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import ipaddress
import logging
import math
import os
import signal
import time
import urllib.parse
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import anyio.to_thread
import click
import uvicorn
from fastapi import APIRouter, Depends, FastAPI, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, SecretStr
from starlette.exceptions import HTTPException
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deployments import metrics, prefect_api, queue_page
from deployments.cli import fails_cleanly, settings_from
from deployments.triggers import InsightState, Triggers
from queue_store import InvalidArgument, Misconfigured, Settings, Status, Unavailable
from queue_store.models import iso

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
MAX_BODY_BYTES = 16 * 1024
MAX_MESSAGE_CHARACTERS = 300  # of a one-line error
# Store calls at once in the threadpool: as many as the store's connection pool holds.
STORE_THREADS = 10
# Retry-After for a job that is not finished: a quarter of its ETA, within these
# bounds; a screen sees its result at most a quarter of the wait after it is ready.
RETRY_FRACTION = 0.25
RETRY_MIN_SECONDS = 2
RETRY_MAX_SECONDS = 30
STORE_DOWN_RETRY_SECONDS = 10
# The queue page: default refresh, its bounds (0 turns it off), rows shown.
REFRESH_SECONDS = 5
REFRESH_MIN_SECONDS = 2
REFRESH_MAX_SECONDS = 600
QUEUE_LIMIT = 50
# An idle connection is kept past the longest Retry-After, so a screen's next
# poll does not race the server closing its connection.
KEEP_ALIVE_SECONDS = 75
GRACEFUL_STOP_SECONDS = 5

REALM = "insight-queue"
INSIGHT_PATH = "/v1/insights/{kind}/{subject}"
NO_STORE = {"Cache-Control": "no-store"}
PAGE_HEADERS = {
    **NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}
JSON_TYPES = ("application/json",)
# Starlette decodes the path before routing, so `%2F` would split a value in
# two: `StrictPaths` routes with each encoded slash kept in its segment as NUL
# (which no key may hold) and marks the scope, and `path_text` turns it back.
_SLASH = "\x00"
_ENCODED_SLASHES = "insight_queue.encoded_slashes"


class ApiConfigError(Misconfigured):
    """The API cannot be served as asked (a token is required and none is set)."""


class Refused(Exception):
    """A request refused with a 4xx, naming the field it is about."""

    def __init__(
        self, status: int, message: str, field: str | None = None, *, challenge: bool = False
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.field, self.challenge = status, message, field, challenge


def problem(
    status: int, message: str, field: str | None = None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    """A refusal: one line of JSON, naming the field it is about where there is one."""
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


def challenged(response: Response) -> Response:
    """Ask for a bearer token, or Basic credentials (a browser prompts for those)."""
    response.headers.append("WWW-Authenticate", f'Bearer realm="{REALM}"')
    response.headers.append("WWW-Authenticate", f'Basic realm="{REALM}", charset="UTF-8"')
    return response


# -- access ---------------------------------------------------------------------------------


def is_loopback(host: str) -> bool:
    """Whether binding to `host` keeps the API on this machine."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def presented_token(authorization: str | None, *, basic: bool) -> str | None:
    """The token in an Authorization header: a bearer token, or (if `basic`) Basic's password."""
    scheme, _, credentials = (authorization or "").strip().partition(" ")
    credentials = credentials.strip()
    if scheme.lower() == "bearer":
        return credentials or None
    if scheme.lower() != "basic" or not basic:
        return None
    try:
        decoded = base64.b64decode(credentials, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


class Access:
    """Who may call what: the operator's token (compared in constant time), and where."""

    def __init__(self, token: SecretStr, *, everywhere: bool) -> None:
        secret = token.get_secret_value()
        self._digest = _digest(secret) if secret else None
        self.everywhere = everywhere

    @property
    def configured(self) -> bool:
        return self._digest is not None

    def allows(self, authorization: str | None, *, basic: bool) -> bool:
        given = presented_token(authorization, basic=basic)
        if self._digest is None or given is None:
            return False
        return hmac.compare_digest(_digest(given), self._digest)

    def require(self, request: Request, *, basic: bool = False) -> None:
        if self._digest is None:
            raise Refused(403, "operator routes are off: set AI_API_TOKEN to use them")
        if not self.allows(request.headers.get("authorization"), basic=basic):
            raise Refused(401, TOKEN_NEEDED, "authorization", challenge=True)


TOKEN_NEEDED = "a valid token is required: Authorization: Bearer <AI_API_TOKEN>"


def _digest(token: str) -> bytes:
    # Digests of equal length: the comparison takes the same time whatever was sent.
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()


def _access(request: Request) -> Access:
    access: Access = request.app.state.access
    return access


async def operator(request: Request) -> None:
    """An operator's API call: the bearer token."""
    _access(request).require(request)


async def page_operator(request: Request) -> None:
    """The page: the bearer token, or Basic credentials a browser remembers."""
    _access(request).require(request, basic=True)


async def scraper(request: Request) -> None:
    """/metrics: the operator's token where one is set, else any caller on this machine."""
    access = _access(request)
    if not access.configured:
        client = request.client.host if request.client else ""
        if not is_loopback(client):
            raise Refused(403, "metrics are served to loopback only: set AI_API_TOKEN")
        return
    access.require(request)


async def same_site(request: Request) -> None:
    """A request that changes state must not come from a page on another site."""
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if (site is not None and site not in ("same-origin", "none")) or (
        origin is not None and origin != own
    ):
        raise Refused(403, "cross-site requests are refused here", "origin")


async def json_only(request: Request) -> None:
    """A body, if any, is JSON (415 otherwise); its size is held by `LimitedBodies`."""
    if request.headers.get("content-length", "0") == "0" and "transfer-encoding" not in (
        request.headers
    ):
        return
    media = request.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media not in JSON_TYPES and not media.endswith("+json"):
        raise Refused(415, "body: send it as application/json", "content-type")


async def single_values(request: Request) -> None:
    """A query parameter given twice is refused, not silently chosen from."""
    for name in request.query_params:
        if len(request.query_params.getlist(name)) > 1:
            raise Refused(422, f"{name}: given more than once; give it once", name)


def path_text(request: Request, name: str) -> str:
    """A path parameter as the client meant it (an encoded slash is a slash)."""
    found = str(request.path_params[name])
    return found.replace(_SLASH, "/") if request.scope.get(_ENCODED_SLASHES) else found


class TokenEverywhere:
    """Every request needs the token (the API is bound off loopback, or asked to)."""

    def __init__(self, app: ASGIApp, access: Access) -> None:
        self.app, self.access = app, access

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = dict(scope.get("headers", []))
            authorization = headers.get(b"authorization", b"").decode("latin-1")
            page = scope["method"] == "GET" and scope["path"].startswith(("/queue", "/static/"))
            if not self.access.allows(authorization, basic=page):
                refusal = challenged(problem(401, TOKEN_NEEDED, "authorization"))
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)


class StrictPaths:
    """Paths and queries as exact text: invalid UTF-8 is refused, `%2F` stays in its value (a
    host app that includes `insights_router` adds it too)."""

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
        if any("/" in s for s in segments) and not any(_SLASH in s for s in segments):
            scope = {
                **scope,
                "path": "/".join(s.replace("/", _SLASH) for s in segments),
                _ENCODED_SLASHES: True,
            }
        await self.app(scope, receive, send)


class LimitedBodies:
    """Request bodies of at most `MAX_BODY_BYTES` (413 past it, before it is all read), and
    `X-Content-Type-Options: nosniff` on every answer."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        received = 0

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


TOO_LARGE = f"body: larger than {MAX_BODY_BYTES} bytes"


# -- a screen's poll ------------------------------------------------------------------------


def retry_after(state: InsightState) -> int | None:
    """Seconds until the next poll is worth making; None once the job is finished."""
    if state.status in (Status.DONE, Status.FAILED):
        return None
    if state.eta_seconds is None:
        return RETRY_MIN_SECONDS
    wait = min(max(state.eta_seconds * RETRY_FRACTION, RETRY_MIN_SECONDS), RETRY_MAX_SECONDS)
    return math.ceil(wait)


def etag(state: InsightState) -> str:
    """A weak ETag of what a screen is shown: the store's version, and this call's run."""
    tag = state.version or ""
    if state.flow_run_id is not None or state.run_note is not None:
        run = f"{state.flow_run_id}|{state.run_note}".encode()
        tag += "-" + hashlib.sha256(run).hexdigest()[:12]
    return f'W/"{tag}"'


def known_version(if_none_match: str | None) -> str | None:
    """The store's version the screen has, if its tag names one and no run."""
    for candidate in (if_none_match or "").split(","):
        tag = candidate.strip().removeprefix("W/").strip('"')
        if tag and "-" not in tag and tag != "*":
            return tag
    return None


def etag_matches(if_none_match: str, tag: str) -> bool:
    """The weak comparison of RFC 9110: `W/` ignored, `*` matches anything."""
    wanted = tag.removeprefix("W/")
    return any(
        c.strip() == "*" or c.strip().removeprefix("W/") == wanted for c in if_none_match.split(",")
    )


def insight_response(state: InsightState, if_none_match: str | None, timing: str) -> Response:
    """A poll's answer: 200 (or 304, before any body is made) with ETag, Retry-After and
    `timing` as its Server-Timing."""
    if state.status == Status.UNKNOWN:
        response = unavailable(state.error or "the store cannot be reached")
        response.headers["Server-Timing"] = timing
        return response
    headers = {"ETag": etag(state), "Cache-Control": "private, no-cache", "Server-Timing": timing}
    if (wait := retry_after(state)) is not None:
        headers["Retry-After"] = str(wait)
    if if_none_match and (state.unchanged or etag_matches(if_none_match, headers["ETag"])):
        return Response(status_code=304, headers=headers)
    return JSONResponse(state.as_dict(), headers=headers)


def insights_router(
    triggers: Triggers, current_user: Callable[..., Any], *, path: str = INSIGHT_PATH
) -> APIRouter:
    """A screen's poll for a host app: `GET /v1/insights/{kind}/{subject}?fingerprint=`.

    `current_user` is the host's dependency that yields the calling user's id (after its own
    authentication): a user can only ever poll their own insights."""
    router = APIRouter(dependencies=[Depends(single_values)])

    # `current_user` as a default: this module's annotations are strings, and
    # FastAPI cannot resolve a local name from one.
    @router.get(path, summary="A screen's poll")
    async def poll(
        request: Request,
        fingerprint: Annotated[str | None, Query()] = None,
        if_none_match: Annotated[str | None, Header()] = None,
        user_id: Any = Depends(current_user),  # noqa: B008
    ) -> Response:
        if isinstance(user_id, int) and not isinstance(user_id, bool):
            user_id = str(user_id)
        if not isinstance(user_id, str):
            raise TypeError(f"the user dependency yielded {type(user_id).__name__}, not an id")
        kind, subject = path_text(request, "kind"), path_text(request, "subject")
        started = time.perf_counter()
        state = await run_in_threadpool(
            triggers.request_insight,
            user_id,
            kind,
            subject,
            fingerprint,
            known=known_version(if_none_match),
        )
        # How long the store took, waiting for a thread included.
        elapsed = (time.perf_counter() - started) * 1000
        return insight_response(state, if_none_match, f"store;dur={elapsed:.1f}")

    return router


# -- the app ----------------------------------------------------------------------------------


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class BackfillRequest(_Body):
    sync_id: str | None = None


class PauseRequest(_Body):
    seconds: float
    reason: str = "paused by an operator"


def refresh_seconds(refresh: Annotated[str | None, Query()] = None) -> int:
    """The page's `?refresh=`: 0 turns it off; other values are held within the bounds."""
    if refresh is None:
        return REFRESH_SECONDS
    try:
        seconds = float(refresh.strip())
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds) or seconds < 0:
        message = f"refresh: must be a number of seconds (0 turns it off), got {refresh[:40]!r}"
        raise Refused(422, message, "refresh")
    if seconds == 0:
        return 0
    return int(min(max(math.ceil(seconds), REFRESH_MIN_SECONDS), REFRESH_MAX_SECONDS))


Limit = Annotated[int, Query(ge=1, le=1000)]
Changes = [Depends(json_only), Depends(same_site)]


def create_app(
    triggers: Triggers,
    *,
    host: str = DEFAULT_HOST,
    require_token: bool = False,
    token: SecretStr | None = None,
    ui_url: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The standalone app, for serving on `host`. `token` defaults to `AI_API_TOKEN`; every
    route needs it off loopback or with `require_token` (then the app is refused without one).
    `ui_url` gives the Prefect UI's address for the page."""
    settings = triggers.runtime.settings
    access = Access(
        settings.api.token if token is None else token,
        everywhere=require_token or not is_loopback(host),
    )
    check_exposure(host, access)
    links = ui_url or (lambda: prefect_api.ui_url(settings))
    store = triggers.store

    app = FastAPI(
        title="insight-queue",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.state.access = access
    add_error_handlers(app)
    app.add_middleware(StrictPaths)
    if access.everywhere:
        app.add_middleware(TokenEverywhere, access=access)
    app.add_middleware(LimitedBodies)
    app.mount("/static", StaticFiles(packages=[("deployments", "static")]), name="static")

    @app.get("/healthz")
    async def healthz() -> Response:
        gate = await run_in_threadpool(store.gate_state)
        return JSONResponse({"status": "ok", "now": iso(gate.now)}, headers=NO_STORE)

    def path_user(request: Request) -> str:
        return path_text(request, "user_id")

    app.include_router(
        insights_router(triggers, path_user, path="/v1/users/{user_id}/insights/{kind}/{subject}")
    )

    @app.post("/v1/users/{user_id}/backfills", status_code=202, dependencies=Changes)
    async def backfill(request: Request, body: BackfillRequest | None = None) -> Response:
        sync_id = body.sync_id if body else None
        state = await run_in_threadpool(triggers.trigger_backfill, path_user(request), sync_id)
        if state.error is not None and state.flow_run_id is None:
            return unavailable(state.error)
        answer = {"status": "started" if state.flow_run_id else "queued", **state.as_dict()}
        return JSONResponse(answer, 202, NO_STORE)

    @app.get("/v1/queue", dependencies=[Depends(operator), Depends(single_values)])
    async def queue(limit: Limit = QUEUE_LIMIT) -> Response:
        view = await run_in_threadpool(store.queue_view, limit)
        return JSONResponse(view.as_dict(), headers=NO_STORE)

    @app.post("/v1/pause", dependencies=[Depends(operator), *Changes])
    async def pause(body: PauseRequest) -> Response:
        gate = await run_in_threadpool(store.pause, body.seconds, body.reason)
        answer = {"paused_until": iso(gate.paused_until), "gate": gate.as_dict()}
        return JSONResponse(answer, headers=NO_STORE)

    @app.post("/v1/resume", dependencies=[Depends(operator), *Changes])
    async def resume(body: _Body | None = None) -> Response:
        gate = await run_in_threadpool(store.resume)
        return JSONResponse({"gate": gate.as_dict()}, headers=NO_STORE)

    @app.post("/v1/users/{user_id}/retry-failed", dependencies=[Depends(operator), *Changes])
    async def retry_failed(request: Request, body: _Body | None = None) -> Response:
        done = await run_in_threadpool(store.retry_failed, path_user(request))
        return JSONResponse(done.as_dict(), headers=NO_STORE)

    scraped = metrics.registry_for(store)

    @app.get("/metrics", dependencies=[Depends(scraper)])
    async def metrics_route() -> Response:
        body = await run_in_threadpool(generate_latest, scraped)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    @app.get("/queue", dependencies=[Depends(page_operator), Depends(single_values)])
    async def page(
        refresh: Annotated[int, Depends(refresh_seconds)], limit: Limit = QUEUE_LIMIT
    ) -> Response:
        stylesheet = str(app.url_path_for("static", path="queue.css"))
        render = functools.partial(queue_page.render, ui_url=links(), stylesheet=stylesheet)
        try:
            view = await run_in_threadpool(store.queue_view, limit)
        except Unavailable as exc:
            shown = render(None, refresh=refresh or REFRESH_SECONDS, error=str(exc))
            headers = {**PAGE_HEADERS, "Retry-After": str(STORE_DOWN_RETRY_SECONDS)}
            return HTMLResponse(shown, 503, headers)
        return HTMLResponse(render(view, refresh=refresh), headers=PAGE_HEADERS)

    return app


def check_exposure(host: str, access: Access) -> None:
    """Refuse to serve off loopback (or where asked to) without a token."""
    if access.everywhere and not access.configured:
        where = "a non-loopback address" if not is_loopback(host) else "--require-token"
        raise ApiConfigError(
            f"AI_API_TOKEN: must be set to serve on {host} ({where}): every route then "
            "needs it as a bearer token"
        )


def add_error_handlers(app: FastAPI) -> None:
    """Every refusal and failure as one line of JSON (a host app that mounts
    `insights_router` adds them too)."""

    @app.exception_handler(Refused)
    async def refused(request: Request, exc: Refused) -> Response:
        response = problem(exc.status, exc.message, exc.field)
        return challenged(response) if exc.challenge else response

    @app.exception_handler(InvalidArgument)
    async def invalid(request: Request, exc: InvalidArgument) -> Response:
        return problem(422, str(exc), exc.argument)

    @app.exception_handler(Misconfigured)
    async def misconfigured(request: Request, exc: Misconfigured) -> Response:
        return problem(500, f"the server is misconfigured: {exc}")

    @app.exception_handler(Unavailable)
    async def store_unavailable(request: Request, exc: Unavailable) -> Response:
        return unavailable(str(exc))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        messages = {404: "no such route", 405: "method not allowed on this route"}
        if exc.status_code == 400:  # FastAPI could not read the body
            return problem(400, "body: not valid JSON", "body")
        if exc.status_code == 413:
            return problem(413, TOO_LARGE, "body")
        message = messages.get(exc.status_code) or str(exc.detail)
        return problem(exc.status_code, message, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        first: Mapping[str, Any] = next(iter(exc.errors()), {})
        location = [str(p) for p in first.get("loc", ()) if p not in ("path", "query", "header")]
        if first.get("type") == "json_invalid":
            reason = first.get("ctx", {}).get("error", "")
            return problem(400, f"body: not valid JSON ({reason})", "body")
        field = location[-1] if location and not location[-1].isdigit() else "body"
        if field == "body" and len(location) > 1:
            field = location[1]
        return problem(422, f"{field}: {first.get('msg', 'invalid')}", field)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.error("unexpected error while answering a request", exc_info=exc)
        return problem(500, "internal error; the server's log has the details")


# -- serving ------------------------------------------------------------------------------------


def app_from_env() -> FastAPI:
    """The app for uvicorn's workers: settings from the environment, `AI_API_HOST` the bind."""
    anyio.to_thread.current_default_thread_limiter().total_tokens = STORE_THREADS
    settings = Settings()
    triggers = Triggers.open(settings)
    triggers.runtime.redact_logs()
    host = os.environ.get("AI_API_HOST", DEFAULT_HOST)
    return create_app(triggers, host=host, require_token=settings.api.require_token)


@click.command("api")
@click.option("--host", default=DEFAULT_HOST, show_default=True, help="address to bind")
@click.option("--port", type=click.IntRange(0, 65535), default=DEFAULT_PORT, show_default=True)
@click.option(
    "--workers",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="server processes (uvicorn's); one core serves about a few hundred polls a second",
)
@click.option(
    "--require-token",
    is_flag=True,
    help="need AI_API_TOKEN on every route even on loopback (behind a proxy)",
)
@click.pass_context
@fails_cleanly
def api_command(
    ctx: click.Context, host: str, port: int, workers: int, require_token: bool
) -> None:
    """Serve the HTTP API and the queue page until SIGTERM or SIGINT (uvicorn's)."""
    settings = settings_from(ctx)
    required = require_token or settings.api.require_token
    check_exposure(host, Access(settings.api.token, everywhere=required or not is_loopback(host)))
    os.environ.update(settings.to_env())
    os.environ["AI_API_HOST"] = host
    os.environ["AI_API_REQUIRE_TOKEN"] = "true" if required else "false"
    operator_note = "" if settings.api.token.get_secret_value() else " (operator routes off)"
    click.echo(f"insight-queue API at http://{host}:{port}; page at /queue{operator_note}")
    # With one process, SIGHUP stops it like SIGTERM; uvicorn's supervisor of
    # several restarts its workers on SIGHUP, as it documents.
    signal.signal(signal.SIGHUP, lambda *_: os.kill(os.getpid(), signal.SIGTERM))
    uvicorn.run(
        "deployments.api:app_from_env",
        factory=True,
        host=host,
        port=port,
        workers=workers,
        log_config=None,
        access_log=bool(ctx.find_root().params.get("verbose")),
        server_header=False,
        timeout_keep_alive=KEEP_ALIVE_SECONDS,
        timeout_graceful_shutdown=GRACEFUL_STOP_SECONDS,
    )
