"""Shared fixtures: one store test suite, every backend; the test tiers.

Store tests take the `database_url` fixture, parametrised over SQLite (a file
per test) and PostgreSQL (a database per test, cloned from a migrated
template). Without `AI_JOB_TEST_POSTGRES_URL` the PostgreSQL cases skip; in CI
(`CI` set) they fail instead.

Tiers, by folder: `unit` (no database server, no subprocess), `integration`
(real databases, in-process servers, a Prefect server), `acceptance` (the CLI,
`serve` and faults with real processes). `make test-fast` runs the first two.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from queue_store import JobStore
from tests.support.databases import (
    POSTGRES_URL,
    FakeClock,
    PostgresDatabases,
    per_test_database,
)
from tests.support.factories import settings_for, store_for
from tests.support.services import PrefectServer

TIERS = ("unit", "integration", "acceptance")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.path)).parts
        for tier in TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One Prefect server subprocess for the session, stopped by its PID at the end."""
    from deployments.processes import free_port

    server = PrefectServer(tmp_path_factory.mktemp("prefect-server"), free_port(), ui=False)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresDatabases]:
    if not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests: set AI_JOB_TEST_POSTGRES_URL")
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    databases = PostgresDatabases()
    try:
        yield databases
    finally:
        databases.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgresql" and not POSTGRES_URL:
        if os.environ.get("CI"):
            pytest.fail("CI must run the PostgreSQL tests: set AI_JOB_TEST_POSTGRES_URL")
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    return str(request.param)


@pytest.fixture
def empty_database_url(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A database with nothing in it, on the backend under test."""
    with per_test_database(backend, tmp_path / "queue.db", request, migrated=False) as url:
        yield url


@pytest.fixture
def database_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[str]:
    """A database at the current schema, on the backend under test."""
    with per_test_database(backend, tmp_path / "queue.db", request) as url:
        yield url


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


StoreFactory = Callable[..., JobStore]


@pytest.fixture
def make_store(database_url: str, clock: FakeClock) -> Iterator[StoreFactory]:
    """Build stores on the test database; keyword arguments override settings."""
    made: list[JobStore] = []

    def factory(**overrides: Any) -> JobStore:
        store = store_for(settings_for(database_url, **overrides), clock=clock)
        made.append(store)
        return store

    yield factory
    for store in made:
        store.close()


@pytest.fixture
def store(make_store: StoreFactory) -> JobStore:
    return make_store()


@pytest.fixture(autouse=True)
def _no_settings_from_the_shell(monkeypatch: pytest.MonkeyPatch) -> None:
    """Settings come from each test, never from the environment it was started in."""
    for name in list(os.environ):
        if name.startswith(("AI_JOB", "AI_GATEWAY_", "AI_API_")) and not name.startswith(
            "AI_JOB_TEST_"
        ):
            monkeypatch.delenv(name)
