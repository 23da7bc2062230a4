"""skymesh.util.stats: the one percentile function (linear, as numpy's default)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from skymesh.util.stats import fmt, percentile, percentiles, ratio, summary

finite = st.floats(min_value=-1e9, max_value=1e9, allow_nan=False, allow_infinity=False)
samples = st.lists(finite, min_size=1, max_size=60)
qs = st.floats(min_value=0.0, max_value=100.0)


@given(samples, qs)
def test_matches_numpy_percentile(values: list[float], q: float) -> None:
    want = float(np.percentile(np.asarray(values, dtype=float), q))
    assert percentile(values, q) == want  # same arithmetic order: equal, not just close


@given(samples, qs, qs)
def test_within_the_data_and_monotone_in_q(values: list[float], q1: float, q2: float) -> None:
    lo, hi = sorted((q1, q2))
    a, b = percentile(values, lo), percentile(values, hi)
    assert a is not None and b is not None
    assert min(values) <= a <= b <= max(values)


@pytest.mark.parametrize(("values", "q", "want"), [
    ([1, 2, 3, 4], 50, 2.5),          # between the middle two
    ([1, 2, 3, 4], 90, 3.7),          # rank 2.7: 3 + 0.7
    ([10], 99, 10.0),
    ([3, 1, 2], 0, 1.0),              # unsorted input
    ([3, 1, 2], 100, 3.0),
    ((5.0, 7.0), 25, 5.5),            # a tuple
])
def test_known_values(values: list[float], q: float, want: float) -> None:
    assert percentile(values, q) == pytest.approx(want)


def test_any_iterable_and_numpy_arrays() -> None:
    assert percentile((x for x in [4, 1, 3, 2]), 50) == 2.5
    assert percentile(np.array([4.0, 1.0, 3.0, 2.0]), 50) == 2.5
    assert percentile(range(101), 90) == 90.0


def test_no_data_is_none_not_zero_or_nan() -> None:
    assert percentile([], 50) is None
    assert percentile(np.array([]), 99) is None
    assert percentiles([], [50, 90]) == [None, None]
    assert summary([], prefix="ttft_", suffix="_s") == {
        "ttft_mean_s": None, "ttft_p50_s": None, "ttft_p90_s": None, "ttft_p99_s": None}


@pytest.mark.parametrize("bad", [[1.0, math.nan, 2.0], [math.inf], [1.0, -math.inf]])
def test_non_finite_samples_are_refused(bad: list[float]) -> None:
    with pytest.raises(ValueError, match="non-finite"):
        percentile(bad, 50)


@pytest.mark.parametrize("q", [-0.1, 100.5, math.nan])
def test_q_outside_0_100_is_refused(q: float) -> None:
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], q)


def test_percentiles_and_summary_agree_with_percentile() -> None:
    values = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4]
    assert percentiles(values, [10, 50, 99]) == [percentile(values, q) for q in (10, 50, 99)]
    got = summary(values, (25, 97.5), prefix="e2e_", suffix="_s")
    assert got == {"e2e_mean_s": pytest.approx(sum(values) / len(values)),
                   "e2e_p25_s": percentile(values, 25), "e2e_p97.5_s": percentile(values, 97.5)}
    assert list(summary(values)) == ["mean", "p50", "p90", "p99"]


def test_ratio_is_none_without_data_and_floors_the_denominator() -> None:
    assert ratio(2.0, 4.0) == 0.5
    assert ratio(1.0, 0.0) == pytest.approx(1e9)
    assert ratio(None, 1.0) is None and ratio(1.0, None) is None


@pytest.mark.parametrize(("spec", "scale", "value", "want"), [
    (">9.2f", 1.0, 1.2345, "     1.23"),
    (">9.2f", 1.0, None, "      n/a"),   # same width: table columns stay aligned
    ("6.0f", 1000.0, 0.0123, "    12"),
    ("6.0f", 1000.0, None, "   n/a"),
    ("+.3f", 1.0, None, "n/a"),
])
def test_fmt_prints_n_a_for_no_data(spec: str, scale: float, value: float | None,
                                    want: str) -> None:
    assert fmt(value, spec, scale) == want
