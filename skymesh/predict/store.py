"""The trained length model as a cached file: ``$SKYMESH_CACHE_DIR`` or ``~/.cache/skymesh``.

The model (about 20 MB) is never committed: :func:`get_moe` loads it, or trains it on the
default training split and saves it there the first time (a couple of minutes on 2 cores).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from skymesh.predict.data import Sample, load_samples, split
from skymesh.predict.moe import MoEConfig, MoEPredictor, train_moe

CACHE_ENV = "SKYMESH_CACHE_DIR"
MODEL_NAME = "length-moe-v1.pt"
SPLIT_SEED = 0


def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skymesh"


def default_model_path() -> Path:
    return cache_dir() / MODEL_NAME


def default_split() -> tuple[list[Sample], list[Sample]]:
    """ShareGPT + GSM8K, 7:3 by conversation / question, seed 0."""
    return split(load_samples(), seed=SPLIT_SEED)


def get_moe(path: Path | None = None, *, quiet: bool = False) -> MoEPredictor:
    path = path or default_model_path()
    if path.is_file():
        return MoEPredictor.load(path)
    if not quiet:
        print(f"length model {path} not found: training it (once)", file=sys.stderr)
    train, _ = default_split()
    model, _ = train_moe(train, MoEConfig())
    model.save(path)
    return model
