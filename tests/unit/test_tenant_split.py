"""The controller's split of a tenant's limits among balancers by the demand they report
(``skymesh_controller.tenants``: ``split``, ``demand_of``, ``pushed``). Pure, fake inputs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skymesh_controller.tenants import demand_of, pushed, split


@pytest.mark.parametrize(("demand", "floor", "want"), [
    # Proportional when every part is above the floor.
    ({"a": 9.0, "b": 1.0}, 0.1, {"a": 0.9, "b": 0.1}),
    ({"a": 1.0, "b": 1.0, "c": 2.0}, 0.1, {"a": 0.25, "b": 0.25, "c": 0.5}),
    # Nobody offers anything: even.
    ({"a": 0.0, "b": 0.0}, 0.1, {"a": 0.5, "b": 0.5}),
    # All at one balancer: the idle one holds floor / n, the busy one the rest.
    ({"a": 30.0, "b": 0.0}, 0.1, {"a": 0.95, "b": 0.05}),
    ({"a": 30.0, "b": 0.0, "c": 0.0, "d": 0.0}, 0.2,
     {"a": 0.85, "b": 0.05, "c": 0.05, "d": 0.05}),
    # A small one under the floor is lifted to it; the others share the rest by demand.
    ({"a": 600.0, "b": 398.0, "c": 2.0}, 0.3, {"a": 0.54, "b": 0.358, "c": 0.1}),
    ({"only": 5.0}, 0.1, {"only": 1.0}),
    ({}, 0.1, {}),
])
def test_split_table(demand: dict[str, float], floor: float, want: dict[str, float]) -> None:
    got = split(demand, floor)
    assert got.keys() == want.keys()
    for b, f in want.items():
        assert got[b] == pytest.approx(f, abs=2e-3), (b, got)


@given(st.dictionaries(st.text(min_size=1, max_size=3),
                       st.floats(min_value=0, max_value=1e6), min_size=1, max_size=12),
       st.floats(min_value=0.001, max_value=0.5))
def test_split_sums_to_one_and_keeps_the_floor(demand: dict[str, float],
                                               floor: float) -> None:
    got = split(demand, floor)
    n = len(demand)
    assert sum(got.values()) == pytest.approx(1.0)
    assert min(got.values()) >= floor / n - 1e-9
    # More demand never means a smaller part.
    ranked = sorted(demand, key=lambda b: demand[b])
    for lo, hi in itertools.pairwise(ranked):
        assert got[lo] <= got[hi] + 1e-9
    # The balancers held at the floor hold at most `floor` of the limit together.
    assert sum(f for f in got.values() if f <= floor / n + 1e-9) <= floor + 1e-9


def report(ts: float, worker: int = 0, **tenants: tuple[float, float]) -> dict[str, Any]:
    return {"ts": ts, "worker": worker, "window_s": 5,
            "tenants": {n: {"requests_per_s": r, "tokens_per_min": t}
                        for n, (r, t) in tenants.items()}}


def test_demand_is_each_workers_newest_fresh_report_summed() -> None:
    samples = [report(100.0, 0, acme=(1.0, 60.0)),
               report(104.0, 0, acme=(2.0, 120.0)),  # worker 0's newest
               report(103.0, 1, acme=(3.0, 0.0), beta=(1.0, 10.0)),
               report(50.0, 2, acme=(100.0, 0.0)),  # stale: counts for nothing
               {"ts": 105.0, "window_s": 5, "models": {}}]  # an older balancer's report
    assert demand_of(samples, since=90.0) == {"acme": (5.0, 120.0), "beta": (1.0, 10.0)}
    assert demand_of(samples, since=200.0) == {}


BALANCERS = {b: {"id": b, "region": r, "state": "up"}
             for b, r in (("us-a", "us"), ("us-b", "us"), ("eu-a", "eu"))}
TENANTS = {"acme": {"name": "acme", "requests_per_s": 30.0, "scope": "global"},
           "local": {"name": "local", "requests_per_s": 4.0, "scope": "region"}}


def parts(me: str, demand: dict[str, Any], balancers: dict[str, Any] = BALANCERS
          ) -> dict[str, tuple[int, float, float]]:
    return {t["name"]: (t["share"], t["fraction"], t["tokens_fraction"])
            for t in pushed(TENANTS, balancers[me], balancers, demand, 0.1)}


def test_pushed_fractions_follow_demand_per_scope() -> None:
    demand = {"us-a": {"acme": (27.0, 900.0), "local": (3.0, 0.0)},
              "us-b": {"acme": (3.0, 100.0), "local": (1.0, 0.0)}}
    us_a, us_b, eu_a = parts("us-a", demand), parts("us-b", demand), parts("eu-a", demand)
    # Global: three balancers; eu-a reported nothing and holds the floor, 0.1 / 3.
    assert eu_a["acme"][0] == 3 and eu_a["acme"][1] == pytest.approx(0.1 / 3, abs=1e-5)
    assert us_a["acme"][1] == pytest.approx(0.9 * (1 - 0.1 / 3), abs=1e-5)
    assert us_a["acme"][1] + us_b["acme"][1] + eu_a["acme"][1] == pytest.approx(1.0)
    assert us_a["acme"][2] == pytest.approx(0.9 * (1 - 0.1 / 3), abs=1e-5)  # tokens too
    # Region: us-a and us-b split theirs 3:1; eu-a is alone in eu.
    assert us_a["local"][:2] == (2, 0.75) and us_b["local"][:2] == (2, 0.25)
    assert eu_a["local"][:2] == (1, 1.0)
    # No demand reported anywhere (no token demand either): even, as before.
    assert parts("us-a", {})["acme"] == (3, pytest.approx(1 / 3, abs=1e-5),
                                         pytest.approx(1 / 3, abs=1e-5))


def test_a_dead_balancer_drops_out_of_the_split() -> None:
    demand = {"us-a": {"acme": (10.0, 0.0)}, "us-b": {"acme": (10.0, 0.0)},
              "eu-a": {"acme": (20.0, 0.0)}}
    down = {**BALANCERS, "eu-a": {**BALANCERS["eu-a"], "state": "down"}}
    assert parts("us-a", demand)["acme"][:2] == (3, 0.25)
    assert parts("us-a", demand, down)["acme"][:2] == (2, 0.5)


# -- a rolling upgrade: balancers older than the demand reports ---------------------------


@pytest.mark.parametrize(("demand", "floor", "want"), [
    # The old one divides by n whatever it is pushed: it is counted at 1/n, the two new
    # ones share the other 2/3 by demand (the idle one at floor / n of the whole).
    ({"old": None, "a": 30.0, "b": 0.0}, 0.3, {"old": 1 / 3, "a": 0.9 - 1 / 3, "b": 0.1}),
    ({"old": None, "a": 3.0, "b": 1.0}, 0.1, {"old": 1 / 3, "a": 0.5, "b": 1 / 6}),
    ({"old": None, "old2": None}, 0.1, {"old": 0.5, "old2": 0.5}),
    ({"old": None, "a": 0.0}, 0.1, {"old": 0.5, "a": 0.5}),
])
def test_split_counts_a_balancer_without_demand_reports_at_its_even_share(
        demand: dict[str, float | None], floor: float, want: dict[str, float]) -> None:
    got = split(demand, floor)
    assert got.keys() == want.keys() and sum(got.values()) == pytest.approx(1.0)
    for b, f in want.items():
        assert got[b] == pytest.approx(f, abs=1e-6), (b, got)


def test_demand_of_a_balancer_whose_fresh_reports_carry_no_demand_is_none() -> None:
    old = [{"ts": 100.0, "window_s": 5, "models": {}, "tenants": None},
           {"ts": 101.0, "window_s": 5, "models": {}}]
    assert demand_of(old, since=90.0) is None  # an older balancer: it holds 1/n
    assert demand_of(old, since=200.0) == {}  # no fresh report at all: nothing offered
    # A new balancer with nothing to report says so ({}): it offers nothing.
    assert demand_of([*old, report(102.0)], since=90.0) == {}


def test_an_older_balancer_in_scope_leaves_the_others_the_rest_of_the_limit() -> None:
    """Mid-upgrade, eu-a (old) admits 1/3 of acme's limit whatever it is pushed: the new
    ones share 2/3 by their demand, so the three never allow more than the limit (they
    were given 1 - floor between them and eu-a its floor: 1/3 over it)."""
    demand: dict[str, Any] = {"us-a": {"acme": (27.0, 900.0)}, "us-b": {}, "eu-a": None}
    got = {b: parts(b, demand)["acme"] for b in BALANCERS}
    assert got["eu-a"][1] == pytest.approx(1 / 3, abs=1e-5)
    assert got["us-b"][1] == pytest.approx(0.1 / 3, abs=1e-5)  # the floor, as before
    assert got["us-a"][1] == pytest.approx(1 - 1 / 3 - 0.1 / 3, abs=1e-5)
    assert sum(f for _, f, _ in got.values()) == pytest.approx(1.0, abs=1e-5)
    assert sum(ft for _, _, ft in got.values()) == pytest.approx(1.0, abs=1e-5)
