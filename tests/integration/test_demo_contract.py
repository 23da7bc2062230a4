"""`skymesh demo --json` keeps the contract's keys (a short real run of the three regions)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from skymesh.util.procs import executable


@pytest.mark.slow
def test_demo_json_has_the_contract_keys(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    run = subprocess.run([*executable("skymesh"), "demo", "--duration", "10", "--json",
                          str(out)], timeout=240, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-3000:]
    res = json.loads(out.read_text())
    mesh, local = res["mesh"], res["region_local"]
    for key in ("throughput_rps", "ttft_p90_s"):
        assert isinstance(mesh[key], float) and isinstance(local[key], float)
    assert set(mesh["regions"]) == {"us", "eu", "asia"}
    for st in mesh["regions"].values():
        assert set(st) >= {"served", "tokens", "forwarded_out", "forwarded_in"}
    assert sum(st["tokens"] for st in mesh["regions"].values()) > 0
    assert mesh["completed"] > 0 and local["completed"] > 0
    assert all(st["forwarded_out"] == 0 for st in local["regions"].values())
