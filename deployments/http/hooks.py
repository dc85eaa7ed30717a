"""The app's own routes: a screen's poll for the user it acts for, and the post-sync hook.

The poll takes a screen's token for its own user, or the service token for any user; the
backfill, the service token only. Both write (a poll queues its insight), so they refuse pages
of other sites but the app's own origins.
"""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from starlette.responses import JSONResponse, Response

from deployments.http.deps import TriggersDep, Writes, for_user, path_text, same_site, service
from deployments.http.errors import NO_STORE, unavailable
from deployments.http.operator import Body
from deployments.http.screens import insights_router
from deployments.triggers import Triggers

USER_INSIGHT_PATH = "/v1/users/{user_id}/insights/{kind}/{subject}"


class BackfillRequest(Body):
    sync_id: str | None = None


def app_router(triggers: Triggers) -> APIRouter:
    router = APIRouter()
    router.include_router(
        insights_router(
            triggers, for_user, path=USER_INSIGHT_PATH, dependencies=[Depends(same_site)]
        )
    )

    @router.post(
        "/v1/users/{user_id}/backfills",
        status_code=202,
        dependencies=[Depends(service), *Writes],
    )
    async def backfill(
        request: Request, triggers: TriggersDep, body: BackfillRequest | None = None
    ) -> Response:
        sync_id = body.sync_id if body else None
        user_id = path_text(request, "user_id")
        state = await run_in_threadpool(triggers.trigger_backfill, user_id, sync_id)
        if state.error is not None and state.flow_run_id is None:
            return unavailable(state.error)
        answer = {"status": "started" if state.flow_run_id else "queued", **state.as_dict()}
        return JSONResponse(answer, 202, NO_STORE)

    return router
