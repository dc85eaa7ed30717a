"""Arithmetic on time spans: how many overlapped at once, how quiet it was between them.

The recorder measures connections and the simulator measures its workers'
occupancy; both ask the same two questions of (start, end) pairs, answered
here once. A span whose end is None has not ended yet.
"""

from __future__ import annotations

from collections.abc import Iterable

Span = tuple[float, float | None]  # (start, end) in seconds; end None while it runs


def gaps_between(spans: Iterable[Span], now: float) -> tuple[float, ...]:
    """For spans in order of start, each one's start minus the latest end
    among those that started before it; negative means they overlapped.

    A span still running counts as ending at `now`. Spans starting at the
    same instant keep the order they were given in.
    """
    result: list[float] = []
    latest_end: float | None = None
    for start, end in sorted(spans, key=lambda span: span[0]):
        if latest_end is not None:
            result.append(start - latest_end)
        finish = now if end is None else end
        latest_end = finish if latest_end is None else max(latest_end, finish)
    return tuple(result)


def peak_overlap(spans: Iterable[Span]) -> int:
    """The most spans running at any one instant; a span still running
    overlaps every span that starts after it."""
    changes: list[tuple[float, int]] = []
    for start, end in spans:
        changes.append((start, 1))
        if end is not None:
            changes.append((end, -1))
    # At the same instant ends sort before starts: a span that starts as
    # another ends follows it, it does not overlap it.
    running = peak = 0
    for _, change in sorted(changes):
        running += change
        peak = max(peak, running)
    return peak
