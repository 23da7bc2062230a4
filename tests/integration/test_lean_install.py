"""Each distribution's wheel, installed as a user would, in a fresh venv outside the
checkout: what it brings, and nothing of the others.

The wheels are built from a copy of the source tree (offline, without build isolation, as
``test_wheel_peering`` does) and installed with their own dependencies only, pinned by
``requirements/lock.txt``. No ``.pth`` reaches back into the test environment: what a
venv lacks, its commands lack.

The dependencies' wheels are downloaded once into a cache under ``~/.cache/skymesh-test``
(keyed by the lock and the dependency list), so each run installs from local files with
``--no-index`` instead of resolving against the registry.

Checked: the data plane alone (package count, ``skymesh-lb``, ``skymesh --version``,
``certs``, ``ctl``, ``dns``, no lab or controller subcommand, a chat completion through
it with no lab module imported); the README's first balancer, its lines run verbatim
after the documented ``pip install . ./replica``; the controller serving its API from its
wheel on a real Redis; and ``skymesh sim`` present exactly where the lab is installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import sysconfig
import tomllib
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
MAX_PACKAGES = 30  # issue #32: the data plane in at most ~30 packages
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


def dependencies(folder: Path) -> list[str]:
    """A distribution's own dependencies, less ours (installed from the built wheels)."""
    deps = tomllib.loads((folder / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d for d in deps if not d.startswith("skymesh")]


def core_dependencies() -> list[str]:
    return dependencies(ROOT)


def core_wheels(deps: list[str] | None = None) -> Path:
    """A folder with the wheels of ``deps`` (the data plane's) at the lock's versions."""
    deps = core_dependencies() if deps is None else deps
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


SUBDISTS = ("controller", "replica", "lab")


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The four distributions' wheels: ``skymesh``, ``controller``, ``replica``, ``lab``."""
    work = tmp_path_factory.mktemp("wheels")
    src, dist = work / "src", work / "dist"
    _copy_source(src)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "build")
    for name in SUBDISTS:
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
          "--no-index", "-q", "-w", str(dist), str(src), *(str(src / n) for n in SUBDISTS)],
         cwd=work, env=_clean_env())
    found = {w.name.split("-")[0]: w for w in dist.glob("*.whl")}
    return {"skymesh": found["skymesh"], "controller": found["skymesh_controller"],
            "replica": found["skymesh_replica"], "lab": found["skymesh_lab"]}


def make_venv(work: Path, wheels: list[Path], deps: list[str]) -> Lean:
    """A fresh venv with ``wheels`` and their dependencies ``deps`` (from the cache)."""
    venv = work / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    python = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
          "--find-links", str(core_wheels(deps)), "-c", str(LOCK), *map(str, wheels)],
         cwd=work, env=env)
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], cwd=work, env=env).strip())
    return Lean(venv, site)


@pytest.fixture(scope="module")
def lean(tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]) -> Lean:
    return make_venv(tmp_path_factory.mktemp("lean"), [wheels["skymesh"]],
                     core_dependencies())


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


def test_the_data_plane_commands_run_without_the_other_distributions(
        lean: Lean, tmp_path: Path) -> None:
    for name in ("skymesh-lb", "skymesh"):
        version = _cmd(lean, name, "--version", cwd=tmp_path)
        assert version.returncode == 0 and re.fullmatch(r"skymesh \d+\.\d+\.\d+\S*\n",
                                                        version.stdout), version
    for args in (("skymesh-lb", "--help"), ("skymesh", "ctl", "--help"),
                 ("skymesh", "dns", "--help")):
        done = _cmd(lean, *args, cwd=tmp_path)
        assert done.returncode == 0 and "usage:" in done.stdout, (args, done.stderr)
    certs = _cmd(lean, "skymesh", "certs", "--out", "pki", "--ca", "--name", "lb-us",
                 cwd=tmp_path)
    assert certs.returncode == 0, certs.stderr
    assert (tmp_path / "pki" / "ca.crt").exists()
    assert not (lean.venv / "bin" / "skymesh-controller").exists()
    assert not (lean.venv / "bin" / "skymesh-replica").exists()


def test_the_lab_and_controller_commands_are_absent_without_them(lean: Lean,
                                                                 tmp_path: Path) -> None:
    helped = _cmd(lean, "skymesh", "--help", cwd=tmp_path)
    assert helped.returncode == 0 and helped.stderr == "", helped
    listed = set(re.search(r"\{([a-z,-]+)\}", helped.stdout).group(1).split(","))  # type: ignore[union-attr]
    assert listed == {"certs", "ctl", "dns"}
    sim = _cmd(lean, "skymesh", "sim", "--workload", "poisson", cwd=tmp_path)
    assert sim.returncode == 2 and "invalid choice: 'sim'" in sim.stderr, sim


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


def readme_first_balancer() -> tuple[str, list[str], str]:
    """The README's first balancer: the ``lb.yaml`` block, the shell lines that start the
    processes, and the curl line, as written there."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## A first balancer"):]
    blocks = re.findall(r"```(\w*)\n(.*?)```", section, re.S)
    config = next(body for lang, body in blocks if lang == "yaml")
    starts = next(body for lang, body in blocks if lang == "sh" and "skymesh-lb" in body)
    curl = next(body for lang, body in blocks if lang == "sh" and "curl" in body)
    assert "pip install . ./replica" in section[:section.index("```")]
    return config, starts.strip().splitlines(), curl


def test_the_readmes_first_balancer_works_as_written(
        tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]) -> None:
    """``pip install . ./replica`` (as wheels), then the README's own lines, verbatim."""
    venv = make_venv(tmp_path_factory.mktemp("readme"), [wheels["skymesh"], wheels["replica"]],
                     sorted({*core_dependencies(), *dependencies(ROOT / "replica")}))
    work = tmp_path_factory.mktemp("first-balancer")
    config, starts, curl = readme_first_balancer()
    (work / "lb.yaml").write_text(config)
    port = re.search(r"port: (\d+)", config).group(1)  # type: ignore[union-attr]
    env = _clean_env() | {"PATH": f"{venv.venv / 'bin'}:/usr/bin:/bin"}
    # The README's lines in one shell, then a wait for the balancer's /ready, then the curl
    # line; the processes are the shell's children, killed with its process group.
    script = "\n".join([*starts, f"for i in $(seq 300); do curl -sf localhost:{port}/ready "
                         ">/dev/null && break; sleep 0.1; done", curl.strip(),
                         "kill $(jobs -p)", "wait"])
    proc = subprocess.Popen(["bash", "-c", script], cwd=work, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=120)
    finally:  # whatever happened, no process of the README's outlives the test
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert "{" in stdout, stderr
    reply = json.loads(stdout[stdout.index("{"):].splitlines()[0])
    assert reply["object"] == "chat.completion", stdout
    assert reply["usage"]["completion_tokens"] == 8
    assert reply["choices"][0]["finish_reason"] == "length"


async def test_the_controller_serves_its_api_from_its_wheel(
        tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]) -> None:
    from controller_support import RedisServer

    venv = make_venv(tmp_path_factory.mktemp("controller"),
                     [wheels["skymesh"], wheels["controller"]],
                     sorted({*core_dependencies(), *dependencies(ROOT / "controller")}))
    work = tmp_path_factory.mktemp("controller-run")
    redis = RedisServer(work)
    redis.start()
    token = "t" * 32
    env = _clean_env() | {"SKYMESH_ADMIN_TOKEN": token}
    ctl: Daemon | None = None
    try:
        with (work / "ctl.log").open("wb") as log:
            proc = subprocess.Popen([str(venv.venv / "bin" / "skymesh-controller"), "--port",
                                     "0", "--store", redis.url], cwd=work, stdout=log,
                                    stderr=subprocess.STDOUT, env=env)
        ctl = _await_listening(proc, work / "ctl.log")
        auth = {"Authorization": f"Bearer {token}"}
        region = {"name": "us-east", "latitude": 38.9, "longitude": -77.0}
        async with aiohttp.ClientSession() as s:
            async with s.post(ctl.url + "/v1/regions", json=region, headers=auth) as r:
                assert r.status in (200, 201), await r.text()
            async with s.get(ctl.url + "/v1/regions", headers=auth) as r:
                assert [g["name"] for g in await r.json()] == ["us-east"]
        # The planner's solver and forecasters are the controller's `planning` extra.
        plan = subprocess.run([str(venv.venv / "bin" / "skymesh"), "plan", "bench"], cwd=work,
                              env=env, capture_output=True, text=True, timeout=120)
        assert plan.returncode == 2 and plan.stderr.count("\n") == 1, plan
        assert "pip install 'skymesh-controller[planning]'" in plan.stderr
    finally:
        if ctl is not None:
            ctl.stop()
        redis.stop()
    assert "skymesh_lab" not in (work / "ctl.log").read_text(errors="replace")


def _await_listening(proc: subprocess.Popen[bytes], log_path: Path) -> Daemon:
    from support import wait_for

    def url() -> str | None:
        if proc.poll() is not None:
            raise AssertionError(log_path.read_text(errors="replace"))
        m = re.search(r"listening on (http://\S+)", log_path.read_text(errors="replace"))
        return m.group(1) if m else None

    return Daemon("skymesh-controller", proc, wait_for(url, "the controller listening", 60),
                  log_path)


def test_the_lab_adds_its_commands_where_it_is_installed(
        tmp_path_factory: pytest.TempPathFactory, wheels: dict[str, Path]) -> None:
    """All four wheels in a venv whose third-party packages come from the test environment
    (a ``.pth``; the lab's are heavy): ``skymesh sim`` runs from the lab's wheel."""
    work = tmp_path_factory.mktemp("lab")
    venv = work / "venv"
    env = _clean_env()
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=work, env=env)
    python = venv / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()"
                      "['purelib'])"], cwd=work, env=env).strip())
    _run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps",
          "--no-index", "-q", *map(str, wheels.values())], cwd=work, env=env)
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    helped = subprocess.run([str(venv / "bin" / "skymesh"), "--help"], cwd=work, env=env,
                            capture_output=True, text=True, timeout=120)
    assert helped.returncode == 0, helped
    for name in ("sim", "bench", "demo", "faults", "plan", "forecast"):
        assert name in helped.stdout
    where = _run([str(python), "-c", "import skymesh_lab.cli as c; print(c.__file__)"],
                 cwd=work, env=env)
    assert where.startswith(str(site)), where
    out = work / "sim.json"
    sim = subprocess.run([str(venv / "bin" / "skymesh"), "sim", "--workload", "poisson",
                          "--regions", "us", "--replicas", "2", "--duration", "5",
                          "--no-progress", "--json", str(out)], cwd=work, timeout=300,
                         env=env | {"SKYMESH_DATA_DIR": str(ROOT.parent / "shared" / "data")},
                         capture_output=True, text=True)
    assert sim.returncode == 0, sim.stderr[-2000:]
    assert json.loads(out.read_text())["completed"] > 0
