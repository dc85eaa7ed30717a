"""The API's credentials: the operator's and the service's tokens, and a screen's JWT. What is not
set is made once and kept in the data directory, so every API process reads the same."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import time
from pathlib import Path
from typing import Any

import jwt

from queue_store import InvalidArgument, Misconfigured, Settings, validation
from queue_store.files import private_directory

CREDENTIALS_FILE = "api-credentials.json"
HMAC_ALGORITHMS = ["HS256"]
KEY_ALGORITHMS = ["RS256", "ES256"]
# Clock differences between the app that signs and this API, seconds.
LEEWAY_SECONDS = 10
MADE = ("operator_token", "service_token", "screen_secret")


class InvalidToken(Exception):
    """A screen token that does not hold: its message says why, without the token."""


class ScreenTokens:
    """Checks (and, with a shared secret, makes) the tokens that let a screen act for its user."""

    def __init__(
        self,
        *,
        secret: str | None = None,
        public_key: str | None = None,
        jwks: str | None = None,
        audience: str,
        issuer: str = "",
    ) -> None:
        self._secret = secret
        self._public_key = public_key
        self._jwks = _key_set(jwks) if jwks is not None else None
        self._audience = audience
        self._issuer = issuer or None

    @property
    def can_issue(self) -> bool:
        return self._secret is not None

    def issue(self, user_id: str, ttl_seconds: float) -> str:
        """A token for `user_id`, valid for `ttl_seconds` (HS256, with the shared secret)."""
        if self._secret is None:
            raise Misconfigured(
                "screen tokens are signed with the app's private key here: the app makes them"
            )
        now = int(time.time())
        claims: dict[str, Any] = {
            "sub": validation.user_id(user_id),
            "aud": self._audience,
            "iat": now,
            "exp": now + max(1, int(ttl_seconds)),
        }
        if self._issuer:
            claims["iss"] = self._issuer
        return jwt.encode(claims, self._secret, algorithm="HS256")

    def user_of(self, token: str) -> str:
        """The user a valid token names; `InvalidToken` otherwise."""
        key, algorithms = self._key_for(token)
        try:
            claims = jwt.decode(
                token,
                key,
                algorithms=algorithms,
                audience=self._audience,
                issuer=self._issuer,
                leeway=LEEWAY_SECONDS,
                options={"require": ["exp", "sub", "aud"]},
            )
        except jwt.ExpiredSignatureError:
            raise InvalidToken("the screen token has expired") from None
        except jwt.PyJWTError as exc:
            raise InvalidToken(f"the screen token is not valid ({type(exc).__name__})") from None
        try:
            return validation.user_id(claims["sub"])
        except InvalidArgument as exc:
            raise InvalidToken(f"the screen token names no usable user ({exc})") from None

    def _key_for(self, token: str) -> tuple[Any, list[str]]:
        if self._secret is not None:
            return self._secret, HMAC_ALGORITHMS
        if self._public_key is not None:
            return self._public_key, KEY_ALGORITHMS
        if self._jwks is not None:
            try:
                kid = jwt.get_unverified_header(token).get("kid")
                found = self._jwks[str(kid)]
            except (jwt.PyJWTError, KeyError):
                raise InvalidToken("the screen token names no key of the JWKS") from None
            return found, [found.algorithm_name] if found.algorithm_name else KEY_ALGORITHMS
        raise InvalidToken("screen tokens are not accepted here")


@dataclasses.dataclass(frozen=True)
class Credentials:
    operator_token: str
    service_token: str
    screens: ScreenTokens
    path: Path  # where the credentials made here are kept
    made: tuple[str, ...] = ()  # which were made just now

    @classmethod
    def load(cls, settings: Settings, *, create: bool = True) -> Credentials:
        """What is not set comes from the data directory's file, made if `create`."""
        api = settings.api
        path = settings.data_dir / CREDENTIALS_FILE
        given = {
            "operator_token": api.operator_token.get_secret_value(),
            "service_token": api.service_token.get_secret_value(),
        }
        if api.screen_public_key is None and api.screen_jwks is None:
            given["screen_secret"] = api.screen_secret.get_secret_value()
        kept = _load(path)
        values = {name: value or kept.get(name, "") for name, value in given.items()}
        made = tuple(name for name, value in values.items() if not value) if create else ()
        if made:
            values |= _keep(path, kept, made)
        screens = _screens(settings, values.get("screen_secret") or None)
        return cls(values["operator_token"], values["service_token"], screens, path, made)


def _screens(settings: Settings, secret: str | None) -> ScreenTokens:
    api = settings.api
    public_key = _read(api.screen_public_key, "AI_API_SCREEN_PUBLIC_KEY")
    jwks = _read(api.screen_jwks, "AI_API_SCREEN_JWKS")
    try:
        return ScreenTokens(
            secret=secret,
            public_key=public_key,
            jwks=jwks,
            audience=api.screen_audience,
            issuer=api.screen_issuer,
        )
    except (ValueError, jwt.PyJWTError) as exc:
        raise Misconfigured(f"AI_API_SCREEN_JWKS: not a usable JWKS ({exc})") from None


def _key_set(text: str) -> jwt.PyJWKSet:
    keys = json.loads(text)
    if not isinstance(keys, dict):  # PyJWT would fail on it with AttributeError
        raise ValueError("its JSON is not an object")
    return jwt.PyJWKSet.from_dict(keys)


def _read(path: Path | None, variable: str) -> str | None:
    if path is None:
        return None
    try:
        return path.read_text()
    except OSError as exc:
        raise Misconfigured(f"{variable}: cannot read {path} ({exc.strerror})") from None


def _keep(path: Path, kept: dict[str, str], names: tuple[str, ...]) -> dict[str, str]:
    """Credentials made now for `names`, kept in `path` beside those it holds already."""
    private_directory(path.parent)
    made = {name: secrets.token_urlsafe(32) for name in names}
    temporary = path.with_name(f".{path.name}.{os.getpid()}")
    with os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as handle:
        json.dump(kept | made, handle, indent=2)
    os.chmod(temporary, 0o600)
    os.replace(temporary, path)
    return made


def _load(path: Path) -> dict[str, str]:
    try:
        found = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise Misconfigured(f"{path}: not readable as credentials ({exc})") from None
    if not isinstance(found, dict):
        raise Misconfigured(f"{path}: not readable as credentials (not an object)")
    return {str(k): str(v) for k, v in found.items() if k in MADE and v}
