"""The run record the kv benches share: load window, commit, flags."""

from __future__ import annotations

import pytest

from skymesh_lab.bench import kv_eviction_vllm
from skymesh_lab.bench.run_record import LoadWindow, commit


def test_load_window_names_both_ends() -> None:
    fields = LoadWindow().fields()
    assert set(fields) == {"load_average_1m_at_start", "load_average_1m_at_end"}
    assert all(v >= 0 for v in fields.values())


def test_commit_prefers_what_the_operator_says_ran() -> None:
    assert commit("before-fix") == "before-fix"
    assert commit()  # this checkout's short hash


def test_a_vllm_bench_without_its_environment_says_which_flag(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYMESH_E2E_ENV", raising=False)
    with pytest.raises(SystemExit) as e:
        kv_eviction_vllm.main(["--json", "unused.json"])
    assert e.value.code == 2
    assert "--vllm-env (or SKYMESH_E2E_ENV)" in capsys.readouterr().err
