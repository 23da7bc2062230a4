"""``tenants.reserve_fall_gaps``: the adaptive reserve's mean of the better classes in
service falls over that many of their mean inter-arrival gaps, at most
``reserve_window_s`` (or ``reserve_fall_s``). Fake clocks throughout."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import Occupancy, Waiter, queue_of


def _one_request(occ: Occupancy, at: float, rate: float, lasts: float) -> None:
    occ.arrived("m", "interactive", at, rate)
    occ.start("m", "interactive", at)
    occ.end("m", "interactive", at + lasts)


def test_the_fall_over_gaps_follows_the_class_rate() -> None:
    """``reserve_fall_gaps`` 4: at 2/s (gap 0.5 s) the mean falls over 2 s; at 0.1/s (gap
    10 s) over 40 s, capped at the 10 s slow fall."""
    busy = Occupancy(fall_s=10.0, fall_gaps=4.0)
    busy.arrived("m", "interactive", 0.0, 2.0)
    busy.start("m", "interactive", 0.0)
    busy.end("m", "interactive", 1.0)
    peak = 1 - math.exp(-1.0)
    assert busy.mean("m", ["interactive"], 3.0) == pytest.approx(peak * math.exp(-1.0))
    light = Occupancy(fall_s=10.0, fall_gaps=4.0)
    _one_request(light, 0.0, 0.1, 1.0)
    assert light.mean("m", ["interactive"], 3.0) == pytest.approx(peak * math.exp(-0.2))


def test_the_queue_tells_the_occupancy_each_arrival_at_the_class_rate() -> None:
    q = queue_of(TenantsConfig(reserve_fall_gaps=4.0), 10)
    q.push(Waiter("m", "web", "interactive", 10, 0.0))
    w = q.pop("m", 0.0)
    assert w is not None
    q.finished(w, 1.0)
    # The first arrival counts as 1 in the 10 s window (0.1/s, a gap of 10 s): its mean
    # falls over min(4 x 10 s, 10 s), not over 4 x 0.5 s.
    peak = 1 - math.exp(-1.0)
    assert q.occupancy.mean("m", ["interactive"], 6.0) == pytest.approx(peak * math.exp(-0.5))


def test_reserve_lull_gaps_is_gone_and_a_config_setting_it_is_refused() -> None:
    """It added nothing measured over reserve_fall_gaps (docs/notes/tenancy-reserve-live.md);
    a config still setting it fails to load, naming it (unknown keys are errors)."""
    with pytest.raises(ValidationError, match="reserve_lull_gaps"):
        TenantsConfig.model_validate({"reserve_lull_gaps": 3.0})
    assert not hasattr(Occupancy(), "lull_gaps")


def test_the_default_falls_over_4_gaps_and_null_over_the_window() -> None:
    """Issue #37: the default reserve's mean falls over 4 of the better classes' gaps;
    ``reserve_fall_gaps: null`` is the default before (over reserve_window_s)."""
    q = queue_of(TenantsConfig(), 10)
    assert (q.occupancy.fall_s, q.occupancy.fall_gaps) == (10.0, 4.0)
    off = queue_of(TenantsConfig.model_validate({"reserve_fall_gaps": None}), 10)
    assert (off.occupancy.fall_s, off.occupancy.fall_gaps) == (10.0, None)
    with_fall = queue_of(TenantsConfig(reserve_fall_s=1.5), 10)
    assert (with_fall.occupancy.fall_s, with_fall.occupancy.fall_gaps) == (1.5, 4.0)
    # At the flood's 2/s the default's mean falls over 2 s; off, over 10 s.
    for queue, tau in ((q, 2.0), (off, 10.0)):
        for i in range(20):  # 2/s over the 10 s window
            queue.push(Waiter("m", "web", "interactive", 10, 0.5 * i))
            w = queue.pop("m", 0.5 * i)
            assert w is not None
            queue.finished(w, 0.5 * i)
        got = queue.occupancy.mean("m", ["interactive"], 12.0)
        assert got == pytest.approx(queue.occupancy.mean("m", ["interactive"], 9.5)
                                    * math.exp(-2.5 / tau))


def test_config_and_the_bench_wire_the_fall_over_gaps() -> None:
    from skymesh_lab.bench.tenancy import FALL_GAPS, FLOOD_ARMS, LIGHT_ARMS, _reserve, _tenants

    with pytest.raises(ValueError):
        TenantsConfig(reserve_fall_gaps=0)
    for arm, gaps in FALL_GAPS.items():
        assert arm in FLOOD_ARMS and arm in LIGHT_ARMS
        assert _tenants(arm)["reserve_fall_gaps"] == gaps
        assert _reserve(arm) == _reserve("fair_reserve")
        cfg = TenantsConfig(**{k: v for k, v in _tenants(arm).items()
                               if k.startswith("reserve")})
        assert cfg.reserve_fall_gaps == gaps


def test_the_simulator_arms_built_on_the_default_get_its_fall_over_gaps() -> None:
    """Every simulator arm with a fair queue falls over the default's 4 gaps (as a config
    that does not set the key), but the arm of the default before (null)."""
    from skymesh_lab.bench.tenancy import FALL_GAPS, FLOOD_ARMS, _sim

    def gaps(arm: str) -> float | None:
        _, queue = _sim([], lambda rec: ("web", "interactive"), arm, 0)
        assert queue is not None
        return queue.occupancy.fall_gaps

    for arm in FLOOD_ARMS:
        if arm in ("no_flood", "fcfs"):
            continue
        assert gaps(arm) == FALL_GAPS.get(arm, 4.0), arm
    assert None in FALL_GAPS.values()
