"""Every command answers ``--version`` with the installed distribution's version."""

from __future__ import annotations

import importlib.metadata
import subprocess

import pytest

from skymesh.util.procs import executable

COMMANDS = ("skymesh", "skymesh-lb", "skymesh-controller", "skymesh-replica")


@pytest.mark.parametrize("command", COMMANDS)
def test_version_flag_prints_the_package_version(command: str) -> None:
    done = subprocess.run([*executable(command), "--version"], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"skymesh {importlib.metadata.version('skymesh')}"
