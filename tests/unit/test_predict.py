"""Length predictors: the MoE-MLP on a small slice beats a constant, the history baseline,
the accuracy metrics, persistence, and that importing the package leaves torch alone."""

from __future__ import annotations

import subprocess
import sys
from functools import cache
from pathlib import Path

import numpy as np
import pytest
from support import length_samples, mae_against_constant

from skymesh.predict.history import HistoryPredictor
from skymesh.predict.moe import MoEConfig, MoEPredictor, train_moe
from skymesh_lab.predict.data import load_samples, split
from skymesh_lab.predict.metrics import accuracy

data = length_samples
SMALL = MoEConfig(max_features=1024, expert_hidden=(32, 16, 8), gate_hidden=16,
                  expert_epochs=6, gate_epochs=6, batch_size=64)


@cache
def model() -> MoEPredictor:
    return train_moe(data()[0], SMALL)[0]


def test_accuracy_counts_within_n_tokens() -> None:
    acc = accuracy([100, 130, 200, 400], [100, 100, 100, 100])
    assert acc["mae_tokens"] == pytest.approx((0 + 30 + 100 + 300) / 4)
    assert (acc["acc25"], acc["acc50"], acc["acc100"]) == (0.25, 0.5, 0.75)
    with pytest.raises(ValueError):
        accuracy([], [])


def test_split_is_deterministic_and_keeps_conversations_whole() -> None:
    samples = load_samples(("sharegpt",))[:3000]
    a_train, a_test = split(samples, seed=3)
    b_train, b_test = split(samples, seed=3)
    assert a_test == b_test and a_train == b_train
    assert 0.2 < len(a_test) / len(samples) < 0.4
    assert not {s.group for s in a_train} & {s.group for s in a_test}


def test_moe_beats_a_constant_mean_on_held_out_prompts() -> None:
    train, test = data()
    moe_mae, const_mae = mae_against_constant(model().predict(test), train, test, np.mean)
    assert moe_mae < 0.97 * const_mae


def test_moe_single_request_path_matches_the_batch(tmp_path: Path) -> None:
    _, test = data()
    m = model()
    s = test[0]
    assert m.predict_one(s.text, s.prompt_tokens, s.history_tokens) == m.predict([s])[0]
    path = tmp_path / "m.pt"
    m.save(path)
    again = MoEPredictor.load(path)
    assert (again.predict(test[:50]) == m.predict(test[:50])).all()


def test_load_refuses_a_foreign_file(tmp_path: Path) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read"):
        MoEPredictor.load(bad)


def test_moe_config_checks_the_expert_count() -> None:
    with pytest.raises(ValueError, match="perfect square"):
        MoEConfig(experts=8)


def test_history_predicts_the_bucket_median() -> None:
    h = HistoryPredictor(window=100, min_bucket=3, default=77)
    assert h.predict(10) == 77
    for out in (10, 20, 30):
        h.observe(1000, out)  # prompt bucket of 1000 tokens
    h.observe(5, 500)
    assert h.predict(900) == 20  # same power-of-two bucket: its median
    assert h.predict(5) == 25  # bucket too small: the global median of 10, 20, 30, 500


def test_importing_the_balancer_side_does_not_import_torch() -> None:
    code = ("import sys, skymesh.predict, skymesh.predict.moe, skymesh.policies.goodserve, "
            "skymesh_lab.sim.runner; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"
