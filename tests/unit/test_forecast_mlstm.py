"""The mLSTM forecaster: Krause's cell, determinism under a seed, learning a daily cycle."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skymesh_controller.planning.forecast import RetrainSchedule, make_forecaster
from skymesh_controller.planning.forecast.mlstm import MLSTMForecaster, build_mlstm
from skymesh_controller.planning.forecast_eval import ape_scores, walk_forward

PERIOD = 12
# Small enough to train in about a second: the point is that it learns, not how well.
TINY = {"lookback": 12, "hidden": 8, "epochs": 40, "refit_epochs": 5, "lr": 0.01,
        "progress": False}


def small_series(periods: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(periods * PERIOD)
    return 100 + 40 * np.sin(2 * np.pi * t / PERIOD) + rng.normal(0, 2, len(t))


def test_the_cell_is_multiplicative_in_input_and_state() -> None:
    torch.manual_seed(0)
    net = build_mlstm(input_size=1, hidden=4, residual=False)
    cell = net.cell
    x = torch.tensor([[0.5]])
    h = torch.ones(1, 4)
    c = torch.zeros(1, 4)
    # m = (W_mx x) * (W_mh h): zero input or zero state zeroes the intermediate state,
    # so with no biases on those maps the recurrent path vanishes.
    assert torch.all(cell.mx(torch.zeros(1, 1)) * cell.mh(h) == 0)
    h2, c2 = cell(x, h, c)
    assert h2.shape == (1, 4) and c2.shape == (1, 4)
    assert net(torch.zeros(3, 5, 1)).shape == (3,)


def test_same_seed_same_forecast_other_seed_differs() -> None:
    y = small_series(6)
    a = make_forecaster("mlstm", PERIOD, seed=7, **TINY).fit(y)
    b = make_forecaster("mlstm", PERIOD, seed=7, **TINY).fit(y)
    c = make_forecaster("mlstm", PERIOD, seed=8, **TINY).fit(y)
    np.testing.assert_array_equal(a.predict(4), b.predict(4))
    assert not np.array_equal(a.predict(4), c.predict(4))


def test_learns_a_small_seasonal_series() -> None:
    y = small_series(10)
    n_train = 8 * PERIOD
    sched = RetrainSchedule(make_forecaster("mlstm", PERIOD, **TINY), every=PERIOD)
    res = walk_forward(sched, y, n_train, horizon=2)
    ours = ape_scores(res.predictions, res.actuals).mean_ape
    baseline = ape_scores(np.full(len(res.actuals), y[:n_train].mean()), res.actuals).mean_ape
    assert res.refits == 1
    assert ours < 0.4 * baseline, (ours, baseline)


def test_two_steps_ahead_is_the_recursion_through_its_own_prediction() -> None:
    y = small_series(5)
    f = MLSTMForecaster(PERIOD, **TINY).fit(y)
    two = f.predict(2)
    one = f.predict(1)
    assert two[0] == pytest.approx(one[0])
    # Feeding the first prediction back as if observed gives the second (PreServe Alg. 2).
    f.update(one)
    assert f.predict(1)[0] == pytest.approx(two[1], rel=1e-5)


def test_rejects_bad_parameters_and_short_history() -> None:
    with pytest.raises(ValueError, match="lookback"):
        MLSTMForecaster(PERIOD, lookback=0)
    with pytest.raises(ValueError, match="needs more than"):
        MLSTMForecaster(PERIOD, **TINY).fit(np.arange(10.0))
    with pytest.raises(RuntimeError, match="fit before predict"):
        MLSTMForecaster(PERIOD).predict(1)
