"""Engines for the two backends, and the one place driver errors are wrapped (without passwords)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, SQLAlchemyError

from queue_store import files
from queue_store.errors import DatabaseError, SettingsError
from queue_store.redact import mask_url

SQLITE_BUSY_TIMEOUT_MS = 30_000
POSTGRES_CONNECT_TIMEOUT_SECONDS = 10

SQLITE_BEGIN = "insight_queue_sqlite_begin"  # the "begin" hook's mode: DEFERRED or IMMEDIATE


def normalise_url(url: str | URL) -> URL:
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise SettingsError(f"AI_JOB_DATABASE_URL: not a database URL ({exc})") from None
    backend = parsed.get_backend_name()
    if backend == "postgresql" and parsed.drivername in ("postgresql", "postgres"):
        parsed = parsed.set(drivername="postgresql+psycopg")
    elif backend not in ("postgresql", "sqlite"):
        raise SettingsError(
            f"AI_JOB_DATABASE_URL: {backend} is not supported; use sqlite:/// or postgresql://"
        )
    return parsed


def create_store_engine(url: str | URL, **kwargs: Any) -> Engine:
    parsed = normalise_url(url)
    if parsed.get_backend_name() == "sqlite":
        return _sqlite_engine(parsed, **kwargs)
    # Connections checked before use: a database restart costs one failed call, not a dead pool.
    kwargs = {"pool_pre_ping": True, "pool_size": 5, "max_overflow": 5, **kwargs}
    connect_args = kwargs.pop("connect_args", {})
    connect_args.setdefault("connect_timeout", POSTGRES_CONNECT_TIMEOUT_SECONDS)
    return create_engine(parsed, connect_args=connect_args, **kwargs)


def _sqlite_engine(url: URL, **kwargs: Any) -> Engine:
    if url.database and url.database != ":memory:" and not url.database.startswith("file:"):
        database = Path(url.database).expanduser()
        try:
            files.private_sqlite(database)
        except OSError as exc:
            raise DatabaseError(
                f"cannot create the SQLite file {database}: {exc.strerror or exc}"
            ) from exc
    engine = create_engine(url, **kwargs)

    @event.listens_for(engine, "connect")
    def _on_connect(dbapi_connection: Any, _record: Any) -> None:
        # Transactions are begun below, so a writer takes the write lock up front (BEGIN
        # IMMEDIATE) instead of failing half-way when it upgrades from a read.
        dbapi_connection.isolation_level = None
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")  # processes share it
        cursor.execute("PRAGMA journal_mode = WAL")  # readers never wait for the writer
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA secure_delete = ON")  # a deleted row is overwritten in the file (D3)
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


def shown_url(url: URL) -> str:
    return mask_url(url.render_as_string(hide_password=False))


def scrub(message: str, url: URL | None = None) -> str:
    """The message without any database password it might quote."""
    secrets = [str(url.password)] if url is not None and url.password else []
    query = url.query.get("password") if url is not None else None
    secrets += [query] if isinstance(query, str) else list(query or ())
    for secret in filter(None, secrets):
        message = message.replace(secret, "***")
    return mask_url(message)


def wrap_database_error(
    exc: SQLAlchemyError, url: URL | None = None, operation: str = "database"
) -> DatabaseError:
    original = getattr(exc, "orig", None) or exc
    first_line = str(original).strip().splitlines()[0] if str(original).strip() else ""
    message = f"{operation}: {type(original).__name__}: {first_line}"
    return DatabaseError(scrub(message[:500], url))
