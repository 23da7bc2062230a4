"""Peering stubs: generated into any folder (the wheel's build hook), regenerated in a
checkout, and never written into an installed package."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from skymesh.mesh import codegen


def test_generate_into_writes_importable_stubs_and_a_stamp(tmp_path: Path) -> None:
    out = tmp_path / "skymesh" / "mesh" / "gen"
    codegen.generate_into(out, codegen.PROTO_ROOT)
    stamp = json.loads((out / ".stamp.json").read_text())
    assert set(stamp) == {"protos", "grpcio_tools"}
    grpc_stub = (out / "skymesh" / "v1" / "peering_pb2_grpc.py").read_text()
    assert "from skymesh.mesh.gen.skymesh.v1 import peering_pb2" in grpc_stub
    assert "from skymesh.v1 import" not in grpc_stub
    for folder in (out, out / "skymesh", out / "skymesh" / "v1"):
        assert (folder / "__init__.py").is_file()


def test_this_checkout_is_one_and_site_packages_is_not(tmp_path: Path) -> None:
    assert codegen.in_checkout()
    assert not codegen.in_checkout(tmp_path)
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "other"\n')
    (tmp_path / "protos").mkdir()
    assert not codegen.in_checkout(tmp_path)


def test_an_installed_package_without_stubs_refuses_to_write_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    site = tmp_path / "site-packages"
    gen = site / "skymesh" / "mesh" / "gen"
    monkeypatch.setattr(codegen, "_PACKAGE_PARENT", site)
    monkeypatch.setattr(codegen, "GEN_DIR", gen)
    assert not codegen.is_fresh()
    with pytest.raises(codegen.StubsUnavailable, match="generated when the wheel is built"):
        codegen.ensure_stubs()
    assert not gen.exists()
    # What a build put there stands, whatever grpcio-tools is installed now.
    codegen.generate_into(gen, codegen.PROTO_ROOT)
    stamp = json.loads((gen / ".stamp.json").read_text())
    (gen / ".stamp.json").write_text(json.dumps({**stamp, "grpcio_tools": "0.0"}))
    assert codegen.is_fresh()


def test_the_command_reports_up_to_date_stubs_in_the_checkout() -> None:
    done = subprocess.run([sys.executable, "-m", "skymesh.mesh.codegen"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert str(codegen.GEN_DIR) in done.stdout
