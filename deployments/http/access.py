"""Who is calling (A1-A3): a credential compared in constant time, within its rate. What a browser
sends by itself (the page's Basic) counts only from the same site."""

from __future__ import annotations

import base64
import binascii
import dataclasses
import enum
import hashlib
import hmac
import math
import secrets
import threading
import time
from collections.abc import Callable

from starlette.requests import Request

from deployments.http.credentials import Credentials, InvalidToken
from deployments.http.errors import Refused
from queue_store.settings import ApiSettings

BEARER_NEEDED = "a credential is required: Authorization: Bearer <token>"
# A rate's bucket holds this many seconds of requests: a screen that opens a few insights at
# once is served at once, a flood is not.
BURST_SECONDS = 10.0
# Buckets kept at most; past it the full ones (credentials at rest) are dropped.
MAX_BUCKETS = 100_000


class Role(enum.StrEnum):
    SCREEN = "screen"
    SERVICE = "service"
    OPERATOR = "operator"


@dataclasses.dataclass(frozen=True)
class Caller:
    role: Role
    user_id: str | None = None  # the user a screen acts for

    def may_act_for(self, user_id: str) -> bool:
        return self.role is Role.SERVICE or (self.role is Role.SCREEN and self.user_id == user_id)


class Rates:
    """A token bucket per caller (a screen's user, or a token); each API process keeps its own."""

    def __init__(self, per_minute: dict[Role, int], clock: Callable[[], float] = time.monotonic):
        self._per_second = {role: rate / 60.0 for role, rate in per_minute.items()}
        self._clock = clock
        self._buckets: dict[Caller, tuple[float, float]] = {}  # caller -> (tokens, at)
        self._lock = threading.Lock()

    def take(self, caller: Caller) -> float | None:
        """Spend one request of the caller's rate; None if allowed, else seconds to wait."""
        rate = self._per_second[caller.role]
        capacity = max(1.0, rate * BURST_SECONDS)
        now = self._clock()
        with self._lock:
            tokens, at = self._buckets.get(caller, (capacity, now))
            tokens = min(capacity, tokens + (now - at) * rate)
            if tokens < 1.0:
                self._buckets[caller] = (tokens, now)
                return (1.0 - tokens) / rate
            self._buckets[caller] = (tokens - 1.0, now)
            if len(self._buckets) > MAX_BUCKETS:
                self._forget_full(now)
        return None

    def _forget_full(self, now: float) -> None:
        for caller, (tokens, at) in list(self._buckets.items()):
            rate = self._per_second[caller.role]
            if tokens + (now - at) * rate >= max(1.0, rate * BURST_SECONDS):
                del self._buckets[caller]


class Gatekeeper:
    def __init__(self, credentials: Credentials, settings: ApiSettings) -> None:
        self._operator = _digest(credentials.operator_token)
        self._service = _digest(credentials.service_token)
        self._screens = credentials.screens
        self.rates = Rates({role: getattr(settings, f"{role}_rate") for role in Role})

    def identify(self, request: Request, *, basic: bool = False) -> Caller:
        """The caller, or `Refused(401)`; `basic`: the operator's token as Basic's password too."""
        scheme, _, credential = request.headers.get("authorization", "").strip().partition(" ")
        credential = credential.strip()
        if scheme.lower() == "bearer" and credential:
            return self._bearer(credential)
        if scheme.lower() == "basic" and basic and credential and from_this_site(request):
            password = _basic_password(credential)
            if password and hmac.compare_digest(_digest(password), self._operator):
                return Caller(Role.OPERATOR)
        raise Refused(401, BEARER_NEEDED, "authorization")

    def _bearer(self, token: str) -> Caller:
        digest = _digest(token)
        # Both compared, whatever the first gave: the time taken says nothing.
        is_operator = hmac.compare_digest(digest, self._operator)
        is_service = hmac.compare_digest(digest, self._service)
        if is_operator:
            return Caller(Role.OPERATOR)
        if is_service:
            return Caller(Role.SERVICE)
        try:
            return Caller(Role.SCREEN, self._screens.user_of(token))
        except InvalidToken as exc:
            raise Refused(401, str(exc), "authorization") from None

    def admit(self, caller: Caller) -> None:
        """Spend one request of the caller's rate, or `Refused(429)` with `Retry-After`."""
        if (wait := self.rates.take(caller)) is not None:
            retry = max(1, math.ceil(wait))
            message = f"too many requests for this {caller.role} credential; retry in {retry} s"
            raise Refused(429, message, "authorization", {"Retry-After": str(retry)})


def from_this_site(request: Request, allowed: tuple[str, ...] = ()) -> bool:
    """Whether a browser sent this from a page of this origin (or of `allowed`), or from no page."""
    site = request.headers.get("sec-fetch-site")
    origin = request.headers.get("origin")
    own = f"{request.url.scheme}://{request.headers.get('host', '')}"
    if origin is not None and origin.rstrip("/") in allowed:
        return True
    if site is not None and site not in ("same-origin", "none"):
        return False
    return origin is None or origin == own


def _basic_password(credential: str) -> str | None:
    try:
        decoded = base64.b64decode(credential, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    _, colon, password = decoded.partition(":")
    return password if colon and password else None


def _digest(token: str) -> bytes:
    """Equal lengths, so a comparison takes the same time; an unset token's matches nothing."""
    if not token:
        return secrets.token_bytes(hashlib.sha256().digest_size)
    return hashlib.sha256(token.encode("utf-8", "surrogateescape")).digest()
