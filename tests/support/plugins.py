"""Generators for the tests (named in AI_JOB_PLUGINS as `tests.support.plugins`).

- `ok`: asks the gateway one short question.
- `broken`: its prompt can never be built.
- `sleepy`: building the prompt sleeps `TEST_SLEEPY_SECONDS` (releasing the GIL).
- `hog`: the first time a subject's prompt is built in the directory named by
  `TEST_MARKS`, building it holds the GIL for `TEST_HOG_SECONDS`; later times
  are quick. A marker file per subject makes the fault happen once, by count.

Users named `mixed-*` get two scopes, `ok:first` and `broken:second`; users named
`seven-and-one-*` get `ok:day-1` to `ok:day-7` and `broken:day-8`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from flows.registry import Messages, Registry, Scope


def _ask(user_id: str, subject: str) -> Messages:
    return [{"role": "user", "content": f"insight for {user_id}/{subject}"}]


def _broken(user_id: str, subject: str) -> Messages:
    raise RuntimeError(f"no data for {subject}")


def _sleepy(user_id: str, subject: str) -> Messages:
    time.sleep(float(os.environ.get("TEST_SLEEPY_SECONDS", "1")))
    return _ask(user_id, subject)


def hold_the_gil(seconds: float) -> None:
    """Keep the GIL for about `seconds`: one C call that never lets another thread run."""
    # sum() over a range runs in C and does not release the GIL until it returns.
    start = time.perf_counter()
    sum(range(2_000_000))
    rate = 2_000_000 / max(time.perf_counter() - start, 1e-6)
    sum(range(int(rate * seconds)))


def _hog(user_id: str, subject: str) -> Messages:
    marks = Path(os.environ["TEST_MARKS"])
    mark = marks / f"hogged-{subject}"
    if not mark.exists():
        mark.touch()
        hold_the_gil(float(os.environ.get("TEST_HOG_SECONDS", "5")))
    return _ask(user_id, subject)


def register(registry: Registry) -> None:
    registry.register_generator("ok", _ask)
    registry.register_generator("broken", _broken)
    registry.register_generator("sleepy", _sleepy)
    registry.register_generator("hog", _hog)
    registry.register_scopes(mixed_scopes)
    registry.register_scopes(seven_and_one)


def mixed_scopes(user_id: str) -> list[Scope]:
    """Users named `mixed-*` have one scope that works and one that never can."""
    if not user_id.startswith("mixed-"):
        return []
    return [Scope("ok", "first"), Scope("broken", "second")]


def seven_and_one(user_id: str) -> list[Scope]:
    """Users named `seven-and-one-*`: seven scopes that work, then one that never can."""
    if not user_id.startswith("seven-and-one-"):
        return []
    return [Scope("ok", f"day-{n}") for n in range(1, 8)] + [Scope("broken", "day-8")]
