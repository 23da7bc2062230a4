"""The security page's figures script (``skymesh_lab.faults.security_figures``), short size,
against real local processes: the JSON has what the page renders, nothing answered 5xx,
every adversarial URL and takeover was refused, and no idle connection outlived the
balancer's idle timeout."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from skymesh_lab.bench.results_tables import security
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
    assert "| lb |" in security(data)  # the page's renderer reads this shape
