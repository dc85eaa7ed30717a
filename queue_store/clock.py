"""The one clock every lease decision reads (L1): PostgreSQL's, or on SQLite the host's monotonic
clock anchored to UTC in the database once per boot; never a worker's own wall clock."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from sqlalchemy import Connection, func, select, update

from queue_store import schema
from queue_store.errors import InvalidArgument
from queue_store.schema import gate, holds, jobs

BOOT_ID_FILE = Path("/proc/sys/kernel/random/boot_id")

ClockFunction = Callable[[], dt.datetime]


class Clock(Protocol):
    def now(self, connection: Connection) -> dt.datetime: ...

    def prepare(self, connection: Connection) -> None:
        """Called inside every write transaction that makes a lease decision."""
        return None


def boot_id() -> str:
    """This host's boot identity: it changes when the monotonic clock restarts."""
    try:
        return BOOT_ID_FILE.read_text().strip()
    except OSError:  # no /proc: when the monotonic clock started, to the minute, will do
        return f"booted@{int((time.time() - time.monotonic()) // 60)}"


class DatabaseClock(Clock):
    def now(self, connection: Connection) -> dt.datetime:
        query = select(func.timezone("UTC", func.clock_timestamp()))
        value: dt.datetime = connection.execute(query).scalar_one()
        return value.replace(tzinfo=dt.UTC) if value.tzinfo is None else value.astimezone(dt.UTC)


class HostClock(Clock):
    """The host's monotonic clock as UTC, through an anchor kept in the SQLite database."""

    def __init__(
        self,
        monotonic: Callable[[], float] = time.monotonic,
        boot: Callable[[], str] = boot_id,
        wall: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
    ) -> None:
        self._monotonic = monotonic
        self._boot = boot()
        self._wall = wall
        self._anchor: tuple[dt.datetime, float] | None = None
        self._lock = threading.Lock()

    def now(self, connection: Connection) -> dt.datetime:
        anchor = self._anchor or self._read_anchor(connection)
        if anchor is None:  # not yet on this boot: only reads get here, the next write lays it
            return self._wall()
        wall, mono = anchor
        return wall + dt.timedelta(seconds=self._monotonic() - mono)

    def prepare(self, connection: Connection) -> None:
        if self._anchor is None:
            with self._lock:
                if self._read_anchor(connection) is None:
                    self._lay_anchor(connection)

    def _read_anchor(self, connection: Connection) -> tuple[dt.datetime, float] | None:
        anchor = select(gate.c.clock_boot_id, gate.c.clock_anchor_wall, gate.c.clock_anchor_mono)
        row = connection.execute(anchor.where(gate.c.id == schema.GATE_ROW_ID)).one_or_none()
        if row is None or row.clock_boot_id != self._boot or row.clock_anchor_wall is None:
            return None
        self._anchor = (row.clock_anchor_wall, float(row.clock_anchor_mono))
        return self._anchor

    def _lay_anchor(self, connection: Connection) -> None:
        """A new boot: anchor here, and nothing of the old boot stays alive or ahead of us."""
        wall, mono = self._wall(), self._monotonic()
        times = select(gate.c.last_finished_at, gate.c.last_answer_at)
        previous = connection.execute(times.where(gate.c.id == schema.GATE_ROW_ID)).one_or_none()
        changes: dict[str, object] = {
            "clock_boot_id": self._boot,
            "clock_anchor_wall": wall,
            "clock_anchor_mono": mono,
        }
        if previous is not None:
            # A wall clock set back across the reboot: the old boot's times must not hold the gate.
            for name, value in previous._mapping.items():
                if value is not None and value > wall:
                    changes[name] = wall
        schema.update_gate(connection, **changes)
        # A hold of the old boot keeps its length from now at most: a wall clock set back
        # across the reboot must not stretch it (the gateway is on another host's time).
        for hold in connection.execute(select(holds).where(holds.c.until > wall)).all():
            longest = wall + (hold.until - hold.started_at)
            if hold.until > longest:
                connection.execute(update(holds).where(holds.c.id == hold.id).values(until=longest))
        # Every process of the previous boot is gone: its claims are dead now.
        connection.execute(update(jobs).where(jobs.c.status == "running").values(heartbeat_at=None))
        self._anchor = (wall, mono)


class InjectedClock(Clock):
    def __init__(self, clock: ClockFunction) -> None:
        self._clock = clock

    def now(self, connection: Connection) -> dt.datetime:
        value = self._clock()
        if value.tzinfo is None:
            raise InvalidArgument("clock", "must return timezone-aware UTC times")
        return value.astimezone(dt.UTC)
