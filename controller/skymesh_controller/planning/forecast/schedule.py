"""Periodic retraining: refit a forecaster every N observed windows, update in between.

PreServe retrains its mLSTM daily on recent history and only appends observations in
between; SageServe re-forecasts hourly. ``RetrainSchedule`` is that policy for any
:class:`~skymesh_controller.planning.forecast.base.Forecaster`: ``observe`` new points, then
``predict``. ``max_history`` bounds what a refit sees (the most recent windows), so a
long-running controller does not refit on ever more data.
"""

from __future__ import annotations

import numpy as np

from skymesh_controller.planning.forecast.base import Forecaster


class RetrainSchedule:
    def __init__(self, forecaster: Forecaster, every: int, max_history: int | None = None) -> None:
        if every < 0:
            raise ValueError("retrain interval must be >= 0 windows (0: never refit)")
        if max_history is not None and max_history < 1:
            raise ValueError("max_history must be positive")
        self.forecaster = forecaster
        self.every = every
        self.max_history = max_history
        self.since_fit = 0
        self.refits = 0

    def fit(self, y: np.ndarray, origin: int = 0) -> RetrainSchedule:
        y = np.asarray(y, dtype=float)
        kept = self._window(y)
        self.forecaster.fit(kept, origin=origin + len(y) - len(kept))
        self.since_fit = 0
        return self

    def observe(self, y_new: np.ndarray | float) -> bool:
        """Add observed points; returns True when this call refitted the model."""
        pts = np.atleast_1d(np.asarray(y_new, dtype=float))
        self.since_fit += len(pts)
        if self.every and self.since_fit >= self.every:
            f = self.forecaster
            history = np.concatenate([f.history, pts])
            kept = self._window(history)
            f.fit(kept, origin=f.origin + len(history) - len(kept))
            self.since_fit = 0
            self.refits += 1
            return True
        self.forecaster.update(pts)
        return False

    def predict(self, h: int) -> np.ndarray:
        return self.forecaster.predict(h)

    def _window(self, y: np.ndarray) -> np.ndarray:
        return y if self.max_history is None else y[-self.max_history:]
