"""What the store counts for operators (M1, M2), in the transactions that settle and claim.
A histogram is kept as Prometheus keeps one: a count, a sum, and cumulative counts per bound."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from sqlalchemy import Connection, Row, func, insert, select, update

from queue_store.models import Tally, Usage, UsageRow
from queue_store.schema import tallies, usage

ATTEMPTS = "attempts"  # every settled attempt, by kind and outcome
CALL_SECONDS = "call_seconds"  # attempts that called the gateway: how long the call took
SCREEN_WAIT_SECONDS = "screen_wait_seconds"  # a screen asking, to its call starting
BOUNDS = {
    ATTEMPTS: (),
    CALL_SECONDS: (1.0, 5.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1020.0, 1800.0),
    SCREEN_WAIT_SECONDS: (1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0),
}
SUMMED = ("answers", "unknown", "prompt_tokens", "completion_tokens")


def count(connection: Connection, name: str, kind: str, outcome: str, value: float = 0.0) -> None:
    """Add one observation of `value` to a tally (a counter, or a histogram's bucket)."""
    key = (tallies.c.name == name, tallies.c.kind == kind, tallies.c.outcome == outcome)
    row = connection.execute(select(tallies).where(*key)).one_or_none()
    bounds = BOUNDS[name]
    before = json.loads(row.buckets) if row is not None else [0] * len(bounds)
    buckets = json.dumps([n + (value <= bound) for n, bound in zip(before, bounds, strict=True)])
    if row is None:
        values = {"name": name, "kind": kind, "outcome": outcome, "count": 1, "total": value}
        connection.execute(insert(tallies).values(**values, buckets=buckets))
    else:
        added = {"count": row._mapping["count"] + 1, "total": row.total + value}
        connection.execute(update(tallies).where(*key).values(**added, buckets=buckets))


def spent_tokens(
    connection: Connection, day: dt.date, user_id: str, kind: str, used: Usage | None
) -> None:
    """Add an answer's usage to its day's, user's and kind's (None: unknown)."""
    key = (usage.c.day == day, usage.c.user_id == user_id, usage.c.kind == kind)
    row = connection.execute(select(usage).where(*key)).one_or_none()
    before = row._mapping if row is not None else dict.fromkeys(SUMMED, 0)
    spent = used or Usage(0, 0)
    added = {
        "answers": 1,
        "unknown": 1 if used is None else 0,
        "prompt_tokens": spent.prompt_tokens,
        "completion_tokens": spent.completion_tokens,
    }
    values = {name: before[name] + n for name, n in added.items()}
    if row is None:
        connection.execute(insert(usage).values(day=day, user_id=user_id, kind=kind, **values))
    else:
        connection.execute(update(usage).where(*key).values(**values))


def tally_attempt(
    connection: Connection,
    now: dt.datetime,
    row: Any,
    outcome: str,
    seconds: float | None,
    answer: Usage | bool,
) -> None:
    """Count a settled attempt, its call's time and its answer's tokens (True: it did not say)."""
    count(connection, ATTEMPTS, row.kind, str(outcome))
    if seconds is not None:
        count(connection, CALL_SECONDS, row.kind, str(outcome), seconds)
    if answer:
        used = answer if isinstance(answer, Usage) else None
        spent_tokens(connection, now.date(), row.user_id, row.kind, used)


def read(connection: Connection) -> list[Tally]:
    return [
        Tally(r.name, r.kind, r.outcome, r._mapping["count"], r.total, tuple(json.loads(r.buckets)))
        for r in connection.execute(select(tallies).order_by(tallies.c.name, tallies.c.kind))
    ]


def usage_by(connection: Connection, *columns: Any) -> list[UsageRow]:
    """Tokens summed by these columns of `usage` (none: one row, every user and kind)."""
    sums = [func.coalesce(func.sum(usage.c[name]), 0).label(name) for name in SUMMED]
    return [_usage_row(r) for r in connection.execute(select(*columns, *sums).group_by(*columns))]


def usage_rows(connection: Connection, limit: int | None = None) -> list[UsageRow]:
    """Tokens per user and kind (of the days still kept per user), the most first."""
    sums = [func.sum(usage.c[name]).label(name) for name in SUMMED]
    tokens = func.sum(usage.c.prompt_tokens + usage.c.completion_tokens)
    query = (
        select(usage.c.user_id, usage.c.kind, *sums)
        .where(usage.c.user_id != "")
        .group_by(usage.c.user_id, usage.c.kind)
        .order_by(tokens.desc(), usage.c.user_id, usage.c.kind)
        .limit(limit)
    )
    return [_usage_row(r) for r in connection.execute(query)]


def _usage_row(row: Row[Any]) -> UsageRow:
    """A row's sums, for the user and kind it was grouped by ("": every one)."""
    sums = {name: int(row._mapping[name]) for name in SUMMED}
    return UsageRow(user_id=getattr(row, "user_id", ""), kind=getattr(row, "kind", ""), **sums)
