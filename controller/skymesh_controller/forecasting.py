"""Forecast versus actual for the dashboard and operators: demand per (model, region).

Walk-forward one-step forecasts over the telemetry the controller holds (so the two lines
can be compared window by window), then ``horizon`` windows ahead. The forecasters are the
planning ones; the daily period follows from the window. With less than two days of
history no seasonal model can be fitted, and the answer says it used persistence (next
window = this window) instead of pretending otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

DAY_S = 86_400
FORECASTERS = ("seasonal-naive", "ets", "arima")


def walk_forward(values: Sequence[float], start: int, window_s: int, forecaster: str,
                 horizon: int) -> tuple[list[dict[str, Any]], str]:
    """Points ``{"ts", "forecast", "actual"}`` and the name of the model actually used."""
    from skymesh_controller.planning.forecast.registry import make_forecaster

    y = np.asarray(values, dtype=float)
    period = max(1, DAY_S // window_s)
    used = forecaster
    if len(y) < 2 * period + 1:
        period, used = 1, "persistence (under two days of history)"
        forecaster = "seasonal-naive"
    warm = max(period, len(y) // 2) if len(y) > 1 else len(y)
    points: list[dict[str, Any]] = [{"ts": start + i * window_s, "forecast": None,
                                     "actual": float(v)} for i, v in enumerate(y)]
    if warm == 0:
        return points, used
    try:
        ahead = _run(make_forecaster(forecaster, period), y, warm, horizon, points)
    except (ValueError, np.linalg.LinAlgError) as exc:
        # Statistical fits can fail on degenerate demand (all zeros, constant): answer
        # with the plainest model rather than an error, and say so.
        used = f"persistence ({forecaster} failed: {exc})"[:200]
        ahead = _run(make_forecaster("seasonal-naive", 1), y, warm, horizon, points)
    points += [{"ts": start + (len(y) + k) * window_s, "forecast": float(v), "actual": None}
               for k, v in enumerate(ahead)]
    return points, used


def _run(model: Any, y: np.ndarray, warm: int, horizon: int, points: list[dict[str, Any]]
         ) -> np.ndarray:
    model.fit(y[:warm])
    for i in range(warm, len(y)):
        points[i]["forecast"] = float(model.predict(1)[0])
        model.update(y[i:i + 1])
    return model.predict(horizon) if horizon > 0 else np.zeros(0)
