"""A screen's poll (P1): the insight's state with an ETag, a 304 while nothing changed, and
`Retry-After` while it waits; for the standalone app and for a host app that mounts it behind its
own authentication (`insights_router`)."""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from deployments.http.deps import path_text, single_values
from deployments.http.errors import unavailable
from deployments.triggers import InsightState, Triggers
from queue_store import Status

INSIGHT_PATH = "/v1/insights/{kind}/{subject}"
# Retry-After for a job that is not finished: a quarter of its ETA, within these
# bounds; a screen sees its result at most a quarter of the wait after it is ready.
RETRY_FRACTION = 0.25
RETRY_MIN_SECONDS = 2
RETRY_MAX_SECONDS = 30


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
        known = known_version(if_none_match)
        started = time.perf_counter()
        state = await run_in_threadpool(
            triggers.request_insight, user_id, kind, subject, fingerprint, known=known
        )
        # How long the store took, waiting for a thread included.
        elapsed = (time.perf_counter() - started) * 1000
        return insight_response(state, if_none_match, f"store;dur={elapsed:.1f}")

    return router
