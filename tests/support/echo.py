"""A secret as a careless gateway, proxy or log might echo it back: every common encoding."""

from __future__ import annotations

import base64
import json
import re
import urllib.parse

ECHO_USER = "user"  # the user name in an echoed "user:<secret>" credential


def _unicode_escaped(text: str, upper: bool = False) -> str:
    units = text.encode("utf-16-be")
    hexes = (int.from_bytes(units[i : i + 2], "big") for i in range(0, len(units), 2))
    return "".join(f"\\u{unit:04X}" if upper else f"\\u{unit:04x}" for unit in hexes)


def _go_escaped(text: str) -> str:
    """What Go's encoding/json does: <, > and & as \\u escapes, quotes and backslashes short."""
    quoted = json.dumps(text)[1:-1]
    return quoted.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def echo_forms(secret: str) -> dict[str, str]:
    """Named renderings of `secret`, each of which gives it away."""
    url_upper = urllib.parse.quote(secret, safe="")
    forms = {
        "plain": secret,
        "json": json.dumps(secret)[1:-1],
        "json_slash_escaped": json.dumps(secret)[1:-1].replace("/", "\\/"),
        "json_every_character": _unicode_escaped(secret),
        "json_every_character_upper": _unicode_escaped(secret, upper=True),
        "json_go_style": _go_escaped(secret),
        "json_twice": json.dumps(json.dumps(secret))[1:-1],
        "url_upper": url_upper,
        "url_lower": re.sub(r"%[0-9A-F]{2}", lambda m: m.group().lower(), url_upper),
        "url_plus": urllib.parse.quote_plus(secret, safe=""),
        "url_keep_slash": urllib.parse.quote(secret),
        "bytes_repr": repr(secret.encode())[2:-1],
        "base64": base64.b64encode(secret.encode()).decode(),
        "base64_urlsafe": base64.urlsafe_b64encode(secret.encode()).decode(),
        "basic_credentials": base64.b64encode(f"{ECHO_USER}:{secret}".encode()).decode(),
    }
    # Inside base64 at every alignment: after 0, 1 and 2 bytes of other text.
    for prefix in ("a", "ab", "abc"):
        encoded = base64.b64encode(f"{prefix}{secret}".encode()).decode()
        forms[f"base64_after_{len(prefix)}"] = encoded
        forms[f"base64_after_{len(prefix)}_json_slash"] = encoded.replace("/", "\\/")
    return forms


def echo_body(secret: str) -> str:
    """A JSON error body quoting `secret` in every form of `echo_forms`, one field each."""
    fields = ", ".join(
        f'"{name}": "{form}"' for name, form in echo_forms(secret).items() if '"' not in form
    )
    # Forms holding a bare quote cannot sit inside a JSON string as they are.
    extra = " ".join(form for form in echo_forms(secret).values() if '"' in form)
    return '{"error": {"message": "rejected credentials", ' + fields + "}} " + extra
