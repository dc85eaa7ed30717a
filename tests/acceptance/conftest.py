"""Fixtures of the acceptance tier that more than one module needs."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from deployments.processes import free_port
from tests.support.databases import POSTGRES_URL, PostgresDatabases
from tests.support.services import PrefectServer


@pytest.fixture(scope="module")
def pg_prefect(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """A Prefect server on a PostgreSQL database of its own, dropped afterwards."""
    if not POSTGRES_URL:
        pytest.skip("AI_JOB_TEST_POSTGRES_URL is not set")
    name = f"iq_prefect_{uuid.uuid4().hex[:8]}"
    admin = create_engine(
        POSTGRES_URL.replace("postgresql://", "postgresql+psycopg://", 1),
        isolation_level="AUTOCOMMIT",
    )
    with admin.connect() as connection:
        connection.execute(text(f"CREATE DATABASE {name}"))
    url = make_url(POSTGRES_URL).set(drivername="postgresql+asyncpg", database=name)
    server = PrefectServer(
        tmp_path_factory.mktemp("prefect-pg"),
        free_port(),
        ui=False,
        database_url=url.render_as_string(hide_password=False),
    )
    try:
        server.start()
        yield server
    finally:
        server.stop()
        with admin.connect() as connection:
            connection.execute(text(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        admin.dispose()


@pytest.fixture
def store_url(postgres: PostgresDatabases) -> Iterator[str]:
    """A migrated PostgreSQL store of the test's own, dropped afterwards."""
    url = postgres.migrated()
    try:
        yield url
    finally:
        postgres.drop(url)
