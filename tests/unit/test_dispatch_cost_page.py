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
