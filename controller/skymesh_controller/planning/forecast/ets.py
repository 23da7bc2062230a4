"""Holt-Winters exponential smoothing (statsmodels ``ExponentialSmoothing``).

Additive level, optionally damped additive trend, additive or multiplicative seasonality at
the forecaster's period (PreServe's ETS baseline, Table 1). ``fit`` estimates smoothing
parameters and initial states; ``update`` keeps them fixed and re-runs the smoothing
recursions over the longer history (statsmodels with ``optimized=False``), which costs
milliseconds, so a walk-forward evaluation refits only on its retrain schedule.

Parameters: ``trend`` ("add" or None), ``damped`` (True), ``seasonal`` ("add", "mul" or
None), ``use_boxcox`` (False).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from skymesh_controller.planning.forecast.base import Forecaster, clip_demand


class HoltWinters(Forecaster):
    name = "ets"

    def __init__(self, period: int, trend: str | None = "add", damped: bool = True,
                 seasonal: str | None = "add", use_boxcox: bool = False) -> None:
        super().__init__(period)
        if trend not in ("add", None) or seasonal not in ("add", "mul", None):
            raise ValueError(f"ets: trend must be 'add' or None, seasonal 'add', 'mul' or None "
                             f"(got {trend!r}, {seasonal!r})")
        self.trend, self.damped, self.seasonal = trend, bool(damped and trend), seasonal
        self.use_boxcox = use_boxcox
        self._params: dict[str, Any] = {}
        self._result: Any = None

    def _model(self, y: np.ndarray, **init: Any) -> Any:
        from statsmodels.tsa.holtwinters import ExponentialSmoothing

        return ExponentialSmoothing(
            y, trend=self.trend, damped_trend=self.damped, seasonal=self.seasonal,
            seasonal_periods=self.period if self.seasonal else None,
            use_boxcox=self.use_boxcox, **init)

    def _fit(self) -> None:
        if self.seasonal and len(self.history) < 2 * self.period:
            raise ValueError(f"ets needs two seasons of history ({2 * self.period} points), "
                             f"got {len(self.history)}")
        with warnings.catch_warnings(record=True):
            # Convergence chatter on flat stretches; the fit is still usable. `record`
            # also swallows what statsmodels re-emits under its own "always" filter.
            warnings.simplefilter("ignore")
            self._result = self._model(self.history, initialization_method="estimated").fit()
        self._params = dict(self._result.params)

    def _update(self, y_new: np.ndarray) -> None:
        p = self._params
        init: dict[str, Any] = {"initialization_method": "known",
                                "initial_level": p["initial_level"]}
        if self.trend:
            init["initial_trend"] = p["initial_trend"]
        if self.seasonal:
            init["initial_seasonal"] = p["initial_seasons"]
        smoothing = {k: p[k] for k in ("smoothing_level", "smoothing_trend",
                                       "smoothing_seasonal", "damping_trend")
                     if k in p and p[k] is not None and not np.isnan(p[k])}
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("ignore")
            model = self._model(self.history, **init)
            self._result = model.fit(optimized=False, **smoothing)

    def predict(self, h: int) -> np.ndarray:
        if self._result is None:
            raise RuntimeError("ets: fit before predict")
        return clip_demand(np.asarray(self._result.forecast(h), dtype=float))
