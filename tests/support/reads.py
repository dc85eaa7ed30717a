"""Short reads of the store for tests: one job by its key, what is left to do, a result."""

from __future__ import annotations

from typing import Any

from sqlalchemy.engine import Engine

from queue_store import Job, JobState, JobStore, Result, Status, job_id


def job_of(store: JobStore, user_id: str, kind: str, subject: str) -> Job | None:
    """The job of this key, or None."""
    jid = job_id(user_id, kind, subject)
    return store.jobs([jid]).get(jid)


def pending(store: JobStore, user_id: str | None = None) -> int:
    """Jobs pending or running (of one user, or of everyone)."""
    if user_id is not None:
        waiting = (Status.PENDING, Status.RUNNING)
        return sum(e.job.status in waiting for e in store.list_jobs(user_id, limit=1000))
    view = store.queue_view(0)
    return view.waiting_total + len(view.running)


def result_of(store: JobStore, user_id: str, kind: str, subject: str) -> Result | None:
    """The latest result of the key, read as the CLI's `result` does."""
    state = store.poll(user_id, kind, subject, queue=False)
    return state.result if state is not None else None


def engine_of(store: JobStore) -> Engine:
    """The store's own engine, for the tests that watch its statements or plans (white-box)."""
    engine: Engine = store._engine
    return engine


def listed_jobs(
    store: JobStore, user_id: str, limit: int = 60, max_attempts: int = 3
) -> list[dict[str, Any]]:
    """A user's queue as `insight-queue jobs --json` prints it."""
    return [entry.as_dict(max_attempts) for entry in store.list_jobs(user_id, limit)]


def state_of(
    store: JobStore, user_id: str, kind: str, subject: str, fingerprint: str | None = None
) -> JobState | None:
    """A job's state as the CLI's `status` reads it (nothing queued), or None."""
    return store.poll(user_id, kind, subject, fingerprint, queue=False)


def standing_by(store: JobStore) -> list[str]:
    """The consumers standing by."""
    return store.gate_state().standing_by
