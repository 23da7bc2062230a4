"""Demand forecasters behind one interface (see :mod:`skymesh_controller.planning.forecast.base`).

Build them by name with :func:`make_forecaster`; torch is loaded only when an mLSTM fits.
"""

from skymesh_controller.planning.forecast.base import Forecaster, SeasonalNaive, clip_demand
from skymesh_controller.planning.forecast.registry import (
    FORECASTER_NAMES,
    forecaster_params,
    make_forecaster,
)
from skymesh_controller.planning.forecast.schedule import RetrainSchedule

__all__ = ["FORECASTER_NAMES", "Forecaster", "RetrainSchedule", "SeasonalNaive",
           "clip_demand", "forecaster_params", "make_forecaster"]
