"""One settings object, read from the environment (`AI_JOB_*`, `AI_GATEWAY_*`, `AI_API_*`) by
pydantic-settings; unset or empty means the default; a bad value is one line naming its variable."""

from __future__ import annotations

import dataclasses
import re
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import platformdirs
from pydantic import AliasChoices, Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from queue_store.errors import SettingsError
from queue_store.redact import PASSWORD_PARAMETERS, mask_url

KIB, MIB = 1 << 10, 1 << 20
_MODULE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


def _f(default: Any, help: str, variable: str | AliasChoices | None = None, **checks: Any) -> Any:
    """A setting, with its variable where it does not follow the prefix (the first is shown)."""
    alias = AliasChoices(variable) if isinstance(variable, str) else variable
    return Field(default=default, validation_alias=alias, description=help, **checks)


class _Checked(BaseSettings):
    """Settings whose errors are one line naming the variable; subclasses add their prefix."""

    model_config = SettingsConfigDict(
        frozen=True,
        extra="forbid",
        env_ignore_empty=True,
        populate_by_name=True,
        validate_default=True,
        allow_inf_nan=False,
    )

    def __init__(self, **values: Any) -> None:
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError(_first_error(type(self), exc)) from None


class GatewaySettings(_Checked):
    model_config = SettingsConfigDict(env_prefix="AI_GATEWAY_")

    url: str = _f("http://127.0.0.1:8765", "base URL of the LLM gateway")
    path: str = _f("/v1/chat/completions", "path of the chat-completions endpoint")
    token: SecretStr = _f(SecretStr(""), "bearer token for the gateway (secret)")
    model: str = _f("default", "model name sent to the gateway")
    connect_timeout: float = _f(5.0, "seconds to open a connection", gt=0)
    read_timeout: float = _f(1080.0, "seconds for the whole call (capped by the claim)", gt=0)
    max_answer_bytes: int = _f(MIB, "largest answer read; a longer one is cut off", ge=KIB)
    cut_hold_seconds: float | None = _f(
        None, "a call cut on our side holds the gateway this long from its start", ge=0
    )

    @field_validator("path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("must start with '/'")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str) -> str:
        parts = urllib.parse.urlsplit(value)  # never echoed: it may carry credentials
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port == 0:
            raise ValueError("expected an http:// or https:// URL with a host")
        return value


MIN_TOKEN_LENGTH = 16  # characters of a service or operator token
MIN_SECRET_BYTES = 32  # of a screen token's HS256 secret (RFC 7518: at least the hash's size)


class ApiSettings(_Checked):
    """The HTTP API's callers and edges; unset credentials are made once, in the data directory."""

    model_config = SettingsConfigDict(env_prefix="AI_API_")

    operator_token: SecretStr = _f(
        SecretStr(""),
        "the operator's token: the queue, its actions, /metrics, the page (secret)",
        AliasChoices("AI_API_OPERATOR_TOKEN", "AI_API_TOKEN"),
    )
    service_token: SecretStr = _f(
        SecretStr(""), "the app backend's token: polls and backfills for any user (secret)"
    )
    screen_secret: SecretStr = _f(
        SecretStr(""), "HS256 secret the app signs screen tokens with (secret)"
    )
    screen_public_key: Path | None = _f(
        None, "PEM public key the app signs screen tokens with (RS256/ES256)"
    )
    screen_jwks: Path | None = _f(None, "JWKS file of the keys the app signs screen tokens with")
    screen_audience: str = _f("insight-queue", "the `aud` a screen token must carry")
    screen_issuer: str = _f("", "the `iss` a screen token must carry (empty: not checked)")
    allowed_hosts: str = _f("", "comma-separated Host names served besides loopback")
    cors_origins: str = _f("", "comma-separated origins whose pages may call the API (CORS)")
    screen_rate: int = _f(120, "requests a minute one screen user may make", ge=1)
    service_rate: int = _f(12000, "requests a minute the service token may make", ge=1)
    operator_rate: int = _f(600, "requests a minute the operator token may make", ge=1)

    @field_validator("operator_token", "service_token")
    @classmethod
    def _long_enough(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value()
        if secret and not secret.strip():
            raise ValueError("is blank: set a real token, or unset it")
        if secret and len(secret) < MIN_TOKEN_LENGTH:
            raise ValueError(f"is shorter than {MIN_TOKEN_LENGTH} characters: too easy to guess")
        return value

    @field_validator("screen_secret")
    @classmethod
    def _strong_enough(cls, value: SecretStr) -> SecretStr:
        secret = value.get_secret_value()
        if secret and len(secret.encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"is shorter than {MIN_SECRET_BYTES} bytes (HS256 needs at least 32)")
        return value

    @field_validator("screen_public_key", "screen_jwks", mode="before")
    @classmethod
    def _path(cls, value: Path | str | None) -> Path | None:
        return None if value in (None, "") else Path(value).expanduser()

    @property
    def hosts(self) -> list[str]:
        return _listed(self.allowed_hosts)

    @property
    def origins(self) -> list[str]:
        return [origin.rstrip("/") for origin in _listed(self.cors_origins)]


def _listed(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


class Settings(_Checked):
    """`Settings()` reads the environment; keyword arguments (field names) win."""

    model_config = SettingsConfigDict(env_prefix="AI_JOB_")

    enabled: bool = _f(True, "false/0/no disables the consumer (never the store)", "AI_JOBS")
    database_url: str = _f("", "the store: sqlite:///... or postgresql://...")
    data_dir: Path = _f(None, "where the embedded default keeps its files")
    concurrency: int = _f(1, "gateway calls in flight, deployment-wide", ge=1)
    gap_seconds: float = _f(20.0, "quiet after each call, deployment-wide", ge=0)
    max_attempts: int = _f(3, "attempts per job before it is given up", ge=1)
    retry_after_seconds: float = _f(1800.0, "a given-up job's cooldown", "AI_JOB_RETRY_AFTER", ge=0)
    claim_timeout_seconds: float = _f(
        1800.0, "upper bound of one attempt", "AI_JOB_CLAIM_TIMEOUT", gt=0
    )
    poll_seconds: float = _f(2.0, "how often an idle consumer looks again", gt=0)
    heartbeat_seconds: float = _f(5.0, "how often a running job's claim is renewed", gt=0)
    lease_seconds: float = _f(60.0, "a claim not renewed this long is dead", gt=0)
    lease_margin_seconds: float | None = _f(
        None, "a call stops this long before its lease (lease/6)", ge=0
    )
    backoff_seconds: float = _f(15.0, "first pause after the gateway is found unreachable", ge=0)
    backoff_max_seconds: float = _f(600.0, "longest pause (backoff, Retry-After)", ge=0)
    default_duration_seconds: float = _f(
        120.0, "expected call length before any was measured", "AI_JOB_DEFAULT_DURATION", ge=0
    )
    max_result_bytes: int = _f(MIB, "largest stored result, as JSON bytes", ge=KIB)
    plugins: str = _f("flows.demo", "comma-separated modules that register generators and scopes")
    order: Literal["fair", "fifo"] = _f("fair", "fair: users take turns in a priority; fifo")
    max_interactive: int = _f(
        8, "a user's waiting screens' jobs; the oldest beyond fall back to prefetch", ge=1
    )
    retention_days: float = _f(
        90.0, "days finished jobs, results and who used tokens are kept", gt=0
    )
    gateway: GatewaySettings = Field(default_factory=GatewaySettings)
    api: ApiSettings = Field(default_factory=ApiSettings)

    @field_validator("data_dir", mode="before")
    @classmethod
    def _expand(cls, value: Path | str | None) -> Path:
        if value is None:
            return Path(platformdirs.user_data_dir("insight-queue", appauthor=False))
        return Path(value).expanduser()

    @field_validator("plugins")
    @classmethod
    def _plugins(cls, value: str) -> str:
        for name in _listed(value):
            if not _MODULE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a Python module name")
        return value

    def model_post_init(self, context: Any, /) -> None:
        if not self.database_url:
            object.__setattr__(self, "database_url", f"sqlite:///{self.data_dir / 'queue.db'}")
        if self.heartbeat_seconds + self.lease_margin >= self.lease_seconds:
            raise SettingsError(
                "AI_JOB_HEARTBEAT_SECONDS: heartbeat plus AI_JOB_LEASE_MARGIN_SECONDS "
                f"({self.heartbeat_seconds:g} + {self.lease_margin:g} s) must be shorter "
                f"than AI_JOB_LEASE_SECONDS ({self.lease_seconds:g} s)"
            )
        if self.lease_margin >= self.claim_timeout_seconds:
            raise SettingsError(
                "AI_JOB_LEASE_MARGIN_SECONDS: must be shorter than the claim timeout"
            )
        if self.backoff_max_seconds < self.backoff_seconds:
            raise SettingsError(
                "AI_JOB_BACKOFF_MAX_SECONDS: must be at least AI_JOB_BACKOFF_SECONDS"
            )

    @property
    def lease_margin(self) -> float:
        margin = self.lease_margin_seconds
        return self.lease_seconds / 6 if margin is None else margin

    @property
    def call_timeout(self) -> float:
        """Seconds one gateway call may take in all (G3)."""
        return min(self.gateway.read_timeout, self.claim_timeout_seconds - self.lease_margin)

    @property
    def cut_hold(self) -> float:
        """Seconds from its start that a call cut on our side holds the gateway (H1)."""
        hold = self.gateway.cut_hold_seconds
        return self.gateway.read_timeout if hold is None else hold

    @property
    def store(self) -> StoreConfig:
        """What the store's rules read, and no secret."""
        names = (field.name for field in dataclasses.fields(StoreConfig))
        return StoreConfig(**{name: getattr(self, name) for name in names})

    @property
    def plugin_modules(self) -> list[str]:
        return _listed(self.plugins)

    def secrets(self) -> list[str]:
        """Every secret held, as text may echo it: tokens, and URLs' users and passwords."""
        api = self.api
        tokens = (self.gateway.token, api.operator_token, api.service_token, api.screen_secret)
        found = [token.get_secret_value() for token in tokens]
        urls = [url for url in (self.gateway.url, self.database_url) if "://" in url]
        for parts in map(urllib.parse.urlsplit, urls):
            user = urllib.parse.unquote(parts.username or "")
            password = urllib.parse.unquote(parts.password or "")
            found += [user, password, f"{user}:{password}" if user and password else ""]
            found += [
                value
                for name, value in urllib.parse.parse_qsl(parts.query)
                if name.lower() in PASSWORD_PARAMETERS
            ]
        return [secret for secret in found if secret]

    def public(self) -> dict[str, Any]:
        """Every setting by its variable, secrets and URL credentials masked."""
        shown: dict[str, Any] = {}
        for variable, _, value in _entries(self):
            if isinstance(value, SecretStr):
                value = "(set)" if value.get_secret_value() else "(not set)"
            elif variable.endswith("_URL"):
                value = mask_url(value)
            elif variable == "AI_JOB_LEASE_MARGIN_SECONDS" and value is None:
                value = f"{self.lease_margin:g} (a sixth of the lease)"
            elif variable == "AI_GATEWAY_CUT_HOLD_SECONDS" and value is None:
                value = f"{self.cut_hold:g} (the read timeout)"
            shown[variable] = str(value) if isinstance(value, Path) else value
        return shown

    def to_env(self) -> dict[str, str]:
        """Variables that reproduce these settings in another process (secrets in clear)."""
        env: dict[str, str] = {}
        for variable, _, value in _entries(self):
            if isinstance(value, SecretStr):
                value = value.get_secret_value()
            if value is not None:
                env[variable] = str(value).lower() if isinstance(value, bool) else str(value)
        return env

    def __repr_args__(self) -> Any:
        return list(self.public().items())


@dataclasses.dataclass(frozen=True)
class StoreConfig:
    concurrency: int
    gap_seconds: float
    max_attempts: int
    retry_after_seconds: float
    claim_timeout_seconds: float
    lease_seconds: float
    backoff_seconds: float
    backoff_max_seconds: float
    default_duration_seconds: float
    max_result_bytes: int
    order: Literal["fair", "fifo"]
    cut_hold: float  # seconds a call cut on our side holds the gateway (H1)
    max_interactive: int  # waiting interactive jobs per user (A3)
    retention_days: float  # finished work is kept this long (D2)


def _variable(model: type[BaseSettings], name: str) -> str:
    alias = model.model_fields[name].validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return f"{model.model_config.get('env_prefix', '')}{name}".upper()


def _entries(settings: BaseSettings | None = None) -> Iterator[tuple[str, str, Any]]:
    """(variable, help, value) of every setting, nested ones included."""
    for model, instance in (
        (Settings, settings),
        (GatewaySettings, getattr(settings, "gateway", None)),
        (ApiSettings, getattr(settings, "api", None)),
    ):
        for name, field in model.model_fields.items():
            if field.description is not None:
                value = getattr(instance, name) if instance is not None else None
                yield _variable(model, name), field.description, value


def variables() -> dict[str, str]:
    return {variable: help for variable, help, _ in _entries()}


def _first_error(model: type[BaseSettings], exc: ValidationError) -> str:
    """One line naming the variable: `AI_JOB_CONCURRENCY: Input should be ...`."""
    error = exc.errors(include_url=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    name = str(error["loc"][0]) if error["loc"] else ""
    if not name or message.startswith("AI_"):
        return message  # a check across fields names its variables; so does a nested model
    fields = {key.lower(): n for n in model.model_fields for key in (n, _variable(model, n))}
    field = fields.get(name.lower())
    variable = _variable(model, field) if field else name
    if error["type"] == "extra_forbidden":
        return f"{variable}: not a setting"
    shown = error.get("input")
    secret = any(word in variable for word in ("TOKEN", "URL", "SECRET", "KEY"))
    if isinstance(shown, str) and not secret:
        return f"{variable}: {message} (got {shown[:80]!r})"
    return f"{variable}: {message}"
