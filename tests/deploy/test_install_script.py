"""deploy/cloud-init/install-skymesh.sh run for real into a temporary prefix and root.

It builds a venv, installs a wheel of this checkout (offline, no dependencies: the
daemons then borrow this venv's packages through a .pth file), writes configs and units
with their paths rewritten, and, not being under systemd at /, starts nothing. The
rendered replica unit's ExecStart is then run and must serve /health.
"""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest
from support import until

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "cloud-init" / "install-skymesh.sh"
ROLES = ("lb", "replica", "controller")


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, product_wheels: list[Path]
              ) -> Iterator[tuple[Path, Path, str]]:
    tmp = tmp_path_factory.mktemp("install")
    prefix, root = tmp / "opt", tmp / "root"
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SKYMESH_ROLES": ",".join(ROLES),
        "SKYMESH_PREFIX": str(prefix),
        "SKYMESH_ROOT": str(root),
        "SKYMESH_PYTHON": str(Path(sys.base_prefix) / "bin" / "python3"),
        "SKYMESH_PIP_SPEC": " ".join(map(str, product_wheels)),
        "SKYMESH_PIP_ARGS": "--no-deps --no-index",
    }
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=240)
    assert proc.returncode == 0, proc.stderr
    yield prefix, root, proc.stderr


def test_installs_the_scripts_configs_and_units_without_systemctl(
        installed: tuple[Path, Path, str]) -> None:
    prefix, root, log = installed
    for role in ROLES:
        assert os.access(prefix / "venv" / "bin" / f"skymesh-{role}", os.X_OK)
    assert sorted(p.name for p in (root / "etc" / "skymesh").iterdir()) == [
        "api-keys", "controller.yaml", "lb.yaml", "replica.env"]
    for name in ("lb.yaml", "api-keys"):
        assert (root / "etc" / "skymesh" / name).stat().st_mode & 0o777 == 0o640
    # No keys yet: the operator is told, and skymesh-lb would refuse a public address.
    assert (root / "etc" / "skymesh" / "api-keys").read_text() == ""
    assert "add client API keys to" in log
    assert "installed skymesh 0.1.0" in log
    assert "not running under systemd" in log
    for role in ROLES:
        text = (root / "etc" / "systemd" / "system" / f"skymesh-{role}.service").read_text()
        settings = [line for line in text.splitlines() if not line.startswith("#")]
        assert not [line for line in settings
                    if re.search(r"(^|[\s=-])/(opt|etc)/skymesh/", line)], "paths not rewritten"
        execs = re.findall(r"^ExecStart=(\S+)", text, re.M)
        assert execs == [f"{prefix}/venv/bin/skymesh-{role}"]
        if role != "replica":
            assert f"--config {root}/etc/skymesh/" in text


def test_rendered_units_pass_systemd_analyze(installed: tuple[Path, Path, str]) -> None:
    _, root, _ = installed
    units = sorted((root / "etc" / "systemd" / "system").glob("*.service"))
    analyze = shutil.which("systemd-analyze")
    if analyze:
        proc = subprocess.run([analyze, "verify", "--man=no", *map(str, units)],
                              capture_output=True, text=True, timeout=60)
        # Unknown keys are only warnings to systemd: any output is a finding.
        assert proc.returncode == 0 and not proc.stderr.strip(), proc.stderr
    else:
        for unit in units:
            sections = re.findall(r"^\[(\w+)\]$", unit.read_text(), re.M)
            assert sections == ["Unit", "Service", "Install"], unit


async def test_the_rendered_replica_unit_starts_a_working_replica(
        installed: tuple[Path, Path, str]) -> None:
    prefix, root, _ = installed
    # The wheel went in without dependencies: lend it this venv's (after its own copy).
    site = Path(sysconfig.get_paths()["purelib"])
    venv_site = next((prefix / "venv" / "lib").glob("python3*/site-packages"))
    (venv_site / "borrowed-deps.pth").write_text(f"{site}\n")

    unit = (root / "etc" / "systemd" / "system" / "skymesh-replica.service").read_text()
    env_path = Path(re.findall(r"^EnvironmentFile=-?(\S+)", unit, re.M)[0])
    args = env_path.read_text().split("SKYMESH_REPLICA_ARGS=", 1)[1].split()
    exec_start = re.findall(r"^ExecStart=(.+)$", unit, re.M)[0]
    words = shlex.split(exec_start.replace("$SKYMESH_REPLICA_ARGS", " ".join(args)))
    # Any free port on loopback, and a fast emulated GPU, for the test.
    words = [w for w in words if w != "0.0.0.0"]
    words[words.index("--port") + 1] = "0"
    words[words.index("--host")] = "--host=127.0.0.1"
    proc = await asyncio.create_subprocess_exec(
        *words, "--time-scale", "0.05", stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=60)
        found = re.search(rb"listening on (http://\S+)", line)
        assert found, line
        url = found.group(1).decode()
        # It runs the wheel's copy, not this checkout's.
        async with aiohttp.ClientSession() as session:
            async def healthy() -> bool:
                async with session.get(url + "/health") as r:
                    return r.status == 200
            await until(healthy, "the installed replica answers /health")
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), timeout=30)
