"""The control-ha results page renders the mid-move section from its JSON, and omits it
for a file measured before the section existed."""

from __future__ import annotations

from typing import Any

from skymesh_lab.bench.control_ha_page import control_ha

BASE: dict[str, Any] = {"takeover": [{"signal": "kill", "ttl_s": 3.0, "renew_s": 1.0,
                                      "takeover_s": 3.5}],
                        "redis_failover": [{"wait_replicas": 1, "acked": 300, "lost": 0,
                                            "unavailable_s": 1.8, "errors": {"503": 9}}]}
RUN = {"ttl_s": 2.0, "renew_s": 0.4, "takeover_s": 2.37, "settled_s": 2.4,
       "round_status": "failed", "round_actions": 0, "settled_times": 1,
       "rounds": {"applied": 1, "failed": 1, "planned": 4},
       "replica": {"region": "us", "state": "healthy"}, "r1_served_before_drain": 4.0,
       "r1_served_after_undrain": 3.0, "client": {"completed": 18}, "failed_requests": 0}


def test_the_mid_move_section_has_a_row_per_run() -> None:
    doc = {**BASE, "mid_move": {"runs": [RUN], "date": "2026-11-28", "cpus": 2,
                                "load_average_1m_at_start": 9.5, "wall_seconds": 61.0}}
    page = control_ha(doc)
    assert "## The leader killed mid-round and mid-move" in page
    row = next(line for line in page.splitlines() if line.startswith("| 2.0 s"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells == ["2.0 s", "0.4 s", "2.37 s", "2.40 s",
                     "failed, 0 actions, settled 1x", "1", "us, healthy", "4 / 3", "18", "0"]
    assert "load average 9.50 at start" in page


def test_a_file_without_the_section_renders_as_before() -> None:
    assert "mid-move" not in control_ha(BASE)


def test_the_mid_round_section_counts_starts_and_registrations() -> None:
    run = {"ttl_s": 3.0, "renew_s": 1.0, "takeover_s": 2.8, "settled_s": 3.6,
           "round_status": "failed", "round_actions": 0, "settled_times": 1,
           "next_round_status": "applied", "replicas_started": 2,
           "replicas_registered": [{"id": "us-1", "region": "us"}]}
    doc = {**BASE, "mid_round": {"runs": [run], "date": "2026-11-28", "cpus": 2,
                                 "load_average_1m_at_start": 9.5, "wall_seconds": 80.0}}
    row = next(line for line in control_ha(doc).splitlines() if line.startswith("| 3.0 s"))
    assert [c.strip() for c in row.strip("|").split("|")] == [
        "3.0 s", "1.0 s", "2.80 s", "3.60 s", "failed, 0 actions, settled 1x", "applied",
        "2", "1"]
