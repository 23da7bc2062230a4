"""Per-model target utilisation in the capacity week (``target_miss``): the derivation from
a model's latency profile, and the plan-driven strategies using it."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from skymesh_controller.planning.strategies import Observation, make_strategy
from skymesh_lab.planning import capacity_week
from skymesh_lab.planning.capacity_week import (
    TARGET_BOUNDS,
    WeekConfig,
    miss_curve,
    model_targets,
    run,
    slo_utilisation,
    target_utilisation,
)

BUDGETS = (0.001, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.2, 0.4)


def test_target_rises_with_the_budget_and_keeps_misses_within_it() -> None:
    miss = miss_curve(slo_s=10.0, t0_s=1.0)
    targets = [target_utilisation(miss, p) for p in BUDGETS]
    assert targets == sorted(targets)
    inside = [u for u in targets if TARGET_BOUNDS[0] < u < TARGET_BOUNDS[1]]
    assert len(set(inside)) == len(inside) >= 5  # strictly rising between the bounds
    for p, u in zip(BUDGETS, targets, strict=True):
        if TARGET_BOUNDS[0] < u < TARGET_BOUNDS[1]:
            assert miss(u) <= p < miss(u + 1e-6)


def test_the_default_budget_gives_the_planners_one_utilisation() -> None:
    # 5% misses is the SLO quantile the single rho* is defined by.
    u = target_utilisation(miss_curve(10.0, 1.0), 0.05)
    assert u == pytest.approx(slo_utilisation(10.0), abs=1e-6)


def test_a_steeper_model_gets_a_lower_target() -> None:
    flat = miss_curve(slo_s=10.0, t0_s=1.0)
    tighter = miss_curve(slo_s=6.0, t0_s=1.0)  # a tighter SLO relative to its prefill
    waits = miss_curve(slo_s=10.0, t0_s=1.0, wait_s=2.0)  # a fixed delay before prefill
    for p in (0.01, 0.02, 0.05):
        assert target_utilisation(tighter, p) < target_utilisation(flat, p)
        assert target_utilisation(waits, p) < target_utilisation(flat, p)

    # Any rising curve: the one that rises faster is under the budget for less.
    def linear(slope: float) -> Any:
        return lambda rho: min(1.0, slope * rho)

    assert target_utilisation(linear(0.2), 0.05) < target_utilisation(linear(0.1), 0.05)
    assert target_utilisation(linear(0.1), 0.05) == pytest.approx(0.5, abs=1e-9)


def test_target_stays_within_its_bounds() -> None:
    miss = miss_curve(10.0, 1.0)
    assert target_utilisation(miss, 1e-9) == TARGET_BOUNDS[0]  # even nearly idle misses more
    assert target_utilisation(miss, 0.9) == TARGET_BOUNDS[1]  # never plan past 95%
    assert target_utilisation(lambda rho: 0.0, 0.01, bounds=(0.2, 0.8)) == 0.8
    assert target_utilisation(lambda rho: 1.0, 0.01, bounds=(0.2, 0.8)) == 0.2
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValueError, match="budget"):
            target_utilisation(miss, bad)
    with pytest.raises(ValueError, match="bounds"):
        target_utilisation(miss, 0.05, bounds=(0.6, 0.4))


def test_miss_curve_is_the_weeks_scoring_function() -> None:
    miss = miss_curve(slo_s=10.0, t0_s=1.0)
    for rho in (0.0, 0.3, 0.5, 0.7, 0.9):
        ok = capacity_week.attainment(10.0, np.zeros(1), np.array([1.0 / (1 - rho)]))[0]
        assert miss(rho) == pytest.approx(1 - ok)
    assert miss(1.0) == 1.0
    values = [miss(r) for r in np.linspace(0, 0.99, 50)]
    assert values == sorted(values)


def test_week_models_targets_come_from_their_own_profiles() -> None:
    from skymesh_lab.planning.capacity import profile_capacity

    caps = {m: profile_capacity(p) for m, (p, _) in capacity_week.MODELS.items()}
    assert model_targets(WeekConfig(), caps) is None
    loose, tight = (model_targets(WeekConfig(target_miss=p), caps) for p in (0.05, 0.02))
    assert loose is not None and tight is not None
    for m, c in caps.items():
        t0 = c.prompt_len / c.mu_p
        assert tight[m] == target_utilisation(miss_curve(10 * t0, t0), 0.02)
        assert tight[m] < loose[m]
    # Here every model's SLO is 10x its own idle prefill time and prompts spread alike,
    # so the three profiles coincide and so do their targets.
    assert max(tight.values()) - min(tight.values()) < 1e-6


def test_config_takes_and_checks_the_budget() -> None:
    assert capacity_week.parse_week_params(["target_miss=0.02"]) == {"target_miss": 0.02}
    for bad in (0.0, 0.5, -1.0):
        with pytest.raises(ValueError, match="target_miss"):
            WeekConfig(target_miss=bad)


def test_lt_u_scales_on_the_endpoints_own_thresholds_and_reactive_does_not() -> None:
    def obs(util: float, **kw: Any) -> Observation:
        return Observation(now=100.0, utilisation=util, load_tps=1.0, ready=2, target=4, **kw)

    lt_u = make_strategy("lt-u")
    assert lt_u.decide("a", obs(0.6)).delta == 0  # under 70%
    assert lt_u.decide("b", obs(0.6, scale_out_utilisation=0.5)).delta == 1
    above = Observation(now=100.0, utilisation=0.25, load_tps=1.0, ready=5, target=4,
                        scale_out_utilisation=0.5, scale_in_utilisation=0.2)
    assert lt_u.decide("c", above).delta == 0  # 25% is over its own 20% scale-in
    reactive = make_strategy("reactive")
    assert reactive.decide("d", obs(0.6, scale_out_utilisation=0.5)).delta == 0
    assert reactive.decide("e", obs(0.75, scale_out_utilisation=0.9)).delta == 1


@pytest.mark.parametrize("target_miss", [None, 0.02])
def test_planner_and_thresholds_use_each_models_target(monkeypatch: pytest.MonkeyPatch,
                                                       target_miss: float | None) -> None:
    # Distinct per-model targets, so that mixing models up would show.
    fake = {"m-large": 0.40, "m-mid": 0.60, "m-small": 0.50}
    if target_miss is not None:
        monkeypatch.setattr(capacity_week, "model_targets",
                            lambda cfg, caps: dict(fake) if cfg.target_miss else None)
    capacities: list[dict[str, float]] = []
    real_solve = capacity_week.solve

    def solve_spy(inp):  # type: ignore[no-untyped-def]
        capacities.append({m: next(iter(g.values())) for m, g in inp.capacity.items()})
        return real_solve(inp)

    seen: dict[tuple[str, str], list[Observation]] = {}
    real_make = capacity_week.make_strategy

    def make_spy(name: str):  # type: ignore[no-untyped-def]
        strat = real_make(name)
        decide = strat.decide

        def spy(endpoint, o):  # type: ignore[no-untyped-def]
            seen.setdefault((name, endpoint[0]), []).append(o)
            return decide(endpoint, o)

        strat.decide = spy  # type: ignore[method-assign]
        return strat

    monkeypatch.setattr(capacity_week, "solve", solve_spy)
    monkeypatch.setattr(capacity_week, "make_strategy", make_spy)
    res = run(WeekConfig(days=0.1, step_s=60.0, target_miss=target_miss,
                         strategies=("reactive", "lt-u")))
    demand = capacity_week.build_demand(WeekConfig(days=0.1, step_s=60.0))
    assert capacities  # LT-U planned
    for m, mu in ((m, c.mu_t) for m, c in demand.caps.items()):
        expect = demand.theta[m] if target_miss is None else fake[m] * mu
        assert all(c[m] == pytest.approx(expect) for c in capacities)
        for o in seen[("reactive", m)]:
            assert o.scale_out_utilisation is None and o.scale_in_utilisation is None
        for o in seen[("lt-u", m)]:
            if target_miss is None:
                assert o.scale_out_utilisation is None
            else:
                assert o.scale_out_utilisation == fake[m]
                assert o.scale_in_utilisation == pytest.approx(fake[m] * 3 / 7)
    assert res["setup"]["target_miss"] == target_miss
