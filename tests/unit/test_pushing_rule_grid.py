"""The pushing-rule grid's verdicts and page (skymesh_lab.bench.rule_grid,
pushing_rule_page), and one short simulated run through its wait log."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_lab.bench import rule_grid
from skymesh_lab.bench.pushing_rule_page import pushing_rule


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


def test_the_page_names_every_losing_cell() -> None:
    runs = [_run("bp", 0, 9.0, 0.5), _run("sp-p", 0, 10.0, 0.8), _run("rule", 0, 9.0, 0.4)]
    data = {"setup": {"seeds": [0]}, "rule": {"prefer_queue": 4, "hold_queue_max": None},
            "criterion": {"throughput_floor": 0.99, "ttft_p90_ceiling": 1.0},
            "runs": runs, "verdicts": rule_grid.verdicts(runs)}
    text = pushing_rule(data)
    assert "does not meet the criterion in: vllm tot-skylb." in text
    assert "`hold_queue_max` none" in text


def test_a_short_run_logs_balancer_waits_and_the_rule_moves_them() -> None:
    rows = {s: rule_grid.run_one("vllm", "tot-skylb", s, 0, 40.0, 30.0, 4, 24)
            for s in ("bp", "sp-p", "rule")}
    assert rows["bp"]["balancer_wait_mean_s"] == 0.0  # blind pushing never queues here
    assert rows["sp-p"]["balancer_wait_mean_s"] > 0.0
    assert rows["sp-p"]["tail_held_mean_s"] <= rows["sp-p"]["tail_balancer_wait_mean_s"]
    assert rows["rule"]["balancer_wait_mean_s"] < rows["sp-p"]["balancer_wait_mean_s"]
