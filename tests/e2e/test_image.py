"""The container images (deploy/docker/Dockerfile), one per role, built here with buildah
and run.

Each role's image (``ROLE=balancer|controller|replica tools/image/build.sh``) is checked
for its configuration (uid 10001, the entrypoint, the HEALTHCHECK, its role) and its
content: the role's packages and never the lab (``import skymesh_lab`` fails in all three;
the balancer's holds no control plane: no ``skymesh_controller``, FastAPI or pandas). The
controller's image serves ``/health`` and passes its own health check. A replica from the
replica image and two balancers from the balancer image, each in its own buildah
container on the host's network (loopback ports): a chat completion through one balancer,
and two balancers peering over mutual TLS (certificates made by ``skymesh certs`` in the
balancer image) with a request forwarded from the one with no replicas to the other. The
health check probes each daemon on the port its command line names, and the daemons run
as uid 10001, which can write nothing in the installed package (stubs baked in).

The builds take minutes each (the first one more: tools/image/make_base.sh debootstraps
the base), so this runs in ``make e2e`` with ``SKYMESH_IMAGE_TEST=1``, as root, where
buildah is installed (``apt-get install buildah debootstrap``); otherwise it is skipped::

    SKYMESH_IMAGE_TEST=1 .venv/bin/pytest -q -p no:cacheprovider -n 0 tests/e2e/test_image.py

The images and buildah's layer cache stay in /var/lib/containers (vfs: GBs) for the next
run; the test's containers are removed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import until, wait_for

from skymesh.util.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
ROLES = ("balancer", "controller", "replica")
BUILDAH = ["buildah", "--storage-driver", "vfs"]
RUN_OPTS = ["--isolation", "chroot", "--network", "host"]
HEALTHCHECK = ["/opt/skymesh/bin/python", "/usr/local/lib/skymesh/healthcheck.py"]
_LISTENING = re.compile(r"listening on (https?://\S+)")

pytestmark = [
    pytest.mark.skipif(not os.environ.get("SKYMESH_IMAGE_TEST"),
                       reason="image test: set SKYMESH_IMAGE_TEST=1 (builds the image: "
                       "minutes; make e2e does)"),
    pytest.mark.skipif(shutil.which("buildah") is None,
                       reason="image test: buildah is not installed (apt-get install "
                       "buildah debootstrap)"),
    pytest.mark.skipif(os.geteuid() != 0, reason="image test: needs root (debootstrap, "
                       "buildah's vfs storage)"),
    pytest.mark.timeout(3600),
]


def _run(cmd: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                          env=None if env is None else {**os.environ, **env})
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@dataclass
class Container:
    """A buildah working container of the image, with the test's folder at /cfg."""

    name: str
    cfg: Path
    env: dict[str, str] = field(default_factory=dict)

    def run_args(self, *cmd: str) -> list[str]:
        env = [f"--env={k}={v}" for k, v in self.env.items()]
        return [*BUILDAH, "run", *RUN_OPTS, *env, "-v", f"{self.cfg}:/cfg", self.name, "--",
                *cmd]

    def run(self, *cmd: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.run_args(*cmd), capture_output=True, text=True, timeout=120)


@dataclass
class Running:
    proc: subprocess.Popen[bytes]
    url: str
    log: Path

    def stop(self) -> None:
        # buildah runs the daemon in its own session under it: signal the whole group.
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            if self.proc.poll() is not None:
                return
            os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue


def _start(ctr: Container, argv: list[str], log: Path) -> Running:
    """The daemon through the image's entrypoint, as the image's user."""
    with log.open("wb") as out:
        proc = subprocess.Popen(ctr.run_args("/usr/local/lib/skymesh/entrypoint.sh", *argv),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def listening_or_exited() -> re.Match[str] | bool:
        return _LISTENING.search(log.read_text(errors="replace")) or proc.poll() is not None

    with contextlib.suppress(AssertionError):  # a timeout fails below, with the log
        got = wait_for(listening_or_exited, f"{argv[0]} listening", timeout=120)
        if isinstance(got, re.Match):
            return Running(proc, got.group(1), log)
    Running(proc, "", log).stop()
    raise AssertionError(f"{argv[0]} did not start:\n{log.read_text(errors='replace')}")


@functools.cache
def image(role: str) -> str:
    """``role``'s image, built once per session (buildah's layer cache makes a rebuild of
    an unchanged tree a matter of seconds)."""
    tag = f"localhost/skymesh-{role}:image-test"
    _run([str(ROOT / "tools" / "image" / "build.sh"), tag], timeout=3000, env={"ROLE": role})
    return tag


@pytest.fixture
def make_container(tmp_path: Path) -> Iterator[Callable[[str, str], Container]]:
    """Working containers of the images (removed after), sharing one /cfg folder."""
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    os.chown(cfg, 10001, 10001)  # the image's user writes the certificates here
    made: list[Container] = []

    def make(role: str, name: str) -> Container:
        ctr = Container(f"skymesh-image-test-{name}-{os.getpid()}", cfg)
        _run([*BUILDAH, "from", "--pull-never", "--name", ctr.name, image(role)])
        made.append(ctr)
        return ctr

    try:
        yield make
    finally:
        for ctr in made:
            subprocess.run([*BUILDAH, "rm", ctr.name], capture_output=True, timeout=120)


# What imports in each role's image: the lab never; the control plane only in its own.
MODULES = ("skymesh", "skymesh_controller", "skymesh_replica", "skymesh_lab", "fastapi",
           "pandas", "statsmodels", "torch")
IMPORTS = {"balancer": {"skymesh"},
           "controller": {"skymesh", "skymesh_controller", "fastapi", "pandas", "statsmodels"},
           "replica": {"skymesh", "skymesh_replica"}}
DAEMON = {"balancer": "skymesh-lb", "controller": "skymesh-controller",
          "replica": "skymesh-replica"}


@pytest.mark.parametrize("role", ROLES)
def test_each_image_is_non_root_with_a_healthcheck_and_its_role(role: str) -> None:
    out = json.loads(_run([*BUILDAH, "inspect", "--type", "image", image(role)]))
    config = out["Docker"]["config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/usr/local/lib/skymesh/entrypoint.sh"]
    assert config["Healthcheck"]["Test"] == ["CMD", *HEALTHCHECK]
    assert f"SKYMESH_ROLE={role}" in config["Env"]
    assert not config.get("Cmd"), "the entrypoint picks the role's daemon itself"


@pytest.mark.parametrize("role", ROLES)
def test_each_image_holds_its_role_and_never_the_lab(
        role: str, make_container: Callable[[str, str], Container]) -> None:
    ctr = make_container(role, role)
    probe = ctr.run("python", "-c", "import importlib.util as u, json, os, sys; "
                    "import skymesh.mesh.proto as p; print(json.dumps({"
                    "'uid': os.getuid(), 'stubs': p.pb.__file__, "
                    "'writable': os.access(os.path.dirname(p.__file__), os.W_OK), "
                    "'imports': [m for m in sys.argv[1:] if u.find_spec(m)]}))", *MODULES)
    assert probe.returncode == 0, probe.stderr
    found = json.loads(probe.stdout)
    assert set(found["imports"]) == IMPORTS[role]
    assert (found["uid"], found["writable"]) == (10001, False)
    assert found["stubs"].startswith("/opt/skymesh/lib/")
    lab = ctr.run("python", "-c", "import skymesh_lab")
    assert lab.returncode == 1 and "No module named 'skymesh_lab'" in lab.stderr

    version = ctr.run("skymesh", "--version")
    assert version.returncode == 0 and "0.1.0" in version.stdout + version.stderr, version
    # With no command, the entrypoint prints the role's daemon's help.
    default = ctr.run("/usr/local/lib/skymesh/entrypoint.sh")
    assert default.returncode == 0, default.stderr
    assert f"usage: {DAEMON[role]}" in default.stdout
    for other in set(DAEMON.values()) - {DAEMON[role], "skymesh-lb"}:
        refused = ctr.run("/usr/local/lib/skymesh/entrypoint.sh", other, "--port", "1")
        assert refused.returncode == 64, (other, refused.stderr)
        assert f"{other} is not in this image (the {role} image" in refused.stderr


async def test_the_controller_image_serves_health(
        make_container: Callable[[str, str], Container], tmp_path: Path) -> None:
    ctr = make_container("controller", "controller")
    ctr.env["SKYMESH_ADMIN_TOKEN"] = "image-test-admin-token"
    argv = ["skymesh-controller", "--host", "127.0.0.1", "--port", str(free_port())]
    daemon = _start(ctr, argv, tmp_path / "controller.log")
    try:
        async with aiohttp.ClientSession() as s:
            async with s.get(daemon.url + "/health") as r:
                assert r.status == 200, await r.text()
            async with s.get(daemon.url + "/v1/balancers") as r:
                assert r.status == 401  # everything but /health needs the token
        check = ctr.run(*HEALTHCHECK, *argv)
        assert check.returncode == 0, check.stderr
    finally:
        daemon.stop()
    check = ctr.run(*HEALTHCHECK, *argv)
    assert check.returncode == 1 and "unhealthy" in check.stderr


async def test_a_replica_and_two_peered_balancers_from_their_images(
        make_container: Callable[[str, str], Container], tmp_path: Path) -> None:
    containers = {"replica": make_container("replica", "replica"),
                  "lb-eu": make_container("balancer", "lb-eu"),
                  "lb-us": make_container("balancer", "lb-us")}
    cfg = containers["replica"].cfg
    made = containers["lb-eu"].run("skymesh", "certs", "--out", "/cfg/pki", "--ca",
                                   "--name", "lb-us", "--name", "lb-eu")
    assert made.returncode == 0, made.stderr
    port = {"replica": free_port(), "lb-eu": free_port(), "lb-us": free_port()}
    grpc = {"lb-us": free_port(), "lb-eu": free_port()}

    def config(me: str, peer: str, replicas: list[str]) -> str:
        doc: dict[str, Any] = {
            "region": me.removeprefix("lb-"),
            "listen": {"host": "127.0.0.1", "port": port[me]},
            "probe": {"interval_s": 0.05}, "replicas": [{"url": u} for u in replicas],
            "mesh": {"id": me, "certs_dir": "/cfg/pki", "listen_port": grpc[me],
                     "heartbeat_interval_s": 0.1,
                     "peers": [{"id": peer, "address": f"127.0.0.1:{grpc[peer]}"}]}}
        (cfg / f"{me}.yaml").write_text(yaml.safe_dump(doc))
        return f"/cfg/{me}.yaml"

    running: list[Running] = []
    try:
        replica_argv = ["skymesh-replica", "--host", "127.0.0.1", "--port",
                        str(port["replica"]), "--time-scale", "0.1"]
        replica = _start(containers["replica"], replica_argv, tmp_path / "replica.log")
        running.append(replica)
        eu_argv = ["skymesh-lb", "--config", config("lb-eu", "lb-us", [replica.url])]
        eu = _start(containers["lb-eu"], eu_argv, tmp_path / "eu.log")
        running.append(eu)
        us_argv = ["skymesh-lb", "--config", config("lb-us", "lb-eu", [])]
        us = _start(containers["lb-us"], us_argv, tmp_path / "us.log")
        running.append(us)

        async with aiohttp.ClientSession() as s:
            async with s.get(replica.url + "/v1/models") as r:
                model = (await r.json())["data"][0]["id"]

            async def status(lb: Running) -> dict[str, Any]:
                async with s.get(lb.url + "/status") as r:
                    out: dict[str, Any] = await r.json()
                    return out

            async def eu_serves() -> bool:
                return any(rep.get("healthy") for rep in (await status(eu))["replicas"].values())

            await until(eu_serves, "eu's balancer sees its replica healthy", 60)
            body = {"model": model, "max_tokens": 8, "ignore_eos": True,
                    "messages": [{"role": "user", "content": "from the image"}]}
            async with s.post(eu.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 8

            async def peered() -> bool:
                views = [(await status(lb))["mesh"]["peers"] for lb in (us, eu)]
                return all(p["liveness"] == "alive" for peers in views for p in peers)

            await until(peered, "both balancers see each other alive over mTLS", 60)

            async def eu_model_heard() -> bool:
                peer = (await status(us))["mesh"]["peers"][0]
                return bool(peer["forwardable"]) and model in peer["models"]

            await until(eu_model_heard, "us has heard eu's replica in its heartbeats", 60)
            async with s.post(us.url + "/v1/chat/completions", json=body) as r:
                assert r.status == 200, await r.text()
                assert (await r.json())["usage"]["completion_tokens"] == 8
            assert (await status(us))["mesh"]["forwarded_out"] == 1
            assert (await status(eu))["mesh"]["forwarded_in"] == 1

        # The image's health check finds each daemon's port from its command line.
        for role, argv in (("replica", replica_argv), ("lb-eu", eu_argv),
                           ("lb-us", us_argv)):
            check = containers[role].run(*HEALTHCHECK, *argv)
            assert check.returncode == 0, f"{role}: {check.stderr}"
        us.stop()
        check = containers["lb-us"].run(*HEALTHCHECK, *us_argv)
        assert check.returncode == 1 and "unhealthy" in check.stderr
    finally:
        for daemon in reversed(running):
            daemon.stop()
    for log in ("eu.log", "us.log"):
        assert "StubsUnavailable" not in (tmp_path / log).read_text(errors="replace")
