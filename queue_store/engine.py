"""Engines for the two backends, and the one place driver errors are wrapped.

SQLite: WAL so readers never wait for the writer, a generous busy timeout because several
processes share the file, transactions begun by us so a write transaction can take the write
lock up front (`BEGIN IMMEDIATE`) instead of failing half-way when it upgrades from a read, and
`secure_delete`, so a deleted row is overwritten in the file, not only unlinked (D3). The file
and its directory are made for this account alone (`files`).

PostgreSQL: psycopg 3; connections checked before use so a database restart costs one failed
call, not a pool of dead connections.
"""

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

# Execution option read by the SQLite "begin" hook: "DEFERRED" or "IMMEDIATE".
SQLITE_BEGIN = "insight_queue_sqlite_begin"


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
        dbapi_connection.isolation_level = None  # transactions are begun below
        cursor = dbapi_connection.cursor()
        cursor.execute(f"PRAGMA busy_timeout = {SQLITE_BUSY_TIMEOUT_MS}")
        cursor.execute("PRAGMA journal_mode = WAL")
        cursor.execute("PRAGMA synchronous = NORMAL")
        cursor.execute("PRAGMA secure_delete = ON")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _on_begin(connection: Any) -> None:
        mode = connection.get_execution_options().get(SQLITE_BEGIN, "DEFERRED")
        connection.exec_driver_sql(f"BEGIN {mode}")

    return engine


def shown_url(url: URL) -> str:
    """The URL for people: its credentials and any `password=` parameter masked."""
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
