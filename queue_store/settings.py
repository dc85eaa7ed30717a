"""One settings object for the whole project, read from the environment.

The names keep the original queue's (`AI_JOBS`, `AI_JOB_*`) and add new ones
under the same prefixes (`AI_JOB_*`, `AI_GATEWAY_*`, `AI_API_*`). pydantic
checks every value once, so a typo in a deployment fails at start-up with the
variable's name instead of as a strange behaviour an hour later. Secrets are
`SecretStr`: they never show in a repr, a log line or `insight-queue settings`,
and neither do credentials inside a URL.

This module must not import Prefect or httpx: the gateway fields are plain data
that `flows` reads.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import os
import re
import urllib.parse
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import platformdirs
from pydantic import (
    AliasChoices,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    EnvSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from queue_store.errors import SettingsError

APP_NAME = "insight-queue"
KIB = 1024
MIB = 1024 * KIB

# Module names in AI_JOB_PLUGINS: dotted Python identifiers.
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def default_data_dir() -> Path:
    """Where the embedded default keeps its SQLite file and Prefect home."""
    return Path(platformdirs.user_data_dir(APP_NAME, appauthor=False))


def default_database_url(data_dir: Path | None = None) -> str:
    return f"sqlite:///{(data_dir or default_data_dir()) / 'queue.db'}"


def _env(name: str, help: str, **kwargs: Any) -> Any:
    """A field read from the environment variable `name`, documented by `help`."""
    return Field(validation_alias=AliasChoices(name), description=help, **kwargs)


# The environment the settings are read from; `Settings.from_env(env)` swaps it
# for one construction without touching `os.environ`.
_ENVIRONMENT: contextvars.ContextVar[Mapping[str, str] | None] = contextvars.ContextVar(
    "insight_queue_environment", default=None
)


class _EnvironmentSource(EnvSettingsSource):
    """The process environment, or the mapping handed to `Settings.from_env`."""

    def _load_env_vars(self) -> Mapping[str, str | None]:
        env = _ENVIRONMENT.get()
        # Unset or empty means the default.
        return {k: v for k, v in (os.environ if env is None else env).items() if v != ""}


class Settings(BaseSettings):
    """Every setting of insight-queue; construct with `Settings.from_env()`.

    Keyword arguments use the field names (`Settings(concurrency=2)`); the
    environment uses the variable names (`AI_JOB_CONCURRENCY=2`).
    """

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        populate_by_name=True,
        env_ignore_empty=True,
        case_sensitive=True,
        validate_default=True,
    )

    # -- the consumer and the store --------------------------------------
    enabled: bool = _env(
        "AI_JOBS", "false/0/no disables the consumer (never the store)", default=True
    )
    database_url: str = _env(
        "AI_JOB_DATABASE_URL",
        "the store: sqlite:///... or postgresql://...; default: the data dir",
        default="",
    )
    data_dir: Path = _env(
        "AI_JOB_DATA_DIR",
        "where the embedded default keeps its files",
        default_factory=default_data_dir,
    )
    concurrency: int = _env(
        "AI_JOB_CONCURRENCY", "gateway calls in flight across the whole deployment", default=1, ge=1
    )
    gap_seconds: float = _env(
        "AI_JOB_GAP_SECONDS", "quiet after each call, deployment-wide", default=20.0, ge=0
    )
    max_attempts: int = _env(
        "AI_JOB_MAX_ATTEMPTS", "attempts per job before it is given up", default=3, ge=1
    )
    retry_after_seconds: float = _env(
        "AI_JOB_RETRY_AFTER",
        "seconds a given-up job stays failed before a poll may queue it again",
        default=1800.0,
        ge=0,
    )
    claim_timeout_seconds: float = _env(
        "AI_JOB_CLAIM_TIMEOUT",
        "upper bound of one attempt; the call is stopped before it",
        default=1800.0,
        gt=0,
    )
    poll_seconds: float = _env(
        "AI_JOB_POLL_SECONDS", "how often an idle consumer looks again", default=2.0, gt=0
    )
    heartbeat_seconds: float = _env(
        "AI_JOB_HEARTBEAT_SECONDS", "how often a running job's claim is renewed", default=5.0, gt=0
    )
    lease_seconds: float = _env(
        "AI_JOB_LEASE_SECONDS",
        "a claim not renewed for this long is dead and may be taken over",
        default=60.0,
        gt=0,
    )
    lease_margin_seconds: float | None = _env(
        "AI_JOB_LEASE_MARGIN_SECONDS",
        "a worker stops its call this long before its claim could lapse; default: a sixth "
        "of the lease",
        default=None,
        ge=0,
    )
    backoff_seconds: float = _env(
        "AI_JOB_BACKOFF_SECONDS",
        "first pause after the gateway is found unreachable",
        default=15.0,
        ge=0,
    )
    backoff_max_seconds: float = _env(
        "AI_JOB_BACKOFF_MAX_SECONDS",
        "longest pause (backoff, Retry-After); the backoff doubles up to it",
        default=600.0,
        ge=0,
    )
    default_duration_seconds: float = _env(
        "AI_JOB_DEFAULT_DURATION",
        "expected call length for ETAs before any was measured",
        default=120.0,
        ge=0,
    )
    max_result_bytes: int = _env(
        "AI_JOB_MAX_RESULT_BYTES", "largest stored result, as JSON bytes", default=MIB, ge=KIB
    )
    plugins: str = _env(
        "AI_JOB_PLUGINS",
        "comma-separated modules that register generators and scopes",
        default="flows.demo",
    )

    # -- the gateway -------------------------------------------------------
    gateway_url: str = _env(
        "AI_GATEWAY_URL", "base URL of the LLM gateway", default="http://127.0.0.1:8765"
    )
    gateway_path: str = _env(
        "AI_GATEWAY_PATH", "path of the chat-completions endpoint", default="/v1/chat/completions"
    )
    gateway_token: SecretStr = _env(
        "AI_GATEWAY_TOKEN", "bearer token for the gateway (secret)", default=SecretStr("")
    )
    gateway_model: str = _env(
        "AI_GATEWAY_MODEL", "model name sent to the gateway", default="default"
    )
    gateway_connect_timeout: float = _env(
        "AI_GATEWAY_CONNECT_TIMEOUT",
        "seconds to open a connection to the gateway",
        default=5.0,
        gt=0,
    )
    gateway_read_timeout: float = _env(
        "AI_GATEWAY_READ_TIMEOUT",
        "seconds for the whole call (connect, send, complete answer); capped by the claim timeout",
        default=1080.0,
        gt=0,
    )
    gateway_max_answer_bytes: int = _env(
        "AI_GATEWAY_MAX_ANSWER_BYTES",
        "largest answer read from the gateway; longer ones are cut off",
        default=MIB,
        ge=KIB,
    )

    # -- the HTTP API --------------------------------------------------------
    api_token: SecretStr = _env(
        "AI_API_TOKEN",
        "bearer token for the API's operator routes, and every route off loopback (secret)",
        default=SecretStr(""),
    )

    # Fields shown as URLs with their credentials masked.
    _URL_FIELDS: ClassVar[tuple[str, ...]] = ("database_url", "gateway_url")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        return (init_settings, _EnvironmentSource(settings_cls))

    # -- checks ------------------------------------------------------------

    @field_validator("*", mode="after")
    @classmethod
    def _finite(cls, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value

    @field_validator("data_dir", mode="after")
    @classmethod
    def _expand(cls, value: Path) -> Path:
        return value.expanduser()

    @field_validator("gateway_path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @field_validator("gateway_url")
    @classmethod
    def _gateway_url(cls, value: str) -> str:
        # Never echo the value: it may carry credentials.
        try:
            parts = urllib.parse.urlsplit(value)
            parts.port  # noqa: B018 - raises on a bad port
        except ValueError:
            raise ValueError("expected an http:// or https:// URL with a host") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http:// or https:// URL with a host")
        return value

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, value: str) -> str:
        for name in (part.strip() for part in value.split(",")):
            if name and not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a Python module name")
        return value

    def model_post_init(self, context: Any, /) -> None:
        if not self.database_url:
            object.__setattr__(self, "database_url", default_database_url(self.data_dir))
        if self.heartbeat_seconds + self.lease_margin >= self.lease_seconds:
            raise SettingsError(
                "AI_JOB_HEARTBEAT_SECONDS: heartbeat plus AI_JOB_LEASE_MARGIN_SECONDS "
                f"({self.heartbeat_seconds:g} + {self.lease_margin:g} s) must be shorter "
                f"than AI_JOB_LEASE_SECONDS ({self.lease_seconds:g} s)"
            )
        if self.lease_margin >= self.claim_timeout_seconds:
            raise SettingsError(
                "AI_JOB_LEASE_MARGIN_SECONDS: must be shorter than AI_JOB_CLAIM_TIMEOUT"
            )
        if self.backoff_max_seconds < self.backoff_seconds:
            raise SettingsError(
                "AI_JOB_BACKOFF_MAX_SECONDS: must be at least AI_JOB_BACKOFF_SECONDS"
            )

    # -- construction --------------------------------------------------------

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_first_error(exc)) from None

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> Settings:
        """Read every `AI_*` variable (from `env` instead of `os.environ` if given).

        Unset or empty means the default; `overrides` (field names) win.
        """
        with _environment(env):
            return cls(**overrides)

    def replace(self, **changes: Any) -> Settings:
        """A copy with some fields changed, checked like a new one."""
        # Only what was given: derived defaults (the margin, the SQLite file)
        # follow the fields they derive from.
        values = {name: getattr(self, name) for name in self.model_fields_set}
        values.update(changes)
        with _environment({}):
            return type(self)(**values)

    # -- derived values ----------------------------------------------------

    @property
    def lease_margin(self) -> float:
        """Seconds a worker stops before its claim could lapse (a sixth of the lease by default)."""
        if self.lease_margin_seconds is None:
            return self.lease_seconds / 6
        return self.lease_margin_seconds

    @property
    def call_timeout(self) -> float:
        """Seconds one gateway call may take in all, never longer than one attempt may last."""
        return min(self.gateway_read_timeout, self.claim_timeout_seconds - self.lease_margin)

    @property
    def plugin_modules(self) -> list[str]:
        return [name.strip() for name in self.plugins.split(",") if name.strip()]

    @property
    def is_default_sqlite(self) -> bool:
        """Whether the store is the embedded default (the SQLite file in the data dir)."""
        return self.database_url == default_database_url(self.data_dir)

    # -- presentation --------------------------------------------------------

    def public(self) -> dict[str, Any]:
        """The settings as shown to people: secrets masked, URLs without credentials."""
        shown: dict[str, Any] = {}
        for name in type(self).model_fields:
            value = getattr(self, name)
            if isinstance(value, SecretStr):
                value = "(set)" if value.get_secret_value() else "(not set)"
            elif name == "lease_margin_seconds" and value is None:
                value = f"{self.lease_margin:g} (a sixth of the lease)"
            elif name in self._URL_FIELDS:
                value = redact_url(value)
            elif isinstance(value, Path):
                value = str(value)
            shown[name] = value
        return shown

    def to_env(self) -> dict[str, str]:
        """Environment variables that reproduce these settings in another process.

        Holds the secrets in clear: for child processes, never for display.
        """
        env: dict[str, str] = {}
        for name, field in type(self).model_fields.items():
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            elif isinstance(value, bool):
                value = "true" if value else "false"
            env[variable(field)] = str(value)
        return env

    def __repr_args__(self) -> Any:
        # The pydantic default would show database_url and gateway_url, which
        # may carry passwords.
        return list(self.public().items())


def variable(field: FieldInfo) -> str:
    """The environment variable a settings field is read from."""
    alias = field.validation_alias
    assert isinstance(alias, AliasChoices)
    name = alias.choices[0]
    assert isinstance(name, str)
    return name


def variables() -> dict[str, FieldInfo]:
    """Every setting by its environment variable, in declaration order."""
    return {variable(field): field for field in Settings.model_fields.values()}


def settings_help() -> str:
    """The settings for `--help`: one line per variable."""
    return "\n".join(f"  {name:<30} {field.description}" for name, field in variables().items())


@contextlib.contextmanager
def _environment(env: Mapping[str, str] | None) -> Iterator[None]:
    token = _ENVIRONMENT.set(env)
    try:
        yield
    finally:
        _ENVIRONMENT.reset(token)


def _first_error(exc: ValidationError) -> str:
    """One line naming the variable: `AI_JOB_CONCURRENCY: Input should be ...`."""
    error = exc.errors(include_url=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    if not error["loc"]:
        return message  # a check across fields names its variables itself
    name = str(error["loc"][0])
    field = Settings.model_fields.get(name)
    if field is None:
        field = variables().get(name)
    if field is not None:
        name = variable(field)
    if error["type"] == "extra_forbidden":
        return f"{name}: not a setting"
    shown = error.get("input")
    secret = field is None or field.annotation is SecretStr or "url" in name.lower()
    if isinstance(shown, str) and not secret:
        return f"{name}: {message} (got {shown[:80]!r})"
    return f"{name}: {message}"


_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]*@")


def redact_url(url: str) -> str:
    """The URL with any user name and password masked, for logs and error messages."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    from queue_store.engine import shown_url

    if url.startswith(("http://", "https://")):
        return _CREDENTIALS.sub("***@", url)
    try:
        parsed = make_url(url)
    except ArgumentError:
        return "(unparseable URL)"
    return shown_url(parsed)
