"""The planner's pure parts: token-rate series from telemetry, forecasts and their error,
one round's plan and diff, and the cooldowns, all on hand-made samples and a fake clock."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_controller.autopilot.config import CooldownConfig, PlannerConfig
from skymesh_controller.autopilot.decide import ForecastBook, decide, token_rates
from skymesh_controller.autopilot.guard import Cooldowns
from skymesh_controller.config import ConfigError, parse_config

W = 60  # window, seconds


def sample(ts: float, region: str, tokens: int, model: str = "llama") -> dict[str, Any]:
    return {"ts": ts, "region": region, "window_s": W,
            "models": {model: {"requests": 1, "prompt_tokens": tokens, "output_tokens": 0}}}


def steady(region: str, tps: float, windows: int, t0: float = 0.0) -> list[dict[str, Any]]:
    return [sample(t0 + i * W + 1, region, int(tps * W)) for i in range(windows)]


def cfg(**over: Any) -> PlannerConfig:
    base: dict[str, Any] = {"capacity": {"llama": {"L4": 100.0}},
                            "schedule": {"window_s": W, "horizon": 3},
                            "forecaster": {"headroom": 0.0}, "epsilon": 1.0}
    base.update(over)
    return PlannerConfig.model_validate(base)


def test_token_rates_pads_quiet_windows_and_leaves_out_the_one_still_filling() -> None:
    samples = [sample(1, "us", 600), sample(61, "us", 1200), sample(185, "us", 60)]
    # now = 250: windows 0..3 complete, window 4 (240..300) still filling.
    series = token_rates(samples, [("llama", "us"), ("llama", "eu")], W, now=250)
    us = series["llama", "us"]
    assert us.start_slot == 0
    assert list(us.values) == [10.0, 20.0, 0.0, 1.0]
    assert ("llama", "eu") not in series  # no report from eu at all


def test_a_round_with_too_little_telemetry_is_skipped_not_scaled_to_the_minimum() -> None:
    c = cfg()
    d = decide(c, ForecastBook(c), now=2 * W + 5, samples=steady("us", 0, 2), regions=["us"],
               current={("llama", "us", "L4"): 5})
    assert d.plan is None and d.changes == []
    assert d.skipped is not None and "needs 3" in d.skipped


def test_plan_follows_demand_per_region_within_bounds() -> None:
    c = cfg(bounds={"llama": {"*": {"min": 1, "max": 10}, "eu": {"min": 0, "max": 2}}})
    samples = steady("us", 450, 10) + steady("eu", 150, 10)
    now = {("llama", "us", "L4"): 1, ("llama", "eu", "L4"): 3}
    d = decide(c, ForecastBook(c), now=10 * W + 5, samples=samples, regions=["us", "eu"],
               current=now)
    assert d.plan is not None and d.skipped is None
    # epsilon 1: each region covers its own forecast with instances of 100 tokens/s.
    assert (d.plan.count("llama", "us"), d.plan.count("llama", "eu")) == (5, 2)
    assert {(k[1], b, a) for k, b, a in d.changes} == {("eu", 3, 2), ("us", 1, 5)}
    # A bound the demand cannot fit in: planned at the bound (not left where it is while
    # the load outgrows it), and the note names the region and what was cut.
    tight = cfg(bounds={"llama": {"us": {"max": 3}}})
    d = decide(tight, ForecastBook(tight), now=10 * W + 5, samples=samples,
               regions=["us", "eu"], current=now)
    assert d.plan is not None and d.skipped is None
    assert (d.plan.count("llama", "us"), d.plan.count("llama", "eu")) == (3, 2)
    assert d.note is not None and "llama/us: 450 -> 300" in d.note
    # A model bound over all regions cuts them alike.
    capped = cfg(bounds={"llama": {"*": {"max": 10}}})
    d = decide(capped, ForecastBook(capped), now=10 * W + 5, samples=samples,
               regions=["us", "eu"], current=now, model_limits={"llama": (0, 4)})
    assert d.plan is not None and d.plan.count("llama", "us") + d.plan.count("llama", "eu") <= 4
    assert d.note is not None and "over its regions" in d.note


def test_a_region_without_telemetry_keeps_its_count_and_is_not_counted_on() -> None:
    c = cfg(epsilon=0.5)
    d = decide(c, ForecastBook(c), now=10 * W + 5, samples=steady("us", 800, 10),
               regions=["us", "asia"],
               current={("llama", "us", "L4"): 2, ("llama", "asia", "L4"): 3})
    assert d.plan is not None
    assert d.plan.count("llama", "asia") == 3  # pinned, not moved
    assert d.plan.count("llama", "us") >= 8  # the global demand is met without asia
    assert all(k[1] != "asia" for k, _, _ in d.changes)
    assert d.kept == [(("llama", "asia"), "no telemetry from this region in 2 windows")]


def test_a_region_gone_silent_is_left_alone_rather_than_read_as_no_demand() -> None:
    c = cfg()
    samples = steady("us", 800, 10) + steady("eu", 300, 10)
    now = {("llama", "us", "L4"): 8, ("llama", "eu", "L4"): 3}
    # Ten minutes on, only us still reports (eu's balancer lost its controller link).
    samples += steady("us", 800, 10, t0=10 * W)
    d = decide(c, ForecastBook(c), now=20 * W + 5, samples=samples, regions=["us", "eu"],
               current=now)
    assert d.plan is not None and d.changes == []
    assert [p for p, _ in d.kept] == [("llama", "eu")]
    assert d.plan.count("llama", "eu") == 3


def test_forecast_error_is_measured_on_the_windows_seen_since_the_last_round() -> None:
    c = cfg()
    book = ForecastBook(c)
    first = decide(c, book, now=10 * W + 5, samples=steady("us", 400, 10), regions=["us"],
                   current={})
    fc = first.forecasts["llama", "us"]
    assert fc.values == [400.0] * 3 and fc.error is None
    assert fc.used.startswith("persistence")  # minutes of history: no daily season yet
    # Two more windows at 300 tokens/s: the persistence forecast of 400 was 1/3 off.
    later = steady("us", 400, 10) + steady("us", 300, 2, t0=10 * W)
    second = decide(c, book, now=12 * W + 5, samples=later, regions=["us"], current={})
    assert second.forecasts["llama", "us"].error == pytest.approx(1 / 3)
    assert second.forecasts["llama", "us"].values == [300.0] * 3


def test_the_configured_forecaster_runs_once_two_days_are_seen() -> None:
    hour = 3600
    c = cfg(schedule={"window_s": hour, "horizon": 2},
            forecaster={"name": "seasonal-naive", "headroom": 0.0})
    # A daily curve: hour h of each day carries 100 * (h + 1) tokens/s.
    samples = [{"ts": i * hour + 1, "region": "us", "window_s": hour,
                "models": {"llama": {"prompt_tokens": 100 * (i % 24 + 1) * hour}}}
               for i in range(49)]
    d = decide(c, ForecastBook(c), now=49 * hour + 5, samples=samples, regions=["us"],
               current={})
    fc = d.forecasts["llama", "us"]
    assert fc.used == "seasonal-naive"
    assert fc.values == [200.0, 300.0]  # hours 1 and 2 of the third day


def test_cooldowns_hold_reversals_and_back_off_retries() -> None:
    g = Cooldowns(CooldownConfig(retry_s=10, retry_max_s=25, max_attempts=3, hold_s=100))
    k = ("llama", "us", "L4")
    g.changed(k, 2, 4, now=0)
    assert g.admit(k, 4, 6, now=5) is None  # the same direction: a rising peak
    assert "hold" in (g.admit(k, 4, 3, now=50) or "")
    assert g.admit(k, 4, 3, now=100) is None
    assert g.failed(k, now=200)  # attempt 1: retry at 210
    assert g.due(205) == [] and g.due(210) == [k]
    assert "retry cooldown" in (g.admit(k, 4, 5, now=205) or "")
    assert g.failed(k, now=210)  # attempt 2: 20 s later
    assert g.retry_at(k) == 230
    assert not g.failed(k, now=230)  # attempt 3 is the last: no more retries
    assert g.due(10_000) == []
    g.changed(k, 4, 5, now=300)
    assert g.retry_at(k) is None


@pytest.mark.parametrize("planner, message", [
    ({"capacity": {"llama": {"L4": 100}}, "strategy": "yolo"}, "unknown strategy 'yolo'"),
    ({"capacity": {"llama": {"L4": 0}}}, "llama.L4: tokens/s must be positive"),
    ({"capacity": {"llama": {"L4": 1}}, "bounds": {"qwen": {}}}, "'qwen' is not a model"),
    ({"capacity": {"llama": {"L4": 1}}, "forecaster": {"name": "arima", "params": {"x": 1}}},
     "has no parameter x"),
    ({"capacity": {"llama": {"L4": 1}}, "bounds": {"llama": {"us": {"min": 3, "max": 1}}}},
     "max must be at least min"),
    ({"capacity": {"llama": {"L4": 1}}, "mode": "yes"}, "planner.mode"),
    ({}, "planner.capacity"),
])
def test_bad_planner_config_names_the_culprit(planner: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match="planner") as err:
        parse_config({"planner": planner})
    assert message in str(err.value)


def test_the_planner_is_off_unless_configured() -> None:
    assert parse_config({}).planner is None
    on = parse_config({"planner": {"capacity": {"llama": {"L4": 1}}}}).planner
    assert on is not None and on.mode == "dry-run" and on.actuator.kind == "none"


def test_a_planner_without_its_extras_fails_at_config_load(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import skymesh.util.extras as extras

    monkeypatch.setattr(extras, "missing", lambda extra: ["torch"] if extra == "forecast"
                        else [])
    parse_config({"planner": {"capacity": {"llama": {"L4": 1}}}})  # no torch needed
    with pytest.raises(ConfigError, match=r"skymesh-controller\[forecast\]"):
        parse_config({"planner": {"capacity": {"llama": {"L4": 1}},
                                  "forecaster": {"name": "mlstm"}}})
