"""A run in which nothing completes reports no latency (JSON null, "n/a" in tables), never
a zero latency, and the comparisons built on it give no ratio instead of crashing."""

from __future__ import annotations

import json

import pytest

from skymesh.util.stats import summary
from skymesh_lab.bench.fidelity import compare, format_table
from skymesh_lab.bench.skylb_macro import format_ceilings, format_tables
from skymesh_lab.bench.skylb_setup import BOX_QS, MESH, comparisons
from skymesh_lab.cli import _print_sim
from skymesh_lab.sim.runner import SimConfig, run


def test_a_simulation_without_requests_reports_null_latencies(
        capsys: pytest.CaptureFixture[str]) -> None:
    # 50 ms of Poisson arrivals at the default rate: no request arrives, none completes.
    res = run(SimConfig(workload="poisson", regions=["us"], replicas={"us": 1},
                        policy="round-robin", seed=0, duration_s=0.05))
    assert res["completed"] == 0
    keys = ("ttft_mean_s", "ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "tpot_mean_s")
    assert all(res[k] is None for k in keys)
    assert all(json.loads(json.dumps(res))[k] is None for k in keys)
    _print_sim(res)
    out = capsys.readouterr().out
    assert "n/a / n/a / n/a s" in out and "0.000 / " not in out


def _row(system: str, latency: float | None) -> dict[str, object]:
    stats = summary([] if latency is None else [latency], BOX_QS, prefix="ttft_",
                    suffix="_s")
    stats.update(summary([] if latency is None else [2 * latency], BOX_QS, prefix="e2e_",
                         suffix="_s"))
    return {"workload": "w", "system": system, "throughput_rps": 1.0,
            "prefix_hit_rate": 0.5, **stats}


def test_macro_comparisons_give_no_ratio_without_data() -> None:
    rows = [_row(MESH, None), _row("single-ll", 1.0), _row("region-local", 2.0)]
    c = comparisons(rows)["w"]
    assert c["ttft_p90_frac_of_best_single"] is None
    assert c["ttft_p90_pct_of_baselines_range"] is None
    assert c["throughput_x_range"] == [1.0, 1.0]
    assert c["targets_met"]["ttft_p90_frac_of_best_single"] is False
    table = format_tables(rows)
    assert "| skymesh-prefix | 1.00 | n/a s | n/a s | n/a s |" in table
    assert "| single-ll | 1.00 | 1.00 s |" in table
    c["ceiling_throughput_x_vs_best_single"] = 2.0
    c["ceiling_ttft_p90_frac_of_best_single"] = None
    assert "| n/a% | n/a% |" in format_ceilings({"w": c})


def test_fidelity_compare_has_no_difference_without_data() -> None:
    sim = {"completed": 3, "throughput_rps": 1.0, "ttft_mean_s": 0.2, "ttft_p50_s": 0.2,
           "ttft_p90_s": 0.3, "e2e_mean_s": 1.0, "e2e_p50_s": 1.0, "e2e_p90_s": 1.5,
           "prefix_hit_rate": 0.5}
    live = {**sim, "completed": 0, **{k: None for k in sim if k.endswith("_s")}}
    diff = compare(sim, live)
    assert diff["ttft_p50_s"] is None and diff["completed"] == -1.0
    table = format_table(sim, live, diff)
    assert "ttft_p50_s" in table and "n/a" in table and "FAIL" in table
