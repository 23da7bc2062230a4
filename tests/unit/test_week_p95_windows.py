"""The capacity week's windowed tail check (SageServe's Fig. 17: TTFT p95 binned by 3
hours): which (region, window) cells keep their p95 within the SLO."""

from __future__ import annotations

import math

import numpy as np

from skymesh_lab.planning.capacity_week import mixture_quantile, p95_windows


def step_major(*regions: list[float]) -> np.ndarray:
    """One list per region, interleaved step by step as the run stores them."""
    return np.array([v for step in zip(*regions, strict=True) for v in step], dtype=float)


def test_a_window_over_its_slo_and_an_empty_one_are_told_apart() -> None:
    # Two regions, four steps, windows of two steps. Region 0: quiet throughout.
    # Region 1: fine, then a saturated step (unbounded TTFT) in its second window.
    # Region 0's second window has no requests: not counted.
    weight = step_major([5, 5, 0, 0], [5, 5, 5, 5])
    wait = step_major([0, 0, 0, 0], [0, 0, 0, 0])
    scale = step_major([0.1, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, math.inf])
    assert p95_windows(1.0, weight, wait, scale, n_regions=2, steps=2) == (2, 3)
    # The same cells against an SLO no request can meet: none met, the same count.
    assert p95_windows(1e-6, weight, wait, scale, n_regions=2, steps=2) == (0, 3)


def test_a_cell_is_judged_by_its_own_p95_not_the_weeks() -> None:
    # One region, two windows: the first has a 10 s backlog wait on a tenth of its
    # requests (its p95 is over a 1 s SLO), the second is clean. Over both, the late
    # requests are 5%: the week's p95 sits at the edge, one window clearly misses.
    weight = np.array([9.0, 1.0, 10.0, 10.0])
    wait = np.array([0.0, 10.0, 0.0, 0.0])
    scale = np.full(4, 0.05)
    assert mixture_quantile(0.95, weight[:2], wait[:2], scale[:2]) > 1.0
    assert p95_windows(1.0, weight, wait, scale, n_regions=1, steps=2) == (1, 2)
