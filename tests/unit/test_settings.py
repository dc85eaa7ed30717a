"""Settings: every variable named in errors, in `--help`, in the README; secrets never shown."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from deployments.cli import main
from queue_store import Settings, SettingsError
from queue_store.settings import variables
from tests.support.settings import settings_from

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"AI_JOB_CONCURRENCY": "x"}, "AI_JOB_CONCURRENCY: Input should be a valid integer"),
        (
            {"AI_JOB_CONCURRENCY": "0"},
            "AI_JOB_CONCURRENCY: Input should be greater than or equal to 1",
        ),
        ({"AI_JOB_GAP_SECONDS": "nan"}, "AI_JOB_GAP_SECONDS"),
        ({"AI_JOBS": "maybe"}, "AI_JOBS: Input should be a valid boolean"),
        (
            {"AI_GATEWAY_URL": "ftp://u:secret@host"},
            "AI_GATEWAY_URL: expected an http:// or https:// URL",
        ),
        ({"AI_GATEWAY_PATH": "v1"}, "AI_GATEWAY_PATH: must start with '/'"),
        ({"AI_JOB_PLUGINS": "ok,no-such"}, "AI_JOB_PLUGINS: 'no-such' is not a Python module name"),
        ({"AI_JOB_LEASE_SECONDS": "5"}, "AI_JOB_HEARTBEAT_SECONDS: heartbeat plus"),
        ({"AI_JOB_BACKOFF_MAX_SECONDS": "1"}, "AI_JOB_BACKOFF_MAX_SECONDS: must be at least"),
        ({"AI_JOB_LEASE_MARGIN_SECONDS": "-1"}, "AI_JOB_LEASE_MARGIN_SECONDS"),
    ],
)
def test_a_bad_value_is_one_line_naming_the_variable(env: dict[str, str], message: str) -> None:
    with pytest.raises(SettingsError) as refused:
        settings_from(env)
    text = str(refused.value)
    assert text.startswith(message), text
    assert "\n" not in text and "secret" not in text


def test_unset_or_empty_means_the_default_and_the_margin_follows_the_lease() -> None:
    settings = settings_from({"AI_JOB_GAP_SECONDS": "", "AI_JOB_LEASE_SECONDS": "30"})
    assert settings.gap_seconds == 20.0
    assert settings.lease_margin == 5.0
    assert Settings(lease_seconds=60).lease_margin == 10.0
    assert settings_from({"AI_JOB_LEASE_MARGIN_SECONDS": "3"}).lease_margin == 3.0


def test_to_env_reproduces_the_settings_in_another_process() -> None:
    settings = Settings(
        concurrency=2, gap_seconds=1.5, enabled=False, gateway={"token": "t0ken-value"}
    )
    assert settings_from(settings.to_env()) == settings


def test_secrets_and_url_credentials_are_never_shown() -> None:
    settings = Settings(
        database_url="postgresql://db-user:db-pass@db.internal/insights",
        gateway={"token": "sk-very-secret", "url": "http://gw-user:gw-pass@gateway.internal:8080"},
        api={"operator_token": "api-very-secret-token"},
    )
    shown = " ".join([repr(settings), str(settings), str(settings.public())])
    for secret in ("sk-very-secret", "api-very-secret", "gw-pass", "db-pass", "gw-user:"):
        assert secret not in shown
    assert settings.public()["AI_GATEWAY_TOKEN"] == "(set)"


def test_every_setting_is_in_help_and_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    table = {m.group(1) for m in re.finditer(r"^\| `(AI_[A-Z_]+)` \|", readme, re.M)}
    assert table == set(variables()), "README's configuration table and the settings differ"
    shown = CliRunner().invoke(main, ["--help"]).output
    for name in variables():
        assert name in shown
