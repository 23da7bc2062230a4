"""The container image (deploy/docker/Dockerfile), built here with buildah and run.

A replica and two balancers run from the SAME image, each in its own buildah container on
the host's network (loopback ports): a chat completion through one balancer, and two
balancers peering over mutual TLS (certificates made by ``skymesh certs`` in the image)
with a request forwarded from the one with no replicas to the other. The image's own
health check probes each daemon on the port its command line names, and the daemons run
as uid 10001, which can write nothing in the installed package (stubs baked in).

The build takes minutes (the first one more: tools/image/make_base.sh debootstraps the
base), so this runs in ``make e2e`` with ``SKYMESH_IMAGE_TEST=1``, as root, where buildah
is installed (``apt-get install buildah debootstrap``); otherwise it is skipped. The
image and buildah's layer cache stay in /var/lib/containers (vfs: GBs) for the next run;
the test's containers are removed.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import yaml
from support import until

from skymesh.util.procs import free_port

ROOT = Path(__file__).resolve().parents[2]
TAG = "localhost/skymesh:image-test"
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


def _run(cmd: list[str], timeout: float = 120) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{cmd} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@dataclass
class Container:
    """A buildah working container of the image, with the test's folder at /cfg."""

    name: str
    cfg: Path

    def run_args(self, *cmd: str) -> list[str]:
        return [*BUILDAH, "run", *RUN_OPTS, "-v", f"{self.cfg}:/cfg", self.name, "--", *cmd]

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
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        m = _LISTENING.search(log.read_text(errors="replace"))
        if m:
            return Running(proc, m.group(1), log)
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    Running(proc, "", log).stop()
    raise AssertionError(f"{argv[0]} did not start:\n{log.read_text(errors='replace')}")


@pytest.fixture(scope="module")
def image() -> str:
    _run([str(ROOT / "tools" / "image" / "build.sh"), TAG], timeout=3000)
    return TAG


@pytest.fixture
def containers(image: str, tmp_path: Path) -> Iterator[dict[str, Container]]:
    cfg = tmp_path / "cfg"
    cfg.mkdir()
    os.chown(cfg, 10001, 10001)  # the image's user writes the certificates here
    made: dict[str, Container] = {}
    try:
        for role in ("replica", "lb-eu", "lb-us"):
            name = f"skymesh-image-test-{role}-{os.getpid()}"
            _run([*BUILDAH, "from", "--name", name, image])
            made[role] = Container(name, cfg)
        yield made
    finally:
        for ctr in made.values():
            subprocess.run([*BUILDAH, "rm", ctr.name], capture_output=True, timeout=120)


def test_the_image_is_non_root_with_a_healthcheck_and_baked_stubs(image: str) -> None:
    config = json.loads(_run([*BUILDAH, "inspect", "--type", "image", image]))["Docker"]["config"]
    assert config["User"] == "10001:10001"
    assert config["Entrypoint"] == ["/usr/local/lib/skymesh/entrypoint.sh"]
    assert config["Healthcheck"]["Test"] == ["CMD", *HEALTHCHECK]


async def test_a_replica_and_two_peered_balancers_from_one_image(
        containers: dict[str, Container], tmp_path: Path) -> None:
    cfg = containers["replica"].cfg
    probe = containers["replica"].run(
        "python", "-c", "import os, skymesh.mesh.proto as p; "
        "print(os.getuid(), os.access(os.path.dirname(p.__file__), os.W_OK), p.pb.__file__)")
    assert probe.returncode == 0, probe.stderr
    uid, writable, stubs = probe.stdout.split()
    assert (uid, writable) == ("10001", "False")
    assert stubs.startswith("/opt/skymesh/lib/")

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
