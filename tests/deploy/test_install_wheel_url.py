"""deploy/cloud-init/install-skymesh.sh installing the operator's wheel by URL, as the
Terraform user data runs it: fetched over HTTP(S) or from S3 (moto here), checked against
its SHA-256, refused before anything is installed when it does not match."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import re
import subprocess
import sys
import threading
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "cloud-init" / "install-skymesh.sh"


@pytest.fixture(scope="module")
def wheel(skymesh_wheel: Path) -> Path:
    return skymesh_wheel


@contextlib.contextmanager
def serving_folder(folder: Path) -> Iterator[str]:
    """``folder`` on a loopback HTTP server: its base URL."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    handler.log_message = lambda *a: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def served(wheel: Path) -> Iterator[str]:
    """The wheel's folder on a loopback HTTP server: its base URL."""
    with serving_folder(wheel.parent) as base:
        yield base


def install(tmp: Path, url: str, sha256: str = "", **extra: str
            ) -> subprocess.CompletedProcess[str]:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "SKYMESH_ROLES": "lb",
        "SKYMESH_PREFIX": str(tmp / "opt"),
        "SKYMESH_ROOT": str(tmp / "root"),
        # This venv's interpreter: it has boto3, as python3-boto3 gives the instances.
        "SKYMESH_PYTHON": sys.executable,
        "SKYMESH_WHEEL_URL": url,
        "SKYMESH_WHEEL_SHA256": sha256,
        "SKYMESH_PIP_ARGS": "--no-deps --no-index",
        **extra,
    }
    return subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True,
                          timeout=240)


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_installs_the_wheels_fetched_by_url_when_their_hashes_match(
        tmp_path: Path, product_wheels: list[Path]) -> None:
    with serving_folder(product_wheels[0].parent) as base:
        urls = [f"{base}/{w.name}" for w in product_wheels]
        proc = install(tmp_path, " ".join(urls), " ".join(map(sha, product_wheels)),
                       SKYMESH_ROLES="lb,replica,controller")
    assert proc.returncode == 0, proc.stderr
    for url in urls:
        assert f"fetched {url}" in proc.stderr
    assert "installed skymesh" in proc.stderr
    for role in ("lb", "replica", "controller"):
        assert os.access(tmp_path / "opt" / "venv" / "bin" / f"skymesh-{role}", os.X_OK)
    # The controller with its planner's extra (pip gets it from the index the operator
    # names; this test installs --no-deps), an extra its wheel declares.
    (controller,) = [w for w in product_wheels if w.name.startswith("skymesh_controller-")]
    assert f"installing {controller.name}[planning]" in proc.stderr, proc.stderr
    with zipfile.ZipFile(controller) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA")))
    assert "planning" in set(re.findall(r"^Provides-Extra: (\S+)$", meta.decode(), re.M))


def test_a_role_without_its_wheel_is_a_clear_error(tmp_path: Path, wheel: Path,
                                                   served: str) -> None:
    proc = install(tmp_path, f"{served}/{wheel.name}", sha(wheel), SKYMESH_ROLES="lb,replica")
    assert proc.returncode == 2
    assert "role replica needs the skymesh-replica wheel" in proc.stderr, proc.stderr


def test_a_wheel_with_another_hash_is_refused_before_anything_is_installed(
        tmp_path: Path, wheel: Path, served: str) -> None:
    proc = install(tmp_path, f"{served}/{wheel.name}", "0" * 64)
    assert proc.returncode == 2
    assert "does not have SHA-256 " + "0" * 64 in proc.stderr
    assert not (tmp_path / "opt").exists()


@pytest.mark.parametrize("url, message", [
    ("ftp://example.com/skymesh-1.0-py3-none-any.whl", "only s3://, https://"),
    ("https://example.com/skymesh-1.0.tar.gz", "must name .whl files"),
])
def test_bad_urls_are_refused_with_a_reason(tmp_path: Path, url: str, message: str) -> None:
    proc = install(tmp_path, url)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_a_missing_wheel_is_a_clear_error(tmp_path: Path, served: str) -> None:
    proc = install(tmp_path, f"{served}/skymesh-0.0.0-py3-none-any.whl", "0" * 64)
    assert proc.returncode == 2
    assert f"cannot fetch {served}/skymesh-0.0.0-py3-none-any.whl" in proc.stderr


def test_fetches_the_wheel_from_s3(tmp_path: Path, moto_url: str) -> None:
    creds: dict[str, Any] = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing",
                             "region_name": "us-east-1"}
    bucket = f"releases-{uuid.uuid4().hex[:8]}"
    s3 = boto3.client("s3", endpoint_url=moto_url, **creds)
    s3.create_bucket(Bucket=bucket)
    name = "skymesh-0.1.0-py3-none-any.whl"
    s3.put_object(Bucket=bucket, Key=f"skymesh/{name}", Body=b"not the wheel you pinned")
    url = f"s3://{bucket}/skymesh/{name}"
    aws = {"AWS_ENDPOINT_URL": moto_url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    # Fetched (the hash is computed over what S3 returned), then refused: the pinned hash
    # is of another file. A full install is the HTTP test's job.
    proc = install(tmp_path, url, hashlib.sha256(b"the real wheel").hexdigest(), **aws)
    assert proc.returncode == 2 and "does not have SHA-256" in proc.stderr, proc.stderr
    proc = install(tmp_path, f"s3://{bucket}/skymesh/skymesh-9.9.9-py3-none-any.whl",
                   "0" * 64, **aws)
    assert proc.returncode == 2 and "cannot fetch s3://" in proc.stderr, proc.stderr


def test_a_fetched_wheel_without_its_hash_is_refused_before_the_fetch(
        tmp_path: Path, wheel: Path, served: str) -> None:
    proc = install(tmp_path, f"{served}/{wheel.name}")
    assert proc.returncode == 2, proc.stderr
    assert "a fetched wheel needs its SHA-256" in proc.stderr
    assert not (tmp_path / "opt").exists()


@pytest.mark.parametrize("spec", ["", "skymesh", "skymesh==0.1.0", "/no/such/skymesh.whl"])
def test_nothing_is_installed_from_an_index_by_name(tmp_path: Path, spec: str) -> None:
    """No wheel URL, and a package spec that is not a local path: refused, nothing built.
    The name ``skymesh`` on a public index is not this project's to vouch for."""
    proc = install(tmp_path, "", SKYMESH_PIP_SPEC=spec)
    assert proc.returncode == 2, proc.stderr
    assert ("not a local path" in proc.stderr or "name what to install" in proc.stderr
            or "no such path" in proc.stderr), proc.stderr
    assert not (tmp_path / "opt").exists()


def test_the_releases_lock_pins_the_dependencies(tmp_path: Path, wheel: Path,
                                                 served: str) -> None:
    proc = install(tmp_path, f"{served}/{wheel.name}", sha(wheel))
    assert proc.returncode == 0, proc.stderr
    pins = sum("==" in line for line in (REPO / "requirements" / "lock.txt").read_text()
               .splitlines())
    assert f"dependencies pinned by the release's lock ({pins} pins)" in proc.stderr
