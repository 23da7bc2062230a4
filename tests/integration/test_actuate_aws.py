"""The AWS actuator against moto's server on loopback (real HTTP, boto3 clients)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import boto3
import pytest

from skymesh_controller.planning.actuate import Actuator
from skymesh_controller.planning.actuate_aws import AwsActuator, group_name
from skymesh_controller.planning.ilp import PlanInput, solve


@pytest.fixture
def actuator(moto_url: str) -> AwsActuator:
    # A fresh AWS account per test.
    urllib.request.urlopen(
        urllib.request.Request(f"{moto_url}/moto-api/reset", method="POST"))

    def factory(service: str, region: str) -> Any:
        return boto3.client(service, region_name=region, endpoint_url=moto_url,
                            aws_access_key_id="testing", aws_secret_access_key="testing")

    return AwsActuator(client_factory=factory)


def test_apply_creates_groups_then_is_idempotent(actuator: AwsActuator) -> None:
    assert isinstance(actuator, Actuator)
    counts = {("llama-8b", "us", "L4"): 3, ("llama-8b", "eu", "L4"): 2,
              ("llama-70b", "asia", "H100-80GB"): 0}
    first = actuator.apply_counts(counts)
    assert first.ok, first.errors
    assert {(c.model, c.region, c.after) for c in first.changed} == {
        ("llama-8b", "us", 3), ("llama-8b", "eu", 2)}
    assert actuator.desired("llama-8b", "us", "L4") == 3
    assert actuator.desired("llama-70b", "asia", "H100-80GB") is None  # nothing to run
    again = actuator.apply_counts(counts)
    assert again.changed == [] and len(again.unchanged) == 3


def test_scaling_updates_desired_and_raises_max(actuator: AwsActuator) -> None:
    actuator.apply_counts({("m", "us", "L4"): 2})
    report = actuator.apply_counts({("m", "us", "L4"): 7})
    assert [(c.before, c.after) for c in report.changed] == [(2, 7)]
    asg = actuator._client("autoscaling", "us-east-1")
    group = asg.describe_auto_scaling_groups(
        AutoScalingGroupNames=[group_name("m", "us", "L4")])["AutoScalingGroups"][0]
    assert group["DesiredCapacity"] == 7 and group["MaxSize"] >= 7
    down = actuator.apply_counts({("m", "us", "L4"): 1})
    assert [(c.before, c.after) for c in down.changed] == [(7, 1)]


def test_applies_a_solved_plan_and_reports_unmapped_regions(actuator: AwsActuator) -> None:
    plan = solve(PlanInput(
        current={"m": {"us": {"L4": 0}, "mars": {"L4": 0}}},
        demand={"m": {"us": [250.0], "mars": [0.0]}}, capacity={"m": {"L4": 100.0}},
        gpus_available={"us": {"L4": 10}, "mars": {"L4": 1}}, epsilon=1.0))
    report = actuator.apply(plan)
    assert actuator.desired("m", "us", "L4") == 3
    assert ("m", "mars", "L4") in report.errors
    assert "no AWS region mapped" in report.errors[("m", "mars", "L4")]


def _cli(args: list[str], moto_url: str) -> subprocess.CompletedProcess[str]:
    """``skymesh plan ARGS`` as a process; ``apply`` is pointed at moto."""
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing"}
    aws = ["--endpoint-url", moto_url] if args[0] == "apply" else []
    return subprocess.run([sys.executable, "-m", "skymesh.cli", "plan", *args, *aws],
                          capture_output=True, text=True, env=env, timeout=120)


def test_plan_apply_takes_a_solved_plan_to_the_groups(actuator: AwsActuator, moto_url: str,
                                                      tmp_path: Path) -> None:
    """``skymesh plan solve`` then ``skymesh plan apply``, real processes against moto:
    the groups get the plan's counts; a second apply changes nothing; a later plan that
    scales a group away sets it to 0 (its key is in the plan's changes, not its counts)."""
    inp = tmp_path / "in.json"
    inp.write_text(json.dumps({
        "current": {"m": {"us": {"L4": 0}, "eu": {"L4": 0}}},
        "demand": {"m": {"us": [250.0], "eu": [120.0]}}, "capacity": {"m": {"L4": 100.0}},
        "gpus_available": {"us": {"L4": 10}, "eu": {"L4": 10}}, "epsilon": 1.0}))
    solved = tmp_path / "solved.json"
    assert _cli(["solve", "--input", str(inp), "--json", str(solved)], moto_url).returncode == 0
    out = tmp_path / "applied.json"
    proc = _cli(["apply", "--plan", str(solved), "--json", str(out)], moto_url)
    assert proc.returncode == 0, proc.stderr
    applied = json.loads(out.read_text())
    assert {(c["region"], c["after"]) for c in applied["changed"]} == {("us", 3), ("eu", 2)}
    assert applied["errors"] == [] and applied["reserved"] == []
    assert actuator.desired("m", "us", "L4") == 3 and actuator.desired("m", "eu", "L4") == 2

    again = _cli(["apply", "--plan", str(solved), "--json", str(out)], moto_url)
    assert again.returncode == 0 and "0 groups changed, 2 unchanged" in again.stdout

    plan = json.loads(solved.read_text())
    plan["counts"] = [c for c in plan["counts"] if c["region"] == "us"]  # eu scaled away
    shrunk = tmp_path / "shrunk.json"
    shrunk.write_text(json.dumps(plan))
    proc = _cli(["apply", "--plan", str(shrunk)], moto_url)
    assert proc.returncode == 0, proc.stderr
    assert actuator.desired("m", "eu", "L4") == 0 and actuator.desired("m", "us", "L4") == 3


@pytest.mark.parametrize("content, message", [
    ("{not json", "Expecting property name"),
    ('{"status": "optimal"}', "not a plan"),
    ('{"counts": [{"model": "m", "region": "us", "gpu": "L4", "count": -1}]}',
     "count must be an integer >= 0"),
    ('{"counts": [{"model": "m", "gpu": "L4", "count": 1}]}', "needs string model"),
])
def test_plan_apply_refuses_a_bad_plan_before_calling_aws(moto_url: str, tmp_path: Path,
                                                          content: str, message: str) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    proc = _cli(["apply", "--plan", str(bad)], moto_url)
    assert proc.returncode == 2
    assert message in proc.stderr and "Traceback" not in proc.stderr
