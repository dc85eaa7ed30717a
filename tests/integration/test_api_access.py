"""Who may call what, and from where: the API's callers and edges over real HTTP.

The API is served in this process (uvicorn on a free loopback port, with the project's h11
protocol), on SQLite and PostgreSQL, with the demo plugin's generators (which say what
subjects they take). Each test makes the requests a caller would make and checks the answer,
and that a refused request wrote nothing. Rates are exhausted by count of requests, with a
rate so small that no bucket refills while a test runs. The edges that need a real process
(slow and huge headers, idle connections, several workers) are in
tests/acceptance/test_api_edges.py.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import datetime as dt
import hashlib
import hmac
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from jwt.algorithms import ECAlgorithm, RSAAlgorithm
from pydantic import SecretStr

from deployments.http import create_app
from deployments.http.access import Caller, Rates, Role
from deployments.http.credentials import Credentials
from deployments.http.middleware import MAX_HEADER_BYTES
from deployments.processes import free_port
from deployments.triggers import Triggers
from devtools.stack import ApiServer
from flows.registry import Registry
from flows.runtime import Runtime
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    Failure,
    JobStore,
    Misconfigured,
    Redactor,
    Status,
)
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
    insight_path,
    job_count,
    screen_token,
    serve,
)
from tests.support.factories import settings_for, store_for
from tests.support.reads import job_of

ALICE, BOB = "alice", "bob"
TODAY = dt.datetime.now(dt.UTC).date()
DAY = TODAY.isoformat()
# The demo's trends: a window of 28 days, `FIRST..LAST`.
WINDOW = f"{(TODAY - dt.timedelta(days=27)).isoformat()}..{DAY}"
APP_ORIGIN = "https://app.example.org"
EVIL_ORIGIN = "https://evil.example"

OPERATOR_ROUTES = [
    ("GET", "/v1/queue", None),
    ("POST", "/v1/pause", {"seconds": 60, "reason": "refused"}),
    ("POST", "/v1/resume", None),
    ("POST", f"/v1/users/{ALICE}/retry-failed", None),
    ("GET", "/metrics", None),
    ("GET", "/queue", None),
]


def day(days_ago: int) -> str:
    return (TODAY - dt.timedelta(days=days_ago)).isoformat()


MakeApi = Callable[..., Served]


@pytest.fixture
def make_api(database_url: str, tmp_path: Path) -> Iterator[MakeApi]:
    """Serve the API on the test's database: `api` settings add to (or replace) the test's
    three credentials; other keyword arguments are settings of their own."""
    with contextlib.ExitStack() as stack:
        made = 0

        def factory(api: dict[str, Any] | None = None, **overrides: Any) -> Served:
            nonlocal made
            made += 1
            credentials = {
                "operator_token": SecretStr(OPERATOR_TOKEN),
                "service_token": SecretStr(SERVICE_TOKEN),
                "screen_secret": SecretStr(SCREEN_SECRET),
            }
            settings = settings_for(
                database_url=database_url,
                data_dir=tmp_path / f"data-{made}",
                max_attempts=1,
                api={**credentials, **(api or {})},
                **overrides,
            )
            registry = Registry.from_plugins(["flows.demo"])
            store = store_for(settings)
            runtime = Runtime(settings, store, registry, Redactor(settings.secrets()))
            stack.callback(runtime.close)
            prefect = f"http://127.0.0.1:{free_port()}/api"
            return stack.enter_context(serve(runtime, prefect))

        yield factory


@pytest.fixture
def api(make_api: MakeApi) -> Served:
    return make_api()


def failed_job(store: JobStore, user: str, kind: str = "hrv") -> str:
    """A job of `user` given up (one attempt): what retry-failed would put back."""
    store.enqueue(user, kind, DAY)
    claim = store.claim_next("test-worker")
    assert claim.job is not None and claim.job.holder is not None
    store.fail(claim.job.id, claim.job.holder, Failure.REJECTED, "HTTP 400")
    return claim.job.id


def b64url(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def unsigned(
    header: dict[str, Any],
    payload: dict[str, Any],
    secret: bytes | None,
    digest: Callable[..., Any] = hashlib.sha256,
) -> str:
    """A JWT built by hand: an HMAC with `secret` (SHA-256 by default), or no signature."""
    signing = f"{b64url(json.dumps(header).encode())}.{b64url(json.dumps(payload).encode())}"
    if secret is None:
        return f"{signing}."
    signature = hmac.new(secret, signing.encode(), digest).digest()
    return f"{signing}.{b64url(signature)}"


def claims(user: str, ttl: int = 3600) -> dict[str, Any]:
    now = int(dt.datetime.now(dt.UTC).timestamp())
    return {"sub": user, "aud": "insight-queue", "iat": now, "exp": now + ttl}


def rsa_key() -> rsa.RSAPrivateKey:
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def public_pem(key: rsa.RSAPrivateKey | ec.EllipticCurvePrivateKey) -> bytes:
    return key.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# -- no credential ---------------------------------------------------------------------------


def test_without_a_credential_every_per_user_route_is_401_and_writes_nothing(
    api: Served,
) -> None:
    failed = failed_job(api.store, ALICE)
    per_user = [
        ("GET", insight_path(ALICE, "sleep", DAY), None),
        ("GET", insight_path(ALICE, "trends", WINDOW), None),
        ("POST", f"/v1/users/{ALICE}/backfills", {"sync_id": "sync-1"}),
        ("POST", f"/v1/users/{ALICE}/backfills", None),
        ("POST", f"/v1/users/{ALICE}/retry-failed", None),
    ]
    service_as_basic = base64.b64encode(f"app:{SERVICE_TOKEN}".encode()).decode()
    for method, path, payload in per_user:
        for headers in (
            {},
            {"Authorization": "Bearer"},
            bearer("not-a-token-of-this-api"),
            {"Authorization": SERVICE_TOKEN},  # no scheme
            {"Authorization": f"Basic {service_as_basic}"},  # Basic is the page's alone
        ):
            assert_challenged(api.bare.request(method, path, json=payload, headers=headers))
        told = api.bare.request(method, path, json=payload)
        assert "Authorization: Bearer" in told.json()["error"], "the refusal says what to send"
    assert job_count(api.database_url) == 1, "nothing queued"
    job = api.store.jobs([failed])[failed]
    assert job.status == Status.FAILED, "nothing retried"


# -- a screen ----------------------------------------------------------------------------------


def test_a_screen_token_for_alice_is_403_on_bobs_path_and_200_on_hers(api: Served) -> None:
    alice = as_screen(ALICE)
    refused = api.bare.get(insight_path(BOB, "sleep", DAY), headers=alice)
    message = assert_refused(refused, 403, "user_id")
    assert "another user" in message
    assert job_of(api.store, BOB, "sleep", DAY) is None
    assert job_count(api.database_url) == 0

    own = api.bare.get(insight_path(ALICE, "sleep", DAY), headers=alice)
    assert own.status_code == 200, own.text
    assert own.json()["status"] == "pending"
    job = job_of(api.store, ALICE, "sleep", DAY)
    assert job is not None and job.priority == INTERACTIVE

    # A screen polls; it never backfills, its own user's or another's.
    for user in (ALICE, BOB):
        backfill = api.bare.post(f"/v1/users/{user}/backfills", json={}, headers=alice)
        assert "the screen credential" in assert_refused(backfill, 403, None)
    assert job_count(api.database_url) == 1

    # The user a token names is the path's user exactly: an encoded slash is part of it.
    team = as_screen("team/alice")
    assert api.bare.get(insight_path("team%2Falice", "sleep", DAY), headers=team).is_success
    assert job_of(api.store, "team/alice", "sleep", DAY) is not None
    assert_refused(api.bare.get(insight_path("team", "sleep", DAY), headers=team), 403, "user_id")
    assert_refused(api.bare.get(insight_path("Alice", "sleep", DAY), headers=alice), 403, "user_id")
    assert job_count(api.database_url) == 2


def test_an_expired_or_wrongly_signed_screen_token_is_401(api: Served) -> None:
    good = screen_token(ALICE)
    header, payload, signature = good.split(".")
    as_bob = b64url(json.dumps(claims(BOB)).encode())
    cases = {
        "expired a minute ago": screen_token(ALICE, ttl=-60),
        "another secret": screen_token(ALICE, key="another-secret-of-enough-length-012345678"),
        "another audience": screen_token(ALICE, aud="another-app"),
        "no expiry": screen_token(ALICE, exp=None),
        "no user": screen_token(ALICE, sub=None),
        "no audience": screen_token(ALICE, aud=None),
        "a user the store refuses": screen_token("a|b"),
        "HS512, not HS256": unsigned(
            {"alg": "HS512", "typ": "JWT"}, claims(ALICE), SCREEN_SECRET.encode(), hashlib.sha512
        ),
        "alg none": unsigned({"alg": "none", "typ": "JWT"}, claims(ALICE), None),
        "bob's claims under alice's signature": f"{header}.{as_bob}.{signature}",
        "cut short": f"{header}.{payload}",
        "not a JWT": "eyJ.not.a.token",
    }
    for why, token in cases.items():
        for user in (ALICE, BOB):
            refused = api.bare.get(insight_path(user, "sleep", DAY), headers=bearer(token))
            assert_challenged(refused)
            assert token not in refused.text, why
    assert (
        "expired"
        in api.bare.get(
            insight_path(ALICE, "sleep", DAY), headers=bearer(cases["expired a minute ago"])
        ).json()["error"]
    )
    assert job_count(api.database_url) == 0
    # The control: the same token unchanged is taken.
    assert api.bare.get(insight_path(ALICE, "sleep", DAY), headers=bearer(good)).is_success


def test_a_screen_token_must_carry_the_issuer_when_one_is_set(make_api: MakeApi) -> None:
    api = make_api(api={"screen_issuer": "https://app.example.org/"})
    path = insight_path(ALICE, "sleep", DAY)
    assert_challenged(api.bare.get(path, headers=as_screen(ALICE)))
    assert_challenged(api.bare.get(path, headers=as_screen(ALICE, iss="https://other.example/")))
    assert job_count(api.database_url) == 0
    taken = api.bare.get(path, headers=as_screen(ALICE, iss="https://app.example.org/"))
    assert taken.status_code == 200, taken.text


def test_rs256_screen_tokens_are_checked_with_the_apps_public_key(
    make_api: MakeApi, tmp_path: Path
) -> None:
    key, stranger = rsa_key(), rsa_key()
    pem = tmp_path / "screens.pem"
    pem.write_bytes(public_pem(key))
    api = make_api(api={"screen_public_key": str(pem), "screen_secret": SecretStr("")})
    path = insight_path(ALICE, "sleep", DAY)

    signed = as_screen(ALICE, key=key, algorithm="RS256")
    assert_refused(api.bare.get(insight_path(BOB, "sleep", DAY), headers=signed), 403, "user_id")
    taken = api.bare.get(path, headers=signed)
    assert taken.status_code == 200, taken.text
    assert job_count(api.database_url) == 1

    ec_key = ec.generate_private_key(ec.SECP256R1())
    for why, token in {
        "another key": screen_token(ALICE, key=stranger, algorithm="RS256"),
        "expired": screen_token(ALICE, key=key, algorithm="RS256", ttl=-60),
        "a shared secret": screen_token(ALICE),
        "the public key as an HMAC secret": unsigned(
            {"alg": "HS256", "typ": "JWT"}, claims(ALICE), public_pem(key)
        ),
        "ES256 with a key the API does not know": screen_token(
            ALICE, key=ec_key, algorithm="ES256"
        ),
    }.items():
        refused = api.bare.get(insight_path(ALICE, "hrv", DAY), headers=bearer(token))
        assert refused.status_code == 401, why
    assert job_count(api.database_url) == 1

    # The app signs its own tokens here: this API has no secret to make one with.
    assert not api.credentials.screens.can_issue
    with pytest.raises(Misconfigured, match="the app makes them"):
        api.credentials.screens.issue(ALICE, 60)


def test_a_jwks_file_names_the_keys_screen_tokens_are_checked_with(
    make_api: MakeApi, tmp_path: Path
) -> None:
    rsa_private, ec_private = rsa_key(), ec.generate_private_key(ec.SECP256R1())
    keys = [
        {**RSAAlgorithm.to_jwk(rsa_private.public_key(), as_dict=True), "kid": "app-rsa"},
        {**ECAlgorithm.to_jwk(ec_private.public_key(), as_dict=True), "kid": "app-ec"},
    ]
    jwks = tmp_path / "screens.jwks.json"
    jwks.write_text(json.dumps({"keys": keys}))
    api = make_api(api={"screen_jwks": str(jwks)})

    by_rsa = screen_token(ALICE, key=rsa_private, algorithm="RS256", headers={"kid": "app-rsa"})
    by_ec = screen_token(BOB, key=ec_private, algorithm="ES256", headers={"kid": "app-ec"})
    assert api.bare.get(insight_path(ALICE, "sleep", DAY), headers=bearer(by_rsa)).is_success
    assert api.bare.get(insight_path(BOB, "sleep", DAY), headers=bearer(by_ec)).is_success
    assert_refused(
        api.bare.get(insight_path(BOB, "hrv", DAY), headers=bearer(by_rsa)), 403, "user_id"
    )
    assert job_count(api.database_url) == 2

    for why, token in {
        "a kid not in the set": screen_token(
            ALICE, key=rsa_private, algorithm="RS256", headers={"kid": "gone"}
        ),
        "no kid": screen_token(ALICE, key=rsa_private, algorithm="RS256"),
        "signed by another key": screen_token(
            ALICE, key=rsa_key(), algorithm="RS256", headers={"kid": "app-rsa"}
        ),
        "the RSA key's kid on an EC signature": screen_token(
            ALICE, key=ec_private, algorithm="ES256", headers={"kid": "app-rsa"}
        ),
        "a shared secret": screen_token(ALICE, headers={"kid": "app-rsa"}),
    }.items():
        refused = api.bare.get(insight_path(ALICE, "hrv", DAY), headers=bearer(token))
        assert refused.status_code == 401, why
    assert job_count(api.database_url) == 2

    # A file that is no JWKS, or none at all, is the operator's to fix: said at start-up.
    for not_a_jwks in ('{"keys": []}', "[1, 2]", '"keys"'):
        jwks.write_text(not_a_jwks)
        with pytest.raises(Misconfigured, match="AI_API_SCREEN_JWKS: not a usable JWKS"):
            Credentials.load(api.runtime.settings)
    jwks.unlink()
    with pytest.raises(Misconfigured, match="AI_API_SCREEN_JWKS: cannot read"):
        Credentials.load(api.runtime.settings)


# -- the service, the operator --------------------------------------------------------------


def test_the_service_token_polls_and_backfills_for_any_user(api: Served) -> None:
    scopes = len(api.runtime.registry.scopes_for(ALICE))
    for user in (ALICE, BOB, "carol"):
        polled = api.bare.get(insight_path(user, "sleep", DAY), headers=SERVICE)
        assert polled.status_code == 200, polled.text
        assert polled.json()["status"] == "pending"
        backfill = api.bare.post(
            f"/v1/users/{user}/backfills", json={"sync_id": f"sync-{user}"}, headers=SERVICE
        )
        assert backfill.status_code == 202, backfill.text
        assert backfill.json()["user_id"] == user and backfill.json()["queued"] == scopes
        job = job_of(api.store, user, "hrv", DAY)
        assert job is not None and job.priority == PREFETCH
    # The demo's scopes include sleep for today: the poll's job, not another.
    assert job_count(api.database_url) == 3 * scopes


def test_operator_routes_refuse_screen_and_service_tokens(api: Served) -> None:
    failed = failed_job(api.store, ALICE)
    for credential in (SERVICE, as_screen(ALICE)):
        for method, path, payload in OPERATOR_ROUTES:
            refused = api.bare.request(method, path, json=payload, headers=credential)
            assert "operator" in assert_refused(refused, 403, None), path
    page = base64.b64encode(f"operator:{SERVICE_TOKEN}".encode()).decode()
    assert_challenged(api.bare.get("/queue", headers={"Authorization": f"Basic {page}"}))
    assert not api.store.gate_state().paused
    assert api.store.jobs([failed])[failed].status == Status.FAILED

    # And the other way round: the operator's token neither polls nor backfills.
    for method, path in [
        ("GET", insight_path(ALICE, "sleep", DAY)),
        ("POST", f"/v1/users/{ALICE}/backfills"),
    ]:
        refused = api.bare.request(method, path, json={}, headers=OPERATOR)
        assert_refused(refused, 403, "user_id" if method == "GET" else None)
    assert job_count(api.database_url) == 1

    # The control: the operator's own routes take it.
    for method, path, payload in OPERATOR_ROUTES:
        allowed = api.bare.request(method, path, json=payload, headers=OPERATOR)
        assert allowed.status_code == 200, (path, allowed.text)
        api.bare.post("/v1/resume", headers=OPERATOR)
    assert api.store.jobs([failed])[failed].status == Status.PENDING


# -- hosts and origins ------------------------------------------------------------------------


def test_a_rebinding_host_is_400_and_writes_nothing(make_api: MakeApi) -> None:
    api = make_api(api={"allowed_hosts": "insights.example.org"})
    port = api.server.port
    basic = base64.b64encode(f"operator:{OPERATOR_TOKEN}".encode()).decode()

    def requests(host: str) -> list[tuple[str, str, Any, dict[str, str]]]:
        # What a page of `host` sends to its own origin: the browser sees no other site.
        site = {"Host": host, "Origin": f"http://{host}", "Sec-Fetch-Site": "same-origin"}
        return [
            ("GET", insight_path(ALICE, "sleep", DAY), None, {**site, **SERVICE}),
            ("POST", f"/v1/users/{ALICE}/backfills", {}, {**site, **SERVICE}),
            ("POST", "/v1/pause", {"seconds": 60}, {**site, **OPERATOR}),
            ("GET", "/queue", None, {**site, "Authorization": f"Basic {basic}"}),
            ("GET", "/healthz", None, site),
        ]

    for host in (f"rebind.evil.example:{port}", "rebind.evil.example", f"127.0.0.2:{port}"):
        for method, path, payload, headers in requests(host):
            refused = api.bare.request(method, path, json=payload, headers=headers)
            assert refused.status_code == 400, (host, path, refused.text)
            assert "access-control-allow-origin" not in refused.headers
    assert job_count(api.database_url) == 0
    assert not api.store.gate_state().paused

    # The control: the same requests on a Host the API serves pass (the Origin check alone
    # would have let the rebinding page through).
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", "insights.example.org"):
        for method, path, payload, headers in requests(host):
            answer = api.bare.request(method, path, json=payload, headers=headers)
            assert answer.is_success, (host, path, answer.text)
            api.bare.post("/v1/resume", headers=OPERATOR)
    assert job_count(api.database_url) > 0


def test_a_cors_preflight_from_an_allowed_origin_is_answered_and_from_another_is_not(
    make_api: MakeApi,
) -> None:
    api = make_api(api={"cors_origins": f"{APP_ORIGIN}/, https://other-app.example.org"})
    path = insight_path(ALICE, "sleep", DAY)
    asking = {
        "Access-Control-Request-Method": "GET",
        "Access-Control-Request-Headers": "authorization, if-none-match",
    }

    allowed = api.bare.options(path, headers={"Origin": APP_ORIGIN, **asking})
    assert allowed.status_code == 200, allowed.text
    assert allowed.headers["access-control-allow-origin"] == APP_ORIGIN
    assert "GET" in allowed.headers["access-control-allow-methods"]
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    assert allowed.headers["access-control-max-age"] == "600"
    assert "access-control-allow-credentials" not in allowed.headers, "bearer tokens only"

    for origin in (EVIL_ORIGIN, "http://app.example.org"):  # the latter: another scheme
        refused = api.bare.options(path, headers={"Origin": origin, **asking})
        assert refused.status_code == 400, (origin, refused.text)
        assert "access-control-allow-origin" not in refused.headers
    odd = {**asking, "Access-Control-Request-Headers": "x-anything"}
    refused = api.bare.options(path, headers={"Origin": APP_ORIGIN, **odd})
    assert refused.status_code == 400, "a header the app's pages do not send"
    assert job_count(api.database_url) == 0, "a preflight queues nothing"

    # The call itself: from the app's page, answered and readable there.
    page = {"Origin": APP_ORIGIN, "Sec-Fetch-Site": "cross-site", **as_screen(ALICE)}
    polled = api.bare.get(path, headers=page)
    assert polled.status_code == 200, polled.text
    assert polled.headers["access-control-allow-origin"] == APP_ORIGIN
    exposed = polled.headers["access-control-expose-headers"].lower()
    assert "etag" in exposed and "retry-after" in exposed
    # From another site's page, the screen's own token is not enough to queue a thing.
    other = {"Origin": EVIL_ORIGIN, "Sec-Fetch-Site": "cross-site", **as_screen(ALICE)}
    refused = api.bare.get(insight_path(ALICE, "hrv", DAY), headers=other)
    assert_refused(refused, 403, "origin")
    assert "access-control-allow-origin" not in refused.headers
    assert job_count(api.database_url) == 1


def test_without_cors_origins_no_page_of_another_site_is_answered(api: Served) -> None:
    path = insight_path(ALICE, "sleep", DAY)
    preflight = api.bare.options(
        path, headers={"Origin": APP_ORIGIN, "Access-Control-Request-Method": "GET"}
    )
    assert preflight.status_code == 405
    assert "access-control-allow-origin" not in preflight.headers
    page = {"Origin": APP_ORIGIN, "Sec-Fetch-Site": "cross-site", **as_screen(ALICE)}
    assert_refused(api.bare.get(path, headers=page), 403, "origin")
    assert job_count(api.database_url) == 0


# -- screens take turns, at most 8 each -----------------------------------------------------


def test_the_ninth_interactive_job_of_a_user_demotes_the_first(api: Served) -> None:
    assert api.runtime.settings.max_interactive == 8
    alice = as_screen(ALICE)
    answers = [api.bare.get(insight_path(ALICE, "sleep", day(n)), headers=alice) for n in range(9)]
    assert [a.status_code for a in answers] == [200] * 9
    assert [a.json()["ahead"] for a in answers[:8]] == list(range(8))
    assert answers[8].json()["ahead"] == 7, "the first of nine no longer waits in front"

    first = job_of(api.store, ALICE, "sleep", day(0))
    assert first is not None and first.priority == PREFETCH and first.requested_at is None
    for n in range(1, 9):
        job = job_of(api.store, ALICE, "sleep", day(n))
        assert job is not None and job.priority == INTERACTIVE, n
    view = api.bare.get("/v1/queue", headers=OPERATOR).json()
    assert [(j["subject"], j["priority_class"]) for j in view["waiting"]] == [
        *((day(n), "interactive") for n in range(1, 9)),
        (day(0), "prefetch"),
    ]


def test_screens_of_two_users_take_turns(api: Served) -> None:
    for n in range(8):
        alice = api.bare.get(insight_path(ALICE, "sleep", day(n)), headers=as_screen(ALICE))
        assert alice.status_code == 200, alice.text
    bob = api.bare.get(insight_path(BOB, "sleep", DAY), headers=as_screen(BOB))
    assert bob.status_code == 200, bob.text
    assert bob.json()["ahead"] == 1, "behind alice's first screen, not behind all 8"
    view = api.bare.get("/v1/queue", headers=OPERATOR).json()
    order = [(j["user_id"], j["subject"]) for j in view["waiting"]]
    assert order[:3] == [(ALICE, day(0)), (BOB, DAY), (ALICE, day(1))]
    assert [j["priority_class"] for j in view["waiting"]] == ["interactive"] * 9


# -- what a generator takes -----------------------------------------------------------------


def test_an_invalid_subject_is_422_and_writes_nothing(api: Served) -> None:
    too_old = (TODAY - dt.timedelta(days=3651)).isoformat()
    too_far = (TODAY + dt.timedelta(days=3)).isoformat()
    short = f"{(TODAY - dt.timedelta(days=26)).isoformat()}..{DAY}"
    late = (TODAY + dt.timedelta(days=3)).isoformat()
    late_window = f"{(TODAY - dt.timedelta(days=24)).isoformat()}..{late}"
    for kind, subject in [
        ("sleep", "yesterday"),
        ("sleep", "2026-13-01"),
        ("sleep", "2026-1-9"),
        ("sleep", f"{DAY}T00:00"),
        ("sleep", f" {DAY}"),
        ("sleep", too_old),
        ("sleep", too_far),
        ("sleep", WINDOW),
        ("steps", "'; DROP TABLE ai_jobs; --"),
        ("trends", DAY),
        ("trends", short),
        ("trends", late_window),
        ("trends", f"{DAY}..{day(27)}"),  # backwards
        ("trends", "A..B"),
    ]:
        for credential in (SERVICE, as_screen(ALICE)):
            refused = api.bare.get(insight_path(ALICE, kind, subject), headers=credential)
            message = assert_refused(refused, 422, "subject")
            assert message.startswith(f"subject: not a subject of {kind!r}"), message
    assert job_count(api.database_url) == 0

    # The control: what the generators take is queued.
    assert api.poll(ALICE, "sleep", DAY).status_code == 200
    assert api.poll(ALICE, "sleep", day(3600)).status_code == 200
    assert api.poll(ALICE, "trends", WINDOW).status_code == 200
    assert job_count(api.database_url) == 3


# -- rates --------------------------------------------------------------------------------


def test_past_its_rate_a_credential_gets_429_with_retry_after(make_api: MakeApi) -> None:
    # One request a minute: a bucket of one, refilled in a minute (no test waits that long).
    api = make_api(api={"screen_rate": 1, "service_rate": 1, "operator_rate": 1})
    calls = [
        ("alice's screen", as_screen(ALICE), insight_path(ALICE, "sleep", day(1))),
        ("the service", SERVICE, insight_path(BOB, "sleep", day(1))),
        ("the operator", OPERATOR, "/v1/queue"),
    ]
    for who, credential, path in calls:
        first = api.bare.get(path, headers=credential)
        assert first.status_code == 200, (who, first.text)
    before = job_count(api.database_url)
    for who, credential, path in calls:
        again = api.bare.get(path.replace(day(1), day(2)), headers=credential)
        message = assert_refused(again, 429, "authorization")
        assert "too many requests" in message, who
        assert 1 <= int(again.headers["retry-after"]) <= 60, who
        assert f"retry in {again.headers['retry-after']} s" in message
    assert job_count(api.database_url) == before, "a refused poll queues nothing"

    # Each screen user has a bucket of their own; a call with no credential spends none.
    bob = api.bare.get(insight_path(BOB, "hrv", DAY), headers=as_screen(BOB))
    assert bob.status_code == 200, bob.text
    for _ in range(3):
        assert_challenged(api.bare.get(insight_path(ALICE, "sleep", DAY)))


def test_a_rate_allows_ten_seconds_of_requests_at_once_and_refills_by_its_clock() -> None:
    now = [1000.0]
    rates = Rates({Role.SCREEN: 60, Role.SERVICE: 6, Role.OPERATOR: 600}, clock=lambda: now[0])
    alice, bob = Caller(Role.SCREEN, ALICE), Caller(Role.SCREEN, BOB)
    assert [rates.take(alice) for _ in range(10)] == [None] * 10
    wait = rates.take(alice)
    assert wait is not None and math.isclose(wait, 1.0)
    assert rates.take(bob) is None, "another user's bucket is full"
    now[0] += 1.0
    assert rates.take(alice) is None
    assert rates.take(alice) is not None
    service = Caller(Role.SERVICE)
    assert rates.take(service) is None  # six a minute: a bucket of one
    wait = rates.take(service)
    assert wait is not None and math.isclose(wait, 10.0)


# -- headers --------------------------------------------------------------------------------


def test_headers_over_16_kb_in_all_are_431_and_write_nothing(api: Served) -> None:
    # Whole requests, as the ASGI app gets them (the server's own limit, on headers still
    # coming in, is tests/acceptance/test_api_edges.py's).
    app = create_app(Triggers(api.runtime, prefect_url=None), api.credentials)
    path = insight_path(ALICE, "sleep", DAY)
    many = {f"x-filler-{n}": "f" * 1000 for n in range(17)}
    under = {f"x-filler-{n}": "f" * 1000 for n in range(MAX_HEADER_BYTES // 1100)}

    async def whole(headers: dict[str, str]) -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            return await client.get(path, headers={**SERVICE, **headers})

    refused = asyncio.run(whole(many))
    assert_refused(refused, 431, "headers")
    assert refused.headers["connection"] == "close"
    assert job_count(api.database_url) == 0
    assert asyncio.run(whole(under)).status_code == 200
    assert job_count(api.database_url) == 1
    # Over real HTTP too, whichever of the two limits meets it first.
    refused = api.bare.get(insight_path(ALICE, "hrv", DAY), headers={**SERVICE, **many})
    assert refused.status_code == 431
    assert job_count(api.database_url) == 1


# -- what answers show -------------------------------------------------------------------------


def test_a_prefect_url_with_credentials_shows_them_in_no_answer(
    api: Served, monkeypatch: pytest.MonkeyPatch
) -> None:
    closed = free_port()
    password = "pw-of-the-prefect-server-0123"
    monkeypatch.setenv("PREFECT_API_URL", f"http://svc:{password}@127.0.0.1:{closed}/api")
    monkeypatch.delenv("PREFECT_UI_URL", raising=False)
    app = create_app(Triggers(api.runtime), api.credentials)  # the UI's address from the URL
    with ApiServer(app) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        polled = http.get(insight_path(ALICE, "sleep", DAY), headers=SERVICE)
        assert polled.json()["run_note"].startswith("Prefect unreachable at http://")
        page = http.get("/queue", headers=OPERATOR)
        assert page.status_code == 200
        assert f'href="http://127.0.0.1:{closed}/runs"' in page.text, "linked, without them"
        backfill = http.post(f"/v1/users/{ALICE}/backfills", json={}, headers=SERVICE)
        queue = http.get("/v1/queue", headers=OPERATOR)
        for answer in (polled, page, backfill, queue):
            assert password not in answer.text and "svc:" not in answer.text, answer.url
