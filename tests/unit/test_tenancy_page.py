"""The tenancy results page renders medians over the seeds from its JSON, and says whether
the interactive TTFT under a flood is within 20% of the no-flood one, for the fair queue
and the slot reserve, in the simulator and live."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.tenancy_page import tenancy


def _flood(arm: str, seed: int, p50: float, **kw: float) -> dict[str, Any]:
    return {"seed": seed, "arm": arm, "ttft_p50_s": p50, "ttft_p99_s": 2 * p50,
            "batch_sent": 0 if arm == "no_flood" else 10,
            "batch_completed": 0 if arm == "no_flood" else 10,
            "batch_tokens_per_s": None if arm == "no_flood" else 1000.0, **kw}


DOC: dict[str, Any] = {
    "setup": {"replicas": 2, "push_mode": "sp-p", "max_wait_s": {"batch": 60.0}},
    "flood": [_flood("no_flood", 0, 0.1), _flood("no_flood", 1, 0.3), _flood("no_flood", 2, 0.2),
              _flood("fcfs", 0, 5.0), _flood("fcfs", 1, 6.0), _flood("fcfs", 2, 7.0),
              *(_flood("fair", s, 0.3, batch_longest_wait_s=40.0 + s,
                       batch_longest_unserved_s=1.5) for s in range(3)),
              *(_flood("fair_reserve", s, 0.22, batch_tokens_per_s=950.0,
                       batch_longest_unserved_s=2.5) for s in range(3))],
    "share": [{"arm": "fcfs", "both_backlogged_s": 50.0, "windows": 9, "light_share": 0.09,
               "light_share_window_min": 0.05, "light_share_window_max": 0.12},
              {"arm": "fair", "both_backlogged_s": 20.0, "windows": 3, "light_share": 0.5,
               "light_share_window_min": 0.48, "light_share_window_max": 0.52}],
    "limits": [{"spread": "even", "offered_per_s": 30.0, "admitted_per_s": 10.1,
                "limit_per_s": 10.0},
               {"spread": "one", "offered_per_s": 30.0, "admitted_per_s": 5.0,
                "limit_per_s": 10.0}],
    "date": "2026-11-28", "wall_seconds": 30.0}


def _row(page: str, first: str) -> list[str]:
    line = next(ln for ln in page.splitlines() if ln.startswith(f"| {first} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_flood_rows_are_medians_and_the_20_percent_verdict_follows() -> None:
    page = tenancy(DOC)
    assert _row(page, "no flood")[:6] == ["no flood", "3", "0.200 s", "0.400 s", "-", "-"]
    assert _row(page, "flood, fair queue") == ["flood, fair queue", "3", "0.300 s", "0.600 s",
                                               "10 / 10", "1,000", "100.0%", "-", "41.0 s",
                                               "1.50 s"]
    assert _row(page, "flood, fair queue + slot reserve")[5:7] == ["950", "95.0%"]
    assert "fair queue: the interactive TTFT p50 under the flood is 1.50x the no-flood " \
        "one (goal: within 20%): goal not met" in page
    assert "slot reserve: the interactive TTFT p50 under the flood is 1.10x the no-flood " \
        "one (goal: within 20%): goal met" in page
    assert "slot reserve: the interactive TTFT p99 under the flood is 1.10x" in page
    assert "unserved for at most 2.5 s, within its aging bound (`max_wait_s.batch`, 60 s)" \
        in page
    close = {**DOC, "flood": [_flood("no_flood", 0, 0.25), _flood("fair", 0, 0.3)]}
    assert "1.20x the no-flood one (goal: within 20%): goal met" in tenancy(close)
    assert "### Live" not in page


def test_live_section_renders_the_same_arms_when_present() -> None:
    live = [_flood("no_flood", 0, 0.1, load_average_1m=1.0),
            _flood("fcfs", 0, 3.0, load_average_1m=1.0),
            _flood("fair_reserve", 0, 0.15, batch_tokens_per_s=900.0, load_average_1m=1.0)]
    page = tenancy({**DOC, "live": live, "setup": {**DOC["setup"], "live_time_scale": 0.5,
                                                   "live_flood": 200, "max_num_seqs": 16}})
    live_part = page[page.index("### Live"):]
    assert "`--max-num-seqs 16 --time-scale 0.5`" in live_part
    assert _row(live_part, "flood, fair queue + slot reserve")[2:7] == [
        "0.150 s", "0.300 s", "10 / 10", "900", "90.0%"]
    assert "p50 under the flood is 1.50x the no-flood one (the quiet run) " \
        "(goal: within 20%): goal not met" in live_part
    assert "one run" in live_part and "releases held back" not in live_part


def test_live_phases_table_gives_medians_over_the_runs() -> None:
    def phased(seed: int, starts: float, held: float) -> dict[str, object]:
        return {**_flood("fair_reserve", seed, 0.15),
                "paced_phase": {"batch_starts_per_s_per_replica": starts,
                                "running_per_replica": 10.0},
                "after_phase": {"batch_starts_per_s_per_replica": 2.0,
                                "running_per_replica": 15.0},
                "reserve_could_hold_share": 1.0, "reserve_held_total": held}

    live = [_flood("no_flood", 0, 0.1), _flood("fcfs", 0, 3.0), _flood("fcfs", 1, 3.0),
            phased(0, 1.0, 100.0), phased(1, 2.0, 300.0), phased(2, 2.5, 500.0)]
    page = tenancy({**DOC, "live": live, "setup": {**DOC["setup"], "live_time_scale": 0.5}})
    live_part = page[page.index("### Live"):]
    assert "medians of 3 runs" in live_part
    phases = live_part[live_part.index("releases held back"):]
    assert _row(phases, "flood, fair queue + slot reserve")[1:] == [
        "3", "2.00", "10.0", "2.00", "15.0", "100%", "300"]
    assert "While pacing may hold" not in phases  # no unpaced arm to compare
    nopace = [{**r, "arm": "fair_reserve_nopace"} for r in live if r["arm"] == "fair_reserve"]
    fcfs = [{**phased(0, 2.5, 0.0), "arm": "fcfs"}]
    page = tenancy({**DOC, "live": [*live, *nopace, *fcfs], "setup": DOC["setup"]})
    assert "starts 2.00 batch requests per second per replica, without pacing 2.00; the " \
        "requests running per replica are 10.0 against first come first served's 10.0" in page
    assert "not the pacing." in page


def test_share_and_limit_tables() -> None:
    page = tenancy(DOC)
    assert _row(page, "fair queue")[4:] == ["50.0%", "48.0% - 52.0%"]
    assert _row(page, "first come first served")[4] == "9.0%"
    assert _row(page, "alternating")[3:] == ["10.10/s", "10/s", "101.0%"]
    assert _row(page, "all to one")[-1] == "50.0%"


def test_lull_table_compares_reserve_idle_times_with_the_fair_queue_alone() -> None:
    lull = [{"seed": 0, "idle_s": None, "ttft_p50_s": 3.0, "ttft_after_lull_max_s": 5.0,
             "batch_tokens_per_s": 1000.0},
            {"seed": 0, "idle_s": 30.0, "ttft_p50_s": 0.16, "ttft_after_lull_max_s": 1.1,
             "batch_tokens_per_s": 950.0}]
    page = tenancy({**DOC, "lull": lull, "setup": {**DOC["setup"], "lull_s": 60.0}})
    assert "falls silent for 60.0 s" in page
    assert _row(page, "fair queue alone")[2:] == ["3.000 s", "5.00 s", "1,000", "100.0%"]
    assert _row(page, "reserve, idle 30 s")[3:] == ["1.10 s", "950", "95.0%"]
    assert "### A lull" not in tenancy(DOC)


def test_batch_goal_is_judged_against_the_capacity_the_interactive_tenant_leaves() -> None:
    """The batch tenant's goal: its throughput against first come first served's, where
    the interactive tenant's own tokens are not idle capacity; said plainly, met or not."""
    setup = {**DOC["setup"], "interactive_request_tokens": 250, "batch_request_tokens": 600}
    rows = [_flood("no_flood", 0, 0.1, interactive_sent=60),
            _flood("fcfs", 0, 5.0, interactive_sent=60, batch_sent=600),
            _flood("fair_reserve", 0, 0.11, interactive_sent=60, batch_sent=600,
                   batch_tokens_per_s=955.0),
            _flood("fair_reserve_fixed", 0, 0.11, interactive_sent=60, batch_sent=600,
                   batch_tokens_per_s=900.0)]
    page = tenancy({**DOC, "flood": rows, "setup": setup})
    # 600 x 600 of 600 x 600 + 60 x 250 tokens: 96.0% is idle capacity for batch.
    assert "slot reserve: the batch tenant's throughput to its last is 95.5% of first " \
        "come first served's, where the idle capacity is 96.0% of it" in page
    assert "(the run's tokens less the interactive tenant's; goal: all of it, within a " \
        "point): goal met." in page
    assert "a fixed reserve of a quarter: the batch tenant's throughput to its last is " \
        "90.0%" in page
    assert page.count("goal not met.") >= 1


def test_tail_engine_and_light_sections_render_from_their_rows() -> None:
    part = {"ttft_s": 0.6, "fair_queue_s": 0.0, "dispatch_s": 0.05, "engine_wait_s": 0.15,
            "prefill_s": 0.4, "batch_prefills": 1.0, "batch_prefill_running": 1.0}
    fast = {**part, "ttft_s": 0.2, "engine_wait_s": 0.05, "prefill_s": 0.1,
            "batch_prefills": 0.1, "batch_prefill_running": 0.2}
    tail = [{"seed": s, "arm": "fair_reserve", "all": fast, "slowest": part}
            for s in range(3)]
    engine = [{"seqs": 12, "tokens_per_s": 480.0, "profile": "p"},
              {"seqs": 16, "tokens_per_s": 600.0, "profile": "p"}]
    flood = [*DOC["flood"], _flood("fair_reserve", 9, 0.2, interactive_last_arrival_s=30.0,
                                   batch_last_done_s=300.0)]
    live = [_flood("fair_reserve", 0, 0.2, interactive_last_arrival_s=15.0,
                   batch_last_done_s=90.0)]
    setup = {**DOC["setup"], "reserve_idle_s": 30.0, "reserve_window_s": 10.0,
             "tail_share": 0.05,
             "light_rate_per_s": 0.5}
    page = tenancy({**DOC, "flood": flood, "tail": tail, "engine": engine, "live": live,
                    "light": DOC["flood"], "setup": setup})
    slow = _row(page, "flood, fair queue + slot reserve | slowest 5%")
    assert slow[2:10] == ["3", "0.600 s", "0.000 s", "0.050 s", "0.150 s", "0.400 s",
                          "1.00", "100%"]
    assert "the largest part is engine: prefill step(s) and reply (0.400 s); inside the " \
        "engine 0.550 s, at the balancer 0.050 s." in page
    assert _row(page, "12")[1:] == ["480", "80.0%", "75.0%"]
    # Held from the start to reserve_idle_s (30 s; pacing: reserve_window_s, 10 s) after
    # the last interactive arrival.
    assert "Here the reserve covers 20% of it in the simulator and 50% live; its pacing " \
        "covers 13% of it in the simulator and 28% live." in page
    assert "### A light interactive tenant" in page and "at 0.5/s" in page


def test_live_runs_are_judged_each_against_their_own_baselines() -> None:
    """The spread across live runs: each reserve arm's batch throughput and p50 against
    the same run's first come first served and no flood, and the runs meeting both goals;
    an arm with another reserve_headroom is named by it; the idle capacity is said to be
    computed alike, beside what the fair queue alone gets."""
    setup = {**DOC["setup"], "interactive_request_tokens": 250, "batch_request_tokens": 600}

    def run(arm: str, seed: int, p50: float, tps: float | None = None,
            **kw: Any) -> dict[str, Any]:
        r = _flood(arm, seed, p50, interactive_sent=60, **kw)
        if arm != "no_flood":
            r.update(batch_sent=200, batch_tokens_per_s=tps)
        return r

    # The baselines ran quiet (a run counts as quiet only with them: the last test).
    live = [run("no_flood", 0, 0.10, load_average_1m=1.0),
            run("no_flood", 1, 0.20, load_average_1m=1.0),
            run("fcfs", 0, 40.0, 2000.0, load_average_1m=1.0),
            run("fcfs", 1, 40.0, 1000.0, load_average_1m=1.0),
            run("fair", 0, 1.0, 1900.0), run("fair", 1, 1.0, 950.0),
            run("fair_reserve", 0, 0.11, 1800.0, load_average_1m=3.2),
            run("fair_reserve", 1, 0.26, 850.0, load_average_1m=17.6),
            run("fair_reserve_h1", 0, 0.11, 1700.0, reserve_headroom=1.0),
            run("fair_reserve_h1", 1, 0.21, 880.0, reserve_headroom=1.0)]
    page = tenancy({**DOC, "live": live, "setup": setup})
    live_part = page[page.index("### Live"):]
    # Idle capacity 200 x 600 / (200 x 600 + 60 x 250) = 88.9%: 90% meets it, 85% not.
    assert _row(live_part, "flood, fair queue + slot reserve | 90.0% / 85.0%") == [
        "flood, fair queue + slot reserve", "90.0% / 85.0%", "5.0 points", "1.10x / 1.30x",
        "1 of 2", "1 of 1", "3 / 18"]
    assert _row(live_part, "the same, `reserve_headroom` 1.0 | 85.0% / 88.0%")[2:] == [
        "3.0 points", "1.10x / 1.05x", "1 of 2", "0 of 0", "- / -"]
    # Quiet: a load average of at most 2 per core (no cores recorded: 2 assumed).
    assert "- flood, fair queue + slot reserve: both goals in each quiet run: goal met " \
        "(1 of 1)." in live_part
    assert "| the same, `reserve_headroom` 1.0 | 2 |" in live_part  # the arms' table too
    assert "The idle capacity (88.9%) is computed alike in the simulator and live" \
        in live_part
    assert "The fair queue alone, which keeps no slot free, gets 95.0%" in live_part


def test_live_phase_notes_say_whether_the_runs_tail_slows_the_batch_tenant() -> None:
    def phased(arm: str, after: float, running: float = 14.0) -> dict[str, Any]:
        return {**_flood(arm, 0, 0.15),
                "paced_phase": {"batch_starts_per_s_per_replica": 1.3,
                                "running_per_replica": 9.0},
                "after_phase": {"batch_starts_per_s_per_replica": after,
                                "running_per_replica": running}}

    def page(after: float) -> str:
        live = [_flood("no_flood", 0, 0.1), phased("fcfs", 1.7, 15.9), phased("fair", 1.6),
                phased("fair_reserve", after), phased("fair_reserve_nopace", 1.75)]
        return tenancy({**DOC, "live": live, "setup": DOC["setup"]})

    assert "and 14.0 against 15.9 after" in page(1.7)

    assert "After pacing's window the default reserve starts 1.70 batch requests per " \
        "second per replica, first come first served 1.70, the fair queue alone 1.60: " \
        "the run's tail, where the reserve keeps a slot per replica free until " \
        "`reserve_idle_s`, does not slow it" in page(1.7)
    assert "`reserve_idle_s`, slows it" in page(1.2)


def test_reserve_by_arrivals_is_judged_against_the_default_in_both_runs() -> None:
    """The arms sized by arrivals get goal lines and a verdict against the default
    reserve: a new default only if the simulator is no worse and live better."""
    def arms(miss_tps: float, miss_p50: float) -> list[dict[str, Any]]:
        return [_flood("no_flood", 0, 0.2), _flood("fcfs", 0, 5.0),
                _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=900.0),
                _flood("fair_reserve_miss01", 0, miss_p50, batch_tokens_per_s=miss_tps,
                       reserve_miss=0.01)]

    page = tenancy({**DOC, "flood": arms(950.0, 0.22), "live": arms(980.0, 0.23)})
    label = "the same, by arrivals, `reserve_miss` 0.01"
    assert _row(page, label)[5:7] == ["950", "95.0%"]
    assert f"- {label}: the interactive TTFT p50 under the flood is 1.10x" in page
    assert (f"- {label}, simulator: batch 95.0% of first come first served's (the default "
            "reserve 90.0%), interactive p50 1.10x (1.10x), p99 1.10x (1.10x): no worse; "
            "live: batch 98.0% (90.0%), interactive p50 1.15x (1.10x): better. It meets "
            "the rule") in page
    # A worse simulator p50, or no more batch live: not a new default.
    worse = tenancy({**DOC, "flood": arms(950.0, 0.24), "live": arms(980.0, 0.23)})
    assert "p50 1.20x (1.10x), p99 1.20x (1.10x): worse in p50, p99" in worse
    assert "It does not meet the rule" in worse
    flat = tenancy({**DOC, "flood": arms(950.0, 0.22), "live": arms(900.0, 0.22)})
    assert "live: batch 90.0% (90.0%), interactive p50 1.10x (1.10x): not better" in flat


def test_other_reserves_are_judged_on_each_quiet_live_run() -> None:
    """Counting the slots held (and any other reserve) against the default: live, in each
    run quiet for both, more batch throughput at a p50 within its goal; a busy run does
    not count, and one quiet run short is enough to say not better."""
    def run(arm: str, seed: int, p50: float, tps: float | None = None,
            load: float = 1.0) -> dict[str, Any]:
        r = _flood(arm, seed, p50, load_average_1m=load)
        if tps is not None:
            r["batch_tokens_per_s"] = tps
        return r

    def live(held_quiet_tps: float) -> list[dict[str, Any]]:
        return [*(run("no_flood", s, 0.1) for s in (0, 1)),
                *(run("fcfs", s, 5.0, 1000.0) for s in (0, 1)),
                run("fair_reserve", 0, 0.11, 850.0), run("fair_reserve", 1, 0.11, 900.0, 30),
                run("fair_reserve_held", 0, 0.11, held_quiet_tps),
                run("fair_reserve_held", 1, 0.11, 600.0, 30)]

    flood = [run("no_flood", 0, 0.1), run("fcfs", 0, 5.0, 1000.0),
             run("fair_reserve", 0, 0.11, 900.0), run("fair_reserve_held", 0, 0.11, 950.0)]
    label = "the same, counting the slots held (`reserve_held`)"
    page = tenancy({**DOC, "flood": flood, "live": live(880.0)})
    assert (f"- {label}, simulator: batch 95.0% of first come first served's (the default "
            "reserve 90.0%), interactive p50 1.10x (1.10x), p99 1.10x (1.10x): no worse; "
            "live: batch 74.0% (87.5%), interactive p50 1.10x (1.10x), in the quiet runs "
            "batch 88.0% (85.0%), p50 1.10x (1.10x): better. It meets the rule") in page
    assert f"- {label}: the interactive TTFT p50 under the flood is 1.10x" in page
    short = tenancy({**DOC, "flood": flood, "live": live(840.0)})
    assert "in the quiet runs batch 84.0% (85.0%), p50 1.10x (1.10x): not better. " \
        "It does not meet the rule" in short


def test_reserve_with_another_fall_is_labelled_and_judged_against_the_default() -> None:
    """An arm with ``reserve_fall_s`` gets its own label, goal lines and a verdict."""
    def arms(tps: float) -> list[dict[str, Any]]:
        return [_flood("no_flood", 0, 0.2), _flood("fcfs", 0, 5.0),
                _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=900.0),
                _flood("fair_reserve_fall15", 0, 0.22, batch_tokens_per_s=tps,
                       reserve_fall_s=1.5)]

    page = tenancy({**DOC, "flood": arms(950.0), "live": arms(960.0)})
    label = "the same, `reserve_fall_s` 1.5"
    assert _row(page, label)[5:7] == ["950", "95.0%"]
    assert f"- {label}: the interactive TTFT p50 under the flood is 1.10x" in page
    assert (f"- {label}, simulator: batch 95.0% of first come first served's (the default "
            "reserve 90.0%)") in page
    assert "live: batch 96.0% (90.0%), interactive p50 1.10x (1.10x): better. It meets" \
        in page


def test_a_reserve_measured_only_on_a_busy_machine_awaits_quiet_runs() -> None:
    """Loads recorded and none quiet: live is not judged on busy medians alone."""
    def arms(load: float) -> list[dict[str, Any]]:
        return [_flood("no_flood", 0, 0.2, load_average_1m=load),
                _flood("fcfs", 0, 5.0, load_average_1m=load),
                _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=800.0,
                       load_average_1m=load),
                _flood("fair_reserve_fall15", 0, 0.22, batch_tokens_per_s=950.0,
                       reserve_fall_s=1.5, load_average_1m=load)]

    busy = tenancy({**DOC, "flood": arms(1.0), "live": arms(7.0)})
    assert ("live: batch 95.0% (80.0%), interactive p50 1.10x (1.10x): better on the "
            "medians, but no run was quiet for both and their baselines (load average "
            "at most 4). The "
            "simulator meets the rule for a new default; live it awaits quiet runs") in busy
    quiet = tenancy({**DOC, "flood": arms(1.0), "live": arms(1.0)})
    assert "in the quiet runs batch 95.0% (80.0%), p50 1.10x (1.10x): better. It meets" \
        in quiet


def test_the_light_load_compares_a_reserve_with_another_fall_with_the_default() -> None:
    light = [_flood("no_flood", 0, 0.1), _flood("fcfs", 0, 5.0),
             _flood("fair_reserve", 0, 0.14, batch_tokens_per_s=900.0),
             _flood("fair_reserve_fall15", 0, 0.15, batch_tokens_per_s=950.0,
                    reserve_fall_s=1.5)]
    page = tenancy({**DOC, "light": light})
    assert ("- the same, `reserve_fall_s` 1.5 at this light load: interactive p50 1.50x "
            "(the default reserve 1.40x), p99 1.50x (1.40x), batch 95.0% (90.0%): worse in "
            "p50, p99.") in page


def test_a_fall_over_gaps_is_labelled_apart_and_judged() -> None:
    """A ``reserve_fall_gaps`` arm gets a label of its own (not the plain fall's), goal
    lines, a verdict and a light-load line."""
    def arms(tps: float) -> list[dict[str, Any]]:
        return [_flood("no_flood", 0, 0.2), _flood("fcfs", 0, 5.0),
                _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=900.0),
                _flood("fair_reserve_fall15", 0, 0.22, batch_tokens_per_s=tps,
                       reserve_fall_s=1.5),
                _flood("fair_reserve_gaps4", 0, 0.22, batch_tokens_per_s=tps,
                       reserve_fall_gaps=4.0)]

    page = tenancy({**DOC, "flood": arms(950.0), "live": arms(960.0), "light": arms(950.0)})
    for label in ("the same, `reserve_fall_gaps` 4.0",):
        assert _row(page, label)[5:7] == ["950", "95.0%"]
        assert f"- {label}: the interactive TTFT p50 under the flood is 1.10x" in page
        assert (f"- {label}, simulator: batch 95.0% of first come first served's (the "
                "default reserve 90.0%)") in page
        assert f"- {label} at this light load: interactive p50 1.10x" in page
    # The plain fall keeps its own rows: as many as each of the others (not merged).
    def rows(label: str) -> int:
        return sum(ln.startswith(f"| {label} |") for ln in page.splitlines())

    assert rows("the same, `reserve_fall_s` 1.5") == rows("the same, `reserve_fall_gaps` 4.0") \
        > 0


def test_the_default_before_is_labelled_and_judged_against_the_new_default() -> None:
    """Since reserve_fall_gaps 4 is the default, its arm with the key null (a fall over
    reserve_window_s) is the default before: labelled so, judged against the default."""
    def arms(tps: float) -> list[dict[str, Any]]:
        return [_flood("no_flood", 0, 0.2), _flood("fcfs", 0, 5.0),
                _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=950.0),
                _flood("fair_reserve_fallwindow", 0, 0.22, batch_tokens_per_s=tps,
                       reserve_fall_gaps=None)]  # type: ignore[arg-type]

    setup = {**DOC["setup"], "reserve_fall_gaps": 4.0, "reserve_window_s": 10.0, "reserve_pace": 1,
             "light_rate_per_s": 0.5}
    page = tenancy({**DOC, "flood": arms(900.0), "light": arms(900.0), "setup": setup})
    label = "the same, its mean falling over `reserve_window_s` (the default before)"
    assert _row(page, label)[5:7] == ["900", "90.0%"]
    assert (f"- {label}, simulator: batch 90.0% of first come first served's (the "
            "default reserve 95.0%)") in page
    assert f"- {label} at this light load: interactive p50 1.10x" in page
    assert "`reserve_pace` 1, its mean falling over `reserve_fall_gaps` 4.0 of the " \
        "interactive mean inter-arrival gaps, at most `reserve_window_s` 10.0 s)" in page


def test_live_goal_lines_judge_only_runs_quiet_for_the_arm_and_its_baseline() -> None:
    """A busy run's inflated no-flood p99 must not make the reserve look better than no
    flood: the live goal lines take medians over the runs quiet for both the arm and its
    pair (no flood for the TTFT, first come first served for the batch throughput)."""
    setup = {**DOC["setup"], "interactive_request_tokens": 250, "batch_request_tokens": 600,
             "live_cpus": 2}

    def run(arm: str, seed: int, p50: float, load: float, tps: float = 1000.0,
            **kw: Any) -> dict[str, Any]:
        r = _flood(arm, seed, p50, interactive_sent=60, load_average_1m=load, **kw)
        if arm != "no_flood":
            r.update(batch_sent=200, batch_tokens_per_s=tps)
        return r

    live = [run("no_flood", 0, 0.10, 1.0), run("fcfs", 0, 40.0, 1.0, 2000.0),
            run("fair_reserve", 0, 0.11, 1.0, 1800.0),
            # Run 1: busy no flood (p99 2.0 s), quiet arm and fcfs.
            run("no_flood", 1, 1.00, 9.0), run("fcfs", 1, 40.0, 1.0, 2000.0),
            run("fair_reserve", 1, 0.11, 1.0, 1000.0),
            run("fair_reserve_fixed", 1, 0.11, 9.0, 1000.0)]
    page = tenancy({**DOC, "live": live, "setup": setup})
    live_part = page[page.index("### Live"):page.index("Per run (each against")]
    # Run 0 only: p50 0.11 / 0.10, p99 0.22 / 0.20; over both runs it would be 0.20x.
    assert "- flood, fair queue + slot reserve: the interactive TTFT p50 under the flood " \
        "is 1.10x the no-flood one (the quiet run) (goal: within 20%): " \
        "goal met." in live_part
    assert "p99 under the flood is 1.10x the no-flood one (the quiet run)" \
        in live_part
    # Batch: both runs are quiet with their fcfs: (1800 + 1000) / 2 / 2000 = 70%.
    assert "- flood, fair queue + slot reserve: the batch tenant's throughput to its " \
        "last is 70.0% of first come first served's (medians of the 2 quiet runs)" \
        in live_part
    # An arm with no quiet run: said, not judged.
    assert "- the same, a fixed reserve of a quarter: the interactive TTFT under the " \
        "flood: no quiet run (of the arm and its no flood) to judge." in live_part
    assert "- the same, a fixed reserve of a quarter: the batch tenant's throughput: no " \
        "quiet run (of the arm and its first come first served) to judge." in live_part
    assert "fixed reserve of a quarter: the interactive TTFT p50" not in live_part


def test_a_run_with_a_busy_baseline_is_not_a_quiet_run() -> None:
    """The per-run table's quiet count and the comparison with the default take a run as
    quiet only when the arm and the run's first come first served and no flood all were:
    a busy no flood's p50 moves the ratio as much as a busy arm (session 24's run 0)."""
    setup = {**DOC["setup"], "live_cpus": 2, "interactive_request_tokens": 250,
             "batch_request_tokens": 600}

    def run(arm: str, seed: int, p50: float, load: float, tps: float = 1000.0
            ) -> dict[str, Any]:
        r = _flood(arm, seed, p50, interactive_sent=60, load_average_1m=load)
        if arm != "no_flood":
            r.update(batch_sent=200, batch_tokens_per_s=tps)
        return r

    def live(base_load: float) -> list[dict[str, Any]]:
        return [run("no_flood", 0, 0.10, base_load), run("fcfs", 0, 5.0, 1.0),
                run("fair_reserve", 0, 0.11, 1.0, 950.0),
                run("fair_reserve_h1", 0, 0.11, 1.0, 990.0),
                run("no_flood", 1, 0.10, 1.0), run("fcfs", 1, 5.0, 1.0),
                run("fair_reserve", 1, 0.11, 1.0, 950.0),
                run("fair_reserve_h1", 1, 0.11, 1.0, 990.0)]

    def headroom(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "reserve_headroom": 1.0} if r["arm"] == "fair_reserve_h1" else r
                for r in rows]

    flood = headroom([_flood("no_flood", 0, 0.2), _flood("fcfs", 0, 5.0),
                      _flood("fair_reserve", 0, 0.22, batch_tokens_per_s=900.0),
                      _flood("fair_reserve_h1", 0, 0.22, batch_tokens_per_s=950.0)])
    quiet = tenancy({**DOC, "flood": flood, "live": headroom(live(1.0)), "setup": setup})
    busy = tenancy({**DOC, "flood": flood, "live": headroom(live(9.0)), "setup": setup})

    def per_run(page: str) -> list[str]:  # the default's row in the per-run table
        return _row(page[page.index("Per run (each against"):],
                    "flood, fair queue + slot reserve")

    assert per_run(quiet)[4:6] == ["2 of 2", "2 of 2"]
    assert per_run(busy)[4:6] == ["2 of 2", "1 of 1"]
    assert "in the quiet runs batch 99.0% (95.0%) / 99.0% (95.0%)," in quiet
    assert "in the quiet runs batch 99.0% (95.0%), p50" in busy
