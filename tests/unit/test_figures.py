"""The benchmarks' percentile agrees with the standard library's."""

from __future__ import annotations

import math
import statistics

import pytest

from benchmarks.figures import percentile

SAMPLES = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0, 5.0, 8.0, 9.0, 7.0, 9.0, 3.0, 2.0]


def test_the_median_and_the_p95_are_the_standard_librarys() -> None:
    assert percentile(SAMPLES, 0.5) == statistics.median(SAMPLES)
    cuts = statistics.quantiles(SAMPLES, n=20, method="inclusive")
    assert percentile(SAMPLES, 0.95) == pytest.approx(cuts[18])
    assert percentile(SAMPLES, 0.0) == min(SAMPLES)
    assert percentile(SAMPLES, 1.0) == max(SAMPLES)


def test_one_value_is_every_percentile_and_none_is_nan() -> None:
    assert percentile([0.25], 0.95) == 0.25
    assert math.isnan(percentile([], 0.5))


@pytest.mark.parametrize("fraction", [-0.1, 1.5, 95])
def test_a_fraction_outside_zero_to_one_is_refused(fraction: float) -> None:
    with pytest.raises(ValueError, match="between 0 and 1"):
        percentile(SAMPLES, fraction)
