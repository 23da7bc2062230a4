"""The word-vector length predictor: real MiniLM vectors (the ``predict`` extra), real
training on slices of the shared data, and its file format."""

from __future__ import annotations

import importlib.util
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import length_samples, mae_against_constant

from skymesh.predict import wordvec
from skymesh.predict.wordvec import (
    MAX_PIECES,
    WordVecConfig,
    WordVecPredictor,
    WordVectors,
    package_dir,
    train_wordvec,
)
from skymesh_lab.predict.data import Sample

data = length_samples
SMALL = WordVecConfig(hidden=(64,), epochs=8, batch_size=64)


@cache
def vectors() -> WordVectors:
    return WordVectors.from_package()


@cache
def model() -> WordVecPredictor:
    return train_wordvec(data()[0], SMALL, vectors())[0]


def test_embedding_is_the_mean_of_the_prompts_word_vectors() -> None:
    v = vectors()
    assert v.matrix.shape == (30522, 384)  # all-MiniLM-L6-v2's WordPiece vocabulary
    ids = v.tokenizer.encode("How long is a piece of string?", add_special_tokens=False).ids
    assert len(ids) >= 7
    got = v.embed(["How long is a piece of string?", ""])
    np.testing.assert_allclose(got[0], v.matrix[ids].mean(axis=0), rtol=1e-6)
    assert not got[1].any()  # an empty prompt has no words: the zero vector


def test_only_the_first_pieces_count() -> None:
    v = vectors()
    head = "word " * MAX_PIECES
    a, b = v.embed([head + "banana " * 300, head + "quantum " * 300])
    np.testing.assert_array_equal(a, b)
    c, d = v.embed(["word " * 10 + "banana", "word " * 10 + "quantum"])
    assert not np.array_equal(c, d)


def test_missing_vectors_name_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: Any) -> Any:
        return None if name == wordvec.MODEL_PACKAGE else real(name, *args)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(FileNotFoundError, match=r"skymesh\[predict\]"):
        package_dir()


def test_learns_what_the_words_say() -> None:
    """Prompts whose wording alone tells short answers from long ones, at equal length:
    the model must read the words, not the length features."""
    short = ["Answer yes or no: is {} a colour?", "Reply with one word: is {} edible?"]
    long = ["Write a detailed essay on the history of {}.",
            "Explain {} step by step in an in-depth article."]
    things = ["red", "bread", "copper", "music", "rain", "stone", "glass", "salt", "wool",
              "tea", "sand", "oil", "silk", "clay", "ice", "milk"]
    train = [Sample(t.format(x), 12, 0, out, "synthetic", f"{i}/{x}")
             for i, (group, out) in enumerate(((short, 4), (long, 900)))
             for t in group for x in things for _ in range(2)]
    m = train_wordvec(train, WordVecConfig(hidden=(32,), epochs=60, batch_size=16),
                      vectors())[0]
    assert m.predict_one("Answer yes or no: is lemon a colour?", 12) < 150
    assert m.predict_one("Write a detailed essay on the history of lemon.", 12) > 600


def test_beats_a_constant_median_on_held_out_prompts() -> None:
    train, test = data()
    mae, const_mae = mae_against_constant(model().predict(test), train, test, np.median)
    assert mae < 0.97 * const_mae


def test_single_request_path_and_file_round_trip(tmp_path: Path) -> None:
    _, test = data()
    m = model()
    s = test[0]
    assert m.predict_one(s.text, s.prompt_tokens, s.history_tokens) == m.predict([s])[0]
    path = tmp_path / "wv.npz"
    m.save(path)
    assert not path.with_name(path.name + ".tmp").exists()
    again = WordVecPredictor.load(path)
    assert again.config == m.config
    # The vectors are stored as float16: predictions may move by a token, not more.
    diff = np.abs(again.predict(test[:100]) - m.predict(test[:100]))
    assert diff.max() <= 2


def test_load_refuses_foreign_files(tmp_path: Path) -> None:
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a model")
    with pytest.raises(ValueError, match="cannot read"):
        WordVecPredictor.load(junk)
    other = tmp_path / "other.npz"
    np.savez(other, weights=np.zeros(3))
    with pytest.raises(ValueError, match="not a SkyMesh word-vector length model"):
        WordVecPredictor.load(other)


@pytest.mark.parametrize("bad", [dict(hidden=()), dict(hidden=(0,)), dict(epochs=0),
                                 dict(dropout=1.0), dict(lr=0)])
def test_config_is_checked(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        WordVecConfig(**bad)


def test_too_few_samples_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least 64"):
        train_wordvec(data()[0][:10], SMALL, vectors())


async def test_the_balancer_loads_it_with_predictor_wordvec(tmp_path: Path) -> None:
    from skymesh.balancer.config import PredictionConfig
    from skymesh.balancer.prediction import LivePredictor

    path = tmp_path / "wv.npz"
    model().save(path)
    live = LivePredictor(PredictionConfig(predictor="wordvec", model_path=str(path)))
    assert live.model_path() == path and live.active == "history"
    live.start()
    await live.wait_loaded()
    assert live.active == "wordvec" and live.error is None
    s = data()[1][0]
    expected = WordVecPredictor.load(path).predict_one(s.text, s.prompt_tokens)
    assert live.predict(s.text, s.prompt_tokens, 0, s.prompt_tokens, None) == expected
    assert live.predict(s.text, s.prompt_tokens, 0, s.prompt_tokens, 1) == 1


def test_the_balancer_defaults_to_the_cached_wordvec_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from skymesh.balancer.config import PredictionConfig
    from skymesh.balancer.prediction import LivePredictor
    from skymesh.predict.store import CACHE_ENV, WORDVEC_MODEL_NAME

    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    live = LivePredictor(PredictionConfig(predictor="wordvec"))
    assert live.model_path() == tmp_path / WORDVEC_MODEL_NAME
    assert LivePredictor(PredictionConfig()).model_path() != live.model_path()
