"""The access-log-cost benchmark's interval of a median (order statistics)."""

from __future__ import annotations

import statistics

import pytest

from skymesh_lab.bench.access_log_cost import median_interval


@pytest.mark.parametrize(("n", "ranks"), [
    (12, (2, 9)),  # P(Binomial(12, 1/2) <= 2) = 0.019, <= 3: 0.073
    (24, (6, 17)),  # <= 6: 0.011, <= 7: 0.032
    (30, (9, 20)),  # <= 9: 0.021, <= 10: 0.049
])
def test_the_interval_is_the_binomial_order_statistics(n: int, ranks: tuple[int, int]) -> None:
    values = [float(i * i) for i in range(n)][::-1]  # any order
    low, high = median_interval(values)
    assert (low, high) == (float(ranks[0] ** 2), float(ranks[1] ** 2))
    assert low <= statistics.median(values) <= high


def test_too_few_values_for_95_percent_give_min_and_max() -> None:
    assert median_interval([3.0, 1.0, 2.0, 5.0, 4.0]) == (1.0, 5.0)


def test_an_outlier_does_not_widen_it() -> None:
    values = [10.0 + i % 3 for i in range(24)]
    assert median_interval([*values[:-1], 1e6]) == median_interval(values)
