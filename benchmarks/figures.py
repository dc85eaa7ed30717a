"""The one percentile the benchmarks report figures with."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], fraction: float) -> float:
    """The `fraction` quantile (0.5 is the median, 0.95 the p95); nan when there are none.

    Linear interpolation between the two nearest ranks, as NumPy's default and
    `statistics.quantiles(method="inclusive")` do, so a p95 of 20 samples is not
    simply the largest but one.
    """
    if not 0 <= fraction <= 1:
        raise ValueError(f"fraction must be between 0 and 1, not {fraction}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * fraction
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)
