"""Build hook: every wheel carries the generated peering stubs (skymesh/mesh/gen) and the
lock its dependencies were tested with (skymesh/constraints.txt, from requirements/lock.txt).

``build_py`` copies the packages, then runs protoc (grpcio-tools, a build requirement)
on ``protos/`` into the build directory. The sdist ships ``protos/`` (MANIFEST.in), so a
wheel built from it gets the stubs too. Editable installs skip this: the checkout builds
its own stubs (``make install``, or on first import). Everything else is in
pyproject.toml.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent


def _codegen() -> ModuleType:
    # Loaded by path: importing the skymesh package would need its runtime dependencies,
    # which a build environment does not have.
    spec = importlib.util.spec_from_file_location(
        "_skymesh_codegen", ROOT / "skymesh" / "mesh" / "codegen.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithStubs(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return
        _codegen().generate_into(Path(self.build_lib) / "skymesh" / "mesh" / "gen",
                                 ROOT / "protos")
        # The lock travels with the release: the installer pins a host's dependencies to
        # what was tested (pip constraints), whenever the host is built.
        lock = ROOT / "requirements" / "lock.txt"
        (Path(self.build_lib) / "skymesh" / "constraints.txt").write_bytes(lock.read_bytes())


setup(cmdclass={"build_py": BuildPyWithStubs})
