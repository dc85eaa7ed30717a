"""The store's files on disk: readable by the service account only (D1).

Insights are text derived from a person's health data: the data directory is made `0700` and
every file of the store (SQLite's database and its `-wal` and `-shm`) and of the API's
credentials `0600`, whatever the process's umask.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def private_directory(path: Path) -> Path:
    """Make `path` (and any missing parents) and leave it to this account alone."""
    path.mkdir(parents=True, exist_ok=True)
    if path.stat().st_mode & 0o777 != DIRECTORY_MODE:
        os.chmod(path, DIRECTORY_MODE)
    return path


def private_sqlite(database: Path) -> None:
    """A SQLite database file that is this account's alone, before SQLite opens it: SQLite
    gives its `-wal` and `-shm` the database file's mode. Existing files are narrowed too."""
    private_directory(database.parent)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    for path in (database, *(Path(f"{database}{suffix}") for suffix in SQLITE_COMPANIONS)):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mode & 0o777 != FILE_MODE:
                os.chmod(path, FILE_MODE)
