"""Where trained length models live: ``$SKYMESH_CACHE_DIR`` or ``~/.cache/skymesh``.

No model is committed (the MoE is about 20 MB, the word-vector model 25 MB). The balancer
only loads one (``prediction.model_path``, by default the file named here); training
them on the shared traces is the lab's (``skymesh predict train``).
"""

from __future__ import annotations

import os
from pathlib import Path

CACHE_ENV = "SKYMESH_CACHE_DIR"
MODEL_NAME = "length-moe-v1.pt"
WORDVEC_MODEL_NAME = "length-wordvec-v1.npz"

def cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "skymesh"


def default_model_path() -> Path:
    return cache_dir() / MODEL_NAME


def default_wordvec_path() -> Path:
    return cache_dir() / WORDVEC_MODEL_NAME
