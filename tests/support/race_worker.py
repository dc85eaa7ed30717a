"""Code that runs in separate processes for the race tests, plus a table dump.

Everything here is importable by a `spawn`ed child: module-level functions,
plain picklable arguments. Children build their own `JobStore` on the real
clock; the parent only ever talks to them through queues and events.
"""

from __future__ import annotations

import datetime as dt
import time
import traceback
from typing import Any

from sqlalchemy import Engine, inspect, text

from queue_store import Blocked, JobStore
from tests.support.factories import settings_for, store_for


def dump_tables(engine: Engine) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table in the database, in a stable order."""
    dumped: dict[str, list[tuple[Any, ...]]] = {}
    with engine.connect() as connection:
        for name in sorted(inspect(connection).get_table_names()):
            rows = connection.execute(text(f"SELECT * FROM {name}")).all()
            dumped[name] = sorted((tuple(row) for row in rows), key=repr)
        connection.rollback()
    return dumped


def claim_loop(
    url: str,
    settings: dict[str, Any],
    name: str,
    ready: Any,
    start: Any,
    out: Any,
    hold_seconds: float,
    give_up_after: float,
    meet: tuple[Any, Any, int] | None = None,
) -> None:
    """Claim, hold, finish until the queue is empty; report every claim made.

    `meet` (a shared holder count, an event and a number): until the event
    is set, a worker holding a claim waits (up to 30 s) for that many
    workers to hold one at once, so "two ran side by side" is an event the
    test waits for rather than a timing it hopes for.

    A record is taken *after* `claim_next` returned (the claim is committed)
    and *before* `finish` is called (it is not yet released), so the recorded
    interval lies inside the time the job really was running.
    """
    records: list[dict[str, Any]] = []
    error: str | None = None
    store: JobStore | None = None
    try:
        store = store_for(settings_for(url, **settings))
        store.has_work()  # connect before the start line
        ready.put(name)
        if not start.wait(60):
            raise TimeoutError("the start signal never came")
        deadline = time.monotonic() + give_up_after
        while time.monotonic() < deadline:
            claim = store.claim_next(name)
            if claim.job is None:
                if claim.blocked == Blocked.EMPTY:
                    break
                time.sleep(0.003)
                continue
            claimed = time.monotonic()
            if meet is not None and not meet[1].is_set():
                holders, met, wanted = meet
                with holders.get_lock():
                    holders.value += 1
                    if holders.value >= wanted:
                        met.set()
                met.wait(30)
                with holders.get_lock():
                    holders.value -= 1
            time.sleep(hold_seconds)
            finishing = time.monotonic()
            status = store.finish(claim.job.id, claim.job.holder or "", result={"by": name})
            records.append(
                {
                    "job": claim.job.id,
                    "holder": claim.job.holder,
                    "attempts": claim.job.attempts,
                    "status_at_claim": str(claim.job.status),
                    "claimed": claimed,
                    "finishing": finishing,
                    "finished_as": str(status),
                }
            )
        else:
            raise TimeoutError(f"{name} gave up after {give_up_after} s")
    except BaseException:  # noqa: BLE001 - the parent asserts on whatever happened here
        error = traceback.format_exc()
    finally:
        if store is not None:
            store.close()
    out.put((name, records, error))


# The shared clock's zero, for actors that take their time from the parent.
SHARED_EPOCH = dt.datetime(2026, 3, 1, 12, 0, tzinfo=dt.UTC)


def actor(
    url: str, settings: dict[str, Any], inbox: Any, outbox: Any, shared_time: Any = None
) -> None:
    """A store in its own process that runs the method calls it is sent.

    Each message is `(method, args, kwargs)`; each reply is `("ok", value)` or
    `("error", exception class name, message)`. `None` ends the process.
    With `shared_time` (a `multiprocessing.Value` of seconds), the store's
    clock is the parent's: every actor reads the same time, which only the
    parent moves.
    """
    clock = None
    if shared_time is not None:

        def clock() -> dt.datetime:
            return SHARED_EPOCH + dt.timedelta(seconds=shared_time.value)

    try:
        store = store_for(settings_for(url, **settings), clock=clock)
    except BaseException:  # noqa: BLE001 - the parent asserts on it
        outbox.put(("error", "startup", traceback.format_exc()))
        return
    outbox.put(("ok", "ready"))
    try:
        while True:
            message = inbox.get()
            if message is None:
                break
            method, args, kwargs = message
            try:
                value = getattr(store, method)(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - the parent asserts on the type
                outbox.put(("error", type(exc).__name__, str(exc)))
            else:
                outbox.put(("ok", value))
    finally:
        store.close()
