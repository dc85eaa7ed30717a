"""The store's errors: one base class, subclasses that say what went wrong.

Callers catch these, never SQLAlchemy's: driver errors are wrapped `from exc`
at the store's edge, with any database password removed from the message.
"""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error insight-queue's store raises."""


class InvalidArgument(StoreError, ValueError):
    """An argument was rejected before the database was touched; `argument` names it."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class SettingsError(StoreError, ValueError):
    """An environment variable or settings value is not usable."""


class SchemaOutdated(StoreError):
    """The database's schema is missing or older than this code needs."""


class SchemaConflict(StoreError):
    """The database holds tables this store cannot adopt; nothing was changed."""


class ClaimLost(StoreError):
    """The caller no longer holds the job (its claim was taken over): nothing was changed."""

    def __init__(self, job_id: str, holder: str) -> None:
        super().__init__(f"job {job_id[:12]}… is no longer held by {holder}")
        self.job_id = job_id
        self.holder = holder


class DatabaseError(StoreError):
    """The database failed or could not be reached; the call changed nothing."""
