"""Walk-forward evaluation: APE with zeros, no look-ahead, horizons, input checks."""

from __future__ import annotations

import numpy as np
import pytest

from skymesh_controller.planning.forecast import Forecaster, RetrainSchedule, SeasonalNaive
from skymesh_controller.planning.forecast_eval import (
    ape_scores,
    evaluate,
    format_table,
    parse_forecasters,
    split_point,
    walk_forward,
)


def test_ape_skips_zero_actuals_and_counts_them() -> None:
    s = ape_scores(np.array([110.0, 80.0, 5.0]), np.array([100.0, 100.0, 0.0]))
    assert s.mean_ape == pytest.approx(0.15) and s.max_ape == pytest.approx(0.2)
    assert (s.n_scored, s.n_zero_skipped) == (2, 1)
    with pytest.raises(ValueError, match="undefined"):
        ape_scores(np.array([1.0]), np.array([0.0]))


class _LastSeen(Forecaster):
    """Predicts the last observed value and records how much history each call saw."""

    name = "last"

    def __init__(self) -> None:
        super().__init__(1)
        self.seen: list[int] = []

    def _fit(self) -> None:
        pass

    def predict(self, h: int) -> np.ndarray:
        self.seen.append(len(self.history))
        return np.full(h, self.history[-1])


@pytest.mark.parametrize("horizon", [1, 2, 3])
def test_walk_forward_never_sees_the_value_it_predicts(horizon: int) -> None:
    y = np.arange(1.0, 21.0)
    f = _LastSeen()
    res = walk_forward(RetrainSchedule(f, every=0), y, n_train=10, horizon=horizon)
    assert len(res.actuals) == len(res.predictions) == 11 - horizon
    assert res.actuals[0] == y[10 + horizon - 1]
    # The forecast for y[j] used y[:j - horizon + 1] only: on a ramp it is `horizon` short.
    np.testing.assert_allclose(res.actuals - res.predictions, horizon)
    assert f.seen == list(range(10, 21 - horizon))


def test_seasonal_naive_is_exact_on_a_periodic_series_at_any_horizon() -> None:
    y = np.tile([5.0, 9.0, 2.0, 7.0], 6)
    for h in (1, 2, 4):
        res = walk_forward(RetrainSchedule(SeasonalNaive(4), every=0), y, 8, horizon=h)
        assert ape_scores(res.predictions, res.actuals).max_ape == 0.0


def test_evaluate_reports_each_forecaster() -> None:
    y = np.tile([5.0, 9.0, 2.0, 7.0], 6) + np.arange(24) * 0.01
    out = evaluate(y, 4, ["seasonal-naive"], train_frac=0.5, horizon=2)
    s = out["seasonal-naive"]
    assert s["n_scored"] == 11 and s["retrain_every"] == 0
    assert 0 < s["mean_ape"] <= s["max_ape"] < 0.1
    assert "seasonal-naive" in format_table(out)


def test_input_checks() -> None:
    assert split_point(100, 0.5) == 50
    for frac in (0.0, 1.0, 1.5):
        with pytest.raises(ValueError, match="train-frac"):
            split_point(100, frac)
    assert parse_forecasters(None) == ["seasonal-naive", "ets", "arima", "mlstm"]
    assert parse_forecasters("arima, ets") == ["arima", "ets"]
    with pytest.raises(ValueError, match="unknown prophet"):
        parse_forecasters("arima,prophet")
    with pytest.raises(ValueError, match="horizon"):
        walk_forward(RetrainSchedule(SeasonalNaive(2), every=0), np.ones(10), 5, horizon=0)


def test_static_forecasts_the_whole_test_part_without_observing_it() -> None:
    y = np.arange(1.0, 21.0)
    f = _LastSeen()
    res = walk_forward(RetrainSchedule(f, every=0), y, n_train=10, static=True)
    assert f.seen == [10]
    assert res.predictions.tolist() == [10.0] * 10
    np.testing.assert_array_equal(res.actuals, y[10:])
