"""The region module's user data, rendered by terraform with the real units, installer and
a balancer config, fits EC2's limit (16 KiB, counted before base64) once gzipped as the
module sends it, and unpacks (as cloud-init does) into valid bash that carries them."""

from __future__ import annotations

import base64
import gzip
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
REGION = REPO / "terraform" / "modules" / "region"
EC2_USER_DATA_LIMIT = 16 * 1024


def render(tmp: Path, role: str) -> bytes:
    """base64gzip(templatefile(user_data.sh.tftpl, ...)) as the module calls it for
    ``role``, by terraform (a root module with no provider: nothing to download)."""
    exe = shutil.which("terraform")
    if exe is None:
        pytest.skip("terraform is not on the PATH (it renders the user data)")
    unit = REPO / "deploy" / "systemd" / f"skymesh-{role}.service"
    config = ("lb.yaml", REPO / "deploy" / "config" / "lb.yaml") if role == "lb" else (
        "replica.env", REPO / "deploy" / "config" / "replica.env")
    args = {"roles": role, "wheel_url": "s3://releases/skymesh/skymesh-0.1.0-py3-none-any.whl",
            "wheel_sha256": "0" * 64, "pip_args": "--index-url https://pypi.example.com/simple",
            "watchdog_url": "http://127.0.0.1:8080/health" if role == "lb" else "",
            "asg_name": "lb-us-east-0", "eip_allocation": "eipalloc-0123456789abcdef0",
            "certs_prefix": "/skymesh/pki", "mesh_id": "lb-us-east-0",
            "api_keys_param": "/skymesh/api-keys", "tls_prefix": "/skymesh/tls"}
    tpl = REGION / "user_data.sh.tftpl"
    (tmp / "main.tf").write_text(
        f'output "user_data" {{\n  value = base64gzip(templatefile("{tpl}", {{\n'
        + "".join(f"    {k} = {json.dumps(v)}\n" for k, v in args.items())
        + f'    install_script = file("{REPO}/deploy/cloud-init/install-skymesh.sh")\n'
        + f'    units = {{ "{unit.name}" = file("{unit}") }}\n'
        + f'    configs = {{ "{config[0]}" = file("{config[1]}") }}\n  }}))\n}}\n')
    env = {**os.environ, "TF_DATA_DIR": str(tmp / ".tf"), "CHECKPOINT_DISABLE": "1",
           "TF_IN_AUTOMATION": "1"}
    for cmd in (["init", "-input=false"], ["apply", "-auto-approve", "-input=false"]):
        out = subprocess.run([exe, *cmd, "-no-color"], cwd=tmp, env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
    out = subprocess.run([exe, "output", "-raw", "user_data"], cwd=tmp, env=env,
                         capture_output=True, text=True, timeout=60, check=True)
    return base64.b64decode(out.stdout)


@pytest.mark.parametrize("role", ["lb", "replica"])
def test_user_data_fits_ec2_gzipped_and_unpacks_to_the_installer(tmp_path: Path,
                                                                 role: str) -> None:
    sent = render(tmp_path, role)
    script = gzip.decompress(sent).decode()
    print(f"user data ({role}): {len(script)} bytes, {len(sent)} gzipped "
          f"(EC2 limit {EC2_USER_DATA_LIMIT})")
    assert len(sent) <= EC2_USER_DATA_LIMIT
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr
    unit = (REPO / "deploy" / "systemd" / f"skymesh-{role}.service").read_text()
    assert unit in script
    assert (REPO / "deploy" / "cloud-init" / "install-skymesh.sh").read_text() in script


def test_the_module_sends_both_roles_user_data_gzipped() -> None:
    main = (REGION / "main.tf").read_text()
    calls = re.findall(r"^\s*(user_data\w*)\s*=\s*(\w+)\(templatefile\(", main, re.M)
    assert sorted(calls) == [("user_data", "base64gzip"), ("user_data_base64", "base64gzip")]
