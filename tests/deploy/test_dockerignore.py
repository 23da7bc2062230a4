"""The image's build context (``.dockerignore``, a whitelist) holds every distribution an
image role builds (deploy/docker/requirements.py): a package left out builds an image
whose commands fail at import (it happened once: ``skymesh --help`` and
``skymesh-replica`` failed inside the image after a layout move). The lab is never in an
image."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setuptools import find_packages

REPO = Path(__file__).resolve().parents[2]


def _roles() -> dict[str, list[tuple[str, tuple[str, ...]]]]:
    spec = importlib.util.spec_from_file_location(
        "image_requirements", REPO / "deploy" / "docker" / "requirements.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ROLES


def test_every_package_an_image_builds_is_in_the_build_context() -> None:
    allowed = {line.strip()[1:].rstrip("/") for line in
               (REPO / ".dockerignore").read_text().splitlines() if line.startswith("!")}
    folders = {folder for role in _roles().values() for folder, _ in role}
    assert folders == {"skymesh", "controller", "replica"}
    for folder in folders:
        home = REPO if folder == "skymesh" else REPO / folder
        if folder != "skymesh":
            assert f"{folder}/pyproject.toml" in allowed
        for top in {p.split(".")[0] for p in find_packages(str(home), include=["skymesh*"])}:
            rel = top if folder == "skymesh" else f"{folder}/{top}"
            assert rel in allowed, f"{rel} is not in the image's build context"
    assert all((REPO / a).exists() for a in allowed), [a for a in allowed
                                                       if not (REPO / a).exists()]
    assert not any("skymesh_lab" in a for a in allowed), "the lab is in an image"
