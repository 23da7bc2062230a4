"""The forecaster interface every model implements, and the seasonal-naive baseline.

A forecaster sees one non-negative series sampled at a fixed window (e.g. prompt tokens per
10 minutes for one (model, region)). ``fit`` trains on history; ``update`` appends newly
observed points without a full refit (refits happen on the caller's schedule);
``predict(h)`` returns the next ``h`` windows after the last point seen.

``fit(y, origin)`` may say which window ``y[0]`` is, counted from any fixed epoch (for
example Unix time divided by the window): forecasters that use the time of day read the
phase of ``history[i]`` as ``(origin + i) % period``, so a refit on a trailing slice of
history keeps the same clock.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import numpy as np


def clip_demand(pred: np.ndarray) -> np.ndarray:
    """Demand is never negative; a model extrapolating below zero means "none"."""
    return np.maximum(np.nan_to_num(pred, nan=0.0), 0.0)


class Forecaster(ABC):
    name: str = "base"

    def __init__(self, period: int) -> None:
        if period < 1:
            raise ValueError("period must be at least one window")
        self.period = period
        self.history = np.zeros(0)
        self.origin = 0

    def fit(self, y: np.ndarray, origin: int = 0) -> Forecaster:
        self.history = np.asarray(y, dtype=float).copy()
        self.origin = int(origin)
        self._fit()
        return self

    def update(self, y_new: np.ndarray) -> None:
        self.history = np.concatenate([self.history, np.asarray(y_new, dtype=float)])
        self._update(np.asarray(y_new, dtype=float))

    @abstractmethod
    def _fit(self) -> None: ...

    def _update(self, y_new: np.ndarray) -> None:
        """Absorb new points; the default keeps the fitted model and only extends history."""

    @abstractmethod
    def predict(self, h: int) -> np.ndarray: ...


class SeasonalNaive(Forecaster):
    """Tomorrow at this time equals today at this time: y[t+k] = y[t+k-period]."""

    name = "seasonal-naive"

    def _fit(self) -> None:
        if len(self.history) < self.period:
            raise ValueError(f"seasonal naive needs at least one period ({self.period} points)")

    def predict(self, h: int) -> np.ndarray:
        last = self.history[-self.period:]
        reps = -(-h // self.period)
        return np.tile(last, reps)[:h].copy()
