"""The store's files on disk, readable by the service account only, whatever the umask (D1)."""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
PRIVATE_UMASK = 0o077  # for processes that write our data (the embedded Prefect server)
SQLITE_COMPANIONS = ("-wal", "-shm", "-journal")


def private_directory(path: Path, *, narrow: bool = True) -> Path:
    """`path` for this account alone; `narrow`: an existing one too (else it may be shared)."""
    made = not path.exists()
    path.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode
    if mode & stat.S_ISVTX and not made:
        return path  # a shared folder such as /tmp: never ours to close; our files are 0600
    if (made or narrow) and mode & 0o777 != DIRECTORY_MODE:
        os.chmod(path, DIRECTORY_MODE)
    return path


def private_sqlite(database: Path) -> None:
    """The database file made before SQLite opens it, which gives `-wal` and `-shm` its mode."""
    private_directory(database.parent, narrow=False)
    with contextlib.suppress(FileExistsError):
        os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE))
    for path in (database, *(Path(f"{database}{suffix}") for suffix in SQLITE_COMPANIONS)):
        with contextlib.suppress(FileNotFoundError):
            if path.stat().st_mode & 0o777 != FILE_MODE:
                os.chmod(path, FILE_MODE)
