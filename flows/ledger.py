"""The run history of generations: one entry per attempt, for operators.

Writing it must never delay or break a generation: entries are written in the background, after
the call has started, and one that cannot be written is logged and dropped.
`flows.history.PrefectLedger` writes Prefect flow runs; `NullLedger` keeps no history.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Protocol

from queue_store import Failure, Job, Settlement, Usage

QUOTED_ELSEWHERE = "(its words are in the store's error)"


class Outcome(enum.StrEnum):
    DONE = "done"
    REQUEUED = "requeued"  # the attempt was spent; queued again below the limit
    FAILED = "failed"  # the attempt was spent, and it was the last allowed
    RELEASED = "released"  # handed back without spending the attempt
    LOST = "lost"  # the claim was taken over: nothing recorded
    UNRECORDED = "unrecorded"  # the store could not be reached to record it


@dataclasses.dataclass(frozen=True)
class Report:
    """What became of one claimed job."""

    job: Job
    outcome: Outcome
    message: str  # one line, secrets removed
    failure: Failure | None = None
    settlement: Settlement | None = None
    called: bool = False  # a request was sent to the gateway
    call_started_at: float | None = None  # wall-clock time the call began
    call_seconds: float | None = None
    seconds: float = 0.0  # from the claim to the recorded outcome
    flow_run_id: str | None = None
    answered: bool = False  # the gateway's answer came (it may have cost tokens)
    usage: Usage | None = None  # the tokens it said it used; None: unknown
    # Words of the gateway's or of a generator's in `message` (an error body, an exception's
    # text): they may quote a prompt or an answer, so only the store keeps them (D4).
    quoted: str = ""

    @property
    def public_message(self) -> str:
        """The message as the run history and the logs may say it: without what it quotes."""
        if not self.quoted:
            return self.message
        return self.message.replace(self.quoted, QUOTED_ELSEWHERE)

    @property
    def pause_seconds(self) -> float | None:
        return self.settlement.pause_seconds if self.settlement else None

    @property
    def succeeded(self) -> bool:
        return self.outcome is Outcome.DONE


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

    def alive(self, worker: str, role: str) -> None:
        """The consumer `worker` is alive (said every heartbeat; never blocks)."""

    def stopped(self, worker: str) -> None:
        """The consumer `worker` stops, on purpose (never blocks)."""


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

    def alive(self, worker: str, role: str) -> None:
        return None

    def stopped(self, worker: str) -> None:
        return None
