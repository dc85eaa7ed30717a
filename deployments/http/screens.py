"""The app's routes: a screen's poll (P1), also for a host app to mount, and the post-sync hook."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from deployments.http.access import (
    Body,
    Writes,
    for_user,
    path_text,
    same_site,
    service,
    single_values,
)
from deployments.http.edges import NO_STORE, unavailable
from deployments.triggers import InsightState, Triggers
from queue_store import Status

INSIGHT_PATH = "/v1/insights/{kind}/{subject}"
USER_INSIGHT_PATH = "/v1/users/{user_id}/insights/{kind}/{subject}"
# Retry-After for a job that is not finished: a quarter of its ETA, within these
# bounds; a screen sees its result at most a quarter of the wait after it is ready.
RETRY_FRACTION = 0.25
RETRY_MIN_SECONDS = 2
RETRY_MAX_SECONDS = 30


class BackfillRequest(Body):
    sync_id: str | None = None


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
    """200, or 304 before any body is made, with ETag, Retry-After and Server-Timing."""
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
    triggers: Triggers,
    current_user: Callable[..., Any],
    *,
    path: str = INSIGHT_PATH,
    dependencies: list[Any] | None = None,
) -> APIRouter:
    """A screen's poll; `current_user` is the host app's dependency yielding the caller's id."""
    router = APIRouter(dependencies=[Depends(single_values), *(dependencies or [])])

    # `current_user` as a default: FastAPI cannot resolve a local name from an annotation.
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


def app_router(triggers: Triggers) -> APIRouter:
    """The poll for a screen's own user (or the service's), and the backfill (the service's)."""
    router = APIRouter()
    # Its own router: the poll's dependencies are not the backfill's.
    router.include_router(
        insights_router(
            triggers, for_user, path=USER_INSIGHT_PATH, dependencies=[Depends(same_site)]
        )
    )

    @router.post(
        "/v1/users/{user_id}/backfills", status_code=202, dependencies=[Depends(service), *Writes]
    )
    async def backfill(request: Request, body: BackfillRequest | None = None) -> Response:
        sync_id = body.sync_id if body else None
        user_id = path_text(request, "user_id")
        state = await run_in_threadpool(triggers.trigger_backfill, user_id, sync_id)
        if state.error is not None and state.flow_run_id is None:
            return unavailable(state.error)
        answer = {"status": "started" if state.flow_run_id else "queued", **state.as_dict()}
        return JSONResponse(answer, 202, NO_STORE)

    return router
