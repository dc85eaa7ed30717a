"""One settings object for the whole project, read from the environment.

The names keep the original queue's (`AI_JOBS`, `AI_JOB_*`) and add new ones
under the same prefixes (`AI_JOB_*`, `AI_GATEWAY_*`). Every value is checked
here, once, so a typo in a deployment fails at start-up with the variable's
name instead of as a strange behaviour an hour later.

This module must not import Prefect or httpx: the gateway fields are plain data
that `flows` reads.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import platformdirs

from queue_store.errors import SettingsError

APP_NAME = "insight-queue"

T = TypeVar("T")


class Secret:
    """A string that never shows itself in a repr, a log line or a table."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def get(self) -> str:
        return self._value

    def __bool__(self) -> bool:
        return bool(self._value)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash(self._value)

    def __repr__(self) -> str:
        return "Secret('**********')" if self._value else "Secret('')"

    __str__ = __repr__


def default_data_dir() -> Path:
    """Where the embedded default keeps its SQLite file and Prefect home."""
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def default_database_url(data_dir: Path | None = None) -> str:
    return f"sqlite:///{(data_dir or default_data_dir()) / 'queue.db'}"


@dataclasses.dataclass(frozen=True)
class Field:
    env: str
    help: str


# The environment variable and the meaning of every setting, for `--help`,
# `insight-queue settings` and the README's table.
FIELDS: dict[str, Field] = {
    "enabled": Field("AI_JOBS", "false/0/no disables the consumer (never the store)"),
    "database_url": Field(
        "AI_JOB_DATABASE_URL", "SQLAlchemy URL of the store; SQLite file in the data dir"
    ),
    "data_dir": Field("AI_JOB_DATA_DIR", "where the embedded default keeps its files"),
    "concurrency": Field(
        "AI_JOB_CONCURRENCY", "gateway calls in flight across the whole deployment"
    ),
    "gap_seconds": Field("AI_JOB_GAP_SECONDS", "quiet after each call, deployment-wide"),
    "max_attempts": Field("AI_JOB_MAX_ATTEMPTS", "attempts per job before it is given up"),
    "retry_after_seconds": Field(
        "AI_JOB_RETRY_AFTER", "cooldown before a given-up job may be queued again"
    ),
    "claim_timeout_seconds": Field(
        "AI_JOB_CLAIM_TIMEOUT", "upper bound of one attempt; the call is abandoned after it"
    ),
    "poll_seconds": Field("AI_JOB_POLL_SECONDS", "how often an idle consumer looks again"),
    "heartbeat_seconds": Field(
        "AI_JOB_HEARTBEAT_SECONDS", "how often a running job's claim is renewed"
    ),
    "lease_seconds": Field(
        "AI_JOB_LEASE_SECONDS", "a claim not renewed for this long is dead and taken over"
    ),
    "backoff_seconds": Field(
        "AI_JOB_BACKOFF_SECONDS", "first pause after the gateway is found unreachable"
    ),
    "backoff_max_seconds": Field(
        "AI_JOB_BACKOFF_MAX_SECONDS", "longest pause; the backoff doubles up to this"
    ),
    "default_duration_seconds": Field(
        "AI_JOB_DEFAULT_DURATION", "expected call length for ETAs before any was measured"
    ),
    "gateway_url": Field("AI_GATEWAY_URL", "base URL of the LLM gateway"),
    "gateway_path": Field("AI_GATEWAY_PATH", "path of the chat-completions endpoint"),
    "gateway_token": Field("AI_GATEWAY_TOKEN", "bearer token for the gateway (secret)"),
    "gateway_model": Field("AI_GATEWAY_MODEL", "model name sent to the gateway"),
    "gateway_connect_timeout": Field(
        "AI_GATEWAY_CONNECT_TIMEOUT", "seconds to open a connection to the gateway"
    ),
    "gateway_read_timeout": Field(
        "AI_GATEWAY_READ_TIMEOUT", "seconds to wait for an answer; capped by AI_JOB_CLAIM_TIMEOUT"
    ),
}


@dataclasses.dataclass(frozen=True)
class Settings:
    enabled: bool = True
    database_url: str = ""
    data_dir: Path = dataclasses.field(default_factory=default_data_dir)
    concurrency: int = 1
    gap_seconds: float = 20.0
    max_attempts: int = 3
    retry_after_seconds: float = 1800.0
    claim_timeout_seconds: float = 1800.0
    poll_seconds: float = 2.0
    heartbeat_seconds: float = 5.0
    lease_seconds: float = 60.0
    backoff_seconds: float = 15.0
    backoff_max_seconds: float = 600.0
    default_duration_seconds: float = 120.0
    gateway_url: str = "http://127.0.0.1:8765"
    gateway_path: str = "/v1/chat/completions"
    gateway_token: Secret = dataclasses.field(default_factory=lambda: Secret(""))
    gateway_model: str = "default"
    gateway_connect_timeout: float = 5.0
    gateway_read_timeout: float = 1080.0

    def __post_init__(self) -> None:
        if not self.database_url:
            object.__setattr__(self, "database_url", default_database_url(self.data_dir))
        self._check()

    def _check(self) -> None:
        def fail(name: str, why: str) -> None:
            raise SettingsError(f"{FIELDS[name].env}: {why}")

        for name in ("concurrency", "max_attempts"):
            if getattr(self, name) < 1:
                fail(name, "must be at least 1")
        for name in (
            "gap_seconds",
            "retry_after_seconds",
            "backoff_seconds",
            "backoff_max_seconds",
            "default_duration_seconds",
        ):
            value = getattr(self, name)
            if value < 0 or not math.isfinite(value):
                fail(name, "must be a finite number of seconds, 0 or more")
        for name in (
            "claim_timeout_seconds",
            "poll_seconds",
            "heartbeat_seconds",
            "lease_seconds",
            "gateway_connect_timeout",
            "gateway_read_timeout",
        ):
            value = getattr(self, name)
            if value <= 0 or not math.isfinite(value):
                fail(name, "must be a finite number of seconds above 0")
        if self.heartbeat_seconds >= self.lease_seconds:
            fail("heartbeat_seconds", "must be shorter than AI_JOB_LEASE_SECONDS")
        if self.backoff_max_seconds < self.backoff_seconds:
            fail("backoff_max_seconds", "must be at least AI_JOB_BACKOFF_SECONDS")
        if not self.gateway_path.startswith("/"):
            fail("gateway_path", "must start with '/'")

    @property
    def read_timeout(self) -> float:
        """The gateway read timeout, never longer than one attempt may last."""
        return min(self.gateway_read_timeout, self.claim_timeout_seconds)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every `AI_JOB*` / `AI_GATEWAY_*` variable; unset or empty means default."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in dataclasses.fields(cls):
            raw = env.get(FIELDS[field.name].env, "").strip()
            if raw:
                values[field.name] = _PARSERS[field.name](FIELDS[field.name].env, raw)
        values.update(overrides)
        return cls(**values)

    def __repr__(self) -> str:
        # Not the dataclass default: database_url may carry a password.
        shown = ", ".join(f"{name}={value!r}" for name, value in self.public().items())
        return f"Settings({shown})"

    def public(self) -> dict[str, Any]:
        """The settings as shown to people: secrets masked, URLs without passwords."""
        shown: dict[str, Any] = {}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, Secret):
                value = "(set)" if value else "(not set)"
            elif field.name == "database_url":
                value = redact_url(value)
            elif isinstance(value, Path):
                value = str(value)
            shown[field.name] = value
        return shown


def redact_url(url: str) -> str:
    """The URL with any password replaced, for logs and error messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from queue_store.engine import shown_url

    try:
        parsed = make_url(url)
    except ArgumentError:
        return "(unparseable URL)"
    return shown_url(parsed)


def _boolean(name: str, raw: str) -> bool:
    lowered = raw.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise SettingsError(f"{name}: expected true/false, got {raw!r}")


def _integer(name: str, raw: str) -> int:
    try:
        return int(raw)
    except ValueError:
        raise SettingsError(f"{name}: expected a whole number, got {raw!r}") from None


def _number(name: str, raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        raise SettingsError(f"{name}: expected a number of seconds, got {raw!r}") from None


def _text(name: str, raw: str) -> str:
    return raw


def _path(name: str, raw: str) -> Path:
    return Path(raw).expanduser()


def _secret(name: str, raw: str) -> Secret:
    return Secret(raw)


def _parser_for(field: dataclasses.Field[Any]) -> Callable[[str, str], Any]:
    annotation = str(field.type)
    return {
        "bool": _boolean,
        "int": _integer,
        "float": _number,
        "str": _text,
        "Path": _path,
        "Secret": _secret,
    }[annotation]


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    field.name: _parser_for(field) for field in dataclasses.fields(Settings)
}
