"""One way for tests to wait on something another process does."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from pathlib import Path


def wait_for(
    condition: Callable[[], object],
    timeout: float,
    what: str,
    *,
    every: float = 0.05,
    log: Path | None = None,
    tolerate: tuple[type[BaseException], ...] = (),
) -> float:
    """Poll `condition` until it holds; returns the wall-clock time it was seen to.

    An exception in `tolerate` (a store that is down, say) counts as "not yet".
    On timeout the AssertionError names `what` and ends with the tail of `log`.
    """
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(*tolerate):
            if condition():
                return time.time()
        time.sleep(every)
    tail = log.read_text(errors="replace")[-3000:] if log is not None and log.exists() else ""
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}\n{tail}".rstrip())
