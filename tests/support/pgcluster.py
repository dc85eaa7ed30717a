"""A throwaway PostgreSQL cluster for tests that need a database to die.

Made with initdb under the test's temporary directory, on a free loopback
port, as the `postgres` user when the tests run as root (PostgreSQL refuses
to run as root). `stop()` and `start()` are the outage; `destroy()` stops it
for good. The machine's own PostgreSQL is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path

from deployments.processes import free_port

BIN_CANDIDATES = sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)


# Where runuser lives on Debian; a user's PATH often leaves out the sbin directories.
SBIN_CANDIDATES = (Path("/usr/sbin"), Path("/sbin"))


def _binary(name: str, candidates: Sequence[Path] = BIN_CANDIDATES, package: str = "") -> str:
    for directory in candidates:
        if (directory / name).exists():
            return str(directory / name)
    found = shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: install {package or 'PostgreSQL server binaries'}")
    return found


class ThrowawayPostgres:
    def __init__(self) -> None:
        # Its own directory under the system's temporary directory: the
        # `postgres` user must be able to reach it, which a test's (private)
        # temporary directory does not allow.
        self._home = Path(tempfile.mkdtemp(prefix="insight-queue-pg-"))
        self.directory = self._home / "pgdata"
        self.port = free_port()
        self._as_postgres = os.geteuid() == 0

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        command = list(args)
        if self._as_postgres:
            runuser = _binary("runuser", SBIN_CANDIDATES, "util-linux")
            command = [runuser, "-u", "postgres", "--", *command]
        # The C locale: a caller's LANG may name a locale this machine never generated,
        # which initdb refuses.
        env = {**os.environ, "LC_ALL": "C", "LANG": "C"}
        # From the cluster's own directory: the caller's may be closed to the postgres user.
        done = subprocess.run(
            command, capture_output=True, text=True, timeout=120, env=env, cwd=self._home
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{Path(args[0]).name} exited {done.returncode}: {done.stderr.strip()[-2000:]}"
            )

    def create(self) -> ThrowawayPostgres:
        self.directory.mkdir(parents=True)
        if self._as_postgres:
            shutil.chown(self._home, "postgres", "postgres")
            shutil.chown(self.directory, "postgres", "postgres")
        self._run(
            _binary("initdb"),
            "-D",
            str(self.directory),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-locale",
        )
        return self.start()

    def start(self) -> ThrowawayPostgres:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(
            _binary("pg_ctl"),
            "-D",
            str(self.directory),
            "-o",
            options,
            "-l",
            str(self.directory / "server.log"),
            "-w",
            "start",
        )
        return self

    def stop(self, mode: str = "immediate") -> None:
        self._run(_binary("pg_ctl"), "-D", str(self.directory), "-m", mode, "-w", "stop")

    def destroy(self) -> None:
        if (self.directory / "postmaster.pid").exists():
            with contextlib.suppress(RuntimeError):
                self.stop()
        shutil.rmtree(self._home, ignore_errors=True)
