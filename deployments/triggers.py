"""What the app calls: the post-sync hook's `trigger_backfill`, and a screen's `request_insight`.

Both return within a few seconds whatever Prefect's state, and never wait for
a generation. Both queue their work in the store first, so nothing is lost
when Prefect cannot be reached: the consumer (or the next poll) takes it.
Both refuse at once what could never succeed: a blank or malformed id, a kind
no generator is registered for.

A screen polls every few seconds, and every poll is a `request_insight`. A run
is started only when one is needed: the job is queued, no consumer says it is
standing by (one that is takes the job within a fraction of a second), and no
call is in flight (the consumer making it takes this job next). Even then,
one run per job per `RUN_WINDOW_SECONDS`, by Prefect's idempotency key.

The one place these keep state is the `Triggers` object; the module-level
functions use the process's own (`current()`), made on first use.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

from deployments import table
from deployments.prefect_api import PrefectApi, PrefectUnavailable, api_url
from flows import runtime as runtimes
from queue_store import (
    INTERACTIVE,
    PREFETCH,
    DatabaseError,
    EnqueueRequest,
    InvalidArgument,
    JobStore,
    Status,
    StoreError,
    job_id,
    validation,
)

logger = logging.getLogger(__name__)

# One screen run per job per window at most, however often its screen polls.
RUN_WINDOW_SECONDS = 30
# A backfill triggered twice for the same sync (or, without a sync id, within
# this window) starts one run.
BACKFILL_WINDOW_SECONDS = 60
NO_SERVER = (
    "no Prefect server: PREFECT_API_URL is not set and no `insight-queue serve` "
    "is running for this data directory"
)


@dataclasses.dataclass(frozen=True)
class InsightState:
    """What a screen gets back from every poll (snake_case, like every JSON of the project)."""

    status: str  # pending | running | done | failed | unknown (the store was unreachable)
    ahead: int | None = None  # jobs that will run before this one
    in_flight: int | None = None
    eta_seconds: float | None = None
    result: dict[str, Any] | None = None  # the latest result, possibly for older data
    fresh: bool = False  # the result answers the fingerprint asked about
    flow_run_id: str | None = None  # the run this call started, if any
    run_note: str | None = None  # why no run was started when one was needed
    paused: str | None = None  # claiming is paused: why, and for how long
    error: str | None = None  # the store could not be reached

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class BackfillState:
    """What the post-sync hook gets back."""

    user_id: str
    queued: int  # scopes queued or already in hand
    flow_run_id: str | None  # the backfill run (the same for the same sync)
    run_note: str | None = None  # why no run was started
    error: str | None = None  # the store could not be reached

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Triggers:
    """The app side: a runtime (store, registry) and the way to Prefect."""

    def __init__(self, runtime: runtimes.Runtime, prefect_url: str | None = None) -> None:
        self.runtime = runtime
        self._prefect_url = prefect_url
        self._api: PrefectApi | None = None
        self._lock = threading.Lock()
        self._outage_logged = False

    @property
    def store(self) -> JobStore:
        return self.runtime.store

    def close(self) -> None:
        """Close the store and the connection to Prefect."""
        with self._lock:
            if self._api is not None:
                self._api.close()
                self._api = None
        self.runtime.close()

    def _prefect(self) -> PrefectApi:
        url = self._prefect_url or api_url(self.runtime.settings)
        if url is None:
            raise PrefectUnavailable(NO_SERVER)
        with self._lock:
            if self._api is None or self._api.base_url != url.rstrip("/"):
                if self._api is not None:
                    self._api.close()
                self._api = PrefectApi(url)
            return self._api

    def check_kind(self, kind: str) -> str:
        """The kind, or `InvalidArgument` if no generator is registered for it."""
        kind = validation.kind(kind)
        registry = self.runtime.registry
        if registry.kinds and not registry.knows(kind):
            raise InvalidArgument(
                "kind",
                f"no generator is registered for {kind!r} (known: {', '.join(registry.kinds)})",
            )
        return kind

    def _start_run(
        self, deployment: table.Deployment, **request: Any
    ) -> tuple[str | None, str | None]:
        try:
            run = self._prefect().create_run(deployment.name, **request)
        except PrefectUnavailable as exc:
            if not self._outage_logged:
                logger.error("%s; queued work waits for a consumer", exc)
            self._outage_logged = True
            return None, str(exc)
        if self._outage_logged:
            logger.warning("Prefect reachable again")
        self._outage_logged = False
        return run, None

    def request_insight(
        self, user_id: str, kind: str, subject: str, fingerprint: str | None = None
    ) -> InsightState:
        """A screen's poll: queue the insight at the front, start a run if needed, report.

        Raises `InvalidArgument` (a `ValueError`) for bad input; never raises
        because Prefect or the database is down: the state says so instead.
        """
        user_id, kind, subject = validation.key(user_id, kind, subject)
        fingerprint = validation.fingerprint(fingerprint)
        self.check_kind(kind)
        store = self.store
        try:
            status = store.enqueue(user_id, kind, subject, fingerprint, INTERACTIVE)
        except StoreError as exc:
            if isinstance(exc, ValueError):
                raise
            logger.error("store unavailable for %s:%s: %s", kind, subject, exc)
            return InsightState(status=str(Status.UNKNOWN), error=str(exc))

        run_id = note = None
        if status == Status.PENDING and self._run_needed():
            window = int(time.time() // RUN_WINDOW_SECONDS)
            run_id, note = self._start_run(
                table.INTERACTIVE,
                parameters={
                    "user_id": user_id,
                    "kind": kind,
                    "subject": subject,
                    "fingerprint": fingerprint,
                },
                name=f"{kind}:{subject}",
                tags=[f"user:{user_id}", f"kind:{kind}", "priority:interactive"],
                idempotency_key=f"interactive:{job_id(user_id, kind, subject)}:{window}",
            )
        try:
            job = store.job(user_id, kind, subject)
            # Only a queued or running job has a place in line: a finished one
            # (most polls, once a screen shows its result) skips that read.
            waiting = job is not None and job.status in (Status.PENDING, Status.RUNNING)
            position = store.position(user_id, kind, subject) if waiting else None
            latest = store.result_of(user_id, kind, subject)
            gate = store.gate_state()
        except StoreError as exc:
            return InsightState(
                status=str(status), flow_run_id=run_id, run_note=note, error=str(exc)
            )
        paused = None
        if gate.paused:
            paused = f"{gate.pause_kind} for {gate.pause_seconds_left:.0f} s: {gate.pause_reason}"
        return InsightState(
            status=str(status),
            ahead=position.ahead if position else None,
            in_flight=position.in_flight if position else None,
            eta_seconds=round(position.eta_seconds, 1) if position else None,
            result=latest.as_dict() if latest else None,
            fresh=latest is not None and latest.is_fresh_for(fingerprint, job),
            flow_run_id=run_id,
            run_note=note,
            paused=paused,
        )

    def _run_needed(self) -> bool:
        """No consumer stands by and none is mid-call: only a new run would take the job."""
        try:
            return not self.store.consumer_standing_by() and self.store.calls_in_flight() == 0
        except StoreError:
            return True

    def trigger_backfill(self, user_id: str, sync_id: str | None = None) -> BackfillState:
        """After a data sync: queue every scope of the user, start the backfill run, return at once.

        Safe to call twice for the same sync: with the same `sync_id` (or,
        without one, within a minute) it starts one run. The scopes are queued
        in the store first (one transaction), so they survive Prefect being
        down or the run crashing.
        """
        user_id = validation.user_id(user_id)
        if sync_id is not None:
            sync_id = validation.text("sync_id", sync_id, 200)
        scopes = self.runtime.registry.scopes_for(user_id)
        try:
            self.store.enqueue_many(
                [
                    EnqueueRequest(
                        user_id, s.kind, s.subject, s.fingerprint, PREFETCH, s.single_subject
                    )
                    for s in scopes
                ]
            )
        except StoreError as exc:
            if isinstance(exc, ValueError):
                raise
            # The run queues them itself when it starts.
            logger.error("could not queue the scopes of %s: %s", user_id, exc)
            error: str | None = str(exc)
        else:
            error = None
        window = sync_id or str(int(time.time() // BACKFILL_WINDOW_SECONDS))
        run_id, note = self._start_run(
            table.BACKFILL,
            parameters={"user_id": user_id},
            name=f"backfill:{user_id}",
            tags=[f"user:{user_id}", "priority:prefetch"],
            idempotency_key=f"backfill:{user_id}:{window}",
        )
        return BackfillState(user_id, len(scopes), run_id, note, error)


_triggers: runtimes.InForce[Triggers] = runtimes.InForce(
    "insight_queue_triggers", lambda: Triggers(runtimes.current())
)


def current() -> Triggers:
    """The triggers in force: installed with `use`, else this process's own."""
    return _triggers.current()


def use(triggers: Triggers) -> contextlib.AbstractContextManager[Triggers]:
    """Install `triggers` for the current context (as `flows.runtime.use` does a runtime)."""
    return _triggers.use(triggers)


@contextlib.contextmanager
def _in_force() -> Iterator[Triggers]:
    """The triggers in force, even when the store cannot be opened right now.

    Opening the store checks its schema, which needs the database. When the
    database cannot be reached, this one call gets triggers on a store opened
    without that check: it meets the outage like any call does (the state
    says so), and the next call opens the store again.
    """
    try:
        triggers = current()
    except DatabaseError:
        one_off = Triggers(runtimes.Runtime.from_env(check_schema=False))
        try:
            yield one_off
        finally:
            one_off.close()
        return
    yield triggers


def request_insight(
    user_id: str, kind: str, subject: str, fingerprint: str | None = None
) -> InsightState:
    """A screen's poll (see `Triggers.request_insight`)."""
    with _in_force() as triggers:
        return triggers.request_insight(user_id, kind, subject, fingerprint)


def trigger_backfill(user_id: str, sync_id: str | None = None) -> BackfillState:
    """The post-sync hook (see `Triggers.trigger_backfill`)."""
    with _in_force() as triggers:
        return triggers.trigger_backfill(user_id, sync_id)
