"""The standalone HTTP API: `create_app` wires the edges, the callers and the routes.

Routes by audience: the app's (`hooks`: a screen's poll, the post-sync hook), the operator's
(`operator`: the queue, its actions, `/metrics`, the page), and `/healthz` for anyone. Every
route goes through `Triggers` (the operator's through its `operator` view of the store); store
calls run in the threadpool, never on the event loop. Who may call what: `access`.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.concurrency import run_in_threadpool
from fastapi.staticfiles import StaticFiles
from starlette.responses import JSONResponse, Response

from deployments import prefect_api
from deployments.http.access import Gatekeeper
from deployments.http.credentials import Credentials
from deployments.http.errors import NO_STORE, add_error_handlers
from deployments.http.hooks import app_router
from deployments.http.middleware import add_edges
from deployments.http.operator import operator_router
from deployments.triggers import Triggers
from queue_store.models import iso


def create_app(
    triggers: Triggers,
    credentials: Credentials,
    *,
    ui_url: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The app for these triggers and credentials; hosts, origins and rates are the settings'
    (`AI_API_*`). `ui_url` gives the Prefect UI's address for the page's links."""
    settings = triggers.runtime.settings
    found = ui_url or (lambda: prefect_api.ui_url(settings))

    def links() -> str | None:
        return link_without_credentials(found())

    app = FastAPI(title="insight-queue", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.triggers = triggers
    app.state.gatekeeper = Gatekeeper(credentials, settings.api)
    app.state.origins = tuple(settings.api.origins)
    add_error_handlers(app)
    add_edges(app, settings.api.hosts, settings.api.origins)
    app.mount("/static", StaticFiles(packages=[("deployments", "static")]), name="static")

    @app.get("/healthz")
    async def healthz() -> Response:
        gate = await run_in_threadpool(triggers.operator.gate_state)
        return JSONResponse({"status": "ok", "now": iso(gate.now)}, headers=NO_STORE)

    app.include_router(app_router(triggers))
    app.include_router(operator_router(triggers.operator, links))
    return app


def link_without_credentials(url: str | None) -> str | None:
    """An address for the page's links: without the user and password a `PREFECT_API_URL` (and
    so the UI's address made from it) may carry. A browser needs none, and the page must not
    show them."""
    if not url:
        return url
    parts = urllib.parse.urlsplit(url)
    if "@" not in parts.netloc:
        return url
    return urllib.parse.urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))
