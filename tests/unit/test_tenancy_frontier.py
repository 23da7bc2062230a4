"""The frontier of the interactive tail against batch throughput
(``skymesh_lab.bench.tenancy_frontier`` and its page): the engine bound's arithmetic,
the settings as ``lb.yaml`` takes them, and a page that reads right with and without a
setting meeting every goal."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import reserve_of
from skymesh_lab.bench import tenancy_frontier as tf
from skymesh_lab.bench.tenancy import merge_live
from skymesh_lab.bench.tenancy_frontier_page import frontier, on_frontier, summarise


def test_the_bound_adds_the_batch_steps_remainder_to_the_slowest_request() -> None:
    base = [0.1] * 59 + [0.2]
    # No batch prefill: the slowest as it is, surely within any goal.
    assert tf.max_median(base, 0.0, 0.25) == pytest.approx(0.2)
    assert tf.max_cdf(base, 0.0, 0.25, 0.2) == 1.0
    # Every request in a batch prefill step: the slowest of 60 uniform waits of up to
    # 0.25 s on top, its median near the top of the step.
    assert tf.max_median(base, 1.0, 0.25) > 0.1 + 0.24
    # One request in 10 in such a step: P(slowest <= x) is the product over requests.
    x = 0.24
    want = (0.9 + 0.1 * (x - 0.1) / 0.25) ** 59 * (0.9 + 0.1 * (x - 0.2) / 0.25)
    assert tf.max_cdf(base, 0.1, 0.25, x) == pytest.approx(want)
    row = tf.engine_bound(base, 0.2, batch_rate_fcfs=1.0, fcfs_end_s=270.0, last_s=30.0,
                          step_s=0.25, share=0.4)
    assert row["in_batch_prefill"] == pytest.approx(0.1)
    assert row["batch_vs_fcfs_at_best"] == pytest.approx(270.0 / (270.0 + 0.6 * 30.0))
    assert row["ttft_p99_x"] == pytest.approx(row["ttft_p99_s"] / 0.2)


def test_the_batch_goal_and_the_share_it_needs() -> None:
    assert tf.batch_goal(600, 60) == pytest.approx(360_000 / 375_000 - 0.01)  # 95.0%
    assert tf.batch_goal(200, 60) == pytest.approx(120_000 / 135_000 - 0.01)  # 87.9%
    # 95% of a 285 s run leaves 15 s to lose: half of a 30 s window.
    assert tf.share_needed(0.95, 285.0, 30.0) == pytest.approx(0.5)
    assert tf.share_needed(0.5, 285.0, 30.0) == 0.0  # the window can go unserved
    # The shortest step with one batch prefill: 400 tokens at the L4 profile, ~0.23 s.
    assert 0.2 < tf.batch_prefill_step_s() < 0.3


def test_each_setting_is_a_tenants_section_lb_yaml_takes() -> None:
    by = {p.name: p for p in tf.points()}
    assert by["fcfs"].reserve is None and by["fair"].reserve is None
    for p in tf.points():
        if p.arm == "fcfs":
            continue
        cfg = TenantsConfig.model_validate(tf.tenants_of(p))
        r = reserve_of(cfg)
        if p.reserve is not None:
            assert (r.pace, r.headroom, r.pace_s) == (min(p.reserve.pace, 1 << 20),
                                                     p.reserve.headroom, p.window_s)
    w3 = reserve_of(TenantsConfig.model_validate(tf.tenants_of(by["pace_0_window_3"])))
    assert (w3.pace, w3.pace_s, w3.adaptive) == (0, 3.0, frozenset({"batch"}))


def test_pace_0_gives_the_batch_tenant_nothing_while_the_interactive_one_sends() -> None:
    by = {p.name: p for p in tf.points()}
    _, paced = tf._run(0, by["pace_0"])
    _, default = tf._run(0, by["pace_1"])
    assert paced["batch_tokens_per_s_while_interactive"] == 0.0
    assert default["batch_tokens_per_s_while_interactive"] > 0.0
    assert paced["batch_completed"] == paced["batch_sent"]  # served once it stops
    assert paced["ttft_p99_s"] < default["ttft_p99_s"]


def _row(arm: str, seed: int, p50: float, p99: float, batch: float | None,
         while_: float | None = None) -> dict[str, Any]:
    return {"seed": seed, "arm": arm, "ttft_p50_s": p50, "ttft_p99_s": p99,
            "batch_tokens_per_s": batch,
            "batch_tokens_per_s_while_interactive": while_ if while_ is not None else batch}


def _doc(good: bool) -> dict[str, Any]:
    rows = []
    for seed in (0, 1, 2):
        rows += [_row("no_flood", seed, 0.1, 0.2, None), _row("fcfs", seed, 9.0, 9.0, 1000.0),
                 _row("a", seed, 0.11, 0.7 + 0.1 * seed, 980.0),
                 _row("b", seed, 0.1, 0.22 if good else 0.3, 960.0 if good else 900.0, 0.0)]
    bound = [{"seed": s, "batch_prefill_step_s": 0.23, "batch_rate_fcfs": 1.0,
              "share_needed": 0.5,
              "at_share_needed": {"in_batch_prefill": 0.12, "ttft_p99_x": 1.5,
                                  "ttft_p99_x_alone": 1.4, "p99_within_goal_chance": 0.05,
                                  "batch_vs_fcfs_at_best": 0.95},
              "by_share": [{"share": 0.0, "in_batch_prefill": 0.0, "ttft_p99_x": 1.0,
                            "ttft_p99_x_alone": 1.0, "p99_within_goal_chance": 1.0,
                            "batch_vs_fcfs_at_best": 0.9}]} for s in (0, 1, 2)]
    return {"setup": {"seeds": [0, 1, 2], "goal_x": 1.2, "batch_goal": 0.95,
                      "reserve_headroom": 1.5, "reserve_pace": 1, "max_num_seqs": 16,
                      "live_batch_goal": 0.879, "bound_shares": [0.0]},
            "points": [{"name": "fcfs", "knob": "order", "value": None},
                       {"name": "a", "knob": "reserve_headroom", "value": 1.5},
                       {"name": "b", "knob": "reserve_pace 0, reserve_window_s", "value": 3.0}],
            "flood": rows, "bound": bound}


B = "`reserve_pace` 0, `reserve_window_s` 3"


def _cells(page: str, first: str) -> list[str]:
    line = next(ln for ln in page.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_a_frontier_with_no_setting_meeting_the_goals_says_so() -> None:
    doc = _doc(good=False)
    page = frontier(doc)
    # Medians of each seed's ratios: p99 0.7/0.8/0.9 over 0.2.
    assert _cells(page, "`reserve_headroom` 1.5 (the default)") == [
        "`reserve_headroom` 1.5 (the default)", "1.10x", "4.00x", "98.0%", "98.0%", "yes",
        "no", "no"]
    assert _cells(page, B)[1:] == ["1.00x", "1.50x", "90.0%", "0.0%", "yes",
                                                  "no", "no"]
    assert "simulator's goals (p50 and p99 within 1.2x, batch at least 95.0% of first " \
        "come first served's): no setting meets all three." in page
    assert "live batch goal instead (p50 and p99 within 1.2x, batch at least 87.9%" in page
    assert "engine alone puts the interactive p99 at 1.50x the no-flood one (goal: within " \
        "1.2x): out of reach" in page
    assert "### Live" not in page


def test_a_frontier_with_a_setting_meeting_the_goals_names_it() -> None:
    page = frontier(_doc(good=True))
    assert _cells(page, B)[1:] == ["1.00x", "1.10x", "96.0%", "0.0%", "yes",
                                                  "yes", "yes"]
    assert "simulator's goals (p50 and p99 within 1.2x, batch at least 95.0% of first come " \
        "first served's): 1 meet all three: " + B + " (p50 1.00x, p99 1.10x, batch " \
        "96.0%, while the interactive tenant sends 0.0%)." in page


def test_on_the_frontier_means_no_other_setting_beats_it_in_both() -> None:
    summary = summarise(_doc(good=True)["flood"])
    assert on_frontier(summary) == {"fcfs", "a", "b"}
    # A setting worse than "a" in both the tail and batch throughput is off it.
    summary["c"] = {"p50": 1.0, "p99": 4.5, "batch": 0.97, "while": 0.9}
    summary["d"] = dict(summary["a"])  # a tie: neither beats the other
    assert on_frontier(summary) == {"fcfs", "a", "b", "d"}


def test_the_live_check_is_read_per_run_against_its_own_baselines() -> None:
    doc = _doc(good=True)
    doc["setup"].update(live_flood=200, live_time_scale=0.5, live_cpus=2,
                        live_rate_per_s=4.0, max_num_seqs=16)
    doc["live"] = [{**_row("no_flood", 0, 0.08, 0.15, None), "load_average_1m": 0.5},
                   {**_row("fcfs", 0, 40.0, 44.0, 2300.0), "load_average_1m": 0.6,
                    "interactive_last_arrival_s": 13.0, "batch_last_done_s": 52.0},
                   {**_row("b", 0, 0.08, 0.16, 1700.0, 0.0), "load_average_1m": 5.0}]
    live = frontier(doc)[frontier(doc).index("### Live"):]
    assert _cells(live, "0") == ["0", B, "1.00x", "1.07x", "73.9%", "0.0%",
                                 "5.0 / 0.6 / 0.5", "no", "no"]
    assert "within a point (87.9%)" in live
    assert "sends for 25% of first come first served's batch run live" in live
    assert f"- {B}: all three goals in 0 of 1 runs (0 of 0 quiet); batch 73.9% of first " \
        "come first served's (in the simulator, against the live batch goal: all three)." \
        in live


def test_the_stagger_settings_are_lb_yaml_settings_with_the_stagger_on() -> None:
    by = {p.name: p for p in tf.points()}
    alone = reserve_of(TenantsConfig.model_validate(tf.tenants_of(by["stagger"])))
    assert alone.stagger and not alone.adaptive and not alone.fractions  # reserve: {}
    h3 = reserve_of(TenantsConfig.model_validate(tf.tenants_of(by["stagger_headroom_3"])))
    assert (h3.stagger, h3.headroom, h3.adaptive) == (True, 3.0, frozenset({"batch"}))
    assert not reserve_of(TenantsConfig.model_validate(tf.tenants_of(by["pace_1"]))).stagger


def test_the_stagger_cuts_the_default_reserves_interactive_tail_in_the_simulator() -> None:
    """Seed 0 of the frontier's flood: on the default reserve, the stagger keeps the
    interactive requests out of the batch prefill steps (the default's p99 is several
    times the stagger's), and the batch tenant still gets a share while they send."""
    by = {p.name: p for p in tf.points()}
    _, staggered = tf._run(0, by["stagger_headroom_1.5"])
    _, default = tf._run(0, by["pace_1"])
    assert staggered["ttft_p99_s"] < 0.5 * default["ttft_p99_s"]
    assert staggered["batch_tokens_per_s_while_interactive"] > 0.0
    assert staggered["batch_completed"] == staggered["batch_sent"]


def test_a_partial_live_rerun_keeps_the_other_settings_with_their_own_baselines() -> None:
    doc = _doc(good=True)
    doc["setup"].update(live_flood=200, live_time_scale=0.5, live_cpus=2,
                        live_rate_per_s=4.0, max_num_seqs=16)
    first = [{**_row("no_flood", 0, 0.08, 0.15, None), "load_average_1m": 0.5},
             {**_row("fcfs", 0, 40.0, 44.0, 2300.0), "load_average_1m": 0.6},
             {**_row("b", 0, 0.08, 0.16, 1700.0, 0.0), "load_average_1m": 0.7}]
    second = [{**_row("no_flood", 0, 0.1, 0.2, None), "load_average_1m": 0.5},
              {**_row("fcfs", 0, 40.0, 44.0, 2000.0), "load_average_1m": 0.6},
              {**_row("a", 0, 0.11, 0.22, 1900.0), "load_average_1m": 0.7}]
    doc["live"] = merge_live(first, second)
    doc["live_wall_seconds_by_run"] = {"0": 448.0, "1": 300.0}
    live = frontier(doc)[frontier(doc).index("### Live"):]
    rows = [ln for ln in live.splitlines() if ln.startswith("| 0 |")]
    # b against run 0's baselines (0.16 / 0.15, 1700 / 2300), a against run 1's.
    assert [c.strip() for c in rows[0].strip("|").split("|")][1:5] == [
        B, "1.00x", "1.07x", "73.9%"]
    assert [c.strip() for c in rows[1].strip("|").split("|")][2:5] == [
        "1.10x", "1.10x", "95.0%"]
    assert "--live-points b --live-seeds 0` (448 s of wall time); then " in live
    assert "--live-points a --live-seeds 0` (300 s of wall time)." in live


def test_the_page_says_whether_the_stagger_meets_the_goals() -> None:
    doc = _doc(good=False)
    doc["points"] += [{"name": "pace_1", "knob": "reserve_pace", "value": 1},
                      {"name": "s", "knob": "reserve_stagger", "value": 2.0}]
    for seed in (0, 1, 2):
        doc["flood"] += [_row("pace_1", seed, 0.11, 0.8, 970.0),
                         _row("s", seed, 0.1, 0.244, 952.0, 500.0)]
    page = frontier(doc)
    assert "- The stagger (`reserve_stagger`), the path the engine bound below leaves " \
        "open. `reserve_stagger` on, `reserve_headroom` 2: p99 1.22x, batch 95.2% (50.0% " \
        "while the interactive tenant sends). The default reserve without it: 4.00x " \
        "(batch 97.0%)." in page
    assert "- It meets all three goals in no setting: at the simulator's batch goal " \
        "(95.0%) its lowest p99 is 1.22x (`reserve_stagger` on, `reserve_headroom` 2), " \
        "against the 1.2x goal." in page
    for r in doc["flood"]:
        if r["arm"] == "s":
            r["ttft_p99_s"] = 0.23
    assert "- It meets all three goals in the simulator: `reserve_stagger` on, " \
        "`reserve_headroom` 2." in frontier(doc)
