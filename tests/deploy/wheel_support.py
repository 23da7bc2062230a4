"""Build a wheel of this checkout, as a release would, for the installer tests."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# What `pip wheel` needs of the checkout: the metadata, the build hook that generates the
# peering stubs from protos/, the lock it ships, and the data plane's package.
SOURCES = ("pyproject.toml", "README.md", "setup.py", "MANIFEST.in", "protos", "requirements",
           "skymesh")


def build_wheel(out: Path) -> Path:
    """A wheel of the checkout in ``out/dist``, built offline from a copy in ``out/src``
    (so the checkout gets no build/ or egg-info from us)."""
    src = out / "src"
    src.mkdir(parents=True)
    for part in SOURCES:
        if (REPO / part).is_dir():
            shutil.copytree(REPO / part, src / part, ignore=shutil.ignore_patterns(
                "__pycache__", "*.pyc", "gen"))
        else:
            shutil.copy2(REPO / part, src / part)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(out / "dist"),
                           str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = (out / "dist").glob("skymesh-*.whl")
    return wheel


def build_product_wheels(out: Path) -> list[Path]:
    """Wheels of the data plane, the emulated replica and the controller (what the
    installer's roles install), built offline into ``out/dist``."""
    first = build_wheel(out)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                           "--no-build-isolation", "--no-index", "-w", str(out / "dist"),
                           str(REPO / "replica"), str(REPO / "controller")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for folder in ("replica", "controller"):  # pip leaves build/ and egg-info beside them
        shutil.rmtree(REPO / folder / "build", ignore_errors=True)
    return [first, *sorted((out / "dist").glob("skymesh_*.whl"))]
