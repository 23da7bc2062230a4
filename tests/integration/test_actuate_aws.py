"""The AWS actuator against moto's server on loopback (real HTTP, boto3 clients)."""

from __future__ import annotations

import urllib.request
from typing import Any

import boto3
import pytest

from skymesh.planning.actuate import Actuator
from skymesh.planning.actuate_aws import AwsActuator, group_name
from skymesh.planning.ilp import PlanInput, solve


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
