"""The HTTP API under test, in this process: served on a free loopback port, with its callers.

`serve` builds the app from the runtime's settings and `Credentials.load`, as `insight-queue
api` does, and gives a client that calls as the app's backend (the service token), one that
sends no credential at all, and screen tokens signed the way the app signs them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Iterator
from typing import Any

import httpx
import jwt
from sqlalchemy import create_engine, select, text

from deployments.http import create_app
from deployments.http.credentials import Credentials
from deployments.triggers import Triggers
from devtools.stack import ApiServer
from flows.runtime import Runtime
from queue_store import JobStore, job_id, schema
from queue_store.engine import normalise_url

OPERATOR_TOKEN = "operator-token-for-tests"
SERVICE_TOKEN = "service-token-for-tests"
SCREEN_SECRET = "screen-secret-for-tests-0123456789abcdef"
AUDIENCE = "insight-queue"
UI = "http://127.0.0.1:4200"

OPERATOR = {"Authorization": f"Bearer {OPERATOR_TOKEN}"}
SERVICE = {"Authorization": f"Bearer {SERVICE_TOKEN}"}


def bearer(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def screen_token(
    user_id: str,
    *,
    key: Any = SCREEN_SECRET,
    algorithm: str = "HS256",
    ttl: float = 3600,
    headers: dict[str, Any] | None = None,
    **claims: Any,
) -> str:
    """A screen's token for `user_id` as the app signs it; `claims` add to or replace its own
    (None drops one)."""
    now = int(time.time())
    payload: dict[str, Any] = {"sub": user_id, "aud": AUDIENCE, "iat": now, "exp": now + ttl}
    payload.update(claims)
    payload = {name: value for name, value in payload.items() if value is not None}
    return jwt.encode(payload, key, algorithm=algorithm, headers=headers)


def as_screen(user_id: str, **options: Any) -> dict[str, str]:
    """The headers of a screen that acts for `user_id`."""
    return bearer(screen_token(user_id, **options))


@dataclasses.dataclass
class Served:
    """The API under test: its server, clients, the store and the credentials behind it."""

    server: ApiServer
    http: httpx.Client  # calls as the app's backend: the service token
    bare: httpx.Client  # sends no credential
    runtime: Runtime
    triggers: Triggers
    credentials: Credentials

    @property
    def store(self) -> JobStore:
        return self.runtime.store

    @property
    def database_url(self) -> str:
        return self.runtime.settings.database_url

    def poll(self, user: str, kind: str, subject: str, **params: Any) -> httpx.Response:
        return self.http.get(insight_path(user, kind, subject), params=params)


def insight_path(user: str, kind: str, subject: str) -> str:
    return f"/v1/users/{user}/insights/{kind}/{subject}"


@contextlib.contextmanager
def serve(runtime: Runtime, prefect_url: str | None) -> Iterator[Served]:
    """The API of `runtime`'s settings on a free loopback port, in a thread of this process,
    stopped at the end."""
    triggers = Triggers(runtime, prefect_url=prefect_url)
    credentials = Credentials.load(runtime.settings)
    app = create_app(triggers, credentials, ui_url=lambda: UI)
    with (
        ApiServer(app) as server,
        httpx.Client(base_url=server.url, timeout=30, headers=SERVICE) as http,
        httpx.Client(base_url=server.url, timeout=30) as bare,
    ):
        yield Served(server, http, bare, runtime, triggers, credentials)


def assert_refused(response: httpx.Response, status: int, field: str | None) -> str:
    """A refusal: the status, one line of JSON naming the field, nothing else."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert "\n" not in response.text
    body = response.json()
    assert set(body) <= {"error", "field"}
    assert isinstance(body["error"], str) and body["error"]
    assert "Traceback" not in body["error"]
    assert body.get("field") == field, body
    return str(body["error"])


def assert_challenged(response: httpx.Response) -> None:
    """A 401 that asks for a credential: a bearer token, or Basic (a browser prompts)."""
    assert_refused(response, 401, "authorization")
    challenges = response.headers.get_list("www-authenticate")
    assert any(c.startswith("Bearer") for c in challenges), challenges
    assert any(c.startswith("Basic") for c in challenges), challenges


def row_version(url: str, user: str, kind: str, subject: str) -> tuple[Any, ...] | None:
    """The job row's revision and updated time, read on a connection of its own."""
    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as connection:
            row = connection.execute(
                select(schema.jobs.c.revision, schema.jobs.c.updated_at).where(
                    schema.jobs.c.id == job_id(user, kind, subject)
                )
            ).one_or_none()
    finally:
        engine.dispose()
    return None if row is None else tuple(row)


def job_count(url: str) -> int:
    engine = create_engine(normalise_url(url))
    try:
        with engine.connect() as connection:
            return int(connection.execute(text("SELECT count(*) FROM ai_jobs")).scalar_one())
    finally:
        engine.dispose()
