"""What the app calls: the post-sync hook's `trigger_backfill`, and a screen's `request_insight`.

Both return at once and never wait for a generation. Both keep working on the
store alone when the Prefect server cannot be reached: the work is queued, the
error is logged once (not once per poll), and the safety-net consumer picks it
up when Prefect is back.

A screen polls every few seconds, and every poll is a `request_insight`. A
flow run is started only when one is needed: when the job is queued and no
consumer is in the middle of a call (one that is will take this job next, as
the store hands out the highest priority first). Even then, one run per job
per `RUN_WINDOW_SECONDS` at most, by Prefect's idempotency key.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any
from uuid import UUID

from queue_store import (
    INTERACTIVE,
    PREFETCH,
    JobStore,
    Settings,
    StoreError,
    check_user_id,
    job_id,
)

logger = logging.getLogger(__name__)

DEPLOYMENT = "insight-queue"
BACKFILL_DEPLOYMENT = f"backfill/{DEPLOYMENT}"
INTERACTIVE_DEPLOYMENT = f"interactive/{DEPLOYMENT}"
DRAIN_DEPLOYMENT = f"drain/{DEPLOYMENT}"

# One interactive run per job per window at most, however often its screen polls.
RUN_WINDOW_SECONDS = 30
# A backfill triggered twice for the same sync within this window runs once.
BACKFILL_WINDOW_SECONDS = 60
# A screen's poll must not hang on Prefect, whose client retries a 503 up to
# five times over a minute: one retry and short timeouts. A run not created
# now is created by the screen's next poll (same idempotency key) or the
# safety net.
CREATE_RUN_RETRIES = 1
CREATE_RUN_TIMEOUT_SECONDS = 5.0


@dataclasses.dataclass(frozen=True)
class InsightState:
    """What a screen gets back from every poll."""

    status: str
    ahead: int | None = None
    eta_seconds: float | None = None
    result: dict[str, Any] | None = None  # the latest result, possibly for older data
    fresh: bool = False  # the result matches the fingerprint asked for
    flow_run_id: str | None = None  # the run started by this call, if any
    error: str | None = None  # set when the store itself could not be reached

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class _OnceLogger:
    """Logs an outage once, and its end once, instead of once per poll."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._failing = False
        self._lock = threading.Lock()

    def failed(self, exc: BaseException) -> None:
        with self._lock:
            if self._failing:
                return
            self._failing = True
        logger.error(
            "%s unreachable (%s: %s); queued work waits for the safety net",
            self._what,
            type(exc).__name__,
            exc,
        )

    def succeeded(self) -> None:
        with self._lock:
            if not self._failing:
                return
            self._failing = False
        logger.warning("%s reachable again", self._what)


_prefect_outage = _OnceLogger("Prefect server")
_deployment_ids: dict[str, UUID] = {}
_store: JobStore | None = None
_store_lock = threading.Lock()


def default_store() -> JobStore:
    global _store
    with _store_lock:
        if _store is None:
            settings = Settings.from_env()
            _store = JobStore(settings.database_url, settings=settings)
        return _store


def _create_run(
    deployment: str,
    parameters: dict[str, Any],
    *,
    name: str,
    tags: list[str],
    idempotency_key: str,
) -> str | None:
    """Start a flow run of a deployment; None (logged once) if Prefect is unreachable."""
    try:
        from prefect import get_client
        from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: CREATE_RUN_RETRIES}),
            get_client(
                sync_client=True, httpx_settings={"timeout": CREATE_RUN_TIMEOUT_SECONDS}
            ) as client,
        ):
            deployment_id = _deployment_ids.get(deployment)
            if deployment_id is None:
                deployment_id = client.read_deployment_by_name(deployment).id
                _deployment_ids[deployment] = deployment_id
            run = client.create_flow_run_from_deployment(
                deployment_id,
                parameters=parameters,
                name=name,
                tags=tags,
                idempotency_key=idempotency_key,
            )
    except Exception as exc:  # noqa: BLE001 - any Prefect failure leaves the work queued
        _deployment_ids.pop(deployment, None)
        _prefect_outage.failed(exc)
        return None
    _prefect_outage.succeeded()
    return str(run.id)


def trigger_backfill(
    user_id: str, sync_id: str | None = None, *, store: JobStore | None = None
) -> str | None:
    """After a data sync: start the backfill flow for the user, and return at once.

    Safe to call twice for the same sync: with the same `sync_id` (or, without
    one, within a minute) it starts one run. The user's scopes are queued in
    the store before the run is asked for, so they survive Prefect being down
    or the run crashing. Returns the flow run id, or None when Prefect is
    unreachable (the safety net then drains what is queued).
    Raises `ValueError` (the store's `InvalidArgument`) for a user id the store
    would refuse.
    """
    user_id = check_user_id(user_id)
    # Queued here first (idempotent, a few fast writes): a run that never
    # starts, or crashes before its own enqueue, then loses nothing, and the
    # safety net drains what is queued.
    _queue_scopes(user_id, store)
    window = sync_id or str(int(time.time() // BACKFILL_WINDOW_SECONDS))
    return _create_run(
        BACKFILL_DEPLOYMENT,
        {"user_id": user_id},
        name=f"backfill:{user_id}",
        tags=["priority:prefetch"],
        idempotency_key=f"backfill:{user_id}:{window}",
    )


def _queue_scopes(user_id: str, store: JobStore | None) -> None:
    """Queue every scope of the user at prefetch priority (what the backfill flow does)."""
    from flows.registry import scopes_for

    try:
        store = store or default_store()
        for scope in scopes_for(user_id):
            store.enqueue(user_id, scope.kind, scope.subject, scope.fingerprint, PREFETCH)
            if scope.single_subject:
                store.supersede(user_id, scope.kind, scope.subject)
    except StoreError as exc:
        # The run queues them itself when it starts.
        logger.error("could not queue the scopes of %s in the store: %s", user_id, exc)


def request_insight(
    user_id: str,
    kind: str,
    subject: str,
    fingerprint: str | None = None,
    *,
    store: JobStore | None = None,
) -> InsightState:
    """A screen's poll: queue the insight at the front, start a run if needed, report.

    Raises `ValueError` (the store's `InvalidArgument`) for bad input; never
    raises because Prefect or the database is down: the state says so instead.
    """
    try:
        store = store or default_store()  # opening it checks the schema: it may fail too
        status = store.enqueue(user_id, kind, subject, fingerprint, INTERACTIVE)
    except StoreError as exc:
        if isinstance(exc, ValueError):
            raise
        logger.error("store unavailable for %s:%s: %s", kind, subject, exc)
        return InsightState(status="unknown", error=str(exc))

    run_id = None
    if status == "pending" and _no_call_in_flight(store):
        window = int(time.time() // RUN_WINDOW_SECONDS)
        run_id = _create_run(
            INTERACTIVE_DEPLOYMENT,
            {"user_id": user_id, "kind": kind, "subject": subject, "fingerprint": fingerprint},
            name=f"{kind}:{subject}",
            tags=[f"kind:{kind}", "priority:interactive"],
            idempotency_key=f"interactive:{job_id(user_id, kind, subject)}:{window}",
        )

    try:
        position = store.position(user_id, kind, subject)
        latest = store.result_of(user_id, kind, subject)
    except StoreError as exc:
        return InsightState(status=status, flow_run_id=run_id, error=str(exc))
    return InsightState(
        status=status,
        ahead=position.ahead if position else None,
        eta_seconds=round(position.eta_seconds, 1) if position else None,
        result=latest.as_dict() if latest else None,
        fresh=latest is not None and fingerprint in (None, latest.fingerprint),
        flow_run_id=run_id,
    )


def _no_call_in_flight(store: JobStore) -> bool:
    """True when no consumer is mid-call (one that is takes our job next)."""
    try:
        return store.calls_in_flight() == 0
    except StoreError:
        return True
