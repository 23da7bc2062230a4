"""The pushing-rule grid's verdicts and page (skymesh_lab.bench.rule_grid,
pushing_rule_page), and one short simulated run through its wait log."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_lab.bench import rule_grid
from skymesh_lab.bench.pushing_rule_page import pushing_rule
from skymesh_lab.bench.rule_stats import comparator, interval


def _run(system: str, seed: int, thr: float, p90: float) -> dict[str, Any]:
    return {"scheduler": "vllm", "cell": "tot-skylb", "system": system, "seed": seed,
            "throughput_rps": thr, "ttft_p90_s": p90}


@pytest.mark.parametrize(("rule", "wins"), [
    ((10.0, 0.5), True),  # best throughput, best P90
    ((9.95, 0.5), True),  # 0.995x the better throughput: within the floor
    ((9.8, 0.5), False),  # 0.98x: below it
    ((10.0, 0.51), False),  # P90 above the better one's
])
def test_a_cell_wins_only_against_the_better_of_bp_and_sp_p(
        rule: tuple[float, float], wins: bool) -> None:
    runs = [_run("bp", 0, 9.0, 0.5), _run("sp-p", 0, 10.0, 0.8), _run("rule", 0, *rule)]
    (v,) = rule_grid.verdicts(runs)
    assert v["wins"] is wins
    assert v["throughput_x_best"] == [pytest.approx(rule[0] / 10.0)]
    assert v["ttft_p90_x_best"] == [pytest.approx(rule[1] / 0.5)]


def test_a_seed_missing_a_system_is_left_out() -> None:
    runs = [_run("bp", 0, 9.0, 0.5), _run("sp-p", 0, 10.0, 0.8), _run("rule", 0, 10, 0.4),
            _run("bp", 1, 9.0, 0.5)]
    (v,) = rule_grid.verdicts(runs)
    assert v["seeds"] == [0]


def _cell(seeds: int, rule_thr: list[float], rule_p90: list[float]) -> list[dict[str, Any]]:
    runs = []
    for s in range(seeds):
        runs += [_run("bp", s, 9.0, 0.5), _run("sp-p", s, 10.0, 0.8),
                 _run("rule", s, rule_thr[s], rule_p90[s])]
    return runs


@pytest.mark.parametrize(("thr", "p90", "verdict"), [
    ([9.5, 9.6, 9.5, 9.6], [0.4, 0.4, 0.41, 0.4], "loses"),  # throughput 0.95x every seed
    ([10.0, 10.1, 10.0, 10.1], [0.6, 0.61, 0.6, 0.62], "loses"),  # P90 1.2x every seed
    ([10.0, 10.1, 10.0, 10.1], [0.4, 0.41, 0.4, 0.42], "wins"),
    ([9.5, 10.5, 9.5, 10.5], [0.4, 0.41, 0.4, 0.42], "ties"),  # throughput straddles 0.99
    ([10.0, 10.1, 10.0, 10.1], [0.3, 0.8, 0.3, 0.8], "ties"),  # P90 straddles 1.0
])
def test_the_verdict_reads_the_interval_over_seeds(thr: list[float], p90: list[float],
                                                    verdict: str) -> None:
    (v,) = rule_grid.verdicts(_cell(4, thr, p90))
    assert v["verdict"] == verdict
    lo, hi = v["throughput_x_best_ci"]
    assert lo <= v["throughput_x_best_gmean"] <= hi


def test_one_seed_has_an_unbounded_interval_and_never_decides() -> None:
    (v,) = rule_grid.verdicts(_cell(1, [5.0], [5.0]))
    assert v["verdict"] == "ties" and v["wins"] is False
    assert v["throughput_x_best_ci"][1] is None


def test_the_interval_narrows_with_seeds_at_the_same_spread() -> None:
    four = interval([0.98, 1.0, 0.98, 1.0])
    eight = interval([0.98, 1.0] * 4)
    assert four[0] < eight[0] < eight[1] < four[1]
    assert interval([1.02] * 3) == pytest.approx((1.02, 1.02))


def test_the_page_names_every_losing_cell_and_states_its_criterion() -> None:
    runs = _cell(4, [9.0, 9.1, 9.0, 9.1], [0.4, 0.4, 0.41, 0.4])
    data = {"setup": {"seeds": [0, 1, 2, 3], "tuning_seeds": [9]},
            "rule": {"prefer_queue": 4, "hold_queue_max": None},
            "criterion": {"throughput_floor": 0.99, "ttft_p90_ceiling": 1.0,
                          "confidence": 0.95},
            "runs": runs, "verdicts": rule_grid.verdicts(runs)}
    text = pushing_rule(data)
    assert ("First criterion (per seed): wins 0, ties 0, loses 1; the rule loses in: "
            "vllm tot-skylb.") in text
    assert "Second criterion (per cell): wins 0, ties 0, loses 1" in text
    assert "`hold_queue_max` none" in text
    assert "95% interval" in text and "chosen on seeds 9" in text
    assert "verdict (per seed)" in text and "verdict (per cell)" in text
    runs = _cell(4, [10.0, 10.1, 10.0, 10.1], [0.4, 0.41, 0.4, 0.42])
    data["verdicts"] = rule_grid.verdicts(runs)
    assert "wins or ties every cell" in pushing_rule(data)


def _noisy_twins(rule_p90: list[float]) -> list[dict[str, Any]]:
    """bp and sp-p equal within noise: on each seed one draws 0.9 s, the other 1.1 s (sp-p
    a hair slower overall); equal throughput everywhere."""
    runs = []
    for s, p90 in enumerate(rule_p90):
        bp, sp_p = (0.9, 1.101) if s % 2 else (1.1, 0.9)
        runs += [_run("bp", s, 10.0, bp), _run("sp-p", s, 10.0, sp_p),
                 _run("rule", s, 10.0, p90)]
    return runs


def test_the_per_cell_comparator_is_not_biased_by_the_per_seed_minimum() -> None:
    # The rule equals both systems' typical P90 (1.0 s): against the per-seed better one
    # (always 0.9 s) it "loses" on every seed; against the one system with the better
    # mean it ties, its ratio 1.1x on some seeds and 0.9x on others.
    (v,) = rule_grid.verdicts(_noisy_twins([1.0] * 6))
    assert v["verdict"] == "loses"
    assert v["ttft_p90_x_best_gmean"] == pytest.approx(1.0 / 0.9)
    assert v["ttft_p90_comparator"] == "bp"
    assert v["verdict_per_cell"] == "ties"
    lo, hi = v["ttft_p90_x_chosen_ci"]
    assert lo < 1.0 < hi
    assert v["throughput_x_chosen_ci"] == pytest.approx([1.0, 1.0])


def test_a_rule_slower_than_both_loses_under_both_criteria() -> None:
    (v,) = rule_grid.verdicts(_noisy_twins([1.3, 1.35, 1.3, 1.32, 1.3, 1.34]))
    assert v["verdict"] == "loses" and v["verdict_per_cell"] == "loses"
    assert v["ttft_p90_x_chosen_ci"][0] > 1.0


def test_each_metric_chooses_its_own_comparator_once_for_all_seeds() -> None:
    # bp has the better P90 and sp-p the better throughput over the cell, though on seed 3
    # bp's throughput beats sp-p's: the comparator stays sp-p on that seed too.
    runs = _cell(4, [10.0, 10.1, 10.0, 10.1], [0.4, 0.41, 0.4, 0.42])
    runs[9] = _run("bp", 3, 10.5, 0.5)
    (v,) = rule_grid.verdicts(runs)
    assert (v["throughput_comparator"], v["ttft_p90_comparator"]) == ("sp-p", "bp")
    assert v["throughput_x_chosen"][3] == pytest.approx(10.1 / 10.0)
    assert v["throughput_x_best"][3] == pytest.approx(10.1 / 10.5)


def test_the_comparator_breaks_an_exact_tie_towards_bp() -> None:
    assert comparator([1.0, 2.0], [2.0, 1.0], higher_is_better=True) == "bp"
    assert comparator([1.0, 2.0], [2.0, 1.0], higher_is_better=False) == "bp"
    assert comparator([1.0, 2.0], [2.0, 1.1], higher_is_better=True) == "sp-p"
    assert comparator([1.0, 2.0], [2.0, 1.1], higher_is_better=False) == "bp"


def test_prefer_queue_is_one_value_or_one_per_scheduler() -> None:
    assert rule_grid.per_scheduler("4") == {"vllm": 4, "sglang": 4}
    assert rule_grid.per_scheduler("vllm=3,sglang=4") == {"vllm": 3, "sglang": 4}
    with pytest.raises(ValueError, match="no value"):
        rule_grid.per_scheduler("vllm=3")
    with pytest.raises(ValueError, match="unknown scheduler"):
        rule_grid.per_scheduler("vllm=3,sglang=4,trt=2")


def test_a_short_run_logs_balancer_waits_and_the_rule_moves_them() -> None:
    rows = {s: rule_grid.run_one("vllm", "tot-skylb", s, 0, 40.0, 30.0, 4, 24)
            for s in ("bp", "sp-p", "rule")}
    assert rows["bp"]["balancer_wait_mean_s"] == 0.0  # blind pushing never queues here
    assert rows["sp-p"]["balancer_wait_mean_s"] > 0.0
    assert rows["sp-p"]["tail_held_mean_s"] <= rows["sp-p"]["tail_balancer_wait_mean_s"]
    assert rows["rule"]["balancer_wait_mean_s"] < rows["sp-p"]["balancer_wait_mean_s"]
