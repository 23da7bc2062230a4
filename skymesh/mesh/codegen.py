"""Generate the peering stubs from ``protos/`` into ``skymesh/mesh/gen`` (gitignored).

Stubs are build output, never edited or committed. They are made by ``make protos`` (and
by ``make install``), by ``python -m skymesh.mesh.codegen [--force]``, and on first use:
:func:`ensure_stubs` runs whenever :mod:`skymesh.mesh.proto` is imported, so a plain
``pip install -e .`` works too. Stubs are rebuilt when the ``.proto`` content or the
grpcio-tools version differs from the stamp written with them (content, not mtimes: a
fresh checkout touches every file).

protoc names modules after the proto path (``skymesh/v1/peering.proto`` ->
``skymesh.v1.peering_pb2``), which would collide with this very package, so the output
goes under ``gen/`` and the one absolute import the gRPC plugin writes
(``from skymesh.v1 import peering_pb2``) is rewritten to ``skymesh.mesh.gen.skymesh.v1``.

Concurrent first imports (several balancers starting at once) serialise on a file lock;
the stamp is written last, so a reader that sees a valid stamp sees complete files.
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

PROTO_ROOT = Path(__file__).resolve().parents[2] / "protos"
PROTO_FILES = ("skymesh/v1/peering.proto",)
GEN_DIR = Path(__file__).resolve().parent / "gen"
GEN_PACKAGE = "skymesh.mesh.gen"
_STAMP = ".stamp.json"
_IMPORT_RE = re.compile(r"^(from|import) skymesh\.v1\b", re.MULTILINE)
# The module name protobuf records for its classes (repr, pickling): make it the real one.
_MODULE_RE = re.compile(r"'skymesh\.v1\.(\w+_pb2)'")


class StubsUnavailable(RuntimeError):
    """The stubs are missing or stale and cannot be generated here."""


def _tools_version() -> str:
    try:
        return importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        return ""


def _wanted_stamp() -> dict[str, str] | None:
    """What the stamp should say, or None when the protos are not shipped (a wheel)."""
    digest = hashlib.sha256()
    for rel in PROTO_FILES:
        path = PROTO_ROOT / rel
        if not path.is_file():
            return None
        digest.update(rel.encode() + b"\0" + path.read_bytes())
    return {"protos": digest.hexdigest(), "grpcio_tools": _tools_version()}


def _current_stamp() -> dict[str, str] | None:
    try:
        stamp = json.loads((GEN_DIR / _STAMP).read_text())
    except (OSError, ValueError):
        return None
    return stamp if isinstance(stamp, dict) else None


def _outputs() -> list[Path]:
    out = []
    for rel in PROTO_FILES:
        stem = GEN_DIR / rel.removesuffix(".proto")
        out += [stem.with_name(stem.name + "_pb2.py"), stem.with_name(stem.name + "_pb2_grpc.py")]
    return out


def is_fresh() -> bool:
    current = _current_stamp()
    if current is None or not all(p.is_file() for p in _outputs()):
        return False
    wanted = _wanted_stamp()
    # Without the protos (an installed wheel) whatever was generated at build time stands.
    return wanted is None or current == wanted


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    GEN_DIR.mkdir(parents=True, exist_ok=True)
    with open(GEN_DIR / ".lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def generate(*, force: bool = False) -> bool:
    """(Re)generate the stubs if stale (or always, with ``force``); True if it ran protoc."""
    with _locked():
        if not force and is_fresh():
            return False
        wanted = _wanted_stamp()
        if wanted is None:
            raise StubsUnavailable(
                f"peering stubs are missing and {PROTO_ROOT} is not there to build them from")
        try:
            import grpc_tools
            from grpc_tools import protoc
        except ImportError as exc:
            raise StubsUnavailable(
                "peering stubs need grpcio-tools to be generated: "
                "pip install 'grpcio-tools>=1.60' (or run `make install`)") from exc
        with tempfile.TemporaryDirectory(dir=GEN_DIR.parent, prefix=".gen-") as tmp:
            args = [
                "grpc_tools.protoc",
                f"-I{PROTO_ROOT}",
                f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
                f"--python_out={tmp}",
                f"--pyi_out={tmp}",
                f"--grpc_python_out={tmp}",
                *PROTO_FILES,
            ]
            if protoc.main(args) != 0:
                raise StubsUnavailable(f"protoc failed on {', '.join(PROTO_FILES)} (see stderr)")
            _install(Path(tmp))
        (GEN_DIR / _STAMP).write_text(json.dumps(wanted, indent=1) + "\n")
    importlib.invalidate_caches()
    return True


def _install(tmp: Path) -> None:
    """Fix the imports, add package markers, and move the files into ``GEN_DIR``."""
    for path in tmp.rglob("*"):
        if path.suffix in (".py", ".pyi"):
            text = path.read_text()
            text = _IMPORT_RE.sub(rf"\1 {GEN_PACKAGE}.skymesh.v1", text)
            path.write_text(_MODULE_RE.sub(rf"'{GEN_PACKAGE}.skymesh.v1.\1'", text))
    for folder in [tmp, *(p for p in tmp.rglob("*") if p.is_dir())]:
        (folder / "__init__.py").write_text("# generated by skymesh.mesh.codegen\n")
    (GEN_DIR / _STAMP).unlink(missing_ok=True)
    for path in sorted(tmp.rglob("*")):
        if path.is_file():
            dest = GEN_DIR / path.relative_to(tmp)
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
