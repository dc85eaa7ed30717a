"""Every route but `/healthz`, by audience. The app's: a screen's poll (P1), which a host app may
mount too, and the post-sync hook's backfill. The operator's: the queue, its actions, `/metrics`
(M1: the store's figures at every scrape, on a registry of its own) and the queue page
(`templates/queue.html`: no script, every value autoescaped with its control and bidirectional
characters as escapes, so "\\u202eevil" cannot read as "live")."""

from __future__ import annotations

import datetime as dt
import functools
import hashlib
import math
import time
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Annotated, Any

import jinja2
from fastapi import APIRouter, Depends, Header, Query, Request
from fastapi.concurrency import run_in_threadpool
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from starlette.responses import HTMLResponse, JSONResponse, Response

from deployments.http.access import (
    Body,
    Writes,
    for_user,
    operator,
    page_operator,
    path_text,
    same_site,
    service,
    single_values,
)
from deployments.http.edges import NO_STORE, STORE_DOWN_RETRY_SECONDS, Refused, unavailable
from deployments.render import printable
from deployments.triggers import InsightState, Triggers
from queue_store import OperatorStore, PauseKind, Status, Tally, Unavailable, tallies
from queue_store.models import iso

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
        ask = functools.partial(triggers.request_insight, known=known_version(if_none_match))
        started = time.perf_counter()
        state = await run_in_threadpool(ask, user_id, kind, subject, fingerprint)
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

PAUSE_CAUSES = {
    "operator": "by an operator",
    "outage": "the gateway was unreachable",
    "timeout": "a call timed out",
    "rate_limit": "the gateway asked to slow down",
    "refused": "the gateway refused our credentials",
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


def duration(seconds: float | None) -> str:
    """Seconds for people: 42 s, 3 min 20 s, 2 h 05 min, 3 d 4 h."""
    if seconds is None:
        return "–"
    whole = max(0, round(seconds))
    if whole < 60:
        return f"{whole} s"
    minutes, secs = divmod(whole, 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s" if secs else f"{minutes} min"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours} h"


def _clock_text(at: dt.datetime, now: dt.datetime) -> str:
    at = at.astimezone(dt.UTC)
    return at.strftime("%H:%M:%S") if at.date() == now.date() else at.strftime("%Y-%m-%d %H:%M")


def safe_ui_url(url: str | None) -> str | None:
    """The Prefect UI's address if it is http(s), without the credentials a URL may carry."""
    parts = urllib.parse.urlsplit(url or "")
    host = parts.netloc.rpartition("@")[2]
    if parts.scheme not in ("http", "https") or not host:
        return None
    if host != parts.netloc:
        url = urllib.parse.urlunsplit(parts._replace(netloc=host))
    return str(url).rstrip("/")


_templates = jinja2.Environment(
    loader=jinja2.PackageLoader("deployments", "templates"),
    autoescape=jinja2.select_autoescape(["html"]),
    undefined=jinja2.StrictUndefined,
)
_templates.filters.update(
    shown=lambda value: printable(str(value)),
    duration=duration,
    iso=iso,
    clock_text=_clock_text,
    has_space=lambda text: any(c.isspace() for c in text),
    plural=lambda count, noun: f"{count} {noun}" if count == 1 else f"{count} {noun}s",
)


def operator_router(triggers: Triggers, ui_url: Callable[[], str | None]) -> APIRouter:
    """The operator's routes; `/metrics` reads the store at every scrape (M1)."""
    router = APIRouter(dependencies=[Depends(single_values)])
    store = triggers.operator
    scraped = registry_for(store)
    only = [Depends(operator)]

    @router.get("/v1/queue", dependencies=only)
    async def queue(limit: Limit = QUEUE_LIMIT) -> Response:
        view = await run_in_threadpool(store.queue_view, limit)
        return JSONResponse(view.as_dict(), headers=NO_STORE)

    @router.post("/v1/pause", dependencies=[*only, *Writes])
    async def pause(body: PauseRequest) -> Response:
        gate = await run_in_threadpool(store.pause, body.seconds, body.reason)
        answer = {"paused_until": iso(gate.paused_until), "gate": gate.as_dict()}
        return JSONResponse(answer, headers=NO_STORE)

    @router.post("/v1/resume", dependencies=[*only, *Writes])
    async def resume(body: Body | None = None) -> Response:
        gate = await run_in_threadpool(store.resume)
        return JSONResponse({"gate": gate.as_dict()}, headers=NO_STORE)

    @router.post("/v1/users/{user_id}/retry-failed", dependencies=[*only, *Writes])
    async def retry_failed(request: Request, body: Body | None = None) -> Response:
        done = await run_in_threadpool(store.retry_failed, path_text(request, "user_id"))
        return JSONResponse(done.as_dict(), headers=NO_STORE)

    @router.delete("/v1/users/{user_id}", dependencies=[*only, *Writes])
    async def forget(request: Request) -> Response:
        state = await run_in_threadpool(triggers.forget, path_text(request, "user_id"))
        return JSONResponse(state.as_dict(), headers=NO_STORE)

    @router.get("/metrics", dependencies=only)
    async def metrics_route() -> Response:
        body = await run_in_threadpool(generate_latest, scraped)
        return Response(body, media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    @router.get("/queue", dependencies=[Depends(page_operator)])
    async def page(
        request: Request,
        refresh: Annotated[int, Depends(refresh_seconds)],
        limit: Limit = QUEUE_LIMIT,
    ) -> Response:
        render = functools.partial(
            _templates.get_template("queue.html").render,
            ui_url=safe_ui_url(ui_url()),
            stylesheet=str(request.url_for("static", path="queue.css").path),
            pause_causes=PAUSE_CAUSES,
        )
        try:
            view = await run_in_threadpool(store.queue_view, limit)
        except Unavailable as exc:
            shown = render(
                view=None,
                error=str(exc),
                now=dt.datetime.now(dt.UTC),
                refresh=refresh or REFRESH_SECONDS,
                title="store unreachable · insight-queue",
            )
            headers = {**PAGE_HEADERS, "Retry-After": str(STORE_DOWN_RETRY_SECONDS)}
            return HTMLResponse(shown, 503, headers)
        paused = "paused · " if view.gate.paused else ""
        title = f"{paused}{view.waiting_total} waiting · insight-queue"
        shown = render(view=view, error=None, now=view.now, refresh=refresh, title=title)
        return HTMLResponse(shown, headers=PAGE_HEADERS)

    return router


PREFIX = "insight_queue"


class StoreCollector(Collector):
    def __init__(self, store: OperatorStore) -> None:
        self._store = store

    def collect(self) -> Iterator[Metric]:
        seen = self._store.queue_view(0)
        gate = seen.gate
        waiting = GaugeMetricFamily(f"{PREFIX}_waiting_jobs", "Jobs waiting", labels=["class"])
        oldest = GaugeMetricFamily(
            f"{PREFIX}_oldest_waiting_seconds", "Age of the oldest waiting job", labels=["class"]
        )
        for name, (count, since) in seen.waiting_by_class.items():
            waiting.add_metric([name], count)
            oldest.add_metric([name], (gate.now - since).total_seconds() if since else 0.0)
        yield from (waiting, oldest)
        hold_left = max((h.seconds_left(gate.now) for h in seen.holds), default=0.0)
        for name, text, value in (
            ("calls_in_flight", "Calls at the gateway now", seen.in_flight),
            ("calls_held", "Calls cut on our side that still hold the gateway", len(seen.holds)),
            ("hold_seconds_left", "Seconds until the last hold of a cut call ends", hold_left),
        ):
            yield GaugeMetricFamily(f"{PREFIX}_{name}", text, value=value)
        text = "1 while claiming is paused, by its cause"
        paused = GaugeMetricFamily(f"{PREFIX}_paused", text, labels=["cause"])
        for cause in PauseKind:
            paused.add_metric([cause.value], float(gate.paused and gate.pause_kind is cause))
        yield paused
        text = "Seconds until claiming resumes"
        yield GaugeMetricFamily(f"{PREFIX}_pause_seconds_left", text, value=gate.pause_seconds_left)
        yield from _tallies(seen.tallies)
        text = "Tokens the gateway's answers said they used"
        used = CounterMetricFamily(f"{PREFIX}_tokens", text, labels=["kind", "type"])
        text = "Answers that did not say their tokens"
        unknown = CounterMetricFamily(f"{PREFIX}_answers_without_usage", text, labels=["kind"])
        for row in seen.usage_by_kind:
            used.add_metric([row.kind, "prompt"], row.prompt_tokens)
            used.add_metric([row.kind, "completion"], row.completion_tokens)
            unknown.add_metric([row.kind], row.unknown)
        yield from (used, unknown)


def _tallies(kept: list[Tally]) -> Iterator[Metric]:
    labels = ["kind", "outcome"]
    text = "Settled attempts, by kind and outcome"
    attempts = CounterMetricFamily(f"{PREFIX}_attempts", text, labels=labels)
    text = "How long calls to the gateway took, by kind and outcome"
    calls = HistogramMetricFamily(f"{PREFIX}_call_duration_seconds", text, labels=labels)
    text = "A screen's wait, from asking to its call's start"
    waits = HistogramMetricFamily(f"{PREFIX}_screen_wait_seconds", text, labels=["kind"])
    for tally in kept:
        if tally.name == tallies.ATTEMPTS:
            attempts.add_metric([tally.kind, tally.outcome], tally.count)
            continue
        bounds = tallies.BOUNDS[tally.name]
        buckets = [(f"{b:g}", n) for b, n in zip(bounds, tally.buckets, strict=True)]
        buckets.append(("+Inf", tally.count))
        if tally.name == tallies.CALL_SECONDS:
            calls.add_metric([tally.kind, tally.outcome], buckets, tally.total)
        else:
            waits.add_metric([tally.kind], buckets, tally.total)
    yield from (attempts, calls, waits)


def registry_for(store: OperatorStore) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(StoreCollector(store))
    return registry
