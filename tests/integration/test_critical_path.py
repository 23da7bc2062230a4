"""The critical-path benchmark traces a live skymesh-lb: every stage is measured."""

from __future__ import annotations

import json
from pathlib import Path

from skymesh_lab.bench.critical_path import STAGES, TOTAL, main, stage_table


def test_stage_table_splits_each_request() -> None:
    recs = [{"in": 0, "handler": 1000, "upstream_write": 3000, "reply_in": 10000,
             "first_written": 14000}] * 3
    t = stage_table(recs)
    assert [v["p50_us"] for v in t.values()] == [1.0, 2.0, 7.0, 4.0, 7.0]
    assert list(t) == [name for name, _, _ in STAGES] + [TOTAL]


def test_traced_balancer_reports_every_stage(tmp_path: Path) -> None:
    out = tmp_path / "cp.json"
    assert main(["--rate", "20", "--seconds", "1.5", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["requests"] >= 10
    assert set(res["stages"]) == {name for name, _, _ in STAGES} | {TOTAL}
    for name, v in res["stages"].items():
        assert 0 < v["p50_us"] <= v["p90_us"], name
    # Stamped on the server that served (the lean one by default): an unstamped start
    # would read as the whole perf_counter, far past a second.
    assert res["stages"][STAGES[0][0]]["p90_us"] < 1e6
    # The balancer's total is its three stages, so it exceeds each of them.
    total = res["stages"][TOTAL]["p50_us"]
    assert total > res["stages"][STAGES[1][0]]["p50_us"]
