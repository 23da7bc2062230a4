"""Sizes of the per-role container images (docs/image.md), read from the built images.

    python -m skymesh_lab.bench.image_sizes --build --json docs/results/data/image-sizes.json
    python -m skymesh_lab.bench.results docs/results/data docs/results   # the page

Run from the repository root. ``--build`` first builds each role's image with ``make
image``'s script (``tools/image/build.sh``, tag ``skymesh-ROLE:VERSION``); without it the
images must exist. For the base image and each role's image this records the size the
engine stores (uncompressed layers: what a host's disk holds once pulled), the layers'
size gzip-compressed (what a registry stores and a pull downloads; buildah only) and, from a
probe run inside the image with its own interpreter, the venv's Python distributions
(name, version, the bytes their RECORD lists), the size of site-packages on disk
(byte-compiled files included) and which of a few modules import there (the lab must not;
the balancer carries no control plane). The page ``docs/results/image-sizes.md`` is
rendered from that JSON by ``skymesh_lab.bench.image_sizes_page``.

Engines: buildah (``--storage-driver vfs``, as ``tools/image/build.sh`` uses it; the probe
runs in a working container made for it and removed after) or docker when a daemon
answers; ``SKYMESH_IMAGE_ENGINE`` forces one, as for the build.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROLES = ("balancer", "controller", "replica")
BASE_IMAGE = "localhost/skymesh-base:bookworm"
VENV_PYTHON = "/opt/skymesh/bin/python"
BUILDAH = ("buildah", "--storage-driver", "vfs")
# Modules whose presence the page reports per image: ours, and the control plane's
# heaviest dependencies (which the balancer's image must not carry).
MODULES = ("skymesh", "skymesh_controller", "skymesh_replica", "skymesh_lab", "fastapi",
           "pandas", "torch")

# Runs inside the image with the venv's interpreter; standard library only.
PROBE = r"""
import importlib.metadata as md, importlib.util as iu, json, os, sys, sysconfig
site = sysconfig.get_paths()["purelib"]
def du(top):
    seen, total = set(), 0
    for d, _, files in os.walk(top):
        for f in files:
            st = os.lstat(os.path.join(d, f))
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total
dists = {}
for dist in md.distributions(path=[site]):
    name = dist.metadata["Name"].lower().replace("_", "-").replace(".", "-")
    dists[name] = {"version": dist.version,
                   "bytes": sum(f.size or 0 for f in dist.files or [])}
print(json.dumps({"python": sys.version.split()[0], "site_packages_bytes": du(site),
                  "venv_bytes": du(sys.prefix), "distributions": dict(sorted(dists.items())),
                  "imports": {m: iu.find_spec(m) is not None for m in sys.argv[1:]}}))
"""


def run(cmd: Sequence[str], timeout: float = 600) -> str:
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    return done.stdout


def pick_engine(env: dict[str, str]) -> str:
    forced = env.get("SKYMESH_IMAGE_ENGINE")
    if forced:
        if forced not in ("buildah", "docker"):
            raise SystemExit("SKYMESH_IMAGE_ENGINE must be buildah or docker")
        return forced
    if shutil.which("docker") and subprocess.run(["docker", "info"], capture_output=True,
                                                 check=False).returncode == 0:
        return "docker"
    return "buildah"


def version(pyproject: Path) -> str:
    m = re.search(r'^version = "(.+)"$', pyproject.read_text(), re.MULTILINE)
    if not m:
        raise SystemExit(f"no version in {pyproject}")
    return m.group(1)


def tag(role: str, ver: str) -> str:
    """The tag ``make image ROLE=role`` gives (tools/image/build.sh)."""
    return f"skymesh-{role}:{ver}"


def stored_size(engine: str, image: str) -> tuple[str, int]:
    """(image id, bytes the engine stores for it)."""
    if engine == "docker":
        out = json.loads(run(["docker", "image", "inspect", image]))[0]
        return str(out["Id"]), int(out["Size"])
    # buildah prints sizes rounded for people; its manifest lists each layer's
    # uncompressed tar in bytes, and the layers sum to what the image stores.
    info = json.loads(run([*BUILDAH, "inspect", "--type", "image", image]))
    return str(info["FromImageID"]), layers_size(info["Manifest"])


def layers_size(manifest: str) -> int:
    """Bytes of an image's layers, from its manifest (OCI or docker schema 2)."""
    return sum(int(layer["size"]) for layer in json.loads(manifest)["layers"])


def compressed_size(engine: str, image: str) -> int | None:
    """Bytes of the image's layers gzip-compressed, as a registry would store them and a
    host pull them (buildah only: docker's own export is uncompressed)."""
    if engine != "buildah":
        return None
    with tempfile.TemporaryDirectory(dir="/var/tmp", prefix="skymesh-image-sizes.") as tmp:
        run([*BUILDAH, "push", "-q", "--compression-format", "gzip", image,
             f"oci:{tmp}:image"])
        (entry,) = json.loads((Path(tmp) / "index.json").read_text())["manifests"]
        blob = Path(tmp) / "blobs" / Path(*entry["digest"].split(":", 1))
        return layers_size(blob.read_text())


def probe(engine: str, image: str) -> dict[str, Any]:
    """The distributions, site-packages size and imports inside ``image``'s venv."""
    argv = [VENV_PYTHON, "-c", PROBE, *MODULES]
    if engine == "docker":
        return dict(json.loads(run(["docker", "run", "--rm", "--network", "none",
                                    "--entrypoint", argv[0], image, *argv[1:]])))
    name = f"skymesh-image-sizes-{os.getpid()}"
    run([*BUILDAH, "from", "--pull-never", "--name", name, image])
    try:
        # chroot isolation (no user namespaces needed) allows only the host's network;
        # the probe opens no socket.
        return dict(json.loads(run([*BUILDAH, "run", "--isolation", "chroot", name, "--",
                                    *argv])))
    finally:
        subprocess.run([*BUILDAH, "rm", name], capture_output=True, check=False)


def measure(engine: str, ver: str, roles: Sequence[str] = ROLES,
            base: str = BASE_IMAGE) -> dict[str, Any]:
    base_id, base_bytes = stored_size(engine, base)
    images: dict[str, Any] = {}
    for role in roles:
        ident, size = stored_size(engine, tag(role, ver))
        images[role] = {"tag": tag(role, ver), "id": ident, "size_bytes": size,
                        "compressed_bytes": compressed_size(engine, tag(role, ver)),
                        **probe(engine, tag(role, ver))}
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                            text=True, check=False).stdout.strip()
    return {"setup": {"engine": engine, "version": ver, "commit": commit or None,
                      "date": datetime.now(UTC).strftime("%Y-%m-%d")},
            "base": {"tag": base, "id": base_id, "size_bytes": base_bytes,
                     "compressed_bytes": compressed_size(engine, base)},
            "images": images}


def build(roles: Sequence[str], env: dict[str, str]) -> None:
    script = Path("tools/image/build.sh")
    if not script.exists():
        raise SystemExit("--build runs tools/image/build.sh: run from the repository root")
    for role in roles:
        subprocess.run([str(script)], env={**env, "ROLE": role}, check=True)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m skymesh_lab.bench.image_sizes",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", type=Path, help="write the measurements here (else stdout)")
    ap.add_argument("--build", action="store_true", help="build each role's image first")
    ap.add_argument("--roles", default=",".join(ROLES), help="comma-separated (default: all)")
    args = ap.parse_args(argv)
    roles = [r for r in args.roles.split(",") if r]
    unknown = sorted(set(roles) - set(ROLES))
    if unknown:
        ap.error(f"unknown role {', '.join(unknown)}; roles: {', '.join(ROLES)}")
    env = dict(os.environ)
    engine = pick_engine(env)
    if args.build:
        build(roles, {**env, "SKYMESH_IMAGE_ENGINE": engine})
    doc = measure(engine, version(Path("pyproject.toml")), roles)
    text = json.dumps(doc, indent=2) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
