"""Where a live router put its requests: per-region shares from the replicas' own
finished-request counters, and the routers' table that prints them."""

from __future__ import annotations

import pytest

from skymesh_lab.bench.skylb_live import Counters, peers_table, served_share


def test_shares_come_from_counter_deltas_grouped_by_region() -> None:
    regions = ["us", "us", "eu", "asia"]
    before = Counters(finished=[10, 0, 5, 100])
    after = Counters(finished=[40, 30, 15, 120])  # us 60, eu 10, asia 20 in the window
    share = served_share(before, after, regions)
    assert share == pytest.approx({"us": 60 / 90, "eu": 10 / 90, "asia": 20 / 90})
    assert served_share(after, after, regions) == {}  # nothing finished: no shares
    with pytest.raises(ValueError):
        served_share(before, Counters(finished=[1, 2]), regions)


def test_the_routers_table_shows_placement() -> None:
    row = {"workload": "chat-arena", "throughput_rps": 8.9, "ttft_p50_s": 0.25,
           "ttft_p90_s": 0.4, "prefix_hit_rate": 0.68}
    rows = [{**row, "system": "single-sgl",
             "served_share_by_region": {"us": 0.5, "eu": 0.25, "asia": 0.25}},
            {**row, "system": "sglang-router", "ttft_p50_s": 0.22}]
    table = peers_table(rows).splitlines()
    assert table[-2].endswith("| 68.0% | 50% / 25% / 25% |")
    assert "-30 ms" in table[-1] and table[-1].endswith("| - |")
