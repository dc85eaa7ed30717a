"""The run history of generations: one entry per attempt, for operators.

The runner opens an entry when it starts on a claimed job, notes what
happens, and closes it with the outcome. Writing the history must never delay
or break a generation: entries are written in the background, after the call
has started, and a history that cannot be written is logged and dropped.

`NullLedger` keeps no history (tests, and consumers without Prefect);
`flows.history.PrefectLedger` writes each attempt as a Prefect flow run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from queue_store import Job

if TYPE_CHECKING:
    from flows.runner import Report


class LedgerEntry(Protocol):
    """The history entry of one attempt."""

    def call_started(self, at: float) -> None:
        """The request was sent, at wall-clock time `at`."""

    def note(self, message: str) -> None:
        """A line for the entry's log."""

    async def run_id(self, wait: float | None = None) -> str | None:
        """The entry's id in the history once written (waits briefly, or `wait` s), else None."""

    def close(self, report: Report) -> None:
        """The attempt is over; `report` says how."""


class Ledger(Protocol):
    def open(self, job: Job) -> LedgerEntry:
        """Start the entry for a job just claimed (never blocks)."""


class _NullEntry:
    def call_started(self, at: float) -> None:
        return None

    def note(self, message: str) -> None:
        return None

    async def run_id(self, wait: float | None = None) -> str | None:
        return None

    def close(self, report: Report) -> None:
        return None


class NullLedger:
    """Keeps no history."""

    def open(self, job: Job) -> LedgerEntry:
        return _NullEntry()
