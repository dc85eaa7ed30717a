"""The app's own routes: a screen's poll for the user it acts for (a screen's token for its own
user, or the service token), and the post-sync hook's backfill (the service token)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from starlette.responses import JSONResponse, Response

from deployments.http.deps import (
    Body,
    TriggersDep,
    Writes,
    for_user,
    path_text,
    same_site,
    service,
)
from deployments.http.errors import NO_STORE, unavailable
from deployments.http.screens import insights_router
from deployments.triggers import Triggers

USER_INSIGHT_PATH = "/v1/users/{user_id}/insights/{kind}/{subject}"


class BackfillRequest(Body):
    sync_id: str | None = None


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
    def backfill(
        request: Request, triggers: TriggersDep, body: BackfillRequest | None = None
    ) -> Response:
        sync_id = body.sync_id if body else None
        state = triggers.trigger_backfill(path_text(request, "user_id"), sync_id)
        if state.error is not None and state.flow_run_id is None:
            return unavailable(state.error)
        answer = {"status": "started" if state.flow_run_id else "queued", **state.as_dict()}
        return JSONResponse(answer, 202, NO_STORE)

    return router
