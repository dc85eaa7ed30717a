"""The standalone HTTP API: `create_app` wires the edges, the callers and the routes by audience
(`hooks`, `operator`), and `/healthz` for anyone. Store calls run in the threadpool, never on the
event loop: routes are plain functions, which FastAPI runs there (a screen's poll awaits its thread
itself, to time the wait)."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import FastAPI
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
    """Hosts, origins and rates are the settings'; `ui_url` gives the Prefect UI's address."""
    settings = triggers.runtime.settings
    app = FastAPI(title="insight-queue", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.triggers = triggers
    app.state.gatekeeper = Gatekeeper(credentials, settings.api)
    app.state.origins = tuple(settings.api.origins)
    add_error_handlers(app)
    add_edges(app, settings.api.hosts, settings.api.origins)
    app.mount("/static", StaticFiles(packages=[("deployments", "static")]), name="static")

    @app.get("/healthz")
    def healthz() -> Response:
        gate = triggers.operator.gate_state()
        return JSONResponse({"status": "ok", "now": iso(gate.now)}, headers=NO_STORE)

    app.include_router(app_router(triggers))
    links = ui_url or (lambda: prefect_api.ui_url(settings))
    app.include_router(operator_router(triggers.operator, links))
    return app
