"""The images' entrypoint (deploy/docker/entrypoint.sh), run here by sh with stand-in
daemons on PATH: each role's image runs its own daemon by default and names the image when
asked for another role's daemon. The images themselves run it in tests/e2e/test_image.py."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ENTRYPOINT = REPO / "deploy" / "docker" / "entrypoint.sh"


def _image_bin(tmp_path: Path, daemons: list[str]) -> Path:
    """A PATH folder holding stand-ins that print their name and arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in daemons:
        script = bin_dir / name
        script.write_text('#!/bin/sh\necho "$(basename "$0")" "$@"\n')
        script.chmod(0o755)
    return bin_dir


def _run(bin_dir: Path, role: str | None, *argv: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    if role is not None:
        env["SKYMESH_ROLE"] = role
    return subprocess.run(["sh", str(ENTRYPOINT), *argv], env=env, capture_output=True,
                          text=True, timeout=30)


def test_no_command_prints_the_help_of_the_images_own_daemon(tmp_path: Path) -> None:
    bin_dir = _image_bin(tmp_path, ["skymesh", "skymesh-lb", "skymesh-controller",
                                    "skymesh-replica"])
    for role, daemon in (("balancer", "skymesh-lb"), ("controller", "skymesh-controller"),
                         ("replica", "skymesh-replica")):
        done = _run(bin_dir, role)
        assert done.returncode == 0, done.stderr
        assert done.stdout.split() == [daemon, "--help"]
    unknown = _run(bin_dir, None)
    assert unknown.returncode == 64 and "usage:" in unknown.stderr


def test_another_roles_daemon_is_refused_naming_the_image(tmp_path: Path) -> None:
    balancer = _image_bin(tmp_path, ["skymesh", "skymesh-lb"])
    done = _run(balancer, "balancer", "skymesh-controller", "--port", "8080")
    assert done.returncode == 64
    assert "skymesh-controller is not in this image (the balancer image" in done.stderr
    assert done.stdout == ""


def test_a_daemon_without_host_or_config_binds_every_interface(tmp_path: Path) -> None:
    bin_dir = _image_bin(tmp_path, ["skymesh-replica", "skymesh-lb"])
    done = _run(bin_dir, "replica", "skymesh-replica", "--port", "8001")
    assert done.stdout.split() == ["skymesh-replica", "--port", "8001", "--host", "0.0.0.0"]
    done = _run(bin_dir, "balancer", "skymesh-lb", "--config", "/etc/skymesh/lb.yaml")
    assert done.stdout.split() == ["skymesh-lb", "--config", "/etc/skymesh/lb.yaml"]
    done = _run(bin_dir, "balancer", "python")
    assert done.returncode == 64 and "not a SkyMesh command: python" in done.stderr
