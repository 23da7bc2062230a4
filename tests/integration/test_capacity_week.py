"""``skymesh sim --experiment capacity-week`` (short form) and ``skymesh plan`` as real
processes: contract JSON, and clear errors with exit code 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CLI = [sys.executable, "-m", "skymesh.cli"]
CONTRACT = ("reactive", "lt-i", "lt-u", "lt-ua")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300)


def test_capacity_week_short_form_writes_the_contract(tmp_path: Path) -> None:
    out = tmp_path / "week.json"
    proc = run("sim", "--experiment", "capacity-week", "--days", "0.25", "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    for name in (*CONTRACT, "preserve"):
        s = res["strategies"][name]
        assert s["gpu_hours"] > 0
        assert 0 <= s["slo_attainment"] <= 1
        assert 0 <= s["p95_windows_met"] <= 1  # 3-hour (region, window) cells, SageServe
        assert isinstance(s["scaling_events"], int)
    assert "Infinity" not in out.read_text()  # strict JSON only
    # The plan-driven strategies solved one ILP per simulated hour (6 h).
    assert res["strategies"]["lt-u"]["ilp_solves"] == 6
    assert res["strategies"]["reactive"]["ilp_solves"] == 0
    # A clairvoyant matches reactive model by model on fewer GPU-hours (a floor for
    # the "equal SLO" comparison), and says so in the printed summary.
    assert 0 < res["clairvoyant_parity"]["vs_reactive"] < 1
    assert "clairvoyant allocator" in proc.stdout
    assert "lt-ua" in proc.stdout


def test_bench_runs_the_planning_experiments(tmp_path: Path) -> None:
    """[bench] reaches [planning]'s experiments: the same week as ``skymesh sim``."""
    via_sim, via_bench = tmp_path / "sim.json", tmp_path / "bench.json"
    assert run("sim", "--experiment", "capacity-week", "--days", "0.25", "--seed", "3",
               "--json", str(via_sim)).returncode == 0
    proc = run("bench", "capacity-week", "--duration", "21600", "--seed", "3",
               "--json", str(via_bench))
    assert proc.returncode == 0, proc.stderr
    a, b = (json.loads(f.read_text())["strategies"] for f in (via_sim, via_bench))
    assert {k: (v["gpu_hours"], v["slo_attainment"]) for k, v in a.items()} == \
        {k: (v["gpu_hours"], v["slo_attainment"]) for k, v in b.items()}
    ilp = tmp_path / "ilp.json"
    proc = run("bench", "plan-ilp", "--json", str(ilp))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(ilp.read_text())
    assert (res["regions"], res["models"], res["gpu_types"]) == (10, 8, 4)
    assert res["status"] == "optimal" and "highspy" in proc.stdout


def test_sim_needs_exactly_one_of_workload_and_experiment() -> None:
    both = run("sim", "--workload", "poisson", "--experiment", "capacity-week")
    neither = run("sim")
    for proc in (both, neither):
        assert proc.returncode == 2
        assert "exactly one of --workload and --experiment" in proc.stderr
    bad = run("sim", "--experiment", "capacity-week", "--days", "9")
    assert bad.returncode == 2 and "days must be in" in bad.stderr
    assert "Traceback" not in bad.stderr
    bad = run("bench", "capacity-week", "--duration", str(9 * 86400))
    assert bad.returncode == 2 and "skymesh bench capacity-week: days must be in" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_plan_bench_writes_the_contract(tmp_path: Path) -> None:
    out = tmp_path / "plan.json"
    proc = run("plan", "bench", "--regions", "3", "--models", "2", "--gpu-types", "2",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert (res["regions"], res["models"], res["gpu_types"]) == (3, 2, 2)
    assert res["status"] == "optimal" and res["solve_seconds"] > 0
    assert res["variables"] == 2 * 3 * 2 * 2


def test_plan_solve_reports_infeasible_input_clearly(tmp_path: Path) -> None:
    spec = {"current": {"m": {"us": {"L4": 0}}}, "demand": {"m": {"us": [5000]}},
            "capacity": {"m": {"L4": 100}}, "gpus_available": {"us": {"L4": 3}},
            "epsilon": 1.0}
    path = tmp_path / "in.json"
    path.write_text(json.dumps(spec))
    proc = run("plan", "solve", "--input", str(path))
    assert proc.returncode == 2
    assert "regional constraint cannot be met" in proc.stderr
    spec["gpus_available"] = {"us": {"L4": 60}}
    path.write_text(json.dumps(spec))
    out = tmp_path / "out.json"
    proc = run("plan", "solve", "--input", str(path), "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["changes"] == [
        {"model": "m", "region": "us", "gpu": "L4", "delta": 50}]
    path.write_text(json.dumps({**spec, "bogus": 1}))
    proc = run("plan", "solve", "--input", str(path))
    assert proc.returncode == 2 and "unknown field(s) bogus" in proc.stderr
