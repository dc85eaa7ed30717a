"""Finding a secret in text by decoding, not by listing its encodings.

`Redactor` removes a secret by matching the forms it could be echoed in. A
test that looked for the same list of forms would share its blind spots, so
`exposures` works the other way round: it undoes the encodings a gateway or a
log could apply (JSON escapes at any depth, percent-encoding, bytes reprs)
and looks for the plain secret, pieces of it, and the stretches of base64
that only the secret can produce, in every decoded reading of the text.
"""

from __future__ import annotations

import base64
import re
import urllib.parse

# A piece this long of a secret is already a leak (an excerpt cut mid-secret).
PIECE = 10

_JSON_UNICODE = re.compile(r"\\+u([0-9a-fA-F]{4})")
_JSON_SHORT = re.compile(r"\\+([\"/\\])")
_BYTES_HEX = re.compile(r"\\+x([0-9a-fA-F]{2})")


def _unescape(text: str) -> str:
    """JSON and Python-repr escapes removed, at any depth of escaping."""
    previous = None
    while previous != text:
        previous = text
        text = _JSON_UNICODE.sub(lambda m: chr(int(m.group(1), 16)), text)
        text = _BYTES_HEX.sub(lambda m: chr(int(m.group(1), 16)), text)
        text = _JSON_SHORT.sub(lambda m: m.group(1), text)
    return text


def readings(text: str) -> list[str]:
    """The text as it is, unescaped, percent-decoded, and both, in either order."""
    found = [text]
    for step in (_unescape, urllib.parse.unquote, urllib.parse.unquote_plus):
        found += [step(reading) for reading in list(found)]
    found += [_unescape(reading) for reading in list(found)]
    return list(dict.fromkeys(found))


def base64_cores(secret: str) -> set[str]:
    """Base64 text that encodes only the secret's bytes, for each of the 3 alignments."""
    raw = secret.encode()
    cores = set()
    for encode in (base64.b64encode, base64.urlsafe_b64encode):
        for offset in range(3):
            encoded = encode(b"\0" * offset + raw + b"\0\0\0").decode()
            start = -(-offset * 4 // 3)
            end = (offset + len(raw)) * 4 // 3
            cores.add(encoded[start:end])
    return {core for core in cores if len(core) >= PIECE}


def exposures(text: str, *secrets: str) -> list[str]:
    """What of each secret can be read back from `text`; empty when nothing can."""
    found: list[str] = []
    for secret in secrets:
        needles = {secret, secret[:PIECE], secret[-PIECE:]} | base64_cores(secret)
        for reading in readings(text):
            found += [needle for needle in needles if needle in reading]
    return sorted(set(found))
