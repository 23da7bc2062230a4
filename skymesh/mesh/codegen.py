"""Generate the peering stubs from ``protos/`` into ``skymesh/mesh/gen`` (gitignored).

Stubs are build output, never edited or committed. Every built artefact carries them:
``setup.py``'s ``build_py`` runs :func:`generate_into` on the build directory, so a wheel
(or a wheel built from the sdist, which ships ``protos/``) has ``skymesh/mesh/gen`` and
its stamp, and an installed package never writes into its own folder at run time.

In a source checkout (an editable install, or the tree on ``sys.path``) the stubs are
made by ``make install``/``make protos``, by ``python -m skymesh.mesh.codegen [--force]``,
and on first use: :func:`ensure_stubs` runs whenever :mod:`skymesh.mesh.proto` is
imported and regenerates them when the ``.proto`` content or the grpcio-tools version
differs from the stamp (content, not mtimes: a fresh checkout touches every file).
Outside a checkout, missing stubs are a broken install and raise :class:`StubsUnavailable`.

protoc names modules after the proto path (``skymesh/v1/peering.proto`` ->
``skymesh.v1.peering_pb2``), which would collide with this very package, so the output
goes under ``gen/`` and the one absolute import the gRPC plugin writes
(``from skymesh.v1 import peering_pb2``) is rewritten to ``skymesh.mesh.gen.skymesh.v1``.

Concurrent first imports in a checkout (several balancers starting at once) serialise on
a file lock; the stamp is written last, so a reader that sees a valid stamp sees complete
files. This module imports only the standard library (grpc_tools when generating), so the
build hook can load it by path before the package's dependencies are installed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import importlib.metadata
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

_PACKAGE_PARENT = Path(__file__).resolve().parents[2]  # the checkout, or site-packages
PROTO_ROOT = _PACKAGE_PARENT / "protos"
PROTO_FILES = ("skymesh/v1/peering.proto",)
GEN_DIR = Path(__file__).resolve().parent / "gen"
GEN_PACKAGE = "skymesh.mesh.gen"
_STAMP = ".stamp.json"
_IMPORT_RE = re.compile(r"^(from|import) skymesh\.v1\b", re.MULTILINE)
# The module name protobuf records for its classes (repr, pickling): make it the real one.
_MODULE_RE = re.compile(r"'skymesh\.v1\.(\w+_pb2)'")
_NAME_RE = re.compile(r'^name\s*=\s*"skymesh"\s*$', re.MULTILINE)


class StubsUnavailable(RuntimeError):
    """The stubs are missing or stale and cannot be generated here."""


def in_checkout(root: Path | None = None) -> bool:
    """True when ``root`` (default: the folder holding this package) is a SkyMesh source
    tree: its ``pyproject.toml`` names the project ``skymesh`` and ``protos/`` is beside
    it. An installed package's parent is site-packages, which has neither."""
    root = _PACKAGE_PARENT if root is None else root
    try:
        text = (root / "pyproject.toml").read_text()
    except OSError:
        return False
    return bool(_NAME_RE.search(text)) and (root / "protos").is_dir()


def _tools_version() -> str:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _stamp_for(proto_root: Path) -> dict[str, str]:
    digest = hashlib.sha256()
    for rel in PROTO_FILES:
        path = proto_root / rel
        if not path.is_file():
            raise StubsUnavailable(f"{path} is missing: cannot build the peering stubs")
        digest.update(rel.encode() + b"\0" + path.read_bytes())
    return {"protos": digest.hexdigest(), "grpcio_tools": _tools_version()}


def _current_stamp(gen_dir: Path) -> dict[str, str] | None:
    try:
        stamp = json.loads((gen_dir / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _outputs(gen_dir: Path) -> list[Path]:
    out = []
    for rel in PROTO_FILES:
        stem = gen_dir / rel.removesuffix(".proto")
        out += [stem.with_name(stem.name + "_pb2.py"), stem.with_name(stem.name + "_pb2_grpc.py")]
    return out


def is_fresh() -> bool:
    current = _current_stamp(GEN_DIR)
    if current is None or not all(p.is_file() for p in _outputs(GEN_DIR)):
        return False
    if not in_checkout():
        return True  # an installed package: what its build generated stands
    return current == _stamp_for(PROTO_ROOT)


@contextlib.contextmanager
def _locked(gen_dir: Path) -> Iterator[None]:
    gen_dir.mkdir(parents=True, exist_ok=True)
    with open(gen_dir / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def generate_into(gen_dir: Path, proto_root: Path) -> None:
    """Run protoc on ``proto_root``'s PROTO_FILES and install the stubs (with package
    markers and a stamp) into ``gen_dir``: the build hook's entry point."""
    wanted = _stamp_for(proto_root)
    try:
        import grpc_tools
        from grpc_tools import protoc
    except ImportError as exc:
        raise StubsUnavailable(
            "peering stubs need grpcio-tools to be generated: "
            "pip install 'grpcio-tools>=1.60' (or run `make install`)") from exc
    gen_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=gen_dir.parent, prefix=".gen-") as tmp:
        args = [
            "grpc_tools.protoc",
            f"-I{proto_root}",
            f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *PROTO_FILES,
        ]
        if protoc.main(args) != 0:
            raise StubsUnavailable(f"protoc failed on {', '.join(PROTO_FILES)} (see stderr)")
        _install(Path(tmp), gen_dir)
    (gen_dir / _STAMP).write_text(json.dumps(wanted, indent=1) + "\n")


def generate(*, force: bool = False) -> bool:
    """(Re)generate the checkout's stubs if stale (or always, with ``force``); True if it
    ran protoc. Refuses outside a checkout: an installed package is never written to."""
    if not in_checkout():
        raise StubsUnavailable(
            f"the installed skymesh package has no usable peering stubs in {GEN_DIR}; they "
            "are generated when the wheel is built (setup.py build_py): reinstall from a "
            "wheel or sdist built with `pip wheel` or `python -m build`")
    with _locked(GEN_DIR):
        if not force and is_fresh():
            return False
        generate_into(GEN_DIR, PROTO_ROOT)
    importlib.invalidate_caches()
    return True


def _install(tmp: Path, gen_dir: Path) -> None:
    """Fix the imports, add package markers, and move the files into ``gen_dir``."""
    for path in tmp.rglob("*"):
        if path.suffix in (".py", ".pyi"):
            text = path.read_text()
            text = _IMPORT_RE.sub(rf"\1 {GEN_PACKAGE}.skymesh.v1", text)
            path.write_text(_MODULE_RE.sub(rf"'{GEN_PACKAGE}.skymesh.v1.\1'", text))
    for folder in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").write_text("# generated by skymesh.mesh.codegen\n")
    (gen_dir / _STAMP).unlink(missing_ok=True)
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            dest = gen_dir / path.relative_to(tmp)
            dest.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, dest)


def ensure_stubs() -> None:
    """Make sure up-to-date stubs are importable; cheap when they are."""
    if not is_fresh():
        generate()


def clean() -> None:
    shutil.rmtree(GEN_DIR, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh.mesh.codegen", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--force", action="store_true", help="regenerate even if fresh")
    args = ap.parse_args(argv)
    try:
        ran = generate(force=args.force)
    except StubsUnavailable as exc:
        print(f"skymesh codegen: {exc}", file=sys.stderr)
        return 1
    print(f"peering stubs {'generated' if ran else 'up to date'} in {GEN_DIR}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
