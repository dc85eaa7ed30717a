"""Generators for the flow tests: one that answers, and one that always raises."""

from __future__ import annotations

from flows.registry import Messages, register_generator


def _ask(user_id: str, subject: str) -> Messages:
    return [{"role": "user", "content": f"insight for {user_id}/{subject}"}]


def _broken(user_id: str, subject: str) -> Messages:
    raise RuntimeError(f"no data for {subject}")


register_generator("ok", _ask)
register_generator("broken", _broken)
