"""``pip install skymesh`` without extras: the product's core, and nothing of the lab.

The wheel is built from a copy of the source tree (offline, without build isolation, as
``test_wheel_peering`` does) and installed into a fresh venv outside the checkout with its
core dependencies only, pinned by ``requirements/lock.txt``. No ``.pth`` reaches back into
the test environment: what the venv lacks, the commands lack.

The core dependencies' wheels are downloaded once into a cache under
``~/.cache/skymesh-test`` (keyed by the lock and the dependency list), so each run installs
from local files with ``--no-index`` instead of resolving against the registry.

Checked: the package count, ``skymesh-lb --help``/``--version``, the ``skymesh`` commands
of the core, the one-line error of a command whose extra is missing, and a chat
completion through ``skymesh-lb`` (from the venv) to a ``skymesh-replica`` (from the
project venv, which has the lab) with no lab module imported by the balancer.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest
from test_wheel_peering import _clean_env, _copy_source, _run, _start

from skymesh.util.procs import Daemon, start_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]
LOCK = ROOT / "requirements" / "lock.txt"
WHEEL_CACHE = Path.home() / ".cache" / "skymesh-test" / "core-wheels"
MAX_PACKAGES = 40  # issue #21: the balancer and ctl in at most ~40 packages
MAX_SITE_MB = 250  # the core is ~150 MB; scipy or torch alone would break this
# Modules the balancer must never import: the lab's, and the lab extras' packages.
LAB_MODULES = ("skymesh_lab", "pandas", "scipy", "sklearn", "matplotlib", "statsmodels",
               "torch", "fastapi", "redis", "boto3")
_IMPORTED = re.compile(r"^import time:\s+\d+ \|\s+\d+ \|\s*(\S+)\s*$", re.M)
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class Lean:
    venv: Path
    site: Path


def core_dependencies() -> list[str]:
    return list(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"])


def core_wheels() -> Path:
    """A folder with the wheels of the core dependencies at the lock's versions."""
    deps = core_dependencies()
    key = hashlib.sha256((LOCK.read_text() + "\n".join(sorted(deps))).encode()).hexdigest()
    folder = WHEEL_CACHE / key[:16]
    if (folder / ".complete").exists():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _run([sys.executable, "-m", "pip", "download", "-q", "--only-binary", ":all:",
          "-d", str(partial), "-c", str(LOCK), *deps], cwd=ROOT, env=_clean_env())
    (partial / ".complete").touch()
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lean]:
    work = tmp_path_factory.mktemp("lean")
    src, dist, venv = work / "src", work / "dist", work / "venv"
    _copy_source(src)
    env = _clean_env()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(src)], cwd=work, env=env)
    (wheel,) = dist.glob("skymesh-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
          "--find-links", str(core_wheels()), "-c", str(LOCK), str(wheel)], cwd=work, env=env)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], cwd=work, env=env).strip())
    yield Lean(venv, site)


def _cmd(lean: Lean, name: str, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(lean.venv / "bin" / name), *args], cwd=cwd, env=_clean_env(),
                          capture_output=True, text=True, timeout=120)


def test_the_core_is_small(lean: Lean) -> None:
    listed = json.loads(_run([sys.executable, "-m", "pip", "--python",
                              str(lean.venv / "bin" / "python"), "list", "--format", "json"],
                             cwd=lean.venv, env=_clean_env()))
    names = {p["name"].lower() for p in listed} - {"pip", "setuptools"}
    assert "skymesh" in names
    assert len(names) <= MAX_PACKAGES, sorted(names)
    assert not names & {"pandas", "scipy", "scikit-learn", "matplotlib", "statsmodels",
                        "torch", "fastapi", "boto3", "grpcio-tools"}, sorted(names)
    size = sum(f.stat().st_size for f in lean.site.rglob("*") if f.is_file())
    assert size < MAX_SITE_MB * 2**20, f"site-packages is {size / 2**20:.0f} MB"


def test_the_core_commands_run(lean: Lean, tmp_path: Path) -> None:
    version = _cmd(lean, "skymesh-lb", "--version", cwd=tmp_path)
    assert version.returncode == 0 and re.fullmatch(r"skymesh \d+\.\d+\.\d+\S*\n",
                                                    version.stdout), version
    for args in (("skymesh-lb", "--help"), ("skymesh", "--help"), ("skymesh", "ctl", "--help"),
                 ("skymesh-controller", "--help"), ("skymesh-replica", "--help")):
        done = _cmd(lean, *args, cwd=tmp_path)
        assert done.returncode == 0 and "usage:" in done.stdout, (args, done.stderr)
    certs = _cmd(lean, "skymesh", "certs", "--out", "pki", "--ca", "--name", "lb-us",
                 cwd=tmp_path)
    assert certs.returncode == 0, certs.stderr
    assert (tmp_path / "pki" / "ca.crt").exists()


@pytest.mark.parametrize(("args", "extra"), [
    (("skymesh", "sim", "--workload", "poisson"), "lab"),
    (("skymesh", "plan", "bench"), "planning"),
    (("skymesh-replica", "--port", "0"), "lab"),
    (("skymesh-controller", "--port", "0"), "controller"),
])
def test_a_command_without_its_extra_says_what_to_install(lean: Lean, tmp_path: Path,
                                                          args: tuple[str, ...],
                                                          extra: str) -> None:
    env = _clean_env() | {"SKYMESH_ADMIN_TOKEN": "t" * 32}
    done = subprocess.run([str(lean.venv / "bin" / args[0]), *args[1:]], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
    assert f"pip install 'skymesh[{extra}]'" in done.stderr, done.stderr


async def test_the_balancer_serves_without_the_lab(lean: Lean, tmp_path: Path) -> None:
    replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.1"],
                           log_path=tmp_path / "replica.log")
    daemons: list[Daemon] = [replica]
    try:
        # -X importtime: every module the balancer imports, lazily too, lands in its log.
        lb = _start(lean.venv, "python", ["-X", "importtime", str(lean.venv / "bin" /
                                          "skymesh-lb"), "--port", "0", "--replicas",
                                          replica.url], tmp_path, tmp_path / "lb.log")
        daemons.append(lb)
        body = {"model": MODEL, "max_tokens": 4, "ignore_eos": True,
                "messages": [{"role": "user", "content": "lean"}]}
        async with (aiohttp.ClientSession() as s,
                    s.post(lb.url + "/v1/chat/completions", json=body) as r):
            assert r.status == 200, await r.text()
            reply = await r.json()
        assert reply["usage"]["completion_tokens"] == 4
    finally:
        for d in reversed(daemons):
            d.stop()
    imported = set(_IMPORTED.findall((tmp_path / "lb.log").read_text(errors="replace")))
    assert {"skymesh.balancer.server", "aiohttp"} <= imported  # the log is the right one
    lab = sorted(m for m in imported
                 if any(m == p or m.startswith(p + ".") for p in LAB_MODULES))
    assert not lab, f"skymesh-lb imported lab modules: {lab}"
