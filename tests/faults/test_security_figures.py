"""The security page's figures script (``skymesh_lab.faults.security_figures``), short size,
against real local processes: the JSON has what the page renders, nothing answered 5xx,
every adversarial URL and takeover was refused, no idle connection outlived the
balancer's idle timeout, and each flood and bad replica was refused or bounded while a
healthy client in the same run lost no request."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from skymesh_lab.bench.security_page import security
from skymesh_lab.faults.security_figures import BAD_URLS, main

pytestmark = pytest.mark.timeout(120)


def test_the_short_pass_finds_no_5xx_and_refuses_every_bad_url(tmp_path: Path) -> None:
    out = tmp_path / "security.json"
    assert main(["--short", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"fuzz", "fuzz_5xx", "urls", "takeover", "idle", "alive"} <= set(data)
    assert set(data["fuzz"]) == {"lb", "replica", "controller"}
    for target, f in data["fuzz"].items():
        assert f["cases"] > 0 and f["5xx"] == 0, (target, f)
    assert data["fuzz_5xx"] == 0
    assert data["urls"] == {"tried": len(BAD_URLS), "refused": len(BAD_URLS), "accepted": []}
    assert data["takeover"]["tried"] > 0
    assert data["takeover"]["refused"] == data["takeover"]["tried"]
    idle = data["idle"]
    assert idle["open_peak"] > 0 and idle["refused"] > 0  # the per-client cap bit
    assert idle["held_after_idle_timeout"] == 0
    assert set(idle["rss_mb"]) == {"before", "holding", "after_release"}
    assert all(data["alive"].values())
    page = security(data)  # the page's renderer reads this shape
    assert "| lb |" in page and "peering port" in page and "telemetry reports" in page
    check_mesh_flood(data["mesh_flood"])
    check_bad_replica(data["bad_replica"])
    check_controller_bodies(data["controller_bodies"])
    check_telemetry_flood(data["telemetry_flood"])


def no_healthy_request_failed(section: dict[str, Any]) -> None:
    for phase in ("no_attack", "attack"):
        h = section["healthy"][phase]
        assert h["requests"] > 0 and h["failed"] == 0 and h["p50_ms"] is not None, h


def check_mesh_flood(m: dict[str, Any]) -> None:
    assert m["alive"] and m["connects"] > m["slots"]  # cut and re-opened
    assert m["refused"] > 0
    # A flood that never handshakes holds at most max_handshakes (64) connections, each
    # costing the balancer 3 descriptors, and leaves none behind. (The slack: the healthy
    # client's and the scrapes' connections; the old code held one per connect.)
    assert 0 < m["held_peak"] <= 64 and m["held_after"] == 0
    fds = m["fds"]
    assert fds["peak"] - fds["before"] <= 3 * 64 + 50, fds
    assert fds["after"] - fds["before"] < 20, fds
    no_healthy_request_failed(m)


def check_bad_replica(bad: dict[str, Any]) -> None:
    assert bad["alive"]
    for mode in ("huge_body", "huge_headers"):
        r = bad[mode]
        # 502 for the reply over its cap; 503 while the failed replica is held back
        assert r["attack_statuses"].get("502", 0) > 0, (mode, r)
        assert set(r["attack_statuses"]) <= {"502", "503"}, (mode, r)
        assert r["limit_hits"] > 0
        # Each reply is cut at its cap (16 MiB, 64 KiB), not read whole.
        assert r["rss_mb"]["peak"] - r["rss_mb"]["before"] < 64, (mode, r["rss_mb"])
        no_healthy_request_failed(r)
    for mode in ("huge_metrics", "costly_metrics"):
        r = bad[mode]
        assert r["marked_unhealthy"] is True and r["limit_hits"] > 0, (mode, r)
        no_healthy_request_failed(r)


def check_controller_bodies(b: dict[str, Any]) -> None:
    assert b["alive"]
    for key, code in (("no_token", "401"), ("agent_over_cap", "413")):
        c = b[key]
        # Answered with the refusal, or reset before the answer could be read: never
        # anything else, never the whole body taken.
        assert c["statuses"].get(code, 0) > 0 and set(c["statuses"]) <= {code, "0"}, c
        assert c["max_sent_bytes"] < b["body_bytes"] // 2, c
        assert c["rss_mb"]["after"] - c["rss_mb"]["before"] < 32, c["rss_mb"]
        no_healthy_request_failed(c)


def check_telemetry_flood(t: dict[str, Any]) -> None:
    assert t["alive"]
    assert t["statuses"] == {"204": t["posts"]}  # the largest report is accepted ...
    assert t["posts"] // t["balancers"] > 64
    # ... and a balancer keeps about telemetry_balancer_bytes (4 MiB) of them, not 10,000
    assert 0 < t["kept_per_balancer"] <= 64
    assert t["kept_bytes_per_balancer"] <= 4 * 2**20
    assert t["huge_report"]["statuses"] and all(
        400 <= int(code) < 500 for code in t["huge_report"]["statuses"])
    assert t["rss_mb"]["after"] - t["rss_mb"]["before"] < 16 * t["balancers"] + 32
    no_healthy_request_failed(t)
