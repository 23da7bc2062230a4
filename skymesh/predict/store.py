"""Trained length models as cached files: ``$SKYMESH_CACHE_DIR`` or ``~/.cache/skymesh``.

No model is committed (the MoE is about 20 MB, the word-vector model 25 MB):
:func:`get_moe` and :func:`get_wordvec` load one, or train it on the default training
split and save it there the first time (one to two minutes on 2 cores).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from skymesh.predict.moe import MoEConfig, MoEPredictor, train_moe
from skymesh.predict.sample import Sample
from skymesh.predict.wordvec import WordVecPredictor, train_wordvec

CACHE_ENV = "SKYMESH_CACHE_DIR"
MODEL_NAME = "length-moe-v1.pt"
WORDVEC_MODEL_NAME = "length-wordvec-v1.npz"
SPLIT_SEED = 0

M = TypeVar("M", MoEPredictor, WordVecPredictor)


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skymesh"


def default_model_path() -> Path:
    return cache_dir() / MODEL_NAME


def default_wordvec_path() -> Path:
    return cache_dir() / WORDVEC_MODEL_NAME


def default_split() -> tuple[list[Sample], list[Sample]]:
    """ShareGPT + GSM8K, 7:3 by conversation / question, seed 0."""
    # Training reads the shared traces through the lab (the ``lab`` extra).
    from skymesh_lab.predict.data import load_samples, split

    return split(load_samples(), seed=SPLIT_SEED)


def _cached(path: Path, load: Callable[[Path], M], train: Callable[[list[Sample]], M],
            quiet: bool) -> M:
    if path.is_file():
        return load(path)
    if not quiet:
        print(f"length model {path} not found: training it (once)", file=sys.stderr)
    model = train(default_split()[0])
    model.save(path)
    return model


def get_moe(path: Path | None = None, *, quiet: bool = False) -> MoEPredictor:
    return _cached(path or default_model_path(), MoEPredictor.load,
                   lambda train: train_moe(train, MoEConfig())[0], quiet)


def get_wordvec(path: Path | None = None, *, quiet: bool = False) -> WordVecPredictor:
    return _cached(path or default_wordvec_path(), WordVecPredictor.load,
                   lambda train: train_wordvec(train)[0], quiet)
