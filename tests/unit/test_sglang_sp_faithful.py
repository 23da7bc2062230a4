"""The faithful SP microbenchmark's tables: ratios per (scheduler, client), markdown."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_lab.bench.sp_faithful import PAPER, markdown, ratios


def row(scheduler: str, workload: str, mode: str, rps: float, p90: float,
        hit: float) -> dict[str, Any]:
    return {"scheduler": scheduler, "workload": workload, "push_mode": mode,
            "throughput_rps": rps, "ttft_p50_s": p90 / 2, "ttft_p90_s": p90,
            "prefix_hit_rate": hit, "preemptions": 0}


def test_ratios_compare_sp_p_with_bp_of_the_same_scheduler_and_client() -> None:
    runs = [row("sglang", "tot-skylb", "bp", 10.0, 2.0, 0.7),
            row("sglang", "tot-skylb", "sp-p", 12.7, 0.5, 0.9),
            row("vllm", "tot-skylb", "bp", 8.0, 1.0, 0.6)]  # no sp-p: no ratio row
    (only,) = ratios(runs)
    assert only["scheduler"] == "sglang" and only["workload"] == "tot-skylb"
    assert only["throughput_x_vs_bp"] == pytest.approx(1.27)
    assert only["ttft_p90_x_lower_vs_bp"] == pytest.approx(4.0)
    assert (only["hit_sp_p"], only["hit_bp"]) == (0.9, 0.7)
    table = markdown({"runs": runs, "ratios": [only]})
    assert "| sglang | tot-skylb | 1.27x | 4.00x | 90.0% | 70.0% |" in table
    assert f"{PAPER['ttft_p90_x_vs_bp']}x" in table
