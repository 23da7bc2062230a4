"""Batch across the mesh in the simulator (``SimBalancer.set_batch``, the live
dispatcher's batch lane) and its results page's verdict."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.tenancy_mesh import run_arm
from skymesh_lab.bench.tenancy_mesh_page import tenancy_mesh


def _elsewhere(run: dict[str, Any]) -> int:
    return sum(n for origin, where in run["batch_ran"].items()
               for region, n in where.items() if region != origin)


def test_the_rule_sends_batch_to_peers_and_local_last_keeps_it_home() -> None:
    home = run_arm("local_last", 0, 60.0)
    mesh = run_arm("mesh_rule", 0, 60.0)
    assert home["batch_sent"] == mesh["batch_sent"] > 0
    assert home["batch_ok"] == home["batch_sent"] and mesh["batch_ok"] == mesh["batch_sent"]
    assert _elsewhere(home) == 0
    assert _elsewhere(mesh) > 0
    # us, the busy region at its peak, is the one that sends batch away.
    assert sum(n for r, n in mesh["batch_ran"]["us"].items() if r != "us") > 0


def _run(arm: str, seed: int, att: float, ok: int, by: float | None) -> dict[str, Any]:
    return {"arm": arm, "seed": seed, "interactive_slo_attainment": att,
            "interactive_ok": ok, "interactive_ttft_p50_s": 0.1,
            "interactive_ttft_p90_s": 0.5, "interactive_us_ttft_p90_s": 0.6,
            "batch_sent": 0 if by is None else 10, "batch_ok": 0 if by is None else 10,
            "batch_by_deadline": by, "batch_e2e_p90_s": None if by is None else 30.0,
            "batch_ran": {} if by is None else {"us": {"us": 6, "eu": 4}},
            "interactive_slo_by_region": {"us": att - 0.01, "eu": att + 0.01}}


def _doc(rule_att: float, rule_ok: int, rule_by: float) -> dict[str, Any]:
    return {"setup": {"regions": ["us", "eu"], "clients": {"us": 2, "eu": 1}},
            "runs": [_run("no_batch", 0, 0.98, 1000, None),
                     _run("fcfs", 0, 0.90, 900, 1.0),
                     _run("mesh_rule", 0, rule_att, rule_ok, rule_by)]}


def test_the_verdict_needs_slo_served_requests_and_deadlines_all_kept() -> None:
    assert "**The goal holds.**" in tenancy_mesh(_doc(0.975, 990, 1.0))
    for att, ok, by in ((0.95, 990, 1.0), (0.975, 900, 1.0), (0.975, 990, 0.9)):
        assert "**The goal does not hold.**" in tenancy_mesh(_doc(att, ok, by)), (att, ok, by)
    page = tenancy_mesh(_doc(0.975, 990, 1.0))
    assert "| us | 4 | 6 |" in page  # where us's batch ran: eu 4, us 6
    assert "recovers part of the loss" in page
    assert "| no batch | 97.0% | 99.0% |" in page  # attainment by the clients' region
