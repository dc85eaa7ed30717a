"""The HTTP API over real HTTP: uvicorn on a free loopback port, on SQLite and PostgreSQL.

Every route is called the way a screen, the post-sync hook or an operator
calls it, with its credential: the client calls as the app's backend (the
service token), operator routes are given the operator's token (who may call
what, and from where: test_api_access.py). Prefect is never reachable here
(the triggers point at a closed loopback port), so every poll answers on the
store alone and says why no run was started. Faults are made by events: the
store is taken away (a directory where the SQLite file was, a PostgreSQL
database that refuses connections) and given back, never by waiting for a
moment.
"""

from __future__ import annotations

import base64
import math
import re
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Header, HTTPException
from prometheus_client.parser import text_string_to_metric_families
from pydantic import SecretStr
from sqlalchemy import create_engine, event, text
from sqlalchemy.engine import make_url

from deployments.http import StrictPaths, add_error_handlers, create_app, insights_router
from deployments.http.credentials import CREDENTIALS_FILE, Credentials
from deployments.http.screens import etag
from deployments.processes import free_port
from deployments.triggers import NO_SERVER, InsightState, Triggers
from devtools.stack import ApiServer
from flows.registry import Messages, Registry, Scope
from flows.runtime import Runtime
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    Failure,
    JobStore,
    Redactor,
    Settings,
    SettingsError,
    Status,
    Usage,
)
from queue_store.engine import normalise_url
from tests.support.api import (
    OPERATOR,
    OPERATOR_TOKEN,
    SCREEN_SECRET,
    SERVICE,
    SERVICE_TOKEN,
    Served,
    as_screen,
    assert_challenged,
    assert_refused,
    bearer,
    job_count,
    row_version,
    serve,
)
from tests.support.databases import POSTGRES_URL, FakeClock
from tests.support.factories import settings_for, store_for
from tests.support.reads import engine_of, job_of
from tests.support.services import ROOT

TOKEN = OPERATOR_TOKEN
USER = "user-1"
DAY = "2026-11-29"


def _ask(user_id: str, subject: str) -> Messages:
    return [{"role": "user", "content": f"insight for {user_id}/{subject}"}]


def _scopes(user_id: str) -> list[Scope]:
    return [Scope("sleep", DAY, "fp-sleep"), Scope("hrv", DAY, "fp-hrv")]


@pytest.fixture
def closed_prefect() -> str:
    """A Prefect API address where nothing listens."""
    return f"http://127.0.0.1:{free_port()}/api"


def make_settings(database_url: str, data_dir: Path, **api: Any) -> Settings:
    return settings_for(
        database_url=database_url,
        data_dir=data_dir,
        max_attempts=1,
        api=api,
    )


@pytest.fixture
def settings(database_url: str, tmp_path: Path) -> Settings:
    return make_settings(
        database_url,
        tmp_path / "data",
        operator_token=SecretStr(OPERATOR_TOKEN),
        service_token=SecretStr(SERVICE_TOKEN),
        screen_secret=SecretStr(SCREEN_SECRET),
    )


def make_runtime(settings: Settings) -> Runtime:
    registry = Registry()
    for kind in ("sleep", "hrv", "trends"):
        registry.register_generator(kind, _ask)
    registry.register_scopes(_scopes)
    store = store_for(settings)
    return Runtime(settings, store, registry, Redactor(settings.secrets()))


@pytest.fixture
def runtime(settings: Settings) -> Iterator[Runtime]:
    made = make_runtime(settings)
    yield made
    made.close()


@pytest.fixture
def api(runtime: Runtime, closed_prefect: str) -> Iterator[Served]:
    with serve(runtime, closed_prefect) as served:
        yield served


# -- helpers -------------------------------------------------------------------------------


def expected_retry_after(eta: float) -> int:
    return math.ceil(min(max(eta * 0.25, 2), 30))


def finish(store: JobStore, output: Any) -> None:
    """Claim the next job and finish it with `output`, as a worker would."""
    claim = store.claim_next("test-worker")
    assert claim.job is not None and claim.job.holder is not None
    store.finish(claim.job.id, claim.job.holder, result=output)


# -- a screen's poll -----------------------------------------------------------------------


def test_healthz_and_a_first_poll_queue_the_insight_at_the_front(api: Served) -> None:
    health = api.http.get("/healthz")
    assert health.status_code == 200
    assert health.json()["status"] == "ok"

    api.store.enqueue("someone-else", "hrv", DAY, None, PREFETCH)
    response = api.poll(USER, "sleep", DAY, fingerprint="fp-1")
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == set(InsightState("pending").as_dict())
    assert body["status"] == "pending"
    assert body["ahead"] == 0, "a screen's insight goes before a backfill's"
    assert body["eta_seconds"] > 0
    assert body["result"] is None and body["fresh"] is False
    assert body["flow_run_id"] is None
    assert body["run_note"].startswith("Prefect unreachable at http://127.0.0.1:")
    assert response.headers["etag"].startswith('W/"')
    assert int(response.headers["retry-after"]) == expected_retry_after(body["eta_seconds"])
    assert response.headers["server-timing"].startswith("store;dur=")
    job = job_of(api.store, USER, "sleep", DAY)
    assert job is not None and job.priority == INTERACTIVE and job.fingerprint == "fp-1"


def test_a_poll_that_changes_nothing_writes_nothing(api: Served) -> None:
    assert api.poll(USER, "sleep", DAY, fingerprint="fp-1").status_code == 200
    before = row_version(api.database_url, USER, "sleep", DAY)
    for _ in range(5):
        assert api.poll(USER, "sleep", DAY, fingerprint="fp-1").json()["status"] == "pending"
    assert row_version(api.database_url, USER, "sleep", DAY) == before

    finish(api.store, {"text": "slept well"})
    done = row_version(api.database_url, USER, "sleep", DAY)
    for _ in range(5):
        assert api.poll(USER, "sleep", DAY, fingerprint="fp-1").json()["status"] == "done"
    assert row_version(api.database_url, USER, "sleep", DAY) == done

    # New data is a change, and is written: the job goes back into the queue.
    assert api.poll(USER, "sleep", DAY, fingerprint="fp-2").json()["status"] == "pending"
    changed = row_version(api.database_url, USER, "sleep", DAY)
    assert changed is not None and done is not None and changed[0] == done[0] + 1


def test_the_result_carries_an_etag_and_an_unchanged_one_is_a_304(api: Served) -> None:
    api.poll(USER, "sleep", DAY, fingerprint="fp-1")
    finish(api.store, {"text": "slept well"})

    first = api.poll(USER, "sleep", DAY, fingerprint="fp-1")
    body = first.json()
    assert body["status"] == "done" and body["fresh"] is True
    assert body["result"]["output"] == {"text": "slept well"}
    assert body["result"]["fingerprint"] == "fp-1"
    assert "retry-after" not in first.headers, "nothing more to wait for"
    tag = first.headers["etag"]

    for sent in (tag, tag.removeprefix("W/"), f'"other", {tag}', "*"):
        again = api.http.get(
            f"/v1/users/{USER}/insights/sleep/{DAY}",
            params={"fingerprint": "fp-1"},
            headers={"If-None-Match": sent},
        )
        assert again.status_code == 304, sent
        assert again.content == b""
        assert again.headers["etag"] == tag

    # New data: the old result is still shown, not fresh, under another tag.
    stale = api.http.get(
        f"/v1/users/{USER}/insights/sleep/{DAY}",
        params={"fingerprint": "fp-2"},
        headers={"If-None-Match": tag},
    )
    assert stale.status_code == 200
    assert stale.json()["status"] == "pending" and stale.json()["fresh"] is False
    assert stale.json()["result"]["output"] == {"text": "slept well"}
    assert stale.headers["etag"] != tag
    assert "retry-after" in stale.headers


def test_retry_after_follows_the_eta_and_a_pause(api: Served) -> None:
    for n in range(3):
        api.store.enqueue(f"ahead-{n}", "sleep", DAY, None, INTERACTIVE)
    response = api.poll(USER, "sleep", DAY)
    body = response.json()
    assert body["ahead"] == 3
    assert int(response.headers["retry-after"]) == expected_retry_after(body["eta_seconds"])

    api.store.pause(3600, "gateway maintenance")
    paused = api.poll(USER, "sleep", DAY)
    assert paused.json()["paused"].startswith("operator for ")
    assert paused.json()["paused"].endswith(": gateway maintenance")
    assert paused.headers["retry-after"] == "30", "long waits are polled every 30 s"


def test_the_etag_ignores_the_countdown_of_the_eta_and_of_a_pause(
    settings: Settings, clock: FakeClock
) -> None:
    store = store_for(settings, clock=clock)
    try:
        store.enqueue("before-1", "sleep", DAY, None, INTERACTIVE)
        store.enqueue("before-2", "sleep", DAY, None, INTERACTIVE)
        store.pause(600, "maintenance")
        one = InsightState.of(store.poll(USER, "sleep", DAY))
        clock.advance(10)
        later = InsightState.of(store.poll(USER, "sleep", DAY))
        assert (one.eta_seconds, one.paused) != (later.eta_seconds, later.paused)
        assert etag(one) == etag(later)
        claim = store.claim_next("w")  # paused: nothing moves
        store.resume()
        claim = store.claim_next("w")
        assert claim.job is not None
        store.finish(claim.job.id, claim.job.holder or "", result="x")
        moved = InsightState.of(store.poll(USER, "sleep", DAY))
        assert moved.ahead == 1 and etag(moved) != etag(later)
    finally:
        store.close()


def test_a_consumer_standing_by_means_no_run_is_asked_for(api: Served) -> None:
    api.store.presence("consumer-1", "consumer")
    body = api.poll(USER, "sleep", DAY).json()
    assert body["status"] == "pending"
    assert body["run_note"] is None and body["flow_run_id"] is None


def test_with_no_prefect_server_at_all_a_poll_says_so(
    runtime: Runtime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PREFECT_API_URL", raising=False)
    with serve(runtime, None) as served:
        body = served.poll(USER, "sleep", DAY).json()
        assert body["status"] == "pending"
        assert body["run_note"] == NO_SERVER


# -- the post-sync hook ----------------------------------------------------------------------


def test_a_backfill_is_accepted_queued_and_idempotent_by_sync_id(api: Served) -> None:
    first = api.http.post(f"/v1/users/{USER}/backfills", json={"sync_id": "sync-1"})
    assert first.status_code == 202, first.text
    body = first.json()
    assert body["status"] == "queued"
    assert body["user_id"] == USER and body["queued"] == 2
    assert body["flow_run_id"] is None and body["error"] is None
    assert body["run_note"].startswith("Prefect unreachable")
    rows = {k: row_version(api.database_url, USER, k, DAY) for k in ("sleep", "hrv")}
    assert all(rows.values())
    for kind in ("sleep", "hrv"):
        job = job_of(api.store, USER, kind, DAY)
        assert job is not None and job.priority == PREFETCH and job.status == Status.PENDING

    again = api.http.post(f"/v1/users/{USER}/backfills", json={"sync_id": "sync-1"})
    assert again.status_code == 202 and again.json() == body
    assert {k: row_version(api.database_url, USER, k, DAY) for k in rows} == rows
    assert job_count(api.database_url) == 2

    no_sync = api.http.post(f"/v1/users/{USER}/backfills")
    assert no_sync.status_code == 202 and no_sync.json()["queued"] == 2


def test_a_bad_backfill_is_refused_naming_the_field_and_queues_nothing(api: Served) -> None:
    url = f"/v1/users/{USER}/backfills"
    assert_refused(api.http.post(url, json={"sync_id": 42}), 422, "sync_id")
    assert_refused(api.http.post(url, json={"sync_id": ""}), 422, "sync_id")
    assert_refused(api.http.post(url, json={"sync_id": "s" * 201}), 422, "sync_id")
    assert_refused(api.http.post(url, json={"sync": "s"}), 422, "sync")
    assert_refused(api.http.post(url, json=["sync-1"]), 422, "body")
    as_json = {"Content-Type": "application/json"}
    assert_refused(api.http.post(url, content=b"{not json", headers=as_json), 400, "body")
    assert_refused(api.http.post(url, content=b"\xff\xfe", headers=as_json), 400, "body")
    assert_refused(api.http.post(url, content=b"[" * 100_000, headers=as_json), 413, "body")
    deep = b"[" * 5_000 + b"]" * 5_000
    assert_refused(api.http.post(url, content=deep, headers=as_json), 400, "body")
    assert_refused(api.http.post("/v1/users/%20/backfills", json={}), 422, "user_id")
    assert_refused(api.http.post("/v1/users/a%7Cb/backfills", json={}), 422, "user_id")
    assert_refused(api.http.get(url), 405, None)
    assert job_count(api.database_url) == 0


# -- the operator --------------------------------------------------------------------------

OPERATOR_ROUTES = [
    ("GET", "/v1/queue", None),
    ("POST", "/v1/pause", {"seconds": 60, "reason": "refused"}),
    ("POST", "/v1/resume", None),
    ("POST", f"/v1/users/{USER}/retry-failed", None),
    ("GET", "/queue", None),
]


def test_operator_routes_need_the_token(api: Served) -> None:
    wrong = [
        {},
        {"Authorization": "Bearer not-the-token"},
        {"Authorization": f"Bearer {TOKEN}x"},
        {"Authorization": "Bearer"},
        {"Authorization": TOKEN},
        {"Authorization": f"Token {TOKEN}"},
        {"Authorization": "Basic !!!"},
        {"Authorization": f"Basic {base64.b64encode(b'op:nope').decode()}"},
        {"Authorization": f"Basic {base64.b64encode(TOKEN.encode()).decode()}"},
    ]
    for method, path, payload in OPERATOR_ROUTES:
        for headers in wrong:
            assert_challenged(api.bare.request(method, path, json=payload, headers=headers))
        allowed = api.bare.request(method, path, json=payload, headers=OPERATOR)
        assert allowed.status_code == 200, (path, allowed.text)
        resumed = api.bare.post("/v1/resume", headers=OPERATOR)
        assert resumed.status_code == 200
    assert api.bare.get("/queue", auth=("anyone", TOKEN)).status_code == 200
    assert not api.store.gate_state().paused


def test_credentials_not_set_are_made_once_kept_and_asked_for(
    database_url: str, tmp_path: Path, closed_prefect: str
) -> None:
    # Without a token set, operator routes were once off and screens open on loopback: now
    # the credentials not set are made, kept for every process, and every route asks for one.
    settings = make_settings(database_url, tmp_path / "data")
    runtime = make_runtime(settings)
    try:
        with serve(runtime, closed_prefect) as served:
            made = served.credentials
            kept = settings.data_dir / CREDENTIALS_FILE
            assert set(made.made) == {"operator_token", "service_token", "screen_secret"}
            assert made.path == kept
            assert stat.S_IMODE(kept.stat().st_mode) == 0o600
            assert stat.S_IMODE(kept.parent.stat().st_mode) == 0o700
            assert len(made.operator_token) >= 16 and len(made.service_token) >= 16
            assert made.operator_token != made.service_token
            operator = bearer(made.operator_token)
            for method, path, payload in OPERATOR_ROUTES:
                assert_challenged(served.bare.request(method, path, json=payload))
                # The client's service token is the test's own, not the one made: no caller.
                assert_challenged(served.http.request(method, path, json=payload))
                allowed = served.bare.request(method, path, json=payload, headers=operator)
                assert allowed.status_code == 200, (path, allowed.text)
                assert served.bare.post("/v1/resume", headers=operator).status_code == 200
            assert_challenged(served.bare.get("/metrics"))
            assert served.bare.get("/metrics", headers=operator).status_code == 200

            assert_challenged(served.bare.get(f"/v1/users/{USER}/insights/sleep/{DAY}"))
            assert_challenged(served.poll(USER, "sleep", DAY))
            assert job_count(served.database_url) == 0, "screens are not open on loopback"
            service = bearer(made.service_token)
            polled = served.bare.get(f"/v1/users/{USER}/insights/sleep/{DAY}", headers=service)
            assert polled.status_code == 200, polled.text
            screen = bearer(made.screens.issue("user-2", 60))
            own = served.bare.get(f"/v1/users/user-2/insights/sleep/{DAY}", headers=screen)
            assert own.status_code == 200, own.text
            assert not served.store.gate_state().paused

        # Every later process reads the same, and makes nothing; a worker only reads.
        for again in (Credentials.load(settings), Credentials.load(settings, create=False)):
            assert again.made == ()
            assert (again.operator_token, again.service_token) == (
                made.operator_token,
                made.service_token,
            )
            assert again.screens.user_of(made.screens.issue(USER, 60)) == USER
    finally:
        runtime.close()


def test_the_operator_sees_the_queue_pauses_resumes_and_retries(api: Served) -> None:
    store = api.store
    store.enqueue(USER, "hrv", DAY)
    claim = store.claim_next("test-worker")
    assert claim.job is not None and claim.job.holder is not None
    store.fail(claim.job.id, claim.job.holder, Failure.REJECTED, "HTTP 400: prompt too long")
    store.enqueue("user-2", "sleep", DAY, None, PREFETCH)
    store.enqueue(USER, "sleep", DAY, None, INTERACTIVE)

    shown = api.http.get("/v1/queue", params={"limit": 10}, headers=OPERATOR)
    assert shown.status_code == 200
    view = shown.json()
    expected = store.queue_view(10).as_dict()
    assert set(view) == set(expected)
    assert [j["id"] for j in view["waiting"]] == [j["id"] for j in expected["waiting"]]
    assert [j["place"] for j in view["waiting"]] == [1, 2]
    assert view["waiting"][0]["user_id"] == USER and view["waiting"][0]["kind"] == "sleep"
    assert view["waiting_total"] == 2 and view["failed_total"] == 1
    assert view["recent_failures"][0]["error"] == "HTTP 400: prompt too long"
    assert view["now"].endswith("+00:00")
    limited = api.http.get("/v1/queue", params={"limit": 1}, headers=OPERATOR).json()
    assert len(limited["waiting"]) == 1 and limited["waiting_total"] == 2

    paused = api.http.post(
        "/v1/pause", json={"seconds": 120, "reason": "gateway upgrade"}, headers=OPERATOR
    )
    assert paused.status_code == 200
    assert paused.json()["gate"]["paused"] is True
    assert paused.json()["gate"]["pause_reason"] == "gateway upgrade"
    assert paused.json()["paused_until"].endswith("+00:00")
    assert store.gate_state().paused
    assert store.claim_next("test-worker").job is None

    resumed = api.http.post("/v1/resume", headers=OPERATOR)
    assert resumed.status_code == 200 and resumed.json()["gate"]["paused"] is False
    assert not store.gate_state().paused

    retried = api.http.post(f"/v1/users/{USER}/retry-failed", headers=OPERATOR)
    assert retried.status_code == 200
    assert retried.json() == {"user_id": USER, "retried": 1, "pending": 2}
    job = job_of(store, USER, "hrv", DAY)
    assert job is not None and job.status == Status.PENDING and job.attempts == 0


def test_bad_operator_input_is_refused_naming_the_field(api: Served) -> None:
    for payload, field in [
        ({}, "seconds"),
        ({"seconds": "60"}, "seconds"),
        ({"seconds": -1}, "seconds"),
        ({"seconds": True}, "seconds"),
        ({"seconds": 1e300}, "seconds"),
        ({"seconds": 60, "reason": 5}, "reason"),
        ({"seconds": 60, "reason": "  "}, "reason"),
        ({"seconds": 60, "until": "later"}, "until"),
    ]:
        assert_refused(api.http.post("/v1/pause", json=payload, headers=OPERATOR), 422, field)
    as_json = {**OPERATOR, "Content-Type": "application/json"}
    nan = api.http.post("/v1/pause", content=b'{"seconds": NaN}', headers=as_json)
    assert_refused(nan, 422, "seconds")
    assert_refused(api.http.post("/v1/resume", json={"x": 1}, headers=OPERATOR), 422, "x")
    for limit in ("0", "1001", "abc", "1.5", ""):
        refused = api.http.get("/v1/queue", params={"limit": limit}, headers=OPERATOR)
        assert_refused(refused, 422, "limit")
    for refresh in ("soon", "-1", "nan", "inf"):
        refused = api.http.get("/queue", params={"refresh": refresh}, headers=OPERATOR)
        assert_refused(refused, 422, "refresh")
    assert_refused(api.http.post("/v1/users/%00/retry-failed", headers=OPERATOR), 422, "user_id")
    assert not api.store.gate_state().paused


def test_the_page_honours_refresh_within_bounds(api: Served) -> None:
    def meta_refresh(value: str | None) -> str | None:
        params = {} if value is None else {"refresh": value}
        page = api.http.get("/queue", params=params, headers=OPERATOR)
        assert page.status_code == 200
        assert page.headers["content-type"].startswith("text/html")
        assert "default-src 'none'" in page.headers["content-security-policy"]
        marker = '<meta http-equiv="refresh" content="'
        if marker not in page.text:
            return None
        return page.text.split(marker, 1)[1].split('"', 1)[0]

    assert meta_refresh(None) == "5"
    assert meta_refresh("10") == "10"
    assert meta_refresh("0.5") == "2"
    assert meta_refresh("100000") == "600"
    assert meta_refresh("0") is None


def test_a_waiting_jobs_poll_is_one_store_transaction_and_a_304_loads_no_result(
    api: Served,
) -> None:
    engine = engine_of(api.store)
    begun: list[int] = []
    statements: list[str] = []

    def on_begin(connection: Any) -> None:
        begun.append(1)

    def on_statement(connection: Any, cursor: Any, statement: str, *rest: Any) -> None:
        statements.append(statement)

    api.store.enqueue("ahead", "sleep", DAY, None, INTERACTIVE)
    first = api.poll(USER, "sleep", DAY, fingerprint="fp")  # queued: a write, then a read
    assert first.json()["status"] == "pending" and first.json()["ahead"] == 1
    event.listen(engine, "begin", on_begin)
    event.listen(engine, "before_cursor_execute", on_statement)
    try:
        again = api.poll(USER, "sleep", DAY, fingerprint="fp")
        assert again.status_code == 200 and again.json()["ahead"] == 1
        assert len(begun) == 1, "a waiting job's unchanged poll is one store transaction"
        assert not [s for s in statements if s.lstrip().upper().startswith(("INSERT", "UPDATE"))]
    finally:
        event.remove(engine, "begin", on_begin)
        event.remove(engine, "before_cursor_execute", on_statement)

    api.store.presence("consumer-1", "consumer")  # no run needed: a 304 may skip the result
    for _ in range(2):
        finish(api.store, {"text": "slept well"})
    done = api.poll(USER, "sleep", DAY, fingerprint="fp")
    assert done.json()["status"] == "done" and done.json()["result"]["output"]
    begun.clear()
    statements.clear()
    event.listen(engine, "begin", on_begin)
    event.listen(engine, "before_cursor_execute", on_statement)
    try:
        unchanged = api.http.get(
            f"/v1/users/{USER}/insights/sleep/{DAY}",
            params={"fingerprint": "fp"},
            headers={"If-None-Match": done.headers["etag"]},
        )
    finally:
        event.remove(engine, "begin", on_begin)
        event.remove(engine, "before_cursor_execute", on_statement)
    assert unchanged.status_code == 304 and unchanged.content == b""
    assert len(begun) == 1
    assert not [s for s in statements if "ai_job_results.output" in s], statements


def test_bodies_are_json_only_and_changes_from_other_sites_are_refused(api: Served) -> None:
    version = row_version(api.database_url, USER, "sleep", DAY)
    as_text = {"Content-Type": "text/plain"}
    for method, path, headers in [
        ("POST", f"/v1/users/{USER}/backfills", as_text),
        ("POST", "/v1/pause", {**OPERATOR, **as_text}),
        ("POST", "/v1/resume", {**OPERATOR, **as_text}),
        ("POST", f"/v1/users/{USER}/retry-failed", {**OPERATOR, **as_text}),
        ("POST", "/v1/pause", {**OPERATOR, "Content-Type": "application/x-www-form-urlencoded"}),
        ("POST", "/v1/pause", {**OPERATOR, "Content-Type": "multipart/form-data; boundary=x"}),
    ]:
        body = b'{"sync_id": "s1", "seconds": 60}'
        refused = api.http.request(method, path, content=body, headers=headers)
        assert_refused(refused, 415, "content-type")
    assert job_count(api.database_url) == 0 and not api.store.gate_state().paused

    for headers in (
        {"Origin": "http://evil.example"},
        {"Sec-Fetch-Site": "cross-site"},
        {"Sec-Fetch-Site": "same-site"},
        {"Origin": "null"},
    ):
        for method, path, payload in OPERATOR_ROUTES:
            if method == "POST":
                refused = api.http.request(
                    method, path, json=payload, headers={**OPERATOR, **headers}
                )
                assert_refused(refused, 403, "origin")
        refused = api.http.post(f"/v1/users/{USER}/backfills", json={}, headers=headers)
        assert_refused(refused, 403, "origin")
        # A poll queues its insight: a write, refused from other sites too.
        polled = api.http.get(f"/v1/users/{USER}/insights/sleep/{DAY}", headers=headers)
        assert_refused(polled, 403, "origin")
    assert job_count(api.database_url) == 0 and not api.store.gate_state().paused
    assert row_version(api.database_url, USER, "sleep", DAY) == version

    # Basic credentials are for the page a browser shows, not for the API, and only from
    # the page's own site.
    basic = {"Authorization": f"Basic {base64.b64encode(f'op:{TOKEN}'.encode()).decode()}"}
    assert_challenged(api.bare.post("/v1/pause", json={"seconds": 60}, headers=basic))
    assert_challenged(api.bare.get("/v1/queue", headers=basic))
    assert api.bare.get("/queue", headers=basic).status_code == 200
    framed = {**basic, "Sec-Fetch-Site": "cross-site", "Origin": "http://evil.example"}
    assert_challenged(api.bare.get("/queue", headers=framed))
    own = api.server.url
    same = api.http.post(
        "/v1/resume", headers={**OPERATOR, "Origin": own, "Sec-Fetch-Site": "same-origin"}
    )
    assert same.status_code == 200


def test_the_page_and_its_stylesheet_carry_their_security_headers(api: Served) -> None:
    page = api.http.get("/queue", headers=OPERATOR)
    assert page.status_code == 200
    policy = page.headers["content-security-policy"]
    assert "default-src 'none'" in policy and "frame-ancestors 'none'" in policy
    assert "style-src 'self'" in policy and "script-src" not in policy
    assert page.headers["x-content-type-options"] == "nosniff"
    assert page.headers["referrer-policy"] == "no-referrer"
    assert page.headers["cache-control"] == "no-store"
    assert '<link rel="stylesheet" href="/static/queue.css">' in page.text
    sheet = api.http.get("/static/queue.css")
    assert sheet.status_code == 200 and sheet.headers["content-type"].startswith("text/css")
    assert sheet.headers["x-content-type-options"] == "nosniff"
    assert ":root" in sheet.text
    assert api.poll(USER, "sleep", DAY).headers["x-content-type-options"] == "nosniff"


def test_metrics_are_prometheus_text_read_from_the_store(
    api: Served, runtime: Runtime, closed_prefect: str
) -> None:
    store = api.store
    store.enqueue(USER, "sleep", DAY, None, INTERACTIVE)
    store.enqueue("user-2", "hrv", DAY)
    claim = store.claim_next("w")
    assert claim.job is not None
    store.finish(claim.job.id, claim.job.holder or "", result="x", usage=Usage(30, 12))
    store.pause(60, "maintenance")

    assert_challenged(api.bare.get("/metrics"))
    assert_refused(api.http.get("/metrics"), 403, None)  # the service token is not the operator
    scraped = api.http.get("/metrics", headers=OPERATOR)
    assert scraped.status_code == 200
    assert scraped.headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(scraped.text)}

    def value(name: str, **labels: str) -> float:
        family = families.get(name) or families[name.removesuffix("_total")]
        found = [s.value for s in family.samples if s.labels == labels and s.name == name]
        assert len(found) == 1, (name, labels, family.samples)
        return float(found[0])

    seen = store.queue_view(0)
    assert (
        value("insight_queue_waiting_jobs", **{"class": "prefetch"})
        == seen.waiting_by_class["prefetch"][0]
        == 1
    )
    assert value("insight_queue_waiting_jobs", **{"class": "interactive"}) == 0
    assert value("insight_queue_calls_in_flight") == 0
    assert value("insight_queue_paused", cause="operator") == 1
    assert value("insight_queue_paused", cause="outage") == 0
    assert value("insight_queue_attempts_total", kind="sleep", outcome="done") == 1
    assert value("insight_queue_tokens_total", kind="sleep", type="prompt") == 30
    assert value("insight_queue_tokens_total", kind="sleep", type="completion") == 12
    assert value("insight_queue_answers_without_usage_total", kind="sleep") == 0
    calls = families["insight_queue_call_duration_seconds"]
    counts = [s for s in calls.samples if s.name.endswith("_count")]
    assert [(s.labels, s.value) for s in counts] == [({"kind": "sleep", "outcome": "done"}, 1)]
    waits = families["insight_queue_screen_wait_seconds"]
    assert [s.value for s in waits.samples if s.name.endswith("_count")] == [1]
    # The example alert rules ask only for what is served.
    served = {s.name for f in families.values() for s in f.samples}
    rules = (ROOT / "docs" / "alerts.yml").read_text()
    asked = set(re.findall(r"insight_queue_[a-z_]+", rules))
    assert asked and asked <= served, asked - served
    # Another API process on the same store reports the very same figures.
    with serve(runtime, closed_prefect) as other:
        again = other.http.get("/metrics", headers=OPERATOR).text
    strip = [
        line for line in again.splitlines() if "seconds_left" not in line and "oldest" not in line
    ]
    assert strip == [
        line
        for line in scraped.text.splitlines()
        if "seconds_left" not in line and "oldest" not in line
    ]


def test_metrics_need_the_operator_token_on_loopback_too(api: Served) -> None:
    # Once open to loopback when no token was set; now the operator's, wherever it is called.
    assert_challenged(api.bare.get("/metrics"))
    assert_challenged(api.bare.get("/metrics", headers=bearer("not-the-token")))
    for other in (SERVICE, as_screen(USER)):
        assert_refused(api.bare.get("/metrics", headers=other), 403, None)
    scraped = api.bare.get("/metrics", headers=OPERATOR)
    assert scraped.status_code == 200 and "insight_queue_waiting_jobs" in scraped.text


# -- hostile paths -------------------------------------------------------------------------


def test_encoded_slashes_reach_exactly_their_own_job(api: Served) -> None:
    assert api.http.get("/v1/users/u/insights/sleep/a%2Fb").json()["status"] == "pending"
    assert api.http.get("/v1/users/u%2Fx/insights/sleep/c%2fd").json()["status"] == "pending"
    assert api.http.get("/v1/users/u%252F/insights/sleep/e").json()["status"] == "pending"
    assert job_of(api.store, "u", "sleep", "a/b") is not None
    assert job_of(api.store, "u/x", "sleep", "c/d") is not None
    assert job_of(api.store, "u%2F", "sleep", "e") is not None, "a literal %2F stays literal"
    assert job_count(api.database_url) == 3
    retried = api.http.post("/v1/users/u%2Fx/retry-failed", headers=OPERATOR)
    assert retried.json()["user_id"] == "u/x" and retried.json()["pending"] == 1
    assert api.http.post("/v1/users/u%2Fx/backfills").json()["user_id"] == "u/x"


def test_hostile_path_parameters_get_a_clean_4xx_and_lose_nothing(api: Served) -> None:
    assert api.poll(USER, "sleep", DAY, fingerprint="fp").status_code == 200
    before = job_count(api.database_url)
    version = row_version(api.database_url, USER, "sleep", DAY)
    ten_kb = "x" * 10_000
    cases: list[tuple[str, int, str | None]] = [
        (f"/v1/users/a%00b/insights/sleep/{DAY}", 422, "user_id"),
        (f"/v1/users/{USER}/insights/sl%00eep/{DAY}", 422, "kind"),
        (f"/v1/users/{USER}/insights/sleep/a%00b", 422, "subject"),
        (f"/v1/users/{ten_kb}/insights/sleep/{DAY}", 422, "user_id"),
        (f"/v1/users/{USER}/insights/{ten_kb}/{DAY}", 422, "kind"),
        (f"/v1/users/{USER}/insights/sleep/{ten_kb}", 422, "subject"),
        (f"/v1/users/{USER}/insights/sleep/{DAY}?fingerprint={ten_kb}", 422, "fingerprint"),
        (f"/v1/users/{USER}/insights/sleep/{DAY}?fingerprint=a%00b", 422, "fingerprint"),
        (f"/v1/users/{USER}/insights/sleep/{DAY}?fingerprint=a&fingerprint=b", 422, "fingerprint"),
        (f"/v1/users/a%7Cb/insights/sleep/{DAY}", 422, "user_id"),
        (f"/v1/users/%20%09/insights/sleep/{DAY}", 422, "user_id"),
        (f"/v1/users/{USER}/insights/unknown-kind/{DAY}", 422, "kind"),
        (f"/v1/users/{USER}/insights/sl%2Feep/{DAY}", 422, "kind"),
        (f"/v1/users/%FF/insights/sleep/{DAY}", 400, "path"),
        (f"/v1/users/{USER}/insights/sleep/%C3%28", 400, "path"),
        (f"/v1/users/{USER}/insights/sleep/{DAY}?fingerprint=%FF", 400, "query"),
        (f"/v1/users/{USER}/insights/sleep/a/b", 404, None),
        (f"/v1/users/{USER}/insights/sleep/a%2Fb%00", 404, None),
        (f"/v1/users/{USER}/insights/sleep", 404, None),
    ]
    for path, status, field in cases:
        assert_refused(api.http.get(path), status, field)
    assert job_count(api.database_url) == before
    assert row_version(api.database_url, USER, "sleep", DAY) == version
    assert api.poll(USER, "sleep", DAY, fingerprint="fp").json()["status"] == "pending"


# -- who may call what ---------------------------------------------------------------------


def test_loopback_hosts_are_served_and_other_hosts_are_not(api: Served) -> None:
    # Loopback was once told apart by the address the API was bound to; now by the Host a
    # request names: loopback and AI_API_ALLOWED_HOSTS only (test_api_access has the latter).
    port = api.server.port
    for host in ("127.0.0.1", "localhost", "LOCALHOST", "[::1]"):
        for named in (host, f"{host}:{port}"):
            served = api.http.get("/healthz", headers={"Host": named})
            assert served.status_code == 200, (named, served.text)
    for host in ("0.0.0.0", "[::]", "192.168.1.20", "10.0.0.1", "example.com"):
        other = {"Host": f"{host}:{port}"}
        assert api.http.get("/healthz", headers=other).status_code == 400, host
        polled = api.http.get(f"/v1/users/{USER}/insights/sleep/{DAY}", headers=other)
        assert polled.status_code == 400, host
    assert job_count(api.database_url) == 0


def test_an_app_opens_its_triggers_from_its_settings(
    settings: Settings, closed_prefect: str
) -> None:
    with Triggers.open(settings, prefect_url=closed_prefect) as triggers:
        assert "sleep" in triggers.runtime.registry.kinds  # AI_JOB_PLUGINS' default, the demo
        state = triggers.request_insight(USER, "sleep", DAY)
        assert state.status == "pending" and state.error is None
        assert job_of(triggers.runtime.store, USER, "sleep", DAY) is not None


def test_with_no_credentials_to_read_the_app_opens_nothing(
    database_url: str, tmp_path: Path, closed_prefect: str
) -> None:
    # The app once refused to start off loopback without a token; now it cannot be open: a
    # worker that finds no credentials kept (it only reads them) matches no token at all.
    settings = make_settings(database_url, tmp_path / "data")
    runtime = make_runtime(settings)
    try:
        credentials = Credentials.load(settings, create=False)
        assert credentials.operator_token == credentials.service_token == ""
        assert not (settings.data_dir / CREDENTIALS_FILE).exists()
        triggers = Triggers(runtime, prefect_url=closed_prefect)
        app = create_app(triggers, credentials)
        with ApiServer(app) as server, httpx.Client(base_url=server.url) as http:
            for headers in ({}, {"Authorization": "Bearer"}, bearer("x" * 43)):
                for method, path, payload in [
                    ("GET", f"/v1/users/{USER}/insights/sleep/{DAY}", None),
                    ("POST", f"/v1/users/{USER}/backfills", {"sync_id": "s"}),
                    ("GET", "/metrics", None),
                    *OPERATOR_ROUTES,
                ]:
                    answer = http.request(method, path, json=payload, headers=headers)
                    assert_challenged(answer)
            assert http.get("/healthz").status_code == 200
        assert job_count(runtime.settings.database_url) == 0
        assert not runtime.store.gate_state().paused
    finally:
        runtime.close()


@pytest.mark.parametrize(
    ("api_settings", "message"),
    [
        ({"operator_token": " \t "}, "AI_API_OPERATOR_TOKEN: is blank: set a real token"),
        ({"service_token": "   "}, "AI_API_SERVICE_TOKEN: is blank: set a real token"),
        ({"operator_token": "short-token"}, "AI_API_OPERATOR_TOKEN: is shorter than 16"),
        ({"service_token": "x" * 15}, "AI_API_SERVICE_TOKEN: is shorter than 16"),
        ({"screen_secret": "s" * 31}, "AI_API_SCREEN_SECRET: is shorter than 32 bytes"),
    ],
)
def test_blank_or_short_credentials_are_refused_by_the_settings(
    api_settings: dict[str, str], message: str
) -> None:
    # A token of blanks was refused at start-up; a token too short to be secret is too now
    # (the command's own refusal is in tests/acceptance/test_api_edges.py).
    with pytest.raises(SettingsError) as refused:
        Settings(api=api_settings)
    assert str(refused.value).startswith(message)
    secret = next(iter(api_settings.values())).strip()
    assert not secret or secret not in str(refused.value), "the message never shows it"
    Settings(api={name: "x" * 32 for name in api_settings})  # long enough: accepted


def test_every_route_but_healthz_and_static_needs_a_credential(api: Served) -> None:
    # Once only off loopback (or with --require-token); now on every address.
    routes = [
        ("GET", f"/v1/users/{USER}/insights/sleep/{DAY}", None, SERVICE),
        ("POST", f"/v1/users/{USER}/backfills", {"sync_id": "s"}, SERVICE),
        ("GET", "/metrics", None, OPERATOR),
        *((method, path, payload, OPERATOR) for method, path, payload in OPERATOR_ROUTES),
    ]
    for method, path, payload, _ in routes:
        assert_challenged(api.bare.request(method, path, json=payload))
        wrong = bearer("wrong-token-of-some-length")
        assert_challenged(api.bare.request(method, path, json=payload, headers=wrong))
    assert job_count(api.database_url) == 0
    assert not api.store.gate_state().paused
    assert_refused(api.bare.get("/no-such-route"), 404, None)
    assert api.bare.get("/healthz").status_code == 200
    assert api.bare.get("/static/queue.css").status_code == 200
    for method, path, payload, credential in routes:
        allowed = api.bare.request(method, path, json=payload, headers=credential)
        assert allowed.status_code in (200, 202), (path, allowed.text)
        api.bare.post("/v1/resume", headers=OPERATOR)


def test_a_host_app_mounts_the_poll_behind_its_own_auth(
    runtime: Runtime, closed_prefect: str
) -> None:
    users = {"alice-token": "alice", "bob-token": "bob"}

    def current_user(authorization: str | None = Header(None)) -> str:
        user = users.get((authorization or "").removeprefix("Bearer "))
        if user is None:
            raise HTTPException(401, "who are you?")
        return user

    triggers = Triggers(runtime, prefect_url=closed_prefect)
    host = FastAPI()
    host.include_router(insights_router(triggers, current_user), prefix="/ai")
    host.add_middleware(StrictPaths)
    add_error_handlers(host)
    with ApiServer(host) as server, httpx.Client(base_url=server.url) as http:
        alice = http.get(
            f"/ai/v1/insights/sleep/{DAY}%2Fam",
            params={"fingerprint": "fp-a"},
            headers={"Authorization": "Bearer alice-token"},
        )
        assert alice.status_code == 200 and alice.json()["status"] == "pending"
        assert job_of(runtime.store, "alice", "sleep", f"{DAY}/am") is not None
        bob = http.get(
            f"/ai/v1/insights/sleep/{DAY}", headers={"Authorization": "Bearer bob-token"}
        )
        assert bob.status_code == 200 and bob.json()["ahead"] == 1
        assert http.get(f"/ai/v1/insights/sleep/{DAY}").status_code == 401
        assert_refused(
            http.get("/ai/v1/insights/nope/x", headers={"Authorization": "Bearer bob-token"}),
            422,
            "kind",
        )
    assert job_count(runtime.settings.database_url) == 2


# -- the store goes away, and comes back ---------------------------------------------------


class StoreOutage:
    """Takes the store's database away and gives it back, by event."""

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.url = make_url(runtime.settings.database_url)

    def begin(self) -> None:
        self.runtime.store.close()  # the next call opens new connections
        if self.url.get_backend_name() == "sqlite":
            assert self.url.database is not None
            path = Path(self.url.database)
            for suffix in ("", "-wal", "-shm"):
                found = Path(f"{path}{suffix}")
                if found.exists():
                    found.rename(f"{path}{suffix}.away")
            path.mkdir()  # where the file was: SQLite cannot open it
        else:
            self._postgres(
                f'ALTER DATABASE "{self.url.database}" WITH ALLOW_CONNECTIONS false',
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                f"WHERE datname = '{self.url.database}' AND pid <> pg_backend_pid()",
            )

    def end(self) -> None:
        if self.url.get_backend_name() == "sqlite":
            assert self.url.database is not None
            path = Path(self.url.database)
            shutil.rmtree(path)
            for suffix in ("", "-wal", "-shm"):
                away = Path(f"{path}{suffix}.away")
                if away.exists():
                    away.rename(f"{path}{suffix}")
        else:
            self._postgres(f'ALTER DATABASE "{self.url.database}" WITH ALLOW_CONNECTIONS true')

    def _postgres(self, *statements: str) -> None:
        admin = create_engine(normalise_url(POSTGRES_URL), isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as connection:
                for statement in statements:
                    connection.execute(text(statement))
        finally:
            admin.dispose()


def test_store_down_is_a_503_with_status_unknown_and_loses_nothing(api: Served) -> None:
    assert api.poll(USER, "sleep", DAY, fingerprint="fp").status_code == 200
    version = row_version(api.database_url, USER, "sleep", DAY)
    outage = StoreOutage(api.runtime)
    outage.begin()
    try:
        down = api.poll(USER, "sleep", DAY, fingerprint="fp")
        assert down.status_code == 503
        assert down.json()["status"] == "unknown" and down.json()["error"]
        assert "\n" not in down.text and down.headers["retry-after"] == "10"
        for method, path, payload, headers in [
            ("GET", "/healthz", None, {}),
            ("POST", f"/v1/users/{USER}/backfills", {"sync_id": "s"}, {}),
            ("GET", "/v1/queue", None, OPERATOR),
            ("POST", "/v1/pause", {"seconds": 60}, OPERATOR),
            ("POST", "/v1/resume", None, OPERATOR),
            ("POST", f"/v1/users/{USER}/retry-failed", None, OPERATOR),
        ]:
            answer = api.http.request(method, path, json=payload, headers=headers)
            assert answer.status_code == 503, (path, answer.text)
            assert answer.json()["status"] == "unknown", path
            assert set(answer.json()) == {"status", "error"}, path
            assert "\n" not in answer.text and answer.headers["retry-after"] == "10"
        page = api.http.get("/queue", headers=OPERATOR)
        assert page.status_code == 503
        assert "The store cannot be read" in page.text
        # Bad input is still bad input, whatever the store's state.
        assert_refused(api.http.get(f"/v1/users/{USER}/insights/sleep/a%00"), 422, "subject")
    finally:
        outage.end()
    back = api.poll(USER, "sleep", DAY, fingerprint="fp")
    assert back.status_code == 200 and back.json()["status"] == "pending"
    assert row_version(api.database_url, USER, "sleep", DAY) == version
    assert job_count(api.database_url) == 1
    assert api.http.get("/healthz").status_code == 200
