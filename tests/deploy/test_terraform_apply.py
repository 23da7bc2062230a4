"""terraform/examples/three-region applied for real, offline: ``terraform init/plan/apply/
destroy`` against moto's server with the local provider mirror
(``skymesh_lab.bench.terraform_apply``), then what it created, read back through the AWS
API: the latency records and their health checks, an Auto Scaling group of one per
region on its launch template, and user data that installs the wheels the operator named
(an emulated replica's user data is run, apt stubbed, into a temp root: it fetches both
wheels from moto's S3, checks their hashes and installs them). One run (two to three
minutes on two shared cores) serves every test here."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from skymesh_lab.bench.terraform_apply import (
    RECORD,
    REGIONS,
    Created,
    Deployment,
    Wheel,
    deploy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SHORT = {"us-east-1": "us-east", "eu-west-1": "eu-west", "ap-northeast-1": "ap-northeast"}
STAGE_LINE = "stage=/var/lib/skymesh-stage\n"


@pytest.fixture(scope="module")
def wheels(request: pytest.FixtureRequest) -> tuple[Wheel, Wheel]:
    """The data plane's and skymesh-replica's wheels of this checkout, to be served from
    moto's S3 under the names and hashes the apply is given."""
    # Only a missing terraform skips: CI machines carry it and the provider mirror, and
    # a missing mirror fails, saying what is missing.
    if shutil.which("terraform") is None:
        pytest.skip("terraform is not on the PATH: the apply against moto needs Terraform "
                    ">= 1.5 and the AWS provider in a /*/tf-plugins mirror")
    built: list[Path] = request.getfixturevalue("product_wheels")
    (data_plane,) = [w for w in built if w.name.startswith("skymesh-")]
    (replica,) = [w for w in built if w.name.startswith("skymesh_replica-")]
    return Wheel.in_s3(data_plane), Wheel.in_s3(replica)


@dataclass
class Boot:
    proc: subprocess.CompletedProcess[str]
    tmp: Path  # holds opt/ (the venv) and root/ (/etc)


def boot_replica(tmp: Path, endpoint: str, created: Created) -> Boot:
    """Run us-east-1's replica user data as cloud-init would, but into ``tmp``: apt-get
    stubbed, the stage folder and the install root moved there, AWS calls to moto, and
    pip kept off any index (the wheels' dependencies are not what is tested)."""
    (script,) = created.replicas["us-east-1"]
    assert script.count(STAGE_LINE) == 1, "the user data no longer stages where expected"
    script = script.replace(STAGE_LINE, f"stage={tmp / 'stage'}\n")
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    (bin_dir / "apt-get").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "apt-get").chmod(0o755)
    (bin_dir / "python3").symlink_to(sys.executable)  # boto3, as python3-boto3 on EC2
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "AWS_ENDPOINT_URL": endpoint,
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "SKYMESH_PREFIX": str(tmp / "opt"),
           "SKYMESH_ROOT": str(tmp / "root"), "PIP_NO_DEPS": "1", "PIP_NO_INDEX": "1"}
    return Boot(subprocess.run(["bash", "-c", script], env=env, capture_output=True,
                               text=True, timeout=300), tmp)


@pytest.fixture(scope="module")
def deployment(wheels: tuple[Wheel, Wheel],
               tmp_path_factory: pytest.TempPathFactory) -> Deployment:
    tmp = tmp_path_factory.mktemp("boot")
    return deploy(replicas=1, wheels=wheels,
                  while_applied=lambda endpoint, created: boot_replica(tmp, endpoint, created))


def test_the_example_applies_everything_it_plans_and_destroys_it_all(
        deployment: Deployment) -> None:
    d = deployment
    assert d.planned == d.applied == d.destroyed == sum(d.by_type.values())
    per_region = {"aws_autoscaling_group": 1, "aws_launch_template": 1, "aws_vpc": 1,
                  "aws_nat_gateway": 1, "aws_instance": 1}
    for rtype, n in per_region.items():
        assert d.by_type.get(rtype) == n * len(REGIONS), (rtype, d.by_type)
    assert d.by_type["aws_route53_record"] == d.by_type["aws_route53_health_check"] == 3
    assert d.left_after_destroy == 0
    gone = d.after_destroy
    assert not gone.records and not gone.health_checks
    assert not any(gone.groups.values()) and not any(gone.templates.values())
    assert not any(gone.replicas.values())


def test_one_latency_record_per_balancer_guarded_by_its_health_check(
        deployment: Deployment) -> None:
    created = deployment.created
    balancers = {b["id"]: b for b in created.outputs["balancers"]}
    checks = {h["Id"]: h for h in created.health_checks}
    assert {r["SetIdentifier"] for r in created.records} == {
        f"lb-{short}-0" for short in SHORT.values()}
    for record in created.records:
        lb = balancers[record["SetIdentifier"]]
        assert record["Name"] == f"{RECORD}." and record["Type"] == "A"
        assert record["Region"] == lb["region"]
        assert record["ResourceRecords"] == [{"Value": lb["ip"]}]
        check = checks[record["HealthCheckId"]]
        assert (check["IPAddress"], check["Port"]) == (lb["ip"], 8080)
        assert (check["Type"], check["ResourcePath"]) == ("HTTP", "/health")
    assert created.outputs["health_check_ids"] == {
        r["SetIdentifier"]: r["HealthCheckId"] for r in created.records}


def test_each_region_runs_a_balancer_group_of_one_on_its_launch_template(
        deployment: Deployment) -> None:
    created = deployment.created
    for region in REGIONS:
        (group,) = created.groups[region]
        name = f"lb-{SHORT[region]}-0"
        assert group["AutoScalingGroupName"] == name
        assert (group["MinSize"], group["DesiredCapacity"], group["MaxSize"]) == (1, 1, 2)
        assert group["HealthCheckType"] == "EC2"
        (template,) = created.templates[region]
        assert template.startswith(f"{name}-")
        assert group["LaunchTemplate"]["LaunchTemplateName"] == template
        assert len(group["Instances"]) == 1, group["Instances"]
        assert created.outputs["asg_names"][SHORT[region]] == [name]


def _exports(script: str) -> dict[str, str]:
    return dict(re.findall(r"^export (SKYMESH_\w+)='([^']*)'$", script, re.M))


def _is_bash(script: str) -> None:
    check = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    assert check.returncode == 0, check.stderr


def test_user_data_names_the_wheels_the_operator_named(
        deployment: Deployment, wheels: tuple[Wheel, Wheel]) -> None:
    data_plane, replica_wheel = wheels
    installer = (REPO / "deploy" / "cloud-init" / "install-skymesh.sh").read_text()
    created = deployment.created
    for region in REGIONS:
        (lb,) = created.templates[region].values()
        env = _exports(lb)
        assert env["SKYMESH_ROLES"] == "lb"
        assert env["SKYMESH_WHEEL_URL"] == data_plane.url
        assert env["SKYMESH_WHEEL_SHA256"] == data_plane.sha256
        assert env["SKYMESH_MESH_ID"] == f"lb-{SHORT[region]}-0"
        assert installer in lb and 'bash "$stage/cloud-init/install-skymesh.sh"' in lb
        _is_bash(lb)
        # The balancer's configuration lists the region's emulated replica.
        assert re.search(r"http://10\.2\d\.100\.20:8001", lb), lb[:2000]
        (replica,) = created.replicas[region]
        env = _exports(replica)
        assert env["SKYMESH_ROLES"] == "replica"
        # The data plane's wheel and skymesh-replica's, each with its own hash, in order.
        assert env["SKYMESH_WHEEL_URL"] == f"{data_plane.url} {replica_wheel.url}"
        assert env["SKYMESH_WHEEL_SHA256"] == f"{data_plane.sha256} {replica_wheel.sha256}"
        assert installer in replica
        _is_bash(replica)


def test_a_replicas_user_data_installs_both_wheels_from_s3(
        deployment: Deployment, wheels: tuple[Wheel, Wheel]) -> None:
    boot = deployment.while_applied
    assert boot.proc.returncode == 0, boot.proc.stdout + boot.proc.stderr
    for wheel in wheels:
        name = wheel.url.rsplit("/", 1)[1]
        assert f"fetched {wheel.url}; installing {name}" in boot.proc.stderr
    venv = boot.tmp / "opt" / "venv"
    assert (venv / "bin" / "skymesh-replica").is_file()
    listed = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "list",
                             "--format=freeze"], capture_output=True, text=True,
                            check=True).stdout
    assert {"skymesh==0.1.0", "skymesh-replica==0.1.0"} <= set(listed.split())
    assert (boot.tmp / "root" / "etc" / "systemd" / "system" / "skymesh-replica.service"
            ).is_file()
    assert "--profile" in (boot.tmp / "root" / "etc" / "skymesh" / "replica.env").read_text()
