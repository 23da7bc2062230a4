"""ARIMA with the daily cycle as Fourier regressors (statsmodels ``SARIMAX``).

SageServe forecasts each (model, region) with ARIMA. A seasonal ARIMA at period 144
(10-minute windows) takes minutes and gigabytes in statsmodels, so the day enters as ``K``
sine/cosine pairs of the time of day, regressors of a small ARMA on the residual
("dynamic harmonic regression", Hyndman & Athanasopoulos, FPP3 sec. 10.5): seconds to fit,
and the daily shape is a smooth curve of ``2K`` coefficients instead of 144 free lags.

``fit`` estimates the model; ``update`` appends observations to the state-space filter
with the parameters kept (``results.append(refit=False)``).

Parameters: ``order`` ((2, 0, 1): the ARMA on the residual), ``harmonics`` (4),
``trend`` ("c": a constant; "ct" adds a linear drift), ``log`` (False: model log1p(y),
which turns a daily shape that scales with the level into an additive one).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

from skymesh_controller.planning.forecast.base import Forecaster, clip_demand


def fourier_terms(t: np.ndarray, period: int, harmonics: int) -> np.ndarray:
    """Columns sin(2 pi k t / period), cos(2 pi k t / period) for k = 1..harmonics."""
    t = np.asarray(t, dtype=float)[:, None]
    k = np.arange(1, harmonics + 1)[None, :]
    angle = 2.0 * np.pi * k * t / period
    return np.hstack([np.sin(angle), np.cos(angle)])


class FourierArima(Forecaster):
    name = "arima"

    def __init__(self, period: int, order: Sequence[int] = (2, 0, 1), harmonics: int = 4,
                 trend: str = "c", log: bool = False) -> None:
        super().__init__(period)
        if len(order) != 3 or any(int(o) < 0 for o in order):
            raise ValueError(f"arima: order must be three non-negative integers, got {order!r}")
        if not 0 <= harmonics <= period // 2:
            raise ValueError(f"arima: harmonics must be in 0..{period // 2} for period {period}")
        self.order = tuple(int(o) for o in order)
        self.harmonics = int(harmonics)
        self.trend = trend
        self.log = bool(log)
        self._result: Any = None

    def _exog(self, start: int, n: int) -> np.ndarray | None:
        if self.harmonics == 0:
            return None
        return fourier_terms(np.arange(start, start + n), self.period, self.harmonics)

    def _fwd(self, y: np.ndarray) -> np.ndarray:
        return np.log1p(np.maximum(y, 0.0)) if self.log else y

    def _fit(self) -> None:
        from statsmodels.tsa.statespace.sarimax import SARIMAX

        n = len(self.history)
        if n < max(2 * self.harmonics + sum(self.order) + 2, 8):
            raise ValueError(f"arima: {n} points are too few to fit")
        model = SARIMAX(self._fwd(self.history), exog=self._exog(self.origin, n), order=self.order,
                        trend=self.trend, enforce_stationarity=False,
                        enforce_invertibility=False)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("ignore")  # convergence chatter; the fit is still usable
            self._result = model.fit(disp=False, maxiter=200)

    def _update(self, y_new: np.ndarray) -> None:
        start = self.origin + len(self.history) - len(y_new)
        with warnings.catch_warnings(record=True):
            warnings.simplefilter("ignore")
            self._result = self._result.append(self._fwd(y_new),
                                               exog=self._exog(start, len(y_new)))

    def predict(self, h: int) -> np.ndarray:
        if self._result is None:
            raise RuntimeError("arima: fit before predict")
        start = self.origin + len(self.history)
        pred = np.asarray(self._result.forecast(h, exog=self._exog(start, h)), dtype=float)
        return clip_demand(np.expm1(pred) if self.log else pred)
