"""The SQL store that decides what the gateway works on next.

A pure library: it never imports Prefect, httpx, `flows` or `deployments`.
"""

from queue_store import tallies
from queue_store.errors import (
    ClaimLost,
    DatabaseError,
    InvalidArgument,
    Misconfigured,
    SchemaConflict,
    SchemaOutdated,
    SettingsError,
    StoreError,
    Unavailable,
)
from queue_store.models import (
    INTERACTIVE,
    PREFETCH,
    Blocked,
    Claim,
    EnqueueRequest,
    Failure,
    GateState,
    Job,
    JobState,
    PauseKind,
    Position,
    QueueEntry,
    QueueView,
    Renewal,
    Result,
    Settlement,
    Status,
    Tally,
    Usage,
    UsageRow,
    Worker,
    job_id,
    priority_class,
)
from queue_store.redact import Redactor
from queue_store.settings import Settings
from queue_store.store import JobStore
from queue_store.validation import user_id as check_user_id

__all__ = [
    "INTERACTIVE",
    "PREFETCH",
    "Blocked",
    "Claim",
    "ClaimLost",
    "DatabaseError",
    "EnqueueRequest",
    "Failure",
    "GateState",
    "InvalidArgument",
    "Job",
    "JobState",
    "JobStore",
    "Misconfigured",
    "PauseKind",
    "Position",
    "QueueEntry",
    "QueueView",
    "Redactor",
    "Renewal",
    "Result",
    "SchemaConflict",
    "SchemaOutdated",
    "Settings",
    "SettingsError",
    "Settlement",
    "Status",
    "StoreError",
    "Tally",
    "Unavailable",
    "Usage",
    "UsageRow",
    "Worker",
    "check_user_id",
    "job_id",
    "priority_class",
    "tallies",
]
