"""The tenancy bench's partial live run (``--live-only --live-arms ...``) merged into the
committed JSON: the new rows are a run of their own, the rows they replace stay as the
baselines of the arms not rerun, and the page pairs each arm with its own run."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.tenancy import FALLS, FLOOD_ARMS, _reserve, _tenants, merge_live
from skymesh_lab.bench.tenancy_page import tenancy


def test_a_partial_live_run_is_a_run_of_its_own() -> None:
    prior = [{"seed": s, "arm": a, "x": "old"} for s in (0, 1) for a in ("fcfs", "fair")]
    new = [{"seed": 0, "arm": "fcfs", "x": "new"}, {"seed": 3, "arm": "fair", "x": "new"}]
    got = merge_live(prior, new)
    assert sorted((r["seed"], r["arm"], r["x"], r.get("run"), r.get("superseded", False))
                  for r in got) == [
        (0, "fair", "old", None, False), (0, "fcfs", "new", 1, False),
        (0, "fcfs", "old", None, True), (1, "fair", "old", None, False),
        (1, "fcfs", "old", None, False), (3, "fair", "new", 1, False)]
    again = merge_live(got, [{"seed": 0, "arm": "fcfs", "x": "newer"}])
    assert [r.get("run") for r in again if r["x"] == "newer"] == [2]


def _row(arm: str, seed: int, p50: float, tps: float | None) -> dict[str, Any]:
    sent = 0 if tps is None else 10
    return {"seed": seed, "arm": arm, "ttft_p50_s": p50, "ttft_p99_s": 2 * p50,
            "interactive_sent": 10, "batch_sent": sent, "batch_completed": sent,
            "batch_tokens_per_s": tps, "load_average_1m": 1.0}


def test_the_page_pairs_each_arm_with_the_baselines_of_its_own_run() -> None:
    """The old run: FCFS 1000 tokens/s, the held arm 900 (90%). A rerun of FCFS at 2000
    and the default at 1800 must not make the held arm 45%."""
    old = [_row("no_flood", 0, 0.1, None), _row("fcfs", 0, 5.0, 1000.0),
           _row("fair_reserve", 0, 0.11, 850.0), _row("fair_reserve_held", 0, 0.11, 900.0)]
    new = [_row("no_flood", 0, 0.1, None), _row("fcfs", 0, 5.0, 2000.0),
           _row("fair_reserve", 0, 0.11, 1800.0)]
    doc = {"setup": {"replicas": 2, "push_mode": "sp-p", "max_wait_s": {"batch": 60.0},
                     "live_cpus": 2, "interactive_request_tokens": 1,
                     "batch_request_tokens": 100},
           "flood": old, "live": merge_live(old, new),
           "share": [], "limits": [], "date": "2026-11-29", "wall_seconds": 1.0}
    page = tenancy(doc)
    spread = next(ln for ln in page.splitlines()
                  if ln.startswith("| the same, counting the slots held") and "points" in ln)
    assert "| 90.0% |" in spread
    default = next(ln for ln in page.splitlines()
                   if ln.startswith("| flood, fair queue + slot reserve |") and "points" in ln)
    assert "| 90.0% |" in default  # 1800 against its own run's 2000, not the old 1000
    # The medians' table too: each arm against its own runs' first come first served.
    live = page[page.index("### Live"):]
    for label in ("flood, fair queue + slot reserve", "the same, counting the slots held"):
        row = next(ln for ln in live.splitlines() if ln.startswith(f"| {label}"))
        assert row.split("|")[7].strip() == "90.0%", row


def test_the_fall_arms_are_the_default_reserve_with_their_fall_in_lb_yaml() -> None:
    for arm, fall in FALLS.items():
        assert arm in FLOOD_ARMS
        assert _tenants(arm)["reserve_fall_s"] == fall
        assert _reserve(arm) == _reserve("fair_reserve")
