"""A real third-party OpenAI-compatible server for tests: fakellm.

`FakeLLM` writes a fakellm YAML config into a directory, starts
`fakellm serve` on a free loopback port in its own session, waits until it
answers, and stops it by its PID (its process group) at the end. Use it as a
context manager, or through the `fakellm_server` fixture below.

The rules answer by the request's `X-Insight-Job` header, which the gateway
client sends percent-encoded (`JOB_HEADER_SAFE` characters left readable).
fakellm compares header values exactly, so the labels below use only
characters that stay as they are: the header carries the label itself.
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Self

import httpx
import pytest
import yaml

from deployments.processes import stop_group as stop_process_group

JOB_HEADER = "x-insight-job"
JOB_HEADER_SAFE = ":/@-_.~"  # what the gateway client leaves unencoded
DEFAULT_CONTENT = "an insight from a third-party server"
RATE_LIMITED_JOB = "rate-limited:2024-05"  # answered HTTP 429
BROKEN_JOB = "broken:2024-05"  # answered HTTP 500
START_SECONDS = 30.0  # fakellm imports FastAPI; a loaded machine is slow
STOP_GRACE_SECONDS = 10.0
START_ATTEMPTS = 3  # a free port can be taken between choosing and binding it


def header_value(label: str) -> str:
    """The `X-Insight-Job` value the gateway client sends for `label`."""
    return urllib.parse.quote(label, safe=JOB_HEADER_SAFE)


def default_rules() -> list[dict[str, Any]]:
    """429 for one job, 500 for another, and content for everything else."""
    return [
        {
            "name": "rate_limited_job",
            "when": {f"header.{JOB_HEADER}": header_value(RATE_LIMITED_JOB)},
            "respond": {"status": 429, "error": "Rate limit reached for requests"},
        },
        {
            "name": "broken_job",
            "when": {f"header.{JOB_HEADER}": header_value(BROKEN_JOB)},
            "respond": {"status": 500, "error": "The server had an error"},
        },
        {"name": "default", "respond": {"content": DEFAULT_CONTENT}},
    ]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class FakeLLM:
    """`fakellm serve` with our rules, on 127.0.0.1, for the length of a block."""

    def __init__(self, directory: Path, rules: Sequence[Mapping[str, Any]] | None = None) -> None:
        self.directory = directory
        self.rules = [dict(rule) for rule in (default_rules() if rules is None else rules)]
        self.config = directory / "fakellm.yaml"
        self.log = directory / "fakellm.log"
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> Self:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.config.write_text(yaml.safe_dump({"version": 1, "rules": self.rules}))
        for _ in range(START_ATTEMPTS):
            self.port = _free_port()
            self.process = self._spawn()
            if self._wait_ready():
                return self
            self.stop()
        raise RuntimeError(f"fakellm did not start: {self.log.read_text()[-2000:]}")

    def _spawn(self) -> subprocess.Popen[bytes]:
        with open(self.log, "ab") as log:
            return subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "fakellm.cli",
                    "serve",
                    "--host",
                    self.host,
                    "--port",
                    str(self.port),
                    "--config",
                    str(self.config),
                ],
                cwd=self.directory,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def _wait_ready(self) -> bool:
        """True once it answers; False if it exited first (its port was taken)."""
        assert self.process is not None
        deadline = time.monotonic() + START_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                return False
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/_fakellm/stats", timeout=2).status_code == 200:
                    return True
            time.sleep(0.1)
        return False

    def stop(self) -> None:
        if self.process is not None:
            stop_process_group(self.process, STOP_GRACE_SECONDS)
            self.process = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.stop()


@pytest.fixture
def fakellm_server(tmp_path: Path) -> Iterator[FakeLLM]:
    """fakellm with the default rules, stopped at the end of the test."""
    with FakeLLM(tmp_path / "fakellm") as server:
        yield server
