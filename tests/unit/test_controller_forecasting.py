"""Forecast versus actual from telemetry windows."""

from __future__ import annotations

import numpy as np

from skymesh_controller.forecasting import walk_forward

HOUR = 3600


def daily(days: int, noise: float = 0.0) -> np.ndarray:
    t = np.arange(days * 24)
    rng = np.random.default_rng(0)
    return 100 + 50 * np.sin(2 * np.pi * t / 24) + rng.normal(0, noise, len(t))


def test_seasonal_forecast_tracks_a_daily_cycle_and_looks_ahead() -> None:
    y = daily(4)
    points, used = walk_forward(y, start=0, window_s=HOUR, forecaster="seasonal-naive",
                                horizon=6)
    assert used == "seasonal-naive"
    scored = [p for p in points if p["forecast"] is not None and p["actual"] is not None]
    assert len(scored) == len(y) // 2  # the first half trains, the second is scored
    assert max(abs(p["forecast"] - p["actual"]) for p in scored) < 1e-6
    ahead = points[len(y):]
    assert [p["ts"] for p in ahead] == [(len(y) + k) * HOUR for k in range(6)]
    assert all(p["actual"] is None for p in ahead)
    assert np.allclose([p["forecast"] for p in ahead], y[:6])  # tomorrow = today


def test_ets_beats_persistence_on_a_noisy_cycle() -> None:
    y = daily(6, noise=3.0)
    ets, _ = walk_forward(y, 0, HOUR, "ets", 0)
    err = np.mean([abs(p["forecast"] - p["actual"]) for p in ets if p["forecast"] is not None])
    persistence = np.mean(np.abs(np.diff(y[len(y) // 2 - 1:])))
    assert err < 0.5 * persistence


def test_short_history_says_it_used_persistence() -> None:
    points, used = walk_forward([5, 7, 9, 11], start=600, window_s=600,
                                forecaster="arima", horizon=2)
    assert used.startswith("persistence")
    assert [p["forecast"] for p in points[2:4]] == [7.0, 9.0]
    assert [p["forecast"] for p in points[4:]] == [11.0, 11.0]
    assert walk_forward([], 0, 600, "ets", 3) == ([], "persistence (under two days of "
                                                       "history)")


def test_a_failing_fit_falls_back_and_says_so() -> None:
    y = np.zeros(24 * 3)  # ETS cannot fit an all-zero series with a multiplicative part
    points, used = walk_forward(y, 0, HOUR, "ets", 2)
    assert all(p["forecast"] == 0 for p in points if p["forecast"] is not None)
    assert used == "ets" or used.startswith("persistence (ets failed")
