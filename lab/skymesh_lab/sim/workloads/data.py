"""Where the workloads find their (read-only, shared) data sets.

The data is never copied into the repository or the package. ``SKYMESH_DATA_DIR`` names
its folder; without it, a source checkout uses ``<checkout>/../shared/data`` (the lab's
layout), and an installed package has no default: the error names the variable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path

DATA_DIR_ENV = "SKYMESH_DATA_DIR"

# <checkout>/lab/skymesh_lab/sim/workloads/data.py -> parents[4] is the checkout; for an
# installed package it is the folder above site-packages, never a checkout.
_PACKAGE_PARENT = Path(__file__).resolve().parents[4]
_PROJECT_NAME = re.compile(r'^name\s*=\s*"skymesh"\s*$', re.MULTILINE)
_CONTENTS = "the folder holding mooncake_fast25/, sharegpt_partial/ ..."


def is_checkout(root: Path) -> bool:
    """True when ``root`` is a SkyMesh source tree (its pyproject.toml names skymesh)."""
    try:
        return bool(_PROJECT_NAME.search((root / "pyproject.toml").read_text()))
    except OSError:
        return False


def data_dir(env: Mapping[str, str] | None = None, root: Path | None = None) -> Path:
    """The shared data directory: ``$SKYMESH_DATA_DIR``, else ``<checkout>/../shared/data``
    inside a source checkout; FileNotFoundError naming the variable otherwise.

    ``env`` and ``root`` (the folder holding the ``skymesh`` package) default to the
    process environment and this package's location: read at call time, never at import.
    """
    env = os.environ if env is None else env
    root = _PACKAGE_PARENT if root is None else root
    value = env.get(DATA_DIR_ENV)
    if value:
        path, source = Path(value).expanduser(), f"${DATA_DIR_ENV}"
    elif is_checkout(root):
        path = root.parent / "shared" / "data"
        source = f"the source checkout's default (${DATA_DIR_ENV} is not set)"
    else:
        raise FileNotFoundError(
            f"SkyMesh has no data directory: set {DATA_DIR_ENV} to {_CONTENTS} "
            f"(skymesh is installed at {root}, outside a source checkout, so there is no "
            "default)")
    if not path.is_dir():
        raise FileNotFoundError(
            f"SkyMesh data directory {path} does not exist (from {source}); "
            f"set {DATA_DIR_ENV} to {_CONTENTS}")
    return path


def data_file(*parts: str) -> Path:
    """A file inside :func:`data_dir`, with an error naming it when it is missing."""
    path = data_dir().joinpath(*parts)
    if not path.is_file():
        raise FileNotFoundError(
            f"SkyMesh data file {path} does not exist (data dir from ${DATA_DIR_ENV}, or "
            "<checkout>/../shared/data in a source checkout)")
    return path
