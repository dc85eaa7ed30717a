"""Schema migrations, forward only (README: restore a backup to go back): upgrade a database to
what this code needs, or say how.
Alembic has its own version table (a database may be shared with an app's Alembic), and is
imported only to upgrade: every command that opens a store reads the revision with one query."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, inspect, text
from sqlalchemy.exc import SQLAlchemyError

from queue_store.engine import create_store_engine, wrap_database_error
from queue_store.schema import VERSION_TABLE

MIGRATIONS = Path(__file__).parent / "migrations"


def upgrade(url_or_engine: str | Engine, revision: str = "head") -> str | None:
    """Bring the database to `revision`; returns the revision it is at afterwards."""
    from alembic import command
    from alembic.config import Config

    engine = create_store_engine(url_or_engine) if isinstance(url_or_engine, str) else url_or_engine
    try:
        with engine.begin() as connection:
            config = Config()
            config.set_main_option("script_location", str(MIGRATIONS))
            config.attributes["connection"] = connection
            command.upgrade(config, revision)
        return current_revision(engine)
    except SQLAlchemyError as exc:
        raise wrap_database_error(exc, engine.url) from exc
    finally:
        if isinstance(url_or_engine, str):
            engine.dispose()


def current_revision(engine: Engine) -> str | None:
    """The database's schema revision, or None when the store was never created."""
    with engine.connect() as connection:
        if not inspect(connection).has_table(VERSION_TABLE):
            return None
        version = text(f"SELECT version_num FROM {VERSION_TABLE}")
        return connection.execute(version).scalar_one_or_none()
