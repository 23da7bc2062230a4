"""``skymesh predict`` as a user runs it: a real process, the contract JSON, clean errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SKYMESH = [sys.executable, "-m", "skymesh.cli"]


def run(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "SKYMESH_CACHE_DIR": str(tmp_path / "cache")}
    return subprocess.run([*SKYMESH, *args], capture_output=True, text=True, env=env,
                          timeout=240)


def test_predict_eval_on_a_slice_writes_the_contract_json(tmp_path: Path) -> None:
    out = tmp_path / "pred.json"
    proc = run(["predict", "eval", "--limit", "400", "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    res = json.loads(out.read_text())
    assert set(res["predictors"]) == {"moe-mlp", "wordvec-mlp", "history"}
    for r in res["predictors"].values():
        assert set(r) >= {"mae_tokens", "acc25", "acc50", "acc100", "ms_per_request"}
        assert 0 <= r["acc25"] <= r["acc50"] <= r["acc100"] <= 1
        assert r["mae_tokens"] > 0 and r["ms_per_request"] > 0
    assert res["samples"] == {"train": 400, "test": 200}
    assert "PreServe, Table 2" in proc.stdout and "78.25" in proc.stdout
    assert set(res["by_source"]["sharegpt"]) == set(res["predictors"])
    assert not (tmp_path / "cache").exists()  # a slice never touches the cached model


def test_predict_train_saves_a_model_eval_can_load(tmp_path: Path) -> None:
    model = tmp_path / "m.pt"
    proc = run(["predict", "train", "--limit", "300", "--out", str(model)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert model.is_file()
    out = tmp_path / "e.json"
    proc = run(["predict", "eval", "--limit", "300", "--model", str(model), "--json", str(out)],
               tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["predictors"]["moe-mlp"]["mae_tokens"] > 0


def test_predict_train_wordvec_saves_a_model_eval_scores(tmp_path: Path) -> None:
    model = tmp_path / "wv.npz"
    proc = run(["predict", "train", "--predictor", "wordvec", "--limit", "300",
                "--out", str(model)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert model.is_file() and "saved" in proc.stdout
    out = tmp_path / "e.json"
    proc = run(["predict", "eval", "--limit", "300", "--wordvec-model", str(model),
                "--json", str(out)], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["predictors"]["wordvec-mlp"]["mae_tokens"] > 0


@pytest.mark.parametrize("args, message", [
    (["predict", "eval", "--limit", "3"], "--limit must be at least 40"),
    (["predict", "eval", "--limit", "400", "--model", "/nonexistent/m.pt"], "cannot read"),
    (["predict", "eval", "--limit", "400", "--wordvec-model", "/nonexistent/w.npz"],
     "cannot read"),
])
def test_bad_input_exits_2_with_a_message(tmp_path: Path, args: list[str], message: str
                                          ) -> None:
    proc = run(args, tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
