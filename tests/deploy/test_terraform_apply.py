"""terraform/examples/three-region applied for real, offline: ``terraform init/plan/apply/
destroy`` against moto's server with the local provider mirror
(``skymesh_lab.bench.terraform_apply``), then what it created, read back through the AWS
API: the latency records and their health checks, an Auto Scaling group of one per
region on its launch template, and user data that installs the wheels the operator named.
One run (two to three minutes on two shared cores) serves every test here."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from skymesh_lab.bench.terraform_apply import (
    RECORD,
    REGIONS,
    REPLICA_WHEEL,
    REPLICA_WHEEL_SHA256,
    WHEEL,
    WHEEL_SHA256,
    Deployment,
    deploy,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
SHORT = {"us-east-1": "us-east", "eu-west-1": "eu-west", "ap-northeast-1": "ap-northeast"}


@pytest.fixture(scope="module")
def deployment() -> Deployment:
    # Only a missing terraform skips: CI machines carry it and the provider mirror, and
    # a missing mirror fails with what to install.
    if shutil.which("terraform") is None:
        pytest.skip("terraform is not on the PATH: the apply against moto needs Terraform "
                    ">= 1.5 and the AWS provider in a /*/tf-plugins mirror")
    return deploy(replicas=1)


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


def test_user_data_installs_the_wheels_the_operator_named(deployment: Deployment) -> None:
    installer = (REPO / "deploy" / "cloud-init" / "install-skymesh.sh").read_text()
    created = deployment.created
    for region in REGIONS:
        (lb,) = created.templates[region].values()
        env = _exports(lb)
        assert env["SKYMESH_ROLES"] == "lb"
        assert env["SKYMESH_WHEEL_URL"] == WHEEL
        assert env["SKYMESH_WHEEL_SHA256"] == WHEEL_SHA256
        assert env["SKYMESH_MESH_ID"] == f"lb-{SHORT[region]}-0"
        assert installer in lb and 'bash "$stage/cloud-init/install-skymesh.sh"' in lb
        _is_bash(lb)
        # The balancer's configuration lists the region's emulated replica.
        assert re.search(r"http://10\.2\d\.100\.20:8001", lb), lb[:2000]
        (replica,) = created.replicas[region]
        env = _exports(replica)
        assert env["SKYMESH_ROLES"] == "replica"
        # The data plane's wheel and skymesh-replica's, each with its own hash, in order.
        assert env["SKYMESH_WHEEL_URL"] == f"{WHEEL} {REPLICA_WHEEL}"
        assert env["SKYMESH_WHEEL_SHA256"] == f"{WHEEL_SHA256} {REPLICA_WHEEL_SHA256}"
        assert installer in replica
        _is_bash(replica)
