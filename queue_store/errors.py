"""The store's errors: one base class, and a branch for each thing a caller does about them.
Callers catch these, never SQLAlchemy's: driver errors are wrapped at the store's edge."""

from __future__ import annotations


class StoreError(Exception):
    """Base of every error the store raises."""


class InvalidArgument(StoreError, ValueError):
    """An argument was refused before the database was touched (FIX8): tell the caller."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"{argument}: {message}")
        self.argument = argument


class Misconfigured(StoreError):
    """The deployment is set up wrong (settings, plugins, the API): an operator must fix it."""


class SettingsError(Misconfigured):
    """An environment variable or settings value is not usable."""


class SchemaConflict(Misconfigured):
    """The database holds tables this store cannot adopt; nothing was changed."""


class Unavailable(StoreError):
    """The store cannot be used right now; the call changed nothing. Try again later."""


class DatabaseError(Unavailable):
    """The database failed or could not be reached."""


class SchemaOutdated(Unavailable):
    """The database's schema is missing or older than this code needs."""


class ClaimLost(StoreError):
    """The caller's claim was taken over, and nothing was changed: it must stop."""

    def __init__(self, job_id: str, holder: str) -> None:
        super().__init__(f"job {job_id[:12]}… is no longer held by {holder}")
        self.job_id = job_id
        self.holder = holder
