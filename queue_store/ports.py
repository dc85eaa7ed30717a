"""The store by role: `WorkerStore` (a consumer), `ScreenStore` (the app's side), `OperatorStore`.
`JobStore` plays every role; a caller names the one it uses, and a test may fake just that one."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, Protocol, overload, runtime_checkable

from queue_store.models import (
    PREFETCH,
    Claim,
    EnqueueRequest,
    Failure,
    Forgotten,
    GateState,
    Job,
    JobState,
    ListedJob,
    Pruned,
    QueueView,
    Renewal,
    Requeued,
    Settlement,
    Status,
    Usage,
)


@runtime_checkable
class WorkerStore(Protocol):
    def claim_next(self, worker: str) -> Claim: ...

    def heartbeat(
        self, jid: str, holder: str, *, calling: bool = False, flow_run_id: str | None = None
    ) -> Renewal: ...

    def finish(
        self,
        jid: str,
        holder: str,
        *,
        result: Any,
        duration_seconds: float | None = None,
        flow_run_id: str | None = None,
        usage: Usage | None = None,
    ) -> Status: ...

    def fail(
        self,
        jid: str,
        holder: str,
        failure: Failure,
        error: str,
        *,
        retry_after: float | None = None,
        flow_run_id: str | None = None,
        duration_seconds: float | None = None,
        answer: Usage | bool = False,
    ) -> Settlement: ...

    def has_work(self, *, or_running: bool = False) -> bool: ...

    def presence(
        self, name: str, role: str, info: dict[str, Any] | None = None, *, leaving: bool = False
    ) -> None: ...


@runtime_checkable
class ScreenStore(Protocol):
    def enqueue(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        priority: int = PREFETCH,
    ) -> Status: ...

    def enqueue_many(self, requests: Iterable[EnqueueRequest]) -> list[Status]: ...

    @overload
    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
        queue: Literal[True] = True,
    ) -> JobState: ...

    @overload
    def poll(
        self,
        user_id: str,
        kind: str,
        subject: str,
        fingerprint: str | None = None,
        *,
        known: str | None = None,
        queue: Literal[False],
    ) -> JobState | None: ...

    def jobs(self, ids: Iterable[str]) -> dict[str, Job]: ...
    def user_of(self, pseudonym: str) -> str | None: ...
    def gate_state(self) -> GateState: ...


@runtime_checkable
class OperatorStore(Protocol):
    def queue_view(self, limit: int = 50) -> QueueView: ...
    def list_jobs(self, user_id: str, limit: int = 60) -> list[ListedJob]: ...
    def gate_state(self) -> GateState: ...
    def pause(self, seconds: float, reason: str) -> GateState: ...
    def resume(self) -> GateState: ...
    def retry_failed(self, user_id: str) -> Requeued: ...
    def requeue(self, kinds: Sequence[str] | None = None) -> int: ...
    def recover(self, worker: str | None = None) -> list[Job]: ...

    def prune(
        self,
        *,
        retention_days: float | None = None,
        by_kind: Mapping[str, float] | None = None,
        dry_run: bool = False,
    ) -> Pruned: ...

    def forget(self, user_id: str | None = None, *, erased: Iterable[str] = ()) -> Forgotten: ...
