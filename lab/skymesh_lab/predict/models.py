"""Length models trained on the shared traces and cached where the balancer finds them
(:mod:`skymesh.predict.store`): :func:`get_moe` and :func:`get_wordvec` load one, or
train it on the default training split and save it there the first time (one to two
minutes on 2 cores).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from skymesh.predict.moe import MoEConfig, MoEPredictor, train_moe
from skymesh.predict.sample import Sample
from skymesh.predict.store import default_model_path, default_wordvec_path
from skymesh.predict.wordvec import WordVecPredictor, train_wordvec
from skymesh_lab.predict.data import load_samples, split

SPLIT_SEED = 0

M = TypeVar("M", MoEPredictor, WordVecPredictor)


def default_split() -> tuple[list[Sample], list[Sample]]:
    """ShareGPT + GSM8K, 7:3 by conversation / question, seed 0."""
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
