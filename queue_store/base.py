"""The store's ground floor: its engine, its clock, its schema, and the transactions every verb runs
in: a read, a write, and a write holding the gate lock (every lease decision)."""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from sqlalchemy import Connection
from sqlalchemy.engine import make_url
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from queue_store import files, lease, migrate, schema, validation
from queue_store.clock import Clock, ClockFunction, DatabaseClock, HostClock, InjectedClock
from queue_store.engine import SQLITE_BEGIN, create_store_engine, shown_url, wrap_database_error
from queue_store.errors import ClaimLost, InvalidArgument, SchemaOutdated
from queue_store.redact import Redactor
from queue_store.settings import Settings

logger = logging.getLogger(__name__)


class StoreBase:
    """It keeps of `settings` only its rules' numbers and a redactor. `create`: a SQLite store is
    created or upgraded on first use; else a missing SQLite file is an error (read-only)."""

    def __init__(
        self,
        url: str | None = None,
        *,
        settings: Settings | None = None,
        clock: ClockFunction | None = None,
        check_schema: bool = True,
        create: bool = True,
    ) -> None:
        settings = settings or Settings()
        self._settings = settings.store
        self._redact = Redactor(settings.secrets())
        target = url or settings.database_url
        self._is_sqlite = make_url(target).get_backend_name() == "sqlite"
        if self._is_sqlite and not create:
            _require_sqlite_file(target)
        if self._is_sqlite and create and target == settings.database_url:
            files.private_directory(settings.data_dir)  # ours: narrowed if it was not (D1)
        self._engine = create_store_engine(target)
        if clock is not None:
            self._clock: Clock = InjectedClock(clock)
        else:
            self._clock = HostClock() if self._is_sqlite else DatabaseClock()
        if check_schema:
            try:
                self._check_schema(upgrade=create and self._is_sqlite)
            except BaseException:
                self._engine.dispose()
                raise

    def close(self) -> None:
        self._engine.dispose()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _revision(self) -> str | None:
        try:
            return migrate.current_revision(self._engine)
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, "schema check") from exc

    def _check_schema(self, *, upgrade: bool) -> None:
        revision = self._revision()
        if upgrade and revision != schema.SCHEMA_REVISION:
            migrate.upgrade(self._engine)
            revision = self._revision()
        if revision != schema.SCHEMA_REVISION:
            found = "no insight-queue schema" if revision is None else f"revision {revision}"
            raise SchemaOutdated(
                f"the database at {shown_url(self._engine.url)} has {found}; this version needs "
                f"revision {schema.SCHEMA_REVISION}. Run `insight-queue db upgrade` to upgrade it."
            )

    @contextmanager
    def _transaction(self, operation: str, *, write: bool) -> Iterator[Connection]:
        try:
            with self._engine.connect() as connection:
                if self._is_sqlite:
                    connection = connection.execution_options(
                        **{SQLITE_BEGIN: "IMMEDIATE" if write else "DEFERRED"}
                    )
                with connection.begin():
                    yield connection
        except (IntegrityError, InvalidArgument, ClaimLost, SchemaOutdated):
            raise
        except SQLAlchemyError as exc:
            raise wrap_database_error(exc, self._engine.url, operation) from exc

    def _read(self, operation: str) -> Any:
        return self._transaction(operation, write=False)

    def _write(self, operation: str) -> Any:
        return self._transaction(operation, write=True)

    @contextmanager
    def _gated(self, operation: str) -> Iterator[lease.Gated]:
        with self._write(operation) as connection:
            state = lease.gate_row(connection, lock=True)
            self._clock.prepare(connection)
            yield lease.Gated(connection, self._clock.now(connection), state, self._settings)

    def _checkpoint(self) -> None:
        """On SQLite, what was deleted leaves the write-ahead log too (D3)."""
        if not self._is_sqlite:
            return
        raw = self._engine.raw_connection()
        try:
            raw.driver_connection.execute("PRAGMA wal_checkpoint(TRUNCATE)")  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - the next checkpoint will do it
            logger.warning("could not checkpoint the SQLite log: %s", exc)
        finally:
            raw.close()

    def _now(self, connection: Connection) -> dt.datetime:
        return self._clock.now(connection)

    def _error(self, value: object, name: str = "error") -> str:
        """An error text as stored: checked, cut, and without secrets (G5)."""
        return validation.error_text(self._redact(validation.error_text(value, name)), name)


def _require_sqlite_file(url: str) -> None:
    database = make_url(url).database
    if database and database != ":memory:" and not database.startswith("file:"):
        path = Path(database).expanduser()
        if not path.exists():
            raise SchemaOutdated(
                f"there is no queue at {path} yet: nothing has been queued there (the first "
                "enqueue, `insight-queue serve` or `insight-queue db upgrade` creates it)"
            )
