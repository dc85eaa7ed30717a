"""A plugin module that registers no generator: every kind is accepted (`AI_JOB_PLUGINS`)."""

from __future__ import annotations

from flows.registry import Registry


def register(registry: Registry) -> None:
    """Register nothing."""
