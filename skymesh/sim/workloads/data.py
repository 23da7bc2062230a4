"""Where the workloads find their (read-only, shared) data sets.

The data is never copied into the repository: it lives in ``/work/shared/data`` next to
the checkout, or wherever ``SKYMESH_DATA_DIR`` points (CI, another machine).
"""

from __future__ import annotations

import os
from pathlib import Path

DATA_DIR_ENV = "SKYMESH_DATA_DIR"

# <repo>/skymesh/sim/workloads/data.py -> parents[3] is <repo>, the folder that holds the
# ``skymesh`` package.
_REPO_ROOT = Path(__file__).resolve().parents[3]


def data_dir() -> Path:
    """The shared data directory: ``$SKYMESH_DATA_DIR``, else ``<repo>/../shared/data``."""
    env = os.environ.get(DATA_DIR_ENV)
    path = Path(env).expanduser() if env else _REPO_ROOT.parent / "shared" / "data"
    if not path.is_dir():
        source = f"${DATA_DIR_ENV}" if env else f"the default (${DATA_DIR_ENV} is not set)"
        raise FileNotFoundError(
            f"SkyMesh data directory {path} does not exist (from {source}); "
            f"set {DATA_DIR_ENV} to the folder holding mooncake_fast25/, sharegpt_partial/ ..."
        )
    return path


def data_file(*parts: str) -> Path:
    """A file inside :func:`data_dir`, with an error naming it when it is missing."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(
            f"SkyMesh data file {path} does not exist (data dir from ${DATA_DIR_ENV} or "
            "<repo>/../shared/data)"
        )
    return path
