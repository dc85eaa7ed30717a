"""The SQL store that decides what the gateway works on next.

A pure library: it never imports Prefect, httpx, `flows` or `deployments`.
"""

from queue_store.errors import (
    ClaimLost,
    DatabaseError,
    InvalidArgument,
    SchemaConflict,
    SchemaOutdated,
    SettingsError,
    StoreError,
)
from queue_store.models import (
    INTERACTIVE,
    PREFETCH,
    Blocked,
    Claim,
    GateState,
    Job,
    Position,
    Result,
    Status,
    job_id,
    priority_class,
)
from queue_store.settings import Secret, Settings
from queue_store.store import JobStore, check_user_id

__all__ = [
    "INTERACTIVE",
    "PREFETCH",
    "Blocked",
    "Claim",
    "ClaimLost",
    "DatabaseError",
    "GateState",
    "InvalidArgument",
    "Job",
    "JobStore",
    "Position",
    "Result",
    "SchemaConflict",
    "SchemaOutdated",
    "Secret",
    "Settings",
    "SettingsError",
    "Status",
    "StoreError",
    "check_user_id",
    "job_id",
    "priority_class",
]
