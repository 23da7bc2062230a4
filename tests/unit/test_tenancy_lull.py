"""``tenants.reserve_lull_gaps`` and ``tenants.reserve_fall_gaps``: the adaptive
reserve's mean of the better classes in service falls over ``reserve_fall_s`` only once
they have sent nothing for that many of their mean inter-arrival gaps (a lull), and over
``reserve_window_s`` while they keep sending; or over that many of their gaps, at most
``reserve_window_s``. Fake clocks throughout."""

from __future__ import annotations

import math

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import Occupancy, Waiter, queue_of

LULL = {"reserve_fall_s": 1.5, "reserve_lull_gaps": 3.0, "reserve_window_s": 10.0}


def _one_request(occ: Occupancy, at: float, rate: float, lasts: float) -> None:
    occ.arrived("m", "interactive", at, rate)
    occ.start("m", "interactive", at)
    occ.end("m", "interactive", at + lasts)


def test_the_fall_is_slow_until_the_lull_then_fast() -> None:
    """A request at 0.5/s (gap 2 s, lull after 6 s) in service 0-1 s: the mean then falls
    over 10 s until 6 s, and over 1.5 s after."""
    occ = Occupancy(fall_s=10.0, lull_fall_s=1.5, lull_gaps=3.0)
    _one_request(occ, 0.0, 0.5, 1.0)
    peak = 1 - math.exp(-1.0)  # risen within 1 s for 1 s
    at_lull = peak * math.exp(-5.0 / 10.0)
    assert occ.mean("m", ["interactive"], 6.0) == pytest.approx(at_lull)
    assert occ.mean("m", ["interactive"], 9.0) == pytest.approx(at_lull * math.exp(-2.0))
    # Read in one step across the lull's start: the same (slow to it, fast after).
    again = Occupancy(fall_s=10.0, lull_fall_s=1.5, lull_gaps=3.0)
    _one_request(again, 0.0, 0.5, 1.0)
    assert again.mean("m", ["interactive"], 9.0) == pytest.approx(at_lull * math.exp(-2.0))


def test_a_light_steady_class_keeps_its_mean_and_one_that_stopped_gives_it_back() -> None:
    """Every 2 s a request in service for 1 s: with the lull the mean stays as with the
    slow fall alone (no gap reaches 3 of them), far above the fast fall's; 10 s after the
    last one it is near the fast fall's."""
    slow = Occupancy(fall_s=10.0)
    fast = Occupancy(fall_s=1.5)
    lull = Occupancy(fall_s=10.0, lull_fall_s=1.5, lull_gaps=3.0)
    for i in range(20):
        for occ in (slow, fast, lull):
            _one_request(occ, 2.0 * i, 0.5, 1.0)
    before = 2.0 * 19 + 0.99  # just before the last one ends
    assert lull.mean("m", ["interactive"], 39.9) == pytest.approx(
        slow.mean("m", ["interactive"], 39.9))
    assert slow.mean("m", ["interactive"], 39.9) > 2 * fast.mean("m", ["interactive"], 39.9)
    assert before < 39.9
    assert lull.mean("m", ["interactive"], 50.0) < 0.05
    assert slow.mean("m", ["interactive"], 50.0) > 0.15


def test_the_lull_waits_for_a_longer_gap_at_a_lower_rate() -> None:
    occ = Occupancy(fall_s=10.0, lull_fall_s=1.5, lull_gaps=3.0)
    occ.arrived("m", "interactive", 0.0, 0.1)  # gap 10 s: no lull before 30 s
    occ.start("m", "interactive", 0.0)
    occ.end("m", "interactive", 5.0)
    peak = occ.mean("m", ["interactive"], 5.0)
    assert occ.mean("m", ["interactive"], 25.0) == pytest.approx(peak * math.exp(-2.0))


def test_an_idle_class_is_not_forgotten_while_its_lull_is_ahead() -> None:
    """A request that arrived with the mean near nothing keeps its lull's start: the mean
    read before it starts must not drop the class (and with it the lull), else its end
    falls fast at once."""
    occ = Occupancy(fall_s=10.0, lull_fall_s=1.5, lull_gaps=3.0)
    occ.arrived("m", "interactive", 0.0, 0.5)
    assert occ.mean("m", ["interactive"], 0.0) == 0.0
    occ.start("m", "interactive", 0.0)
    occ.end("m", "interactive", 1.0)
    peak = 1 - math.exp(-1.0)
    assert occ.mean("m", ["interactive"], 3.0) == pytest.approx(peak * math.exp(-0.2))


def test_config_and_the_queue_wire_the_lull() -> None:
    q = queue_of(TenantsConfig(**LULL), 10)
    assert (q.occupancy.fall_s, q.occupancy.lull_fall_s, q.occupancy.lull_gaps) == \
        (10.0, 1.5, 3.0)
    plain = queue_of(TenantsConfig(reserve_fall_s=1.5), 10)
    assert plain.occupancy.fall_s == 1.5 and plain.occupancy.lull_gaps is None
    with pytest.raises(ValueError):
        TenantsConfig(reserve_lull_gaps=0)
    # The queue tells the occupancy of each arrival, at the class's rate.
    q.push(Waiter("m", "web", "interactive", 10, 0.0))
    w = q.pop("m", 0.0)
    assert w is not None
    q.finished(w, 1.0)
    # The first arrival counts as 1 in the 10 s window (0.1/s): no lull for 30 s, so
    # 5 s after it the mean has fallen over 10 s, not 1.5 s.
    peak = 1 - math.exp(-1.0)
    assert q.occupancy.mean("m", ["interactive"], 6.0) == pytest.approx(peak * math.exp(-0.5))


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


def test_config_and_the_bench_wire_the_fall_over_gaps() -> None:
    from skymesh_lab.bench.tenancy import (
        FALL_GAPS,
        FLOOD_ARMS,
        LIGHT_ARMS,
        LULLS,
        _reserve,
        _tenants,
    )

    q = queue_of(TenantsConfig(reserve_fall_gaps=4.0), 10)
    assert (q.occupancy.fall_s, q.occupancy.fall_gaps) == (10.0, 4.0)
    assert queue_of(TenantsConfig(), 10).occupancy.fall_gaps is None
    with pytest.raises(ValueError):
        TenantsConfig(reserve_fall_gaps=0)
    for arm, gaps in FALL_GAPS.items():
        assert arm in FLOOD_ARMS and arm in LIGHT_ARMS
        assert _tenants(arm)["reserve_fall_gaps"] == gaps
        assert _reserve(arm) == _reserve("fair_reserve")
        TenantsConfig(**{k: v for k, v in _tenants(arm).items() if k.startswith("reserve")})
    for arm, (fall, lull) in LULLS.items():
        assert arm in FLOOD_ARMS and arm in LIGHT_ARMS
        got = _tenants(arm)
        assert (got["reserve_fall_s"], got["reserve_lull_gaps"]) == (fall, lull)
