"""Shared fixtures: one store test suite, every backend.

Store tests take the `database_url` fixture, parametrised over SQLite (a file
per test) and PostgreSQL (a schema per test in the database named by
`AI_JOB_TEST_POSTGRES_URL`). Without that variable the PostgreSQL cases skip;
CI always sets it.
"""

from __future__ import annotations

import datetime as dt
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from queue_store import JobStore, Settings, migrate
from tests.services import PrefectServer

POSTGRES_URL = os.environ.get("AI_JOB_TEST_POSTGRES_URL", "")


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One Prefect server subprocess for the session, stopped by its PID at the end."""
    server = PrefectServer(tmp_path_factory.mktemp("prefect-server")).start()
    try:
        yield server
    finally:
        server.stop()


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


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgresql" and not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests: set AI_JOB_TEST_POSTGRES_URL")
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    return str(request.param)


@pytest.fixture
def empty_database_url(backend: str, tmp_path: Path) -> Iterator[str]:
    """A database with nothing in it, on the backend under test."""
    if backend == "sqlite":
        yield f"sqlite:///{tmp_path / 'queue.db'}"
        return
    schema = f"t_{uuid.uuid4().hex[:12]}"
    admin = create_engine(POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1))
    with admin.begin() as connection:
        connection.execute(text(f"CREATE SCHEMA {schema}"))
    try:
        yield postgres_schema_url(POSTGRES_URL, schema)
    finally:
        with admin.begin() as connection:
            connection.execute(text(f"DROP SCHEMA {schema} CASCADE"))
        admin.dispose()


@pytest.fixture
def database_url(empty_database_url: str) -> str:
    """A database upgraded to the current schema."""
    migrate.upgrade(empty_database_url)
    return empty_database_url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


StoreFactory = Callable[..., JobStore]


@pytest.fixture
def make_store(database_url: str, clock: FakeClock) -> Iterator[StoreFactory]:
    """Build stores on the test database; keyword arguments override settings."""
    made: list[JobStore] = []

    def factory(**overrides: Any) -> JobStore:
        values: dict[str, Any] = {"gap_seconds": 0.0, "database_url": database_url}
        values.update(overrides)
        store = JobStore(database_url, settings=Settings(**values), clock=clock)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: StoreFactory) -> JobStore:
    return make_store()
