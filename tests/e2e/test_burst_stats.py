"""The burst benchmark's run order and aggregation over rounds, and its results page (no
vLLM needed: runs in ``make test`` too)."""

from __future__ import annotations

import itertools
import json
from typing import Any

import burst_bench
import burst_stats
import pytest

from skymesh_lab.bench.results_vllm_burst import vllm_burst

MODES = ["sp-p", "bp", "sp-o"]


def test_each_mode_takes_each_position_once_in_as_many_rounds_as_modes() -> None:
    orders = burst_stats.round_orders(MODES, 3)
    assert all(sorted(o) == sorted(MODES) for o in orders)
    for pos in range(3):
        assert sorted(o[pos] for o in orders) == sorted(MODES)


def test_twice_as_many_rounds_run_every_order_so_each_mode_follows_each_other_equally() -> None:
    orders = burst_stats.round_orders(MODES, 6)
    assert sorted(map(tuple, orders)) == sorted(itertools.permutations(MODES))
    follows = [(o[i], o[i + 1]) for o in orders for i in range(2)]
    counts = {pair: follows.count(pair) for pair in itertools.permutations(MODES, 2)}
    assert set(counts.values()) == {2}


def test_fixed_order_repeats_the_given_one() -> None:
    assert burst_stats.round_orders(MODES, 2, balanced=False) == [MODES, MODES]


def _run(done: float, ttft: float, waiting: float = 0.0) -> dict[str, Any]:
    server = {"waiting_mean": waiting, "waiting_max": 2 * waiting, "running_mean": 3.5,
              "running_when_backlogged_mean": 3.8}
    return {"ttft_p50_s": ttft, "ttft_p90_s": 2 * ttft, "completion_s": done,
            "lb_queue_mean": 5.0, "lb_queue_max": 9, "loadavg_mean": 3.0, "failed": 0,
            "unhealthy_flips": 0, "servers": {"s0": server, "s1": server},
            "cpu_s": {"s0": 50.0, "s1": 49.0, "lb": 3.0, "bench": 4.0, "others": 10.0},
            "rss_mb": {"s0": 900.0, "s1": 910.0}}


# Round 1 runs sp-p first and is 10% faster overall; sp-p is 0.9x bp in both rounds.
ROUNDS = [
    {"round": 1, "order": ["sp-p", "bp"], "runs": {"sp-p": _run(45.0, 9.0),
                                                   "bp": _run(50.0, 10.0, waiting=7.0)}},
    {"round": 2, "order": ["bp", "sp-p"], "runs": {"bp": _run(55.0, 11.0, waiting=8.0),
                                                   "sp-p": _run(49.5, 9.9)}},
]


def test_aggregate_gives_mean_and_spread_over_rounds() -> None:
    agg = burst_stats.aggregate(ROUNDS)
    assert agg["bp"]["completion_s"] == {"mean": 52.5, "min": 50.0, "max": 55.0,
                                         "sd": pytest.approx(3.536, abs=1e-3), "n": 2}
    assert agg["bp"]["servers"]["s0"]["waiting_mean"]["mean"] == 7.5
    assert agg["sp-p"]["servers"]["s1"]["waiting_max"]["max"] == 0.0
    assert agg["sp-p"]["rounds"] == 2


def test_paired_ratio_cancels_what_the_round_did_to_both_modes() -> None:
    ratios = burst_stats.paired(ROUNDS, "sp-p", "bp")
    assert ratios["completion_s"]["per_round"] == [0.9, 0.9]
    assert ratios["completion_s"]["geomean"] == pytest.approx(0.9)
    assert ratios["ttft_p90_s"]["min"] == ratios["ttft_p90_s"]["max"] == 0.9
    assert ratios["completion_s"]["ci95"] == [0.9, 0.9]  # no spread: a point


def test_paired_interval_holds_one_when_rounds_disagree() -> None:
    rounds = [{"order": ["a", "b"], "runs": {"a": _run(a, 1.0), "b": _run(50.0, 1.0)}}
              for a in (40.0, 60.0, 45.0, 58.0)]
    lo, hi = burst_stats.paired(rounds, "a", "b")["completion_s"]["ci95"]
    assert lo < 1.0 < hi
    assert burst_stats.paired(rounds[:1], "a", "b")["completion_s"]["ci95"] is None


def test_paired_geomean_is_symmetric_for_opposite_rounds() -> None:
    rounds = [{"order": ["a", "b"], "runs": {"a": _run(20.0, 1.0), "b": _run(10.0, 1.0)}},
              {"order": ["b", "a"], "runs": {"a": _run(10.0, 1.0), "b": _run(20.0, 1.0)}}]
    assert burst_stats.paired(rounds, "a", "b")["completion_s"]["geomean"] == 1.0


def test_by_position_shows_the_order_effect_and_none_when_absent() -> None:
    # Whatever runs first is 5% faster than its mode's mean, whatever runs second 5% slower.
    rounds = [{"order": ["sp-p", "bp"], "runs": {"sp-p": _run(45.0, 9.0),
                                                 "bp": _run(55.0, 11.0)}},
              {"order": ["bp", "sp-p"], "runs": {"bp": _run(50.0, 10.0),
                                                 "sp-p": _run(49.5, 9.9)}}]
    pos = burst_stats.by_position(rounds)["completion_s"]
    assert pos[0] == pytest.approx((45 / 47.25 + 50 / 52.5) / 2, abs=1e-4)
    assert pos[1] == pytest.approx((55 / 52.5 + 49.5 / 47.25) / 2, abs=1e-4)
    assert pos[0] < 0.96 and pos[1] > 1.04
    assert burst_stats.by_position(ROUNDS)["completion_s"] == [1.0, 1.0]


def test_modes_parse_with_headroom_variants_and_reject_the_rest() -> None:
    assert burst_bench.parse_modes("sp-p, bp,sp-p+1") == ["sp-p", "bp", "sp-p+1"]
    for bad in ("sp-x", "sp-p+", "bp,bp"):
        with pytest.raises(ValueError):
            burst_bench.parse_modes(bad)


def test_headroom_variant_is_sp_p_with_a_queue_inside_the_engine() -> None:
    args = burst_bench.argparse.Namespace(sp_p_max_num_seqs=True, queue_timeout_s=600.0)
    assert burst_bench.lb_config("sp-p+1", args)["pushing"] == {
        "mode": "sp-p", "max_num_seqs": burst_bench.MAX_NUM_SEQS, "engine_queue": 1}
    assert burst_bench.lb_config("sp-p", args)["pushing"] == {
        "mode": "sp-p", "max_num_seqs": burst_bench.MAX_NUM_SEQS, "engine_queue": 0}
    assert burst_bench.lb_config("sp-o", args)["pushing"]["max_outstanding"] == 4


def test_results_page_has_every_mode_the_ratios_and_the_positions() -> None:
    doc = burst_bench.build_doc({"servers": 2, "max_num_seqs": 4, "order": "balanced",
                                 "warmup_max_tokens": 16}, ROUNDS)
    page = vllm_burst(doc)
    assert "| sp-p | s0 | 0.00 | 0 |" in page
    assert "| bp | s1 | 7.50 (7.00-8.00) | 16 |" in page
    assert "| sp-p/bp | all done | 0.90 / 0.90 | 0.90 | 0.90-0.90 |" in page
    assert "| 2 | 1 | bp | 11.0 s | 55.0 s |" in page


def test_contention_relates_burst_time_to_the_cores_the_servers_got() -> None:
    # The servers' CPU is the same work each time; the longer bursts got fewer cores.
    runs = [dict(_run(done, 10.0), cpu_s={"s0": 40.0, "s1": 40.0, "lb": 1.0, "bench": 2.0,
                                           "others": others})
            for done, others in ((40.0, 10.0), (50.0, 30.0), (80.0, 70.0))]
    rounds = [{"order": ["bp"], "runs": {"bp": r}} for r in runs]
    assert burst_stats.cores(runs[0], "servers") == 2.0
    assert burst_stats.cores(runs[2], "others") == pytest.approx(0.875)
    c = burst_stats.contention(rounds)
    assert c["runs"] == 3
    assert c["completion_vs_servers_cores_r"] < -0.9
    assert c["completion_vs_others_cores_r"] > 0.9
    assert burst_stats.contention(rounds[:2])["completion_vs_servers_cores_r"] is None


def test_resume_keeps_the_first_parts_rounds_and_setup_and_notes_the_new_part() -> None:
    done = burst_bench.build_doc({"generated_at": "T0", "loadavg_at_start": [1.0],
                                  "repeats": 2}, ROUNDS[:1])
    setup, rounds = burst_bench.resume(done, {"generated_at": "T1", "loadavg_at_start": [9.0],
                                              "repeats": 4}, ["bp", "sp-p"])
    assert rounds == ROUNDS[:1]
    assert setup["generated_at"] == "T0" and setup["repeats"] == 4
    assert setup["resumed"] == [{"at": "T1", "from_round": 2, "loadavg_at_start": [9.0]}]
    with pytest.raises(ValueError, match="other modes"):
        burst_bench.resume(done, setup, ["bp", "sp-o"])


def test_results_page_shows_the_balancers_limit_told_or_learned_beside_vllms_waiting() -> None:
    def run(cap_start: tuple[Any, Any], cap_end: tuple[Any, Any],
            learned_after: float | None, waiting: float) -> dict[str, Any]:
        r = _run(50.0, 10.0, waiting)
        server = {**r["servers"]["s0"], "lb_max_num_seqs_at_start": cap_start[0],
                  "lb_max_num_seqs_source_at_start": cap_start[1],
                  "lb_max_num_seqs": cap_end[0], "lb_max_num_seqs_source": cap_end[1],
                  "learned_after_s": learned_after}
        return {**r, "servers": {"s0": server, "s1": server}}

    rounds = [{"round": 1, "order": ["bp", "sp-p-told", "sp-p-learned"], "runs": {
        "bp": run((None, None), (None, None), None, 8.0),
        "sp-p-told": run((4, "told"), (4, "told"), None, 0.5),
        "sp-p-learned": run((1, "unknown"), (4, "learned"), 3.2, 0.25)}}]
    doc = burst_bench.build_doc({"servers": 2, "max_num_seqs": 4}, rounds)
    page = vllm_burst(doc)
    assert "| 1 | sp-p-learned | s0 | 0.25 | 0.5 | 1 unknown | 4 learned | 3.2 s |" in page
    assert "| 1 | sp-p-told | s1 | 0.50 | 1 | 4 told | 4 told | - |" in page
    assert "| 1 | bp | s0 | 8.00 | 16 | - | - | - |" in page
    assert "`sp-p-told` and `sp-p-learned` run the balancer's defaults" in page
    assert "sp-p-learned/sp-p-told" in doc["paired"]
    # A page from runs that recorded no limit (the committed ones) has no such table.
    assert "limit at start" not in vllm_burst(burst_bench.build_doc({}, ROUNDS))


def test_a_server_whose_metrics_never_answered_has_no_figures_rather_than_zeros() -> None:
    urls = ["http://a", "http://b"]
    status = json.dumps({"queued": 3, "replicas": {}}).encode()
    metrics = (b"# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting 5.0\n"
               b"# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running 4.0\n")
    samples = burst_bench.Samples()
    for _ in range(2):  # b's /metrics timed out both times (status 0)
        burst_bench._take_sample(urls, [(200, status), (200, metrics), (0, b"")], samples,
                                 0.5)
    a, b = (burst_bench.server_summary(u, samples) for u in urls)
    assert (a["metrics_samples"], a["waiting_mean"], a["waiting_max"]) == (2, 5.0, 5.0)
    assert a["running_when_backlogged_mean"] == 4.0
    assert (b["metrics_samples"], b["waiting_mean"], b["waiting_max"],
            b["running_mean"]) == (0, None, None, None)
    assert samples.queued == [3.0, 3.0]
