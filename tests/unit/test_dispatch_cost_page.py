"""The dispatch-cost page says why decisions differ from the base, and shows the live
benchmark's shape (``@stubs``) when the JSON has it."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.dispatch_cost_page import dispatch_cost


def _modes(pt: float, stubs: bool) -> dict[str, Any]:
    names = {"round-robin+bp": 10.0, "prefix-tree+sp-p": pt, "least-load+sp-p": 20.0}
    if stubs:
        names |= {"round-robin+bp@stubs": 10.0, "prefix-tree+sp-p@stubs": pt / 2,
                  "prefix-tree+bp@stubs": 15.0}
    return {n: {"us_per_request": v, "min": v, "max": v, "digest": "x"}
            for n, v in names.items()}


def _doc(stubs: bool, same: bool) -> dict[str, Any]:
    setup: dict[str, Any] = {"replicas": 8, "max_num_seqs": 8, "prefer_queue": 3,
                             "clients": 96, "requests": 100, "repeat": 1, "seed": 0}
    if stubs:
        setup["stubs"] = {"replicas": 2, "clients": 64, "prompts": 16,
                          "prompt_chars": 2000, "metrics_lag_s": 1.0}
    cur = {"modes": _modes(100.0, stubs), "default_over_round_robin": 10.0}
    base = {"modes": _modes(120.0, stubs), "default_over_round_robin": 12.0,
            "label": "abc1234"}
    if stubs:
        cur["stubs_default_over_round_robin"] = 5.0
        base["stubs_default_over_round_robin"] = 6.0
    return {"setup": setup, "current": cur, "base": base,
            "same_decisions": {n: same or n.startswith("round-robin")
                               for n in cur["modes"]},
            "speedup": {n: 1.0 for n in cur["modes"]}}


def test_the_page_says_which_decisions_differ_and_why() -> None:
    page = dispatch_cost(_doc(stubs=True, same=False))
    assert "Decisions differ from `abc1234` for prefix-tree+sp-p" in page
    assert "RouteRequest.tie" in page
    assert "| prefix-tree+sp-p@stubs | 50 [50, 50] | 60 [60, 60] |" in page
    assert "**5x** now" in page and "6x" in page
    assert "2 replicas that publish neither" in page


def test_same_decisions_and_no_stubs_leave_those_out() -> None:
    page = dispatch_cost(_doc(stubs=False, same=True))
    assert "Decisions differ" not in page and "@stubs" not in page


def _live(told: bool) -> dict[str, Any]:
    def cfg(v: float) -> dict[str, Any]:
        return {"rounds": [v], "median": v, "min": v, "max": v}

    configs = {"default": cfg(180.0), "rr": cfg(110.0)}
    setup_configs = {"default": "(no flags)", "rr": "--policy round-robin --push-mode bp"}
    ratios: dict[str, Any] = {"default": {"rounds": [1.64], "median": 1.64}}
    if told:
        configs["default-told"] = cfg(130.0)
        setup_configs["default-told"] = "--config {tmp}/told.yaml"
        ratios["default-told"] = {"rounds": [1.18], "median": 1.18}
    setup = {"rounds": 1, "duration_s": 4, "seed": 0, "connections": 64, "workers": 1,
             "configs": setup_configs, "base": None, "commit": "abc", "cpus": 2,
             "load_average_1m_at_start": 1.0, "date": "2026-11-29",
             "told_yaml": "pushing:\n  max_num_seqs: 256\n  prefer_queue: 256\n"}
    return {"setup": setup, "command": "python -m x",
            "versions": {"current": {"configs": configs, "ratio_rounds": [1.64],
                                     "ratio_median": 1.64, "ratios": ratios}}}


def _told_doc() -> dict[str, Any]:
    """A run with the @told row and a live run with its default-told arm."""
    doc = _doc(stubs=True, same=True)
    doc["current"]["modes"]["prefix-tree+sp-p@told"] = {
        "us_per_request": 22.0, "min": 21.0, "max": 23.0, "digest": "y"}
    doc["current"]["told_default_over_round_robin"] = 2.2
    doc["setup"]["told"] = {"max_num_seqs": 256, "prefer_queue": 256, "warmup": 1000}
    doc["dispatch-cost-live"] = _live(told=True)
    return doc


def test_the_page_shows_the_default_where_sp_p_does_not_bind() -> None:
    doc = _told_doc()
    page = dispatch_cost(doc)
    # 70 us between default and rr, 50 of it the queue, 20 over rr without it.
    for part in ("| prefix-tree+sp-p@told | 22 [21, 23] |",
                 "(@told) it costs **2.2x** round-robin+bp@stubs now, 12 us more",
                 "`pushing: {max_num_seqs: 256, prefer_queue: 256}`",
                 "| 130 [130, 130] | 1.18 | **1.18x** |", "(70 us per request",
                 "(default-told) costs 20 us over rr", "the default costs 50 us more than that"):
        assert part in page, part


def test_a_default_below_its_told_arm_reads_as_the_rounds_spread() -> None:
    doc = _told_doc()
    told = doc["dispatch-cost-live"]["versions"]["current"]["configs"]["default-told"]
    told.update(rounds=[185.0], median=185.0, min=185.0, max=185.0)
    page = dispatch_cost(doc)
    assert ("the default costs 5 us less than that, within the spread between rounds: "
            "here nothing shows of what sp-p's limit may still cost once learnt") in page
    assert "more than that" not in page


def test_a_live_run_without_the_told_arm_keeps_its_table() -> None:
    doc = _doc(stubs=True, same=True)
    doc["dispatch-cost-live"] = _live(told=False)
    page = dispatch_cost(doc)
    assert "not binding" not in page and "standing queue itself" not in page
    assert "| now | 180 [180, 180] | 110 [110, 110] | 1.64 | **1.64x** |" in page


def _live_limits(limits: dict[str, list[list[int | None]]]) -> dict[str, Any]:
    def configs(v: str) -> dict[str, Any]:
        return {"default": {"rounds": [150.0], "median": 150.0, "min": 150.0, "max": 150.0,
                            "limits": limits.get(v, [])},
                "rr": {"rounds": [100.0], "median": 100.0, "min": 100.0, "max": 100.0}}

    return {"setup": {"rounds": 1, "duration_s": 4.0, "warmup_s": 1.0, "seed": 0,
                      "connections": 64, "workers": 1, "base": "abc1234",
                      "configs": {"default": "(no flags)", "rr": "--policy round-robin"},
                      "commit": "x", "load_average_1m_at_start": 1.0, "cpus": 2,
                      "date": "2026-11-29"},
            "command": "python -m skymesh_lab.bench.dispatch_cost_live",
            "versions": {v: {"configs": configs(v), "ratio_rounds": [1.5],
                             "ratio_median": 1.5} for v in ("current", "base")}}


def test_the_live_section_gives_the_limits_sp_p_learned_for_the_stubs() -> None:
    doc = _doc(stubs=True, same=True) | {
        "dispatch-cost-live": _live_limits({"current": [[46, 62]], "base": [[2, 2]]})}
    page = dispatch_cost(doc)
    assert "after 1 s of the same load, not counted" in page
    assert "the default's segments): now 46-62, at the base 2, for 64 connections" in page
    # An older JSON without them: no such clause.
    older = dispatch_cost(_doc(stubs=True, same=True) | {"dispatch-cost-live": _live_limits({})})
    assert "segment's end" not in older


def test_the_live_section_says_the_machine_as_its_load_average_was() -> None:
    """Not a fixed "spread widely on the loaded machine" (said of a run at load 0.22)."""
    live = _live_limits({})
    live["versions"]["current"]["ratio_rounds"] = [1.2, 1.1, 1.43]
    for load, state in ((0.22, "the machine quiet"), (1.0, "a loaded machine")):
        live["setup"]["load_average_1m_at_start"] = load
        page = dispatch_cost(_doc(stubs=True, same=True) | {"dispatch-cost-live": live})
        assert (f"2 CPUs shared with other jobs ({state} at start: load average {load:g}), "
                "commit `x`; the per-round ratios range from 1.1 to 1.43 now, so the median "
                "is the figure.") in page
        assert "loaded machine's" not in page and "spread widely" not in page

