"""The forecast-aware overflow benchmark's parts: the diurnal client gate, both forecast
feeds, a short run of every arm, and its results page."""

from __future__ import annotations

import math

import pytest

from skymesh_lab.bench import forecast_peers as fp
from skymesh_lab.bench.forecast_peers_page import forecast_peers as render

DAY = 24.0  # one-second windows


def test_client_curves_peak_a_third_of_a_day_apart() -> None:
    peaks = [max(range(240), key=lambda k: fp.active_clients(j, k * DAY / 240, DAY))
             for j in range(3)]
    assert peaks == [0, 80, 160]
    total = {round(sum(fp.active_clients(j, t, DAY) for j in range(3)), 6)
             for t in (0.0, 3.3, 11.1, 20.0)}
    assert total == {3 * fp.BASE + 1.5 * fp.SWING}  # the load moves, the total does not
    # Just past us's peak, us falls and eu (peaking a third of a day later) climbs.
    assert fp.falling(0, 1.0, DAY) and not fp.falling(1, 1.0, DAY)


def test_the_gate_holds_inactive_clients_until_their_turn() -> None:
    wl = fp.DiurnalChat(seed=0, day_s=DAY, duration_s=2 * DAY)
    first = list(wl.initial())
    per_region = {r: [t for t, item in first if item.region == r] for r in fp.REGIONS}
    for j, region in enumerate(fp.REGIONS):
        at_start = sum(1 for t in per_region[region] if t == 0.0)
        assert at_start == math.ceil(fp.active_clients(j, 0.0, DAY))
        for t, item in first:  # every deferred client starts when the curve reaches it
            rank = fp.meta_int(item, "client") % (fp.BASE + fp.SWING)
            if item.region == region:
                assert fp.active_clients(j, t, DAY) > rank
    assert wl.tokens["us"][0] > wl.tokens["eu"][0] > 0


def test_the_feeds_publish_relative_loads() -> None:
    oracle = fp.OracleFeed(DAY, horizon=3).outlooks(0.5)
    assert [o.region for o in oracle] == fp.REGIONS and oracle[0].start == 0.0
    us, eu, asia = (o.load for o in oracle)
    assert us[0] > 1.5 and us[2] < us[0]  # at its peak, and falling
    assert eu[2] > eu[0] and asia[2] < asia[0]

    wl = fp.DiurnalChat(seed=0, day_s=DAY, duration_s=2 * DAY)
    feed = fp.ForecastFeed(wl, horizon=2)
    wl.tokens["us"][:24] = range(24)
    wl.tokens["eu"][:24] = 12.0
    wl.tokens["asia"][:24] = 12.0
    assert feed.outlooks(23.5) == []  # under a season of history: nothing yet
    got = {o.region: o for o in feed.outlooks(24.0)}
    # Seasonal naive: tomorrow's windows 0 and 1 are today's, over the mean of 11.5 + ...
    mean = (11.5 + 12.0 + 12.0) / 3
    assert got["us"].start == 24.0 and got["us"].load == pytest.approx((0.0, 1 / mean))
    assert got["eu"].load == pytest.approx((12 / mean, 12 / mean))


def test_every_arm_runs_and_the_page_renders() -> None:
    runs = [fp.run_arm(arm, seed=1, day_s=8.0) for arm in fp.ARMS]
    assert all(r["completed"] > 0 for r in runs)
    with pytest.raises(ValueError, match="unknown arm"):
        fp.run_arm("psychic", seed=1, day_s=8.0)
    data = fp.result(runs, [1], 8.0, fp.OutlookParams())
    page = render(data)
    assert "forecast-aware, oracle forecast" in page and "**Every run**" in page
    assert page.count("\n| ") >= 2 * len(fp.ARMS)
