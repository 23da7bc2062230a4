"""The planner's series on the controller's ``GET /metrics`` (docs/autopilot.md).

    skymesh_controller_planner_rounds_total{status}                         counter
    skymesh_controller_planner_forecast_error{model,region}                 mean APE, 0.08 = 8%
    skymesh_controller_planner_planned_instances{model,region}              the last plan
    skymesh_controller_planner_actual_instances{model,region}               what runs
    skymesh_controller_planner_actuation_errors_total{model,region}         counter
    skymesh_controller_planner_strategy_actions_total{model,region,direction}  counter
    skymesh_controller_planner_moves_total{outcome}                         counter
    skymesh_controller_planner_last_round_timestamp_seconds
    skymesh_controller_planner_last_round_duration_seconds
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric


@dataclass
class Stats:
    """What /metrics shows, kept as plain numbers (the planner updates them)."""

    rounds: dict[str, int] = field(default_factory=dict)  # by outcome
    forecast_error: dict[tuple[str, str], float] = field(default_factory=dict)
    planned: dict[tuple[str, str], int] = field(default_factory=dict)
    actual: dict[tuple[str, str], int] = field(default_factory=dict)
    actuation_errors: dict[tuple[str, str], int] = field(default_factory=dict)
    strategy_actions: dict[tuple[str, str, str], int] = field(default_factory=dict)
    moves: Counter[str] = field(default_factory=Counter)  # by outcome (moves.py)
    last_round_ts: float = 0.0
    last_round_seconds: float = 0.0


def families(stats: Stats) -> Iterator[Metric]:
    s = stats
    rounds = CounterMetricFamily("skymesh_controller_planner_rounds",
                                 "Planning rounds by status", labels=["status"])
    for status, n in sorted(s.rounds.items()):
        rounds.add_metric([status], n)
    yield rounds
    for name, doc, values in (
            ("forecast_error", "Mean absolute percentage error of the last forecast "
                               "on the windows seen since (0.08 = 8%)", s.forecast_error),
            ("planned_instances", "Instances the last plan counts", s.planned),
            ("actual_instances", "Instances running (the actuator's view)", s.actual)):
        g = GaugeMetricFamily(f"skymesh_controller_planner_{name}", doc,
                              labels=["model", "region"])
        for (m, r), v in sorted(values.items()):
            g.add_metric([m, r], v)
        yield g
    err = CounterMetricFamily("skymesh_controller_planner_actuation_errors",
                              "Keys the actuator failed to apply",
                              labels=["model", "region"])
    for (m, r), n in sorted(s.actuation_errors.items()):
        err.add_metric([m, r], n)
    yield err
    acts = CounterMetricFamily("skymesh_controller_planner_strategy_actions",
                               "Scaling steps of the strategy between rounds",
                               labels=["model", "region", "direction"])
    for (m, r, d), n in sorted(s.strategy_actions.items()):
        acts.add_metric([m, r, d], n)
    yield acts
    moves = CounterMetricFamily("skymesh_controller_planner_moves",
                                "Replica moves (drain, re-register) by outcome",
                                labels=["outcome"])
    for outcome, n in sorted(s.moves.items()):
        moves.add_metric([outcome], n)
    yield moves
    yield GaugeMetricFamily("skymesh_controller_planner_last_round_timestamp_seconds",
                            "When the last round ran", value=s.last_round_ts)
    yield GaugeMetricFamily("skymesh_controller_planner_last_round_duration_seconds",
                            "How long the last round took", value=s.last_round_seconds)
