"""The built artefacts peer: an sdist is built from a copy of the source tree, a wheel from
that sdist (as ``python -m build`` does), the wheel is installed into a fresh venv outside
the checkout, and two ``skymesh-lb`` from that venv, started outside the checkout, peer
over mutual TLS and forward a request.

Offline and quick: the build runs without isolation (setuptools and grpcio-tools come from
the test's own environment) and the fresh venv sees the test environment's third-party
packages through a ``.pth`` line, appended after its own site-packages. skymesh itself is
not on that path (the checkout is installed in editable mode, whose finder a plain ``.pth``
path line does not run), so the package under test comes from the wheel; the test checks
that, and that nothing is written into the installed package at run time.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import until

from skymesh.util.procs import Daemon, free_port, start_daemon

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.1-8B-Instruct"
STUBS = ("skymesh/mesh/gen/skymesh/v1/peering_pb2.py",
         "skymesh/mesh/gen/skymesh/v1/peering_pb2_grpc.py", "skymesh/mesh/gen/.stamp.json")
_LISTENING = re.compile(r"listening on (https?://\S+)")


@dataclass
class Installed:
    venv: Path
    package: Path  # the installed skymesh package folder
    wheel: Path
    sdist: Path


def _run(cmd: list[str], cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def _clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PYTHON", "VIRTUAL_ENV", "SKYMESH_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _copy_source(dest: Path) -> None:
    """The files an sdist is built from, as they are in the work tree (no build output)."""
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", ".lock", ".gen-*")
    for name in ("skymesh", "protos", "requirements"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    shutil.rmtree(dest / "skymesh" / "mesh" / "gen", ignore_errors=True)
    for name in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "LICENSE"):
        if (ROOT / name).exists():
            shutil.copy2(ROOT / name, dest / name)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    work = tmp_path_factory.mktemp("wheel")
    src, dist, venv = work / "src", work / "dist", work / "venv"
    _copy_source(src)
    env = _clean_env()
    _run([sys.executable, "-c", "import sys; from setuptools import build_meta; "
          "build_meta.build_sdist(sys.argv[1])", str(dist)], cwd=src, env=env)
    (sdist,) = dist.glob("skymesh-*.tar.gz")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(sdist)], cwd=work, env=env)
    (wheel,) = dist.glob("skymesh-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], cwd=work, env=env).strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", str(wheel)], cwd=work, env=env)
    yield Installed(venv, site / "skymesh", wheel, sdist)


def test_the_sdist_carries_the_protos_and_the_wheel_the_stubs(installed: Installed) -> None:
    with tarfile.open(installed.sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert "protos/skymesh/v1/peering.proto" in names and "setup.py" in names
    assert not any(n.startswith("skymesh/mesh/gen/") for n in names)
    assert "requirements/lock.txt" in names
    with zipfile.ZipFile(installed.wheel) as whl:
        assert set(STUBS) <= set(whl.namelist())
        # The lock travels with the release, for the installer's pip constraints.
        assert whl.read("skymesh/constraints.txt") == (ROOT / "requirements" /
                                                       "lock.txt").read_bytes()


def _snapshot(package: Path) -> dict[str, int]:
    return {str(p.relative_to(package)): p.stat().st_mtime_ns for p in package.rglob("*")
            if "__pycache__" not in p.parts}


def _start(venv: Path, name: str, args: list[str], cwd: Path, log_path: Path) -> Daemon:
    with log_path.open("wb") as log:
        proc = subprocess.Popen([str(venv / "bin" / name), *args], cwd=cwd, stdout=log,
                                stderr=subprocess.STDOUT, env=_clean_env())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        m = _LISTENING.search(log_path.read_text(errors="replace"))
        if m:
            return Daemon(name, proc, m.group(1), log_path)
        if proc.poll() is not None:
            break
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    raise AssertionError(f"{name} did not start:\n{log_path.read_text(errors='replace')}")


async def test_two_balancers_from_the_wheel_peer_over_mtls(installed: Installed,
                                                           tmp_path: Path) -> None:
    venv, cwd = installed.venv, tmp_path / "run"
    cwd.mkdir()
    where = _run([str(venv / "bin" / "python"), "-c", "import skymesh, skymesh.mesh.proto as p; "
                  "print(skymesh.__file__, p.pb.__file__)"], cwd=cwd, env=_clean_env()).split()
    assert all(Path(w).is_relative_to(installed.package) for w in where), where
    before = _snapshot(installed.package)
    _run([str(venv / "bin" / "skymesh"), "certs", "--out", "pki", "--ca",
          "--name", "lb-us", "--name", "lb-eu"], cwd=cwd, env=_clean_env())
    replica = start_daemon("skymesh-replica", ["--port", "0", "--time-scale", "0.1"],
                           log_path=tmp_path / "replica.log")
    grpc = {"lb-us": free_port(), "lb-eu": free_port()}

    def config(me: str, peer: str, replicas: list[str]) -> str:
        cfg: dict[str, Any] = {
            "region": me.removeprefix("lb-"), "listen": {"port": 0},
            "probe": {"interval_s": 0.05}, "replicas": [{"url": u} for u in replicas],
            "mesh": {"id": me, "certs_dir": "pki", "listen_port": grpc[me],
                     "heartbeat_interval_s": 0.1,
                     "peers": [{"id": peer, "address": f"127.0.0.1:{grpc[peer]}"}]}}
        (cwd / f"{me}.yaml").write_text(yaml.safe_dump(cfg))
        return f"{me}.yaml"

    # us has no replicas of its own: whatever it serves, eu's replica serves over the mesh.
    daemons = [replica]
    try:
        eu = _start(venv, "skymesh-lb", ["--config", config("lb-eu", "lb-us", [replica.url])],
                    cwd, tmp_path / "eu.log")
        daemons.append(eu)
        us = _start(venv, "skymesh-lb", ["--config", config("lb-us", "lb-eu", [])],
                    cwd, tmp_path / "us.log")
        daemons.append(us)
        async with aiohttp.ClientSession() as s:
            async def status(lb: Daemon) -> dict[str, Any]:
                async with s.get(lb.url + "/status") as r:
                    out: dict[str, Any] = await r.json()
                    return out

            async def peered() -> bool:
                views = [(await status(lb))["mesh"]["peers"] for lb in (us, eu)]
                return all(p["liveness"] == "alive" and p["rtt_s"] is not None
                           for peers in views for p in peers)

            await until(peered, "both balancers see each other alive, by heartbeats", 30)

            async def eu_model_heard() -> bool:
                peer = (await status(us))["mesh"]["peers"][0]
                return peer["forwardable"] and MODEL in peer["models"]

            await until(eu_model_heard, "us has heard eu's replica in its heartbeats", 30)
            body = {"model": MODEL, "max_tokens": 8, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "through the mesh"}]}
            async with s.post(us.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                reply = await r.json()
            assert reply["usage"]["completion_tokens"] == 8
            st_us, st_eu = await status(us), await status(eu)
            assert st_us["mesh"]["forwarded_out"] == 1
            assert st_eu["mesh"]["forwarded_in"] == 1
    finally:
        for d in reversed(daemons):
            d.stop()
    assert _snapshot(installed.package) == before  # nothing generated at run time
    assert "StubsUnavailable" not in (tmp_path / "us.log").read_text()
