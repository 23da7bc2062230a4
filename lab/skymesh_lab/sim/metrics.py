"""Summary statistics of a simulation run (the JSON keys of ``skymesh sim``); latency
percentiles come from ``skymesh.util.stats.summary``."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def spread(samples: Sequence[Sequence[int]]) -> dict[str, float]:
    """Per-replica outstanding-request spread, averaged over time samples."""
    if not samples:
        return {"outstanding_std_mean": 0.0, "outstanding_range_mean": 0.0,
                "outstanding_cv_mean": 0.0}
    a = np.asarray(samples, dtype=float)
    std = a.std(axis=1)
    rng = a.max(axis=1) - a.min(axis=1)
    mean = a.mean(axis=1)
    cv = np.divide(std, mean, out=np.zeros_like(std), where=mean > 0)
    return {
        "outstanding_std_mean": float(std.mean()),
        "outstanding_range_mean": float(rng.mean()),
        "outstanding_cv_mean": float(cv.mean()),
    }
