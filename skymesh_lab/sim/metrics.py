"""Summary statistics of a simulation run (the JSON keys of ``skymesh sim``)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def percentiles(values: Sequence[float], prefix: str) -> dict[str, float]:
    if not values:
        return {f"{prefix}_{k}": 0.0 for k in ("mean_s", "p50_s", "p90_s", "p99_s")}
    a = np.asarray(values, dtype=float)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {
        f"{prefix}_mean_s": float(a.mean()),
        f"{prefix}_p50_s": float(p50),
        f"{prefix}_p90_s": float(p90),
        f"{prefix}_p99_s": float(p99),
    }


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
