"""The HA results page's burst table: arms grouped, ordered, and aggregated as stated."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.ha_region_page import burst_table


def row(mode: str, n: int, margin: int | None, waiting: tuple[float, int], wall: float
        ) -> dict[str, Any]:
    r = {"mode": mode, "balancers": n, "streams": 48, "completed": 48,
         "replica_waiting_mean": waiting[0], "replica_waiting_max": waiting[1],
         "balancer_queue_max": 30, "wall_s": wall}
    if margin is not None:
        r["balancers_per_region"] = margin
    return r


def test_burst_table_groups_arms_and_reads_old_rows_as_margin_one() -> None:
    doc = {"burst": [row("bp", 1, 1, (5.0, 12), 4.0),
                     row("sp-p", 2, 2, (0.1, 2), 9.0), row("sp-p", 2, 2, (0.3, 1), 11.0),
                     row("sp-p", 2, None, (1.2, 4), 6.0),  # written before the margin
                     row("sp-p", 1, 1, (0.0, 1), 8.0)]}
    lines = burst_table(doc).splitlines()[2:]
    assert [line.split(" | ")[:3] for line in lines] == [
        ["| sp-p", "1", "1"], ["| sp-p", "2", "1"], ["| sp-p", "2", "2"], ["| bp", "1", "1"]]
    margin = lines[2].split(" | ")
    # runs, mean of the runs' means, max of maxima, completed / streams, wall mean (range)
    assert margin[3:] == ["2", "0.20", "2", "30", "96 / 96", "10.0 (9.0-11.0) |"]
