"""Statistical forecasters, the registry and the retraining schedule."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from skymesh_controller.planning.forecast import (
    FORECASTER_NAMES,
    Forecaster,
    RetrainSchedule,
    SeasonalNaive,
    make_forecaster,
)
from skymesh_controller.planning.forecast.arima import FourierArima, fourier_terms
from skymesh_controller.planning.forecast_eval import ape_scores, walk_forward

PERIOD = 24


def seasonal_series(days: int, seed: int = 0) -> np.ndarray:
    """Hourly demand: level 100, a slow upward trend, a daily wave and noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(days * PERIOD)
    return (100 + 0.2 * t + 30 * np.sin(2 * np.pi * t / PERIOD)
            + 10 * np.cos(4 * np.pi * t / PERIOD) + rng.normal(0, 3, len(t)))


@pytest.mark.parametrize("name", ["seasonal-naive", "ets", "arima"])
def test_beats_the_training_mean_on_a_seasonal_series(name: str) -> None:
    y = seasonal_series(8)
    n_train = 6 * PERIOD
    res = walk_forward(RetrainSchedule(make_forecaster(name, PERIOD), every=0), y, n_train)
    ours = ape_scores(res.predictions, res.actuals).mean_ape
    baseline = ape_scores(np.full(len(res.actuals), y[:n_train].mean()), res.actuals).mean_ape
    # The mean baseline is about 25% off; the trend alone makes seasonal naive ~5% off.
    assert ours < 0.4 * baseline, (ours, baseline)
    if name != "seasonal-naive":
        assert ours < 0.04


def test_fourier_arima_recovers_a_known_daily_pattern() -> None:
    rng = np.random.default_rng(1)
    t = np.arange(6 * PERIOD)
    shape = 40 * np.sin(2 * np.pi * t / PERIOD + 0.7) + 15 * np.cos(6 * np.pi * t / PERIOD)
    y = 200 + shape + rng.normal(0, 1, len(t))
    # The model is told the first point is 5 windows into the day: forecasts must follow
    # the same clock.
    f = FourierArima(PERIOD, order=(1, 0, 0), harmonics=3).fit(y[5:], origin=5)
    ahead = np.arange(len(t), len(t) + PERIOD)
    truth = 200 + 40 * np.sin(2 * np.pi * ahead / PERIOD + 0.7) \
        + 15 * np.cos(6 * np.pi * ahead / PERIOD)
    assert np.abs(f.predict(PERIOD) - truth).max() < 3.0
    # After appending a day, the forecast has moved on by a day and still fits.
    f.update(truth)
    assert np.abs(f.predict(PERIOD) - truth).max() < 3.0


def test_fourier_terms() -> None:
    x = fourier_terms(np.array([0, 6, 12]), PERIOD, 2)
    assert x.shape == (3, 4)
    np.testing.assert_allclose(x[1], [1.0, 0.0, 0.0, -1.0], atol=1e-12)  # a quarter day


def test_ets_update_matches_a_fresh_filter_with_the_same_parameters() -> None:
    y = seasonal_series(6)
    f = make_forecaster("ets", PERIOD).fit(y[:96])
    before = f.predict(1)[0]
    f.update(y[96:120])
    after = f.predict(PERIOD)
    assert len(after) == PERIOD and np.all(after >= 0)
    assert after[0] != before
    assert abs(after[0] - y[120]) / y[120] < 0.1


def test_seasonal_naive_repeats_the_last_period() -> None:
    f = SeasonalNaive(3).fit(np.array([1.0, 2, 3, 4, 5, 6]))
    assert f.predict(7).tolist() == [4, 5, 6, 4, 5, 6, 4]
    with pytest.raises(ValueError, match="at least one period"):
        SeasonalNaive(4).fit(np.array([1.0, 2]))


def test_registry_builds_every_name_and_rejects_unknowns() -> None:
    assert FORECASTER_NAMES == ("seasonal-naive", "ets", "arima", "mlstm")
    for name in FORECASTER_NAMES:
        f = make_forecaster(name, 144)
        assert isinstance(f, Forecaster) and f.name == name and f.period == 144
    assert make_forecaster("arima", 24, harmonics=2).harmonics == 2  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="unknown forecaster 'prophet'"):
        make_forecaster("prophet", 24)
    with pytest.raises(ValueError, match="no parameter bogus"):
        make_forecaster("ets", 24, bogus=1)
    with pytest.raises(ValueError, match="harmonics"):
        make_forecaster("arima", 24, harmonics=13)


def test_importing_the_forecasters_does_not_load_torch() -> None:
    code = ("import sys, skymesh_controller.planning.forecast as f; "
            "f.make_forecaster('mlstm', 24); "
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


class _Spy(Forecaster):
    name = "spy"

    def __init__(self, period: int) -> None:
        super().__init__(period)
        self.fits: list[tuple[int, int]] = []
        self.updates = 0

    def _fit(self) -> None:
        self.fits.append((len(self.history), self.origin))

    def _update(self, y_new: np.ndarray) -> None:
        self.updates += len(y_new)

    def predict(self, h: int) -> np.ndarray:
        return np.full(h, self.history[-1])


def test_retrain_schedule_refits_every_n_windows_and_keeps_the_clock() -> None:
    spy = _Spy(4)
    sched = RetrainSchedule(spy, every=3, max_history=10).fit(np.arange(12.0), origin=100)
    # The first fit keeps the last 10 points, which start 2 windows after the origin.
    assert spy.fits == [(10, 102)]
    refitted = [sched.observe(v) for v in (12.0, 13.0, 14.0, 15.0, 16.0, 17.0, 18.0)]
    assert refitted == [False, False, True, False, False, True, False]
    assert sched.refits == 2 and spy.updates == 5
    # Second refit: 12 + 6 points seen, the last 10 kept, the first at window 100 + 8.
    assert spy.fits[-1] == (10, 108)
    assert spy.history[-1] == 18.0
    never = RetrainSchedule(_Spy(4), every=0).fit(np.arange(5.0))
    assert not any(never.observe(v) for v in range(20))
    with pytest.raises(ValueError):
        RetrainSchedule(_Spy(4), every=-1)
