"""The redactor (G5): a secret in any form it can be echoed in is removed, and nothing else.

Every check reads the redacted text back with `tests.support.secrets.exposures`,
which decodes JSON, URL and repr escapes and base64 instead of listing forms,
so it does not share the redactor's blind spots.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import time
import urllib.parse
from collections.abc import Iterator

import pytest
from pydantic import SecretStr

from queue_store.redact import REDACTED, RedactingFilter, Redactor, install_log_redaction
from tests.support.echo import echo_forms
from tests.support.factories import settings_for
from tests.support.secrets import exposures

TOKEN = 'sk-live/Q7+x=y&z%w"q\\<t>~9'
PASSWORD = "pässwörd-😀/?#@:"
ORDINARY = (
    "POST http://gateway.test/v1/chat/completions: gateway refused the request (HTTP 500): "
    '{"error": {"message": "The server had an error", "type": "server_error"}} 0123456789'
)


@pytest.fixture
def redact() -> Redactor:
    return Redactor([TOKEN, PASSWORD])


@pytest.mark.parametrize("secret", [TOKEN, PASSWORD], ids=["token", "non-ascii-password"])
@pytest.mark.parametrize("form", list(echo_forms(TOKEN)))
def test_every_form_is_redacted(redact: Redactor, secret: str, form: str) -> None:
    rendered = echo_forms(secret)[form]
    text = f"before {rendered} after"
    cleaned = redact(text)
    assert exposures(cleaned, secret) == [], cleaned
    assert REDACTED in cleaned
    assert cleaned.startswith("before ") and cleaned.endswith(" after")


def test_escapes_mixed_within_one_rendering_are_redacted(redact: Redactor) -> None:
    # Some characters escaped one way, some another, some not at all.
    mixed = 'sk-live\\/Q7%2Bx=y\\u0026z%25w\\"q\\\\\\u003ct%3E~9'
    assert redact(f"key {mixed}!") == f"key {REDACTED}!"


@pytest.mark.parametrize("prefix", ["", "u", "us", "use", "user:", "a much longer user name:"])
@pytest.mark.parametrize(
    "encode", [base64.b64encode, base64.urlsafe_b64encode], ids=["standard", "urlsafe"]
)
def test_base64_of_user_and_token_is_redacted_at_any_alignment(
    redact: Redactor, prefix: str, encode: object
) -> None:
    assert callable(encode)
    encoded = encode(f"{prefix}{TOKEN}".encode()).decode()
    for text in (f"Authorization: Basic {encoded}", json.dumps({"auth": encoded})):
        cleaned = redact(text)
        assert exposures(cleaned, TOKEN) == [], cleaned


def test_a_secret_inside_longer_base64_is_redacted(redact: Redactor) -> None:
    encoded = base64.b64encode(f"header bytes {TOKEN} trailer bytes".encode()).decode()
    assert exposures(redact(encoded), TOKEN) == []


@pytest.mark.parametrize(
    "text",
    [
        "\\" * 131_072,
        ("\\" * 50 + "u00") * 2_500,
        "s\\" * 65_536,
        "ordinary words of a long log line " * 4_000,
    ],
    ids=["backslashes", "broken-escapes", "first-letter-and-backslash", "ordinary"],
)
def test_a_long_hostile_text_is_searched_in_linear_time(text: str) -> None:
    # An error body is chosen by the gateway. Measured: about 0.3 s for these
    # 128 kB texts; a pattern that backtracks over runs of backslashes takes
    # minutes.
    redact = Redactor([TOKEN, PASSWORD, "\\back\\slash-secret", "alice:pw-0123456789"])
    started = time.monotonic()
    assert redact(text) == text
    assert time.monotonic() - started < 5.0


def test_credentials_in_any_url_are_removed() -> None:
    redact = Redactor()
    text = "connect to postgresql://role:s3cret@db.internal:5432/app and https://u:p@h.example/x"
    assert redact(text) == (
        f"connect to postgresql://{REDACTED}@db.internal:5432/app and https://{REDACTED}@h.example/x"
    )


def test_ordinary_text_is_left_alone(redact: Redactor) -> None:
    assert redact(ORDINARY) == ORDINARY
    assert Redactor()(ORDINARY) == ORDINARY


@pytest.mark.parametrize("secret", ["", "a", "ab", "abc"])
def test_secrets_too_short_to_matter_are_not_searched_for(secret: str) -> None:
    assert Redactor([secret])(f"{ORDINARY} abc") == f"{ORDINARY} abc"


def test_the_longest_secret_goes_whole() -> None:
    redact = Redactor(["alice", "alice:s3cret-pw"])
    assert redact("as alice:s3cret-pw, alice") == f"as {REDACTED}, {REDACTED}"


def test_the_secrets_of_the_settings_are_known() -> None:
    quoted = urllib.parse.quote(PASSWORD, safe="")
    settings = settings_for(
        database_url=f"postgresql://db-role:{quoted}@127.0.0.1:5432/q",
        gateway={"token": SecretStr(TOKEN), "url": "http://gw-user:gw-p%40ss-word@gateway.test/"},
        api={"operator_token": SecretStr("api-token-0123456789")},
    )
    redact = Redactor(settings.secrets())
    secrets = [
        TOKEN,
        "api-token-0123456789",
        "gw-p@ss-word",
        "gw-user:gw-p@ss-word",
        PASSWORD,
        f"db-role:{PASSWORD}",
    ]
    for secret in secrets:
        for form in echo_forms(secret).values():
            cleaned = redact(f"<{form}>")
            assert exposures(cleaned, *secrets) == [], (secret, cleaned)


def test_a_password_given_as_a_url_query_parameter_is_known_too() -> None:
    settings = settings_for(
        database_url="postgresql://db-role@127.0.0.1:5432/q?sslmode=disable&password=pw-in-query-42"
    )
    redact = Redactor(settings.secrets())
    for form in echo_forms("pw-in-query-42").values():
        assert exposures(redact(f"failed: {form}"), "pw-in-query-42") == [], form
    assert redact("sslmode=disable") == "sslmode=disable"


# --- the logging filter ---------------------------------------------------------------------


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    logger = logging.getLogger("tests.redact")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    install_log_redaction(Redactor([TOKEN]), ["tests.redact"])
    try:
        yield logger, stream
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_the_filter_redacts_messages_and_their_arguments(
    logged: tuple[logging.Logger, io.StringIO],
) -> None:
    logger, stream = logged
    logger.debug("bearer %s", TOKEN)
    logger.info("answer %r", {"token": echo_forms(TOKEN)["json_go_style"]})
    logger.warning(f"plain {echo_forms(TOKEN)['basic_credentials']}")
    logger.error("%s and %d", "no secret", 7)
    text = stream.getvalue()
    assert exposures(text, TOKEN) == [], text
    assert text.count(REDACTED) == 3
    assert "ERROR no secret and 7" in text


def test_the_filter_redacts_exception_text(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, stream = logged
    try:
        raise RuntimeError(f"gateway said {echo_forms(TOKEN)['json']}")
    except RuntimeError:
        logger.exception("the call failed")
    text = stream.getvalue()
    assert "RuntimeError: gateway said" in text and "Traceback" in text
    assert exposures(text, TOKEN) == [], text


def test_the_filter_redacts_exception_text_another_handler_formatted_first() -> None:
    # A handler without the filter formats first and caches the traceback
    # in the record; the filtered handler must not print that cache as it is.
    plain, filtered = io.StringIO(), io.StringIO()
    first, second = logging.StreamHandler(plain), logging.StreamHandler(filtered)
    second.addFilter(RedactingFilter(Redactor([TOKEN])))
    logger = logging.getLogger("tests.redact.two")
    logger.propagate = False
    logger.addHandler(first)
    logger.addHandler(second)
    try:
        try:
            raise RuntimeError(f"token {TOKEN}")
        except RuntimeError:
            logger.exception("failed")
    finally:
        logger.removeHandler(first)
        logger.removeHandler(second)
        logger.propagate = True
    assert TOKEN in plain.getvalue()  # the control: the cache held it
    assert "RuntimeError: token" in filtered.getvalue()
    assert exposures(filtered.getvalue(), TOKEN) == [], filtered.getvalue()


def test_installing_twice_adds_one_filter() -> None:
    handler = logging.StreamHandler(io.StringIO())
    logger = logging.getLogger("tests.redact.once")
    logger.addHandler(handler)
    try:
        install_log_redaction(Redactor([TOKEN]), ["tests.redact.once"])
        install_log_redaction(Redactor([TOKEN]), ["tests.redact.once"])
        assert sum(isinstance(f, RedactingFilter) for f in handler.filters) == 1
    finally:
        logger.removeHandler(handler)
