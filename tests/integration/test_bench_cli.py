"""``skymesh bench`` as the contract writes it: every experiment runs with ``--mode sim``."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
from pathlib import Path

from skymesh_lab.cli import BENCH_EXPERIMENTS


def test_every_experiment_accepts_mode_sim() -> None:
    """``skymesh bench`` checks ``--mode`` against a module's ``MODES``: a module that
    uses the name for something else (sp-microbench's pushing modes did) refuses the
    contract's ``--mode sim``."""
    for name, path in BENCH_EXPERIMENTS.items():
        modes = getattr(importlib.import_module(path), "MODES", ("sim",))
        assert "sim" in modes and set(modes) <= {"sim", "live"}, (name, modes)


def test_sp_microbench_writes_the_contract_json(tmp_path: Path) -> None:
    out = tmp_path / "sp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "skymesh.cli", "bench", "sp-microbench", "--mode", "sim",
         "--duration", "30", "--json", str(out)],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    systems = json.loads(out.read_text())["systems"]
    assert set(systems) == {"bp", "sp-o", "sp-p"}
    for s in systems.values():
        assert s["throughput_rps"] > 0 and s["ttft_p90_s"] > 0
        assert 0 < s["prefix_hit_rate"] <= 1
    assert "SP-P vs BP" in proc.stdout
