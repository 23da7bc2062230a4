"""The autopilot results page reads the run's own data: when it calls the machine starved,
and the generated comparison of the autopilot against the other arms."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.autopilot_live_page import MIN_ROUNDS, comparison, starved


def arm(gpu_hours: float, slo: float, met: int = 5, short: int = 2) -> dict[str, Any]:
    return {"gpu_hours": gpu_hours, "slo_attainment": slo, "rises": 6, "rises_met": met,
            "short_hours": short, "requests": 100, "not_sent_late": 0}


def doc(load_start: float, load_end: float, rounds: int) -> dict[str, Any]:
    return {"machine": {"cpus": 2, "load_average_1m_at_start": load_start,
                        "load_average_1m_at_end": load_end},
            "rounds": rounds,
            "arms": {"autopilot": arm(240, 0.5), "fixed": arm(288, 0.6, 6, 0)}}


def test_the_demos_own_load_is_not_a_sign_of_starvation() -> None:
    assert starved(doc(1.0, 6.0, 23)) == []


def test_other_jobs_before_the_demo_and_missed_rounds_are() -> None:
    signs = starved(doc(9.5, 12.0, MIN_ROUNDS - 1))
    assert any("9.5 on 2 cores before the demo" in s for s in signs)
    assert any(f"{MIN_ROUNDS - 1} planner rounds" in s for s in signs)


def test_late_requests_are_counted_over_every_arm() -> None:
    d = doc(1.0, 2.0, 24)
    d["arms"]["fixed"]["not_sent_late"] = 3
    assert starved(d) == ["3 requests the clients fell too far behind to send (of 203)"]


def test_the_comparison_says_fewer_or_more_with_the_sign_of_the_slo() -> None:
    [line] = comparison({"autopilot": arm(240, 0.5), "fixed": arm(300, 0.6, 6, 0),
                         "reactive": arm(200, 0.45, 2, 25)})
    assert "20.0% fewer GPU-hours than fixed with -10.0 points" in line
    assert "20.0% more GPU-hours than reactive with +5.0 points" in line
    assert "5 of 6 rises met ahead against 2, 2 short hours against 25" in line
    assert comparison({"fixed": arm(288, 0.6)}) == []
