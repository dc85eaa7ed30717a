"""Input checks of every public argument, before the database is touched (FIX8): each returns the
value as the store uses it, or raises `InvalidArgument` naming the argument."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from queue_store.errors import InvalidArgument
from queue_store.models import (
    MAX_ERROR_LENGTH,
    MAX_FINGERPRINT_LENGTH,
    MAX_HOLDER_LENGTH,
    MAX_ID_LENGTH,
    MAX_KIND_LENGTH,
    MAX_PRIORITY,
    MAX_RUN_ID_LENGTH,
    MAX_SUBJECT_LENGTH,
    MAX_WORKER_LENGTH,
)

MAX_LIST_LIMIT = 1000
MAX_SECONDS = 10 * 365 * 24 * 3600.0  # longest pause or duration the store accepts

_WORKER_NAME = re.compile(r"[A-Za-z0-9._:@+=-]+")  # no "/": none prefixes another's claim token


def text(name: str, value: object, max_length: int) -> str:
    if not isinstance(value, str):
        raise InvalidArgument(name, f"must be a string, got {type(value).__name__}")
    if not value:
        raise InvalidArgument(name, "must not be empty")
    if not value.strip():
        raise InvalidArgument(name, "must not be blank")
    if len(value) > max_length:
        raise InvalidArgument(name, f"is {len(value)} characters; at most {max_length}")
    if "\x00" in value:
        raise InvalidArgument(name, "must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgument(name, "is not valid Unicode text (lone surrogate)") from None
    return value


def user_id(value: object) -> str:
    checked = text("user_id", value, MAX_ID_LENGTH)
    # The id hashes "user|kind|subject": a "|" in the first two parts would let two keys share it.
    if "|" in checked:
        raise InvalidArgument("user_id", "must not contain '|'")
    return checked


def kind(value: object) -> str:
    checked = text("kind", value, MAX_KIND_LENGTH)
    if "|" in checked:
        raise InvalidArgument("kind", "must not contain '|'")
    return checked


def key(user: object, kind_: object, subject: object) -> tuple[str, str, str]:
    return user_id(user), kind(kind_), text("subject", subject, MAX_SUBJECT_LENGTH)


def fingerprint(value: object) -> str | None:
    if value is None or value == "":  # "none given", as in the original queue
        return None
    return text("fingerprint", value, MAX_FINGERPRINT_LENGTH)


def priority(value: object) -> int:
    return _integer("priority", value, 0, MAX_PRIORITY)


def limit(value: object, *, minimum: int = 1) -> int:
    return _integer("limit", value, minimum, MAX_LIST_LIMIT)


def _integer(name: str, value: object, minimum: int, maximum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(name, f"must be an int, got {type(value).__name__}")
    if not minimum <= value <= maximum:
        raise InvalidArgument(name, f"must be between {minimum} and {maximum}, got {value}")
    return value


def seconds(name: str, value: object, maximum: float = MAX_SECONDS) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidArgument(name, f"must be a number of seconds, got {type(value).__name__}")
    try:
        as_float = float(value)
    except OverflowError:
        raise InvalidArgument(name, "is too large") from None
    if not math.isfinite(as_float) or not 0 <= as_float <= maximum:
        raise InvalidArgument(name, f"must be between 0 and {maximum:.0f} seconds; got {value}")
    return as_float


def job_id(value: object) -> str:
    checked = text("job_id", value, 64)
    if len(checked) != 64 or any(c not in "0123456789abcdef" for c in checked):
        raise InvalidArgument("job_id", "must be 64 lowercase hex characters")
    return checked


def worker(value: object) -> str:
    checked = text("worker", value, MAX_WORKER_LENGTH)
    if not _WORKER_NAME.fullmatch(checked):
        raise InvalidArgument(
            "worker", "may hold only letters, digits and . _ : @ + = - (no '/', no spaces)"
        )
    return checked


def holder(value: object) -> str:
    checked = text("holder", value, MAX_HOLDER_LENGTH)
    name, slash, nonce = checked.partition("/")
    if not slash or not nonce or not _WORKER_NAME.fullmatch(name):
        raise InvalidArgument("holder", "is not a claim token (expected '<worker>/<nonce>')")
    return checked


def run_id(value: object) -> str:
    return text("flow_run_id", value, MAX_RUN_ID_LENGTH)


def result(value: object, max_bytes: int) -> tuple[Any, int]:
    """The result and its size as stored JSON."""
    try:
        encoded = json.dumps(value, ensure_ascii=True, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as exc:
        raise InvalidArgument("result", f"must be JSON-serialisable ({exc})") from None
    size = len(encoded)
    if size > max_bytes:
        raise InvalidArgument(
            "result",
            f"is {size:,} bytes of JSON; at most {max_bytes:,} (AI_JOB_MAX_RESULT_BYTES)",
        )
    return value, size


def error_text(value: object, name: str = "error") -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(name, "must be a non-empty string")
    cleaned = value.replace("\x00", "").encode("utf-8", "replace").decode("utf-8")
    return cleaned[:MAX_ERROR_LENGTH]
