"""The image sizes page (``skymesh_lab.bench.image_sizes``): sizes read from a manifest's
layers, and the tables rendered from the measured JSON, never typed by hand. The
measurement itself runs against built images (``--build``; tests/e2e/test_image.py
checks the same images' content)."""

from __future__ import annotations

import json

import pytest

from skymesh_lab.bench.image_sizes import layers_size, pick_engine, tag
from skymesh_lab.bench.image_sizes_page import added, image_sizes
from skymesh_lab.bench.results_pages import BY_NAME


def _image(role: str, size: int, dists: dict[str, int], imports: set[str]) -> dict[str, object]:
    return {"tag": tag(role, "0.1.0"), "id": "sha256:x", "size_bytes": size,
            "compressed_bytes": size // 3 if role == "balancer" else None,
            "site_packages_bytes": sum(dists.values()) + 1_000_000, "venv_bytes": 0,
            "python": "3.11.2",
            "distributions": {n: {"version": "1", "bytes": b} for n, b in dists.items()},
            "imports": {m: m in imports for m in ("skymesh", "skymesh_lab", "fastapi")}}


DOC = {
    "setup": {"engine": "buildah", "version": "0.1.0", "commit": "abc1234",
              "date": "2026-11-28"},
    "base": {"tag": "localhost/skymesh-base:bookworm", "id": "b", "size_bytes": 182_710_784,
             "compressed_bytes": 60_000_000},
    "images": {
        "controller": _image("controller", 710_000_000,
                             {"skymesh": 2_000_000, "numpy": 40_000_000,
                              "pandas": 70_000_000, "fastapi": 1_000_000},
                             {"skymesh", "fastapi"}),
        "balancer": _image("balancer", 358_068_736,
                           {"skymesh": 2_000_000, "numpy": 40_000_000}, {"skymesh"}),
    },
}


def test_the_stored_size_is_the_sum_of_the_manifests_layers() -> None:
    manifest = {"schemaVersion": 2, "config": {"size": 369},
                "layers": [{"size": 182_710_784}, {"size": 1024}, {"size": 175_356_928}]}
    assert layers_size(json.dumps(manifest)) == 358_068_736


def test_the_page_gives_each_role_its_size_over_the_base_and_its_packages() -> None:
    text = image_sizes(DOC)
    assert ("| `localhost/skymesh-base:bookworm` (the base) | 182.7 | 60.0 | - | - | - |"
            in text)
    # balancer first whatever the JSON's order; 358.1 - 182.7 over the base
    assert text.index("skymesh-balancer") < text.index("skymesh-controller")
    assert "| `skymesh-balancer:0.1.0` | 358.1 | 119.4 | 175.4 | 43.0 | 2 |" in text
    # a figure not measured (docker gives no compressed size) is a dash, not zero
    assert "| `skymesh-controller:0.1.0` | 710.0 | - | 527.3 | 114.0 | 4 |" in text
    assert "| `skymesh_lab` | no | no |" in text
    assert "| `fastapi` | no | yes |" in text
    assert "| controller | pandas 70.0, numpy 40.0, skymesh 2.0, fastapi 1.0 | 2, 71.0 |" in text
    assert "at commit `abc1234`" in text


def test_added_lists_what_a_role_installs_beyond_another() -> None:
    assert added(DOC, "controller", "balancer") == {"pandas": 70_000_000,
                                                    "fastapi": 1_000_000}
    assert added(DOC, "balancer", "controller") == {}


def test_the_results_registry_renders_the_page_with_its_command() -> None:
    source = BY_NAME["image-sizes"]
    assert source.render(DOC) == image_sizes(DOC)
    assert source.command("docs/results/data/image-sizes.json") == (
        ".venv/bin/python -m skymesh_lab.bench.image_sizes --build --json "
        "docs/results/data/image-sizes.json")


def test_the_engine_is_forced_by_the_environment_or_refused() -> None:
    assert pick_engine({"SKYMESH_IMAGE_ENGINE": "buildah"}) == "buildah"
    with pytest.raises(SystemExit):
        pick_engine({"SKYMESH_IMAGE_ENGINE": "podman"})
