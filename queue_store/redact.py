"""Redaction of secrets in every form a gateway may echo them in (G5): plain, JSON-escaped,
URL-encoded, in a bytes repr, escaped twice, any mixture of these, or inside base64; and URL
credentials. Pure Python: no Prefect, no httpx."""

from __future__ import annotations

import base64
import logging
import re
from collections.abc import Iterable

REDACTED = "[redacted]"
MIN_SECRET_LENGTH = 4  # shorter ones are not searched for: "ab" would mangle text, protect nothing
MIN_BASE64_CORE = 6  # the shortest base64 stretch of the secret alone that is searched for
MAX_ESCAPE_BACKSLASHES = 8  # an escape may stand behind: JSON in JSON in JSON needs 7

_CREDENTIALS_IN_URL = re.compile(r"(?<=://)[^/@\s\"']*@")
# URL query parameters that carry a password (libpq reads `password`).
PASSWORD_PARAMETERS = frozenset({"password", "passwd", "pwd", "sslpassword"})
_PASSWORD_IN_QUERY = re.compile(
    r"(?i)([?&](?:" + "|".join(sorted(PASSWORD_PARAMETERS)) + r")=)[^&\s\"']*"
)
# Characters with a short escape in JSON or a Python repr, and the letter after the backslash.
_SHORT_ESCAPES = dict(zip("\"'\\/\b\f\n\r\t", "\"'\\/bfnrt", strict=True))


def _hex(value: int, width: int) -> str:
    """`value` in hexadecimal, either case."""
    digits = f"{value:0{width}x}"
    return "".join(f"[{d}{d.upper()}]" if d.isalpha() else d for d in digits)


def _character(c: str) -> str:
    """A pattern for one character of a secret in every escape a text can give it: JSON's
    `\\uXXXX`, a bytes repr's `\\xNN`, a short escape, each behind up to `MAX_ESCAPE_BACKSLASHES`;
    percent-encoding; `+` for a space. Matched one by one, so any mixture is found."""
    # Runs of backslashes are bounded, and taken whole but for a backslash of the secret itself
    # (which may share its run with the next character's escape): search time stays linear.
    units = c.encode("utf-16-be")
    raw = c.encode("utf-8")
    escape = rf"\\{{1,{MAX_ESCAPE_BACKSLASHES}}}+"
    options = [
        re.escape(c),
        "".join(
            escape + "u" + _hex(int.from_bytes(units[i : i + 2], "big"), 4)
            for i in range(0, len(units), 2)
        ),
        "".join(escape + "x" + _hex(byte, 2) for byte in raw),
        "".join("%" + _hex(byte, 2) for byte in raw),
    ]
    if c == "\\":
        options.append(rf"\\{{1,{MAX_ESCAPE_BACKSLASHES}}}")
    elif c in _SHORT_ESCAPES:
        options.append(escape + re.escape(_SHORT_ESCAPES[c]))
    if c == " ":
        options.append(r"\+")
    return "(?:" + "|".join(options) + ")"


def _base64_cores(secret: bytes) -> set[str]:
    """The stretch of base64 text that depends only on `secret`, at each of the 3 alignments."""
    cores: set[str] = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for offset in range(3):
            encoded = encode(b"\0" * offset + secret + b"\0\0\0").decode("ascii")
            # Characters that mix in the bytes around the secret vary with the text: not those.
            start = -(-offset * 4 // 3)  # ceil(offset * 4 / 3)
            end = ((offset + len(secret)) * 4) // 3
            core = encoded[start:end]
            if len(core) >= MIN_BASE64_CORE:
                cores.add(core)
    return cores


_USERINFO = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*)://([^/@\s\"':]*)(:[^/@\s\"']*)?@")


def _masked(found: re.Match[str]) -> str:
    scheme, user, password = found.groups()
    if scheme.lower() in ("http", "https"):  # a gateway's user name may be its key
        return f"{scheme}://***@"
    return f"{scheme}://{user}:***@" if password else found.group()


def mask_url(url: str) -> str:
    """A URL, or a text holding URLs, with its credentials masked."""
    return _PASSWORD_IN_QUERY.sub(r"\1***", _USERINFO.sub(_masked, url))


class Redactor:
    """Removes given secrets, in all their forms, and URL credentials from text."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        forms: set[str] = set()  # each secret and the base64 stretches that encode only it
        for secret in secrets:
            if len(secret) >= MIN_SECRET_LENGTH:
                forms |= {secret} | _base64_cores(secret.encode())
        # Longest first, so a form that contains another is removed whole.
        ordered = sorted(forms, key=lambda form: (-len(form), form))
        spelled = ("".join(map(_character, form)) for form in ordered)
        self._pattern = re.compile("|".join(spelled)) if ordered else None

    def __call__(self, text: str) -> str:
        if self._pattern is not None:
            text = self._pattern.sub(REDACTED, text)
        return _CREDENTIALS_IN_URL.sub(f"{REDACTED}@", text)


class RedactingFilter(logging.Filter):
    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self._redact = redactor

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # noqa: BLE001 - a broken record is logged as it is
            return True
        redacted = self._redact(message)
        if redacted != message or record.args:
            record.msg, record.args = redacted, None
        if record.exc_text:  # a traceback another handler cached: formatters print it as it is
            record.exc_text = self._redact(record.exc_text)
        elif record.exc_info and record.exc_info[1] is not None:
            record.exc_text = self._redact(logging.Formatter().formatException(record.exc_info))
        return True


def install_log_redaction(redactor: Redactor, loggers: Iterable[str] = ("",)) -> None:
    """Redact every record reaching the handlers of these loggers (root by default)."""
    redacting = RedactingFilter(redactor)
    for name in loggers:
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, RedactingFilter) for f in handler.filters):
                handler.addFilter(redacting)
