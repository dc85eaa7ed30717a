"""Databases for the tests: SQLite files, and PostgreSQL databases cloned from a template.

PostgreSQL tests run when `AI_JOB_TEST_POSTGRES_URL` names a server where the
tests may create databases (CI always sets it). Each test gets a database of
its own: cloned from a template that was migrated once per test process, or
empty for the migration tests. Databases are dropped at the end.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from queue_store import migrate

POSTGRES_URL = os.environ.get("AI_JOB_TEST_POSTGRES_URL", "")


class FakeClock:
    """A clock tests move by hand. Each reading advances one microsecond, so
    jobs enqueued "at the same time" still have a definite age order."""

    def __init__(self, start: dt.datetime | None = None) -> None:
        self.now = start or dt.datetime(2026, 1, 5, 9, 0, tzinfo=dt.UTC)

    def __call__(self) -> dt.datetime:
        self.now += dt.timedelta(microseconds=1)
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += dt.timedelta(seconds=seconds)


def postgres_schema_url(base: str, schema: str) -> str:
    separator = "&" if "?" in base else "?"
    return f"{base}{separator}options=-csearch_path%3D{schema}"


class PostgresDatabases:
    """Creates per-test databases on the server of `POSTGRES_URL` (one per test process)."""

    def __init__(self, base_url: str = POSTGRES_URL) -> None:
        self._base = make_url(base_url.replace("postgresql://", "postgresql+psycopg://", 1))
        self._admin = create_engine(self._base, isolation_level="AUTOCOMMIT")
        self._prefix = f"iq_{os.getpid()}_{uuid.uuid4().hex[:6]}"
        self._template: str | None = None
        self._lock = threading.Lock()
        self._made: list[str] = []

    def _url(self, name: str) -> str:
        return (
            self._base.set(database=name)
            .render_as_string(hide_password=False)
            .replace("postgresql+psycopg://", "postgresql://", 1)
        )

    def _create(self, name: str, template: str | None = None) -> None:
        clause = f" TEMPLATE {template}" if template else ""
        with self._admin.connect() as connection:
            connection.execute(text(f"CREATE DATABASE {name}{clause}"))
        self._made.append(name)

    def empty(self) -> str:
        """A new database with nothing in it."""
        name = f"{self._prefix}_{uuid.uuid4().hex[:8]}"
        self._create(name)
        return self._url(name)

    def migrated(self) -> str:
        """A new database at the current schema, cloned from the template."""
        with self._lock:
            if self._template is None:
                template = f"{self._prefix}_template"
                self._create(template)
                migrate.upgrade(self._url(template))
                self._template = template
        name = f"{self._prefix}_{uuid.uuid4().hex[:8]}"
        self._create(name, self._template)
        return self._url(name)

    def drop(self, url: str) -> None:
        name = make_url(url).database
        with self._admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        if name in self._made:
            self._made.remove(name)

    def close(self) -> None:
        for name in reversed(self._made):
            with self._admin.connect() as connection:
                connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        self._admin.dispose()


@contextlib.contextmanager
def per_test_database(
    backend: str, path: Path, request: pytest.FixtureRequest, *, migrated: bool = True
) -> Iterator[str]:
    """A database of one test on `backend`: at the current schema, or with nothing in it.

    SQLite: a file at `path`. PostgreSQL: a database made by the `postgres`
    fixture (asked for only then; cloned from the template when migrated),
    dropped at the end.
    """
    if backend == "sqlite":
        url = f"sqlite:///{path}"
        if migrated:
            migrate.upgrade(url)
        yield url
        return
    databases: PostgresDatabases = request.getfixturevalue("postgres")
    url = databases.migrated() if migrated else databases.empty()
    try:
        yield url
    finally:
        databases.drop(url)
