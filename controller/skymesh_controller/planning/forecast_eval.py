"""Walk-forward evaluation of forecasters, scored by absolute percentage error (APE).

PreServe's protocol (sec. 5.2.1): split the series chronologically (1:1 by default), train
on the first part, then step through the second. At each step the forecaster has seen
every window before ``t`` and predicts ``horizon`` windows ahead; the last of those is
scored against the actual value. Between steps it observes the actual value through its
:class:`~.forecast.RetrainSchedule` (refit every ``retrain_every`` windows,
a cheap update otherwise). ``horizon=1`` scores the next window; ``horizon=2`` is PreServe's
online phase (at the start of window ``i``, predict ``i+1`` through a prediction of ``i``).
``static=True`` is the other reading of "train on one half, test on the other": one
forecast of the whole test half from the training half, nothing observed in between.

APE = |prediction - actual| / actual, as fractions. It is undefined where the actual is
zero (ServeGen's collection gaps, an idle hour of a small service): those windows are left
out of the mean and max and counted in ``n_zero_skipped``; everything else is scored.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import numpy as np

from skymesh_controller.planning.forecast import FORECASTER_NAMES, RetrainSchedule, make_forecaster

# Default retraining: daily for the fitted models (PreServe retrains its mLSTM daily);
# seasonal naive has nothing to fit.
NEVER = 0


def default_retrain_every(name: str, period: int) -> int:
    return NEVER if name == "seasonal-naive" else period


@dataclass
class WalkResult:
    predictions: np.ndarray
    actuals: np.ndarray
    fit_seconds: float
    walk_seconds: float
    refits: int


@dataclass
class Score:
    mean_ape: float
    max_ape: float
    n_scored: int
    n_zero_skipped: int
    extra: dict[str, Any] = field(default_factory=dict)

    def as_json(self) -> dict[str, Any]:
        return {"mean_ape": self.mean_ape, "max_ape": self.max_ape, "n_scored": self.n_scored,
                "n_zero_skipped": self.n_zero_skipped, **self.extra}


def ape_scores(predictions: np.ndarray, actuals: np.ndarray) -> Score:
    pred = np.asarray(predictions, dtype=float)
    act = np.asarray(actuals, dtype=float)
    if pred.shape != act.shape:
        raise ValueError("predictions and actuals differ in length")
    nonzero = act != 0
    if not nonzero.any():
        raise ValueError("every actual value is zero: APE is undefined")
    ape = np.abs(pred[nonzero] - act[nonzero]) / np.abs(act[nonzero])
    return Score(mean_ape=float(ape.mean()), max_ape=float(ape.max()),
                 n_scored=int(nonzero.sum()), n_zero_skipped=int((~nonzero).sum()))


def split_point(n: int, train_frac: float) -> int:
    if not 0.0 < train_frac < 1.0:
        raise ValueError(f"--train-frac must be between 0 and 1, got {train_frac}")
    n_train = round(n * train_frac)
    if n_train < 2 or n - n_train < 1:
        raise ValueError(f"{n} windows split at {train_frac} leave nothing to train or test on")
    return n_train


def walk_forward(schedule: RetrainSchedule, y: np.ndarray, n_train: int, horizon: int = 1,
                 origin: int = 0, tick: Callable[[], None] | None = None,
                 static: bool = False) -> WalkResult:
    """Fit on ``y[:n_train]``, then predict ``y[t + horizon - 1]`` from ``y[:t]`` for each t.

    ``static`` instead forecasts the whole test part in one go from the training part,
    never observing it (``horizon`` is then ignored): the protocol under which a model
    must carry the training days' shape across the rest of the week.
    """
    if horizon < 1:
        raise ValueError(f"--horizon must be at least 1, got {horizon}")
    y = np.asarray(y, dtype=float)
    n = len(y)
    if n_train + horizon > n:
        raise ValueError(f"horizon {horizon} reaches past the {n - n_train} test windows")
    t0 = time.perf_counter()
    schedule.fit(y[:n_train], origin=origin)
    fit_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    if static:
        pred = schedule.predict(n - n_train)
        return WalkResult(predictions=np.asarray(pred, dtype=float), actuals=y[n_train:],
                          fit_seconds=fit_s, walk_seconds=time.perf_counter() - t1, refits=0)
    preds = []
    for t in range(n_train, n - horizon + 1):
        preds.append(float(schedule.predict(horizon)[-1]))
        if t < n - horizon:
            schedule.observe(y[t])
        if tick is not None:
            tick()
    return WalkResult(predictions=np.asarray(preds), actuals=y[n_train + horizon - 1:],
                      fit_seconds=fit_s, walk_seconds=time.perf_counter() - t1,
                      refits=schedule.refits)


def parse_forecasters(text: str | None) -> list[str]:
    if not text:
        return list(FORECASTER_NAMES)
    names = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in names if s not in FORECASTER_NAMES]
    if unknown or not names:
        raise ValueError(f"--forecasters: unknown {', '.join(unknown) or '(empty)'}; "
                         f"choose from {', '.join(FORECASTER_NAMES)}")
    return names


def evaluate(y: np.ndarray, period: int, names: Sequence[str] = FORECASTER_NAMES,
             train_frac: float = 0.5, horizon: int = 1, retrain_every: int | None = None,
             params: dict[str, dict[str, Any]] | None = None, origin: int = 0,
             progress: bool = False, static: bool = False) -> dict[str, Any]:
    """Score each named forecaster on ``y``; returns the ``forecasters`` JSON object."""
    from tqdm import tqdm

    y = np.asarray(y, dtype=float)
    n_train = split_point(len(y), train_frac)
    params = params or {}
    out: dict[str, Any] = {}
    for name in names:
        p = dict(params.get(name, {}))
        if name == "mlstm":
            p.setdefault("progress", progress)
        every = default_retrain_every(name, period) if retrain_every is None else retrain_every
        schedule = RetrainSchedule(make_forecaster(name, period, **p), every=every)
        with tqdm(total=len(y) - n_train - horizon + 1, desc=f"walk {name}", unit="win",
                  leave=False, disable=not progress) as bar:
            res = walk_forward(schedule, y, n_train, horizon, origin=origin,
                               tick=partial(bar.update, 1), static=static)
        score = ape_scores(res.predictions, res.actuals)
        score.extra = {"fit_seconds": round(res.fit_seconds, 3),
                       "walk_seconds": round(res.walk_seconds, 3),
                       "retrain_every": every, "refits": res.refits,
                       "params": {k: v for k, v in p.items() if k != "progress"}}
        out[name] = score.as_json()
    return out


def format_table(forecasters: dict[str, Any]) -> str:
    head = (f"{'forecaster':<16}{'mean APE':>10}{'max APE':>10}{'fit s':>9}{'walk s':>9}"
            f"{'refits':>8}")
    rows = [head, "-" * len(head)]
    for name, s in forecasters.items():
        rows.append(f"{name:<16}{s['mean_ape'] * 100:>9.2f}%{s['max_ape'] * 100:>9.2f}%"
                    f"{s['fit_seconds']:>9.2f}{s['walk_seconds']:>9.2f}{s['refits']:>8}")
    return "\n".join(rows)
