"""Forecasters by name: the one constructor the CLI, the evaluator and the planner use.

``make_forecaster("arima", period=24, harmonics=3)`` builds a fresh, unfitted forecaster;
an unknown name or parameter fails with a ValueError naming it and what is accepted.
"""

from __future__ import annotations

import inspect
from typing import Any

from skymesh_controller.planning.forecast.arima import FourierArima
from skymesh_controller.planning.forecast.base import Forecaster, SeasonalNaive
from skymesh_controller.planning.forecast.ets import HoltWinters

FORECASTER_NAMES = ("seasonal-naive", "ets", "arima", "mlstm")


def _classes() -> dict[str, type[Forecaster]]:
    # mlstm's module imports torch lazily, so importing the class here is free.
    from skymesh_controller.planning.forecast.mlstm import MLSTMForecaster

    return {"seasonal-naive": SeasonalNaive, "ets": HoltWinters, "arima": FourierArima,
            "mlstm": MLSTMForecaster}


def forecaster_params(name: str) -> dict[str, Any]:
    """The parameters ``name`` accepts beyond ``period``, with their defaults."""
    cls = _class(name)
    sig = inspect.signature(cls.__init__)
    return {p.name: p.default for p in sig.parameters.values()
            if p.name not in ("self", "period")}


def _class(name: str) -> type[Forecaster]:
    classes = _classes()
    if name not in classes:
        raise ValueError(f"unknown forecaster {name!r}; one of {', '.join(FORECASTER_NAMES)}")
    return classes[name]


def make_forecaster(name: str, period: int, **params: Any) -> Forecaster:
    cls = _class(name)
    accepted = forecaster_params(name)
    unknown = sorted(set(params) - set(accepted))
    if unknown:
        raise ValueError(f"forecaster {name!r} has no parameter {', '.join(unknown)}; "
                         f"it takes {', '.join(accepted) or 'none'}")
    return cls(period, **params)
