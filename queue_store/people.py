"""Pseudonyms: a random name per user, all the run history ever sees of them (D4)."""

from __future__ import annotations

import datetime as dt
import secrets
from collections.abc import Iterable

from sqlalchemy import Connection, select

from queue_store import schema
from queue_store.schema import people

PSEUDONYM_BYTES = 12
MAX_PSEUDONYM_LENGTH = 40


def new_pseudonym() -> str:
    return "p-" + secrets.token_hex(PSEUDONYM_BYTES)


def pseudonymize(connection: Connection, user_ids: Iterable[str], now: dt.datetime) -> None:
    """A pseudonym for each of these users who has none yet."""
    wanted = sorted(set(user_ids))
    if not wanted:
        return
    known = set(
        connection.execute(select(people.c.user_id).where(people.c.user_id.in_(wanted))).scalars()
    )
    missing = [u for u in wanted if u not in known]
    if not missing:
        return
    rows = [{"user_id": u, "pseudonym": new_pseudonym(), "created_at": now} for u in missing]
    statement = schema.upsert(connection, people).on_conflict_do_nothing(index_elements=["user_id"])
    connection.execute(statement, rows)


def pseudonym_of(connection: Connection, user_id: str) -> str | None:
    found = connection.execute(select(people.c.pseudonym).where(people.c.user_id == user_id))
    return found.scalar_one_or_none()


def user_of(connection: Connection, pseudonym: str) -> str | None:
    found = connection.execute(select(people.c.user_id).where(people.c.pseudonym == pseudonym))
    return found.scalar_one_or_none()
