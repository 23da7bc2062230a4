"""The image's build context (``.dockerignore``, a whitelist) holds every package the
wheel ships: a package left out builds an image whose commands fail at import (it
happened: ``skymesh_lab`` after the layout move, so ``skymesh --help`` and
``skymesh-replica`` failed inside the image)."""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def test_every_shipped_package_is_in_the_build_context() -> None:
    allowed = {line.strip()[1:].rstrip("/") for line in
               (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    tops = {p.split(".")[0] for p in find_packages(str(REPO), include=["skymesh*"])}
    assert tops == {"skymesh", "skymesh_lab"}
    assert tops <= allowed, tops - allowed
    assert all((REPO / a).exists() for a in allowed), [a for a in allowed
                                                       if not (REPO / a).exists()]
