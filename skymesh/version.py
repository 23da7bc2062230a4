"""The installed SkyMesh version, for every command's ``--version`` and the start-up line."""

from __future__ import annotations

import argparse
import importlib.metadata


def package_version() -> str:
    """The version pip recorded for the ``skymesh`` distribution ("unknown" when the
    source tree is used without being installed)."""
    try:
        return importlib.metadata.version("skymesh")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def add_version_flag(parser: argparse.ArgumentParser) -> None:
    """``--version``: print ``skymesh X.Y.Z`` and exit 0."""
    parser.add_argument("--version", action="version", version=f"skymesh {package_version()}")
