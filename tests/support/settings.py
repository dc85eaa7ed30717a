"""Settings as another process would read them from its environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from unittest import mock

from queue_store import Settings


def settings_from(env: Mapping[str, str]) -> Settings:
    """The settings a process whose `AI_*` variables are exactly those of `env` reads."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("AI_")}
    with mock.patch.dict(os.environ, {**kept, **env}, clear=True):
        return Settings()
