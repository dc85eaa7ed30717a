"""What the app calls: `trigger_backfill`, `request_insight` and `forget`. Each writes the store
first and starts a Prefect run only when the store says one is needed."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

from deployments import table
from deployments.prefect_api import PrefectApi, PrefectUnavailable, api_url
from flows.runtime import Runtime
from queue_store import (
    Forgotten,
    JobState,
    OperatorStore,
    ScreenStore,
    Settings,
    Status,
    Unavailable,
    job_id,
    validation,
)

logger = logging.getLogger(__name__)

# One screen run per job per window at most, however often its screen polls.
RUN_WINDOW_SECONDS = 30
# Without a sync id, a backfill triggered twice within this window starts one run.
BACKFILL_WINDOW_SECONDS = 60
# Runs name their user by pseudonym, as flows.history tags generation runs (D4).
TAG_PREFIX_USER = "user:"
NO_SERVER = (
    "no Prefect server: PREFECT_API_URL is not set and no `insight-queue serve` "
    "is running for this data directory"
)


@dataclasses.dataclass(frozen=True)
class InsightState:
    """What a screen gets back from every poll (README.md, "Using it from an app")."""

    status: str  # pending | running | done | failed | unknown (the store was unreachable)
    ahead: int | None = None
    ahead_exact: bool | None = None
    in_flight: int | None = None
    eta_seconds: float | None = None
    result: dict[str, Any] | None = None
    fresh: bool = False
    flow_run_id: str | None = None  # the run this call started, if any
    run_note: str | None = None
    paused: str | None = None
    error: str | None = None
    # Not part of the answer: the store's version of it, and whether the
    # caller's version still holds (then `result` was not loaded).
    version: str | None = dataclasses.field(default=None, compare=False)
    unchanged: bool = dataclasses.field(default=False, compare=False)

    @classmethod
    def of(cls, state: JobState, run_id: str | None = None, note: str | None = None) -> Self:
        return cls(
            str(state.status),
            **(state.position.as_dict() if state.position else {}),
            result=state.result.as_dict() if state.result else None,
            fresh=state.fresh,
            flow_run_id=run_id,
            run_note=note,
            paused=state.paused,
            version=state.version,
            unchanged=state.unchanged and run_id is None and note is None,
        )

    def as_dict(self) -> dict[str, Any]:
        shown = dataclasses.asdict(self)
        del shown["version"], shown["unchanged"]
        return shown


@dataclasses.dataclass(frozen=True)
class ForgetState:
    forgotten: Forgotten  # the store's part
    history_note: str | None = None  # why the run history's part is not done yet

    def as_dict(self) -> dict[str, Any]:
        return {**self.forgotten.as_dict(), "history_note": self.history_note}


@dataclasses.dataclass(frozen=True)
class BackfillState:
    user_id: str
    queued: int  # scopes queued or already in hand
    flow_run_id: str | None  # the same for the same sync
    run_note: str | None = None  # why no run was started
    error: str | None = None  # the store could not be reached

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class Triggers(contextlib.AbstractContextManager["Triggers"]):
    """One per process, used from any thread; a `with` closes it."""

    def __init__(self, runtime: Runtime, prefect_url: str | None = None) -> None:
        self.runtime = runtime
        self._prefect_url = prefect_url
        self._api: PrefectApi | None = None
        self._lock = threading.Lock()
        self._outage_logged = False
        # Screen runs started, by job and window: a poll in the same window
        # needs no round trip to Prefect to learn the run's id again.
        self._screen_runs: dict[tuple[str, int], str] = {}

    @classmethod
    def open(cls, settings: Settings | None = None, *, prefect_url: str | None = None) -> Self:
        return cls(Runtime.open(settings), prefect_url)

    @property
    def store(self) -> ScreenStore:
        return self.runtime.store

    @property
    def operator(self) -> OperatorStore:
        return self.runtime.store

    def close(self) -> None:
        with self._lock:
            api, self._api = self._api, None
        if api is not None:
            api.close()
        self.runtime.close()

    def __exit__(self, *_: object) -> None:
        self.close()

    def _url(self) -> str | None:
        return self._prefect_url or api_url(self.runtime.settings)

    def _prefect(self) -> PrefectApi:
        if (url := self._url()) is None:
            raise PrefectUnavailable(NO_SERVER)
        with self._lock:
            if self._api is None or self._api.base_url != url.rstrip("/"):
                if self._api is not None:
                    self._api.close()
                self._api = PrefectApi(url)
            return self._api

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
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
    ) -> InsightState:
        """A screen's poll; while `known` (the screen's `version`) holds, `unchanged`, no result.
        Raises `InvalidArgument` for bad input only; an outage is told in the state."""
        user_id, kind, subject = validation.key(user_id, kind, subject)
        fingerprint = validation.fingerprint(fingerprint)
        self.runtime.registry.check(kind, subject)
        try:
            state = self.store.poll(user_id, kind, subject, fingerprint, known=known)
        except Unavailable as exc:
            logger.error("store unavailable for %s:%s: %s", kind, subject, exc)
            return InsightState(status=str(Status.UNKNOWN), error=str(exc))
        pseudonym = state.job.pseudonym
        if not state.run_needed or pseudonym is None:
            return InsightState.of(state)
        window = int(time.time() // RUN_WINDOW_SECONDS)
        key = (state.job.id, window)
        if (started := self._screen_runs.get(key)) is not None:
            return InsightState.of(state, started)
        # Prefect sees the user as their pseudonym only (D4), in the key too.
        run_id, note = self._start_run(
            table.INTERACTIVE,
            parameters={"user": pseudonym, "kind": kind, "subject": subject},
            name=f"{kind}:{subject}",
            tags=[f"{TAG_PREFIX_USER}{pseudonym}", f"kind:{kind}", "priority:interactive"],
            idempotency_key=f"interactive:{pseudonym}:{kind}:{subject}:{window}",
        )
        if run_id is not None:
            with self._lock:
                self._screen_runs = {k: v for k, v in self._screen_runs.items() if k[1] >= window}
                self._screen_runs[key] = run_id
        return InsightState.of(state, run_id, note)

    def trigger_backfill(self, user_id: str, sync_id: str | None = None) -> BackfillState:
        """Queue the user's scopes and start one backfill run per `sync_id` (or per minute)."""
        user_id = validation.user_id(user_id)
        if sync_id is not None:
            sync_id = validation.text("sync_id", sync_id, 200)
        scopes = self.runtime.registry.scopes_for(user_id)
        try:
            self.store.enqueue_many([s.request(user_id) for s in scopes])
            ids = [job_id(user_id, s.kind, s.subject) for s in scopes]
            found = self.store.jobs(ids) if ids else {}
        except Unavailable as exc:
            # Without the store there is no pseudonym to name the user by: no run either.
            logger.error("could not queue the scopes of %s: %s", user_id, exc)
            return BackfillState(user_id, len(scopes), None, None, str(exc))
        pseudonym = next((j.pseudonym for j in found.values() if j.pseudonym), None)
        if pseudonym is None:
            return BackfillState(user_id, len(scopes), None, "no scope to queue for this user")
        window = sync_id or str(int(time.time() // BACKFILL_WINDOW_SECONDS))
        run_id, note = self._start_run(
            table.BACKFILL,
            parameters={"user": pseudonym},
            name=f"backfill:{pseudonym}",
            tags=[f"{TAG_PREFIX_USER}{pseudonym}", "priority:prefetch"],
            idempotency_key=f"backfill:{pseudonym}:{window}",
        )
        return BackfillState(user_id, len(scopes), run_id, note)

    def forget(self, user_id: str) -> ForgetState:
        """D3: the store's rows at once, then the runs in Prefect, with those left waiting."""
        user_id = validation.user_id(user_id)
        forgotten = self.operator.forget(user_id)
        erased, note = self.erase_history(forgotten.history_pending)
        if erased:
            left = self.operator.forget(erased=erased).history_pending
            forgotten = dataclasses.replace(forgotten, history_pending=left)
        return ForgetState(forgotten, note)

    def erase_history(self, pseudonyms: Sequence[str]) -> tuple[list[str], str | None]:
        """Prefect's client, for an operator's action: returns those done, and why not the rest."""
        if not pseudonyms:
            return [], None
        if (url := self._url()) is None:
            return [], NO_SERVER
        from prefect.settings import PREFECT_API_URL, temporary_settings

        from flows.history import erase_runs

        with temporary_settings(updates={PREFECT_API_URL: url}):
            return asyncio.run(erase_runs(list(pseudonyms)))
