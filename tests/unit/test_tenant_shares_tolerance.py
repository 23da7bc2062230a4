"""The tolerance of controller-pushed shares (skymesh_lab.bench.tenancy_shares): a tenant
at 3x its global limit through three balancers in two regions, on a fake clock.

Equal shares: never above the limit by more than the balancers' bursts; below it only
where a balancer gets less than its share (what equal shares can admit at best); and when
a balancer dies the others' shares grow to hold the whole limit (that a push hands out no
fresh burst is tests/unit/test_tenant_push.py's). Shares weighted by reported demand: the
limit within 10% however the traffic is spread, from the second report on, and again
within three reports of a shift."""

from __future__ import annotations

import pytest

from skymesh_lab.bench.tenancy_shares import LIMIT_RPS, RUN_S, TOLERANCE, run

# Each of the three balancers may spend its burst (one second of its share) once.
OVER = 3 * (LIMIT_RPS / 3) / (LIMIT_RPS * RUN_S)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("spread", ["even", "uneven", "skewed"])
def test_admitted_is_the_limit_within_bursts_or_what_equal_shares_allow(
        spread: str, seed: int) -> None:
    r = run(seed, spread, "equal")
    assert r["offered_per_s"] > 2.5 * LIMIT_RPS
    assert r["admitted_over_limit"] <= 1 + OVER + 1e-9
    assert r["admitted_over_limit"] >= r["ideal_over_limit"] - 0.02
    if spread != "skewed":  # every balancer gets at least its share: the limit holds
        assert r["admitted_over_limit"] >= 0.97


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_dead_balancers_share_goes_to_the_others(seed: int) -> None:
    r = run(seed, "dies", "equal")
    assert r["before_over_limit"] >= 0.97
    # Two balancers now hold the whole limit (within their bursts over the half run).
    assert 0.97 <= r["after_over_limit"] <= 1 + 2 * (LIMIT_RPS / 2) / (
        LIMIT_RPS * RUN_S / 2)


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spread", ["even", "uneven", "90/10", "skewed", "one"])
def test_weighted_shares_hold_the_limit_however_the_traffic_is_spread(
        spread: str, seed: int) -> None:
    r = run(seed, spread, "weighted")
    assert r["reports_to_converge"] is not None and r["reports_to_converge"] <= 2
    assert abs(r["converged_over_limit"] - 1.0) <= TOLERANCE
    assert r["worst_window_after"] <= TOLERANCE
    if spread in ("one", "skewed"):  # where equal shares fall short
        assert r["admitted_over_limit"] > run(seed, spread, "equal")["admitted_over_limit"]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("spread", ["shift", "dies"])
def test_weighted_shares_follow_a_shift_within_three_reports(spread: str, seed: int) -> None:
    r = run(seed, spread, "weighted")
    assert r["reports_to_converge_after"] is not None
    assert r["reports_to_converge_after"] <= 3
    settled = r["window_over_limit"][len(r["window_over_limit"]) // 2 + 3:]
    assert all(abs(w - 1.0) <= TOLERANCE for w in settled)
