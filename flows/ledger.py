"""The run history's port: one entry per generation attempt, for operators. Writing it must
never delay or break a generation (`flows.history.PrefectLedger` writes Prefect flow runs)."""

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
    flow_run_id: str | None = None
    answered: bool = False  # the gateway's answer came (it may have cost tokens)
    usage: Usage | None = None  # the tokens it said it used; None: unknown
    quoted: str = ""  # the gateway's or a generator's words in `message`: the store's only (D4)

    @property
    def public_message(self) -> str:
        """The message as the run history and the logs may say it: without what it quotes."""
        return self.message.replace(self.quoted, QUOTED_ELSEWHERE) if self.quoted else self.message

    @property
    def pause_seconds(self) -> float | None:
        return self.settlement.pause_seconds if self.settlement else None

    @property
    def succeeded(self) -> bool:
        return self.outcome is Outcome.DONE


class LedgerEntry(Protocol):
    """The history entry of one attempt; no method blocks."""

    def call_started(self, at: float) -> None: ...  # the request was sent, at wall-clock `at`
    def note(self, message: str) -> None: ...  # a line for the entry's log
    def close(self, report: Report) -> None: ...  # the attempt is over
    async def run_id(self, wait: float | None = None) -> str | None:
        """The entry's id once written (waits briefly, or `wait` s), else None."""


class Ledger(Protocol):
    """Opens an entry for each job just claimed; hears a consumer's heartbeats and its stop."""

    def open(self, job: Job) -> LedgerEntry: ...
    def alive(self, worker: str, role: str) -> None: ...
    def stopped(self, worker: str) -> None: ...


class NullLedger:
    """Keeps no history: each entry is the ledger itself, and every method does nothing."""

    def open(self, job: Job) -> LedgerEntry:
        return self

    def alive(self, worker: str, role: str) -> None: ...
    def stopped(self, worker: str) -> None: ...
    def call_started(self, at: float) -> None: ...
    def note(self, message: str) -> None: ...
    def close(self, report: Report) -> None: ...
    async def run_id(self, wait: float | None = None) -> str | None:
        return None
