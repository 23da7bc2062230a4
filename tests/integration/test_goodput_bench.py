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


def run_module(args: list[str], tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = {**os.environ, "SKYMESH_CACHE_DIR": str(tmp_path / "cache"),
            "SKYMESH_LENGTH_PREDICTOR": "noisy-oracle", **env}
    return subprocess.run([sys.executable, "-m", "skymesh_lab.bench.goodput", *args],
                          capture_output=True, text=True, env=full, timeout=240)


def test_goodput_paper_fleet_runs_on_goodserves_testbed(tmp_path: Path) -> None:
    out = tmp_path / "paper.json"
    proc = run_module(["--fleet", "paper", "--duration", "10", "--scales", "2", "--json",
                       str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    setup = res["setup"]
    assert setup["fleet_name"] == "paper"
    assert setup["profiles"] == ["llama3.1-8b-h800", "llama3.1-8b-a800", "llama3.1-8b-a40",
                                 "llama3.1-8b-2xv100"]
    # GoodServe sets its deadlines on the A800, its mid-tier GPU.
    assert setup["deadline_profile"] == "llama3.1-8b-a800"
    assert set(res["by_scale"]) == {"2x"}
    assert set(res["systems"]) >= CONTRACT_SYSTEMS
    # Round robin spreads over exactly the fleet's four replicas.
    served = res["by_scale"]["2x"]["round-robin"]["completed_per_replica"]
    assert len(served) == 4 and all(n > 0 for n in served.values())


def test_goodput_fleet_mix_changes_what_the_replicas_can_do(tmp_path: Path) -> None:
    goodput = {}
    for mix in ("a40=2", "h800=2"):
        out = tmp_path / f"{mix}.json"
        # The fleet comes from the environment when --fleet is absent.
        proc = run_module(["--duration", "10", "--scales", "2", "--json", str(out)], tmp_path,
                          SKYMESH_GOODPUT_FLEET=mix)
        assert proc.returncode == 0, proc.stderr
        res = json.loads(out.read_text())
        assert res["setup"]["fleet"] == mix and res["setup"]["fleet_name"] is None
        assert len(res["by_scale"]["2x"]["least-load"]["completed_per_replica"]) == 2
        goodput[mix] = res["systems"]["least-load"]["goodput_rps"]
    # Same arrivals and deadlines: two H800s meet more of them than two A40s.
    assert goodput["h800=2"] > goodput["a40=2"] * 1.2


def test_goodput_bench_refuses_an_unknown_fleet(tmp_path: Path) -> None:
    proc = run(["bench", "goodput", "--duration", "5"], tmp_path,
               SKYMESH_GOODPUT_FLEET="tpu=4", SKYMESH_LENGTH_PREDICTOR="noisy-oracle")
    assert proc.returncode == 2
    assert "tpu" in proc.stderr and "paper" in proc.stderr and "Traceback" not in proc.stderr
