"""The operator's routes: the queue, its actions, `/metrics`, and the page; the operator token only
(the page also takes it as Basic's password, from the same site)."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.responses import HTMLResponse, JSONResponse, Response

from deployments import metrics, queue_page
from deployments.http.deps import (
    Body,
    OperationsDep,
    TriggersDep,
    Writes,
    operator,
    page_operator,
    path_text,
    single_values,
)
from deployments.http.errors import NO_STORE, STORE_DOWN_RETRY_SECONDS, Refused
from queue_store import OperatorStore, Unavailable
from queue_store.models import iso

# The queue page: default refresh, its bounds (0 turns it off), rows shown.
REFRESH_SECONDS = 5
REFRESH_MIN_SECONDS = 2
REFRESH_MAX_SECONDS = 600
QUEUE_LIMIT = 50
PAGE_HEADERS = {
    **NO_STORE,
    "Content-Security-Policy": (
        "default-src 'none'; style-src 'self'; base-uri 'none'; form-action 'none'; "
        "frame-ancestors 'none'"
    ),
    "Referrer-Policy": "no-referrer",
}

Limit = Annotated[int, Query(ge=1, le=1000)]


class PauseRequest(Body):
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


def operator_router(store: OperatorStore, ui_url: Callable[[], str | None]) -> APIRouter:
    """The operator's routes; `/metrics` reads `store` at every scrape (M1)."""
    router = APIRouter(dependencies=[Depends(single_values)])
    scraped = metrics.registry_for(store)
    only = [Depends(operator)]

    @router.get("/v1/queue", dependencies=only)
    def queue(ops: OperationsDep, limit: Limit = QUEUE_LIMIT) -> Response:
        return JSONResponse(ops.queue_view(limit).as_dict(), headers=NO_STORE)

    @router.post("/v1/pause", dependencies=[*only, *Writes])
    def pause(ops: OperationsDep, body: PauseRequest) -> Response:
        gate = ops.pause(body.seconds, body.reason)
        answer = {"paused_until": iso(gate.paused_until), "gate": gate.as_dict()}
        return JSONResponse(answer, headers=NO_STORE)

    @router.post("/v1/resume", dependencies=[*only, *Writes])
    def resume(ops: OperationsDep, body: Body | None = None) -> Response:
        return JSONResponse({"gate": ops.resume().as_dict()}, headers=NO_STORE)

    @router.post("/v1/users/{user_id}/retry-failed", dependencies=[*only, *Writes])
    def retry_failed(request: Request, ops: OperationsDep, body: Body | None = None) -> Response:
        done = ops.retry_failed(path_text(request, "user_id"))
        return JSONResponse(done.as_dict(), headers=NO_STORE)

    @router.delete("/v1/users/{user_id}", dependencies=[*only, *Writes])
    def forget(request: Request, triggers: TriggersDep) -> Response:
        """Erase the user (D3): the store's part at once, Prefect's when it can."""
        state = triggers.forget(path_text(request, "user_id"))
        return JSONResponse(state.as_dict(), headers=NO_STORE)

    @router.get("/metrics", dependencies=only)
    def metrics_route() -> Response:
        return Response(generate_latest(scraped), media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    @router.get("/queue", dependencies=[Depends(page_operator)])
    def page(
        request: Request,
        ops: OperationsDep,
        refresh: Annotated[int, Depends(refresh_seconds)],
        limit: Limit = QUEUE_LIMIT,
    ) -> Response:
        stylesheet = str(request.url_for("static", path="queue.css").path)
        render = functools.partial(queue_page.render, ui_url=ui_url(), stylesheet=stylesheet)
        try:
            view = ops.queue_view(limit)
        except Unavailable as exc:
            shown = render(None, refresh=refresh or REFRESH_SECONDS, error=str(exc))
            headers = {**PAGE_HEADERS, "Retry-After": str(STORE_DOWN_RETRY_SECONDS)}
            return HTMLResponse(shown, 503, headers)
        return HTMLResponse(render(view, refresh=refresh), headers=PAGE_HEADERS)

    return router
