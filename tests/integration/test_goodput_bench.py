"""``skymesh bench goodput`` (short form) and the predictive policies through
``skymesh sim``, as real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SKYMESH = [sys.executable, "-m", "skymesh.cli"]
CONTRACT_SYSTEMS = {"goodserve", "least-load", "round-robin", "power-of-two", "prefix-tree",
                    "lmetric"}


def run(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "SKYMESH_CACHE_DIR": str(tmp_path / "cache"), **env}
    return subprocess.run([*SKYMESH, *args], capture_output=True, text=True, env=full,
                          timeout=240)


def test_goodput_short_form_writes_the_contract_json(tmp_path: Path) -> None:
    out = tmp_path / "goodput.json"
    proc = run(["bench", "goodput", "--mode", "sim", "--duration", "20", "--json", str(out)],
               tmp_path, SKYMESH_LENGTH_PREDICTOR="noisy-oracle")
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res["systems"]) >= CONTRACT_SYSTEMS
    for r in res["systems"].values():
        assert r["goodput_rps"] >= 0 and 0 <= r["slo_violation_rate"] <= 1
    assert set(res["by_scale"]) == {"1x", "1.5x", "2x", "2.5x", "3x"}
    # Looser deadlines never lower a router's goodput on the same arrivals.
    gs = [res["by_scale"][s]["goodserve"]["goodput_rps"] for s in res["by_scale"]]
    assert gs == sorted(gs)
    assert "GoodServe vs next best" in proc.stdout


def test_goodput_refuses_an_unknown_predictor(tmp_path: Path) -> None:
    proc = run(["bench", "goodput", "--duration", "5"], tmp_path,
               SKYMESH_LENGTH_PREDICTOR="crystal-ball")
    assert proc.returncode == 2
    assert "crystal-ball" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("policy", ["goodserve", "preserve", "vllm-load"])
def test_policies_run_through_skymesh_sim(tmp_path: Path, policy: str) -> None:
    out = tmp_path / f"{policy}.json"
    proc = run(["sim", "--workload", "poisson", "--policy", policy, "--regions", "us",
                "--replicas", "2", "--duration", "10", "--no-progress", "--json", str(out)],
               tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert res["policy"] == policy
    assert res["completed"] == res["requests"] > 10
