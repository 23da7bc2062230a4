"""The AWS actuator's capacity reservations, call by call.

moto does not implement EC2 capacity reservations, so these tests run the actuator on real
boto3 clients with botocore's ``Stubber``: every request is validated against the EC2 and
Auto Scaling API models (names and types of every parameter) and must match the expected
call, in order; every canned response is validated against the model's output shape. An
unexpected call fails the test.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from typing import Any

import boto3
import pytest
from botocore.stub import ANY, Stubber
from hypothesis import given
from hypothesis import strategies as st

from skymesh_controller.planning.actuate_aws import AwsActuator, group_name, split_over

KEY = ("llama-8b", "us", "L4")
NAME = group_name(*KEY)
ZONE = "us-east-1a"
CR_FILTERS = [{"Name": "tag:skymesh:group", "Values": [NAME]},
              {"Name": "state", "Values": ["active", "pending"]}]


class Aws:
    def __init__(self) -> None:
        kw = {"region_name": "us-east-1", "aws_access_key_id": "testing",
              "aws_secret_access_key": "testing"}
        self.clients = {s: boto3.client(s, **kw)
                        for s in ("autoscaling", "ec2")}
        self.stubs = {s: Stubber(c) for s, c in self.clients.items()}

    def expect(self, service: str, op: str, params: dict[str, Any] | None,
               response: dict[str, Any] | None = None) -> None:
        self.stubs[service].add_response(op, response or {}, params)

    def group(self, desired: int) -> None:
        self.expect("autoscaling", "describe_auto_scaling_groups",
                    {"AutoScalingGroupNames": [NAME]}, {"AutoScalingGroups": [{
                        "AutoScalingGroupName": NAME, "MinSize": 0, "MaxSize": max(desired, 1),
                        "DesiredCapacity": desired, "DefaultCooldown": 300,
                        "AvailabilityZones": [ZONE], "HealthCheckType": "EC2",
                        "CreatedTime": dt.datetime(2026, 11, 1)}]})

    def reservation(self, held: int | None, *more: tuple[str, str, int]) -> None:
        """The group's reservations: ``held`` in ZONE as cr-0abc, then (id, zone, count)."""
        found = [] if held is None else [{"CapacityReservationId": "cr-0abc",
                                          "AvailabilityZone": ZONE,
                                          "TotalInstanceCount": held, "State": "active"}]
        found += [{"CapacityReservationId": cr, "AvailabilityZone": zone,
                   "TotalInstanceCount": n, "State": "active"} for cr, zone, n in more]
        self.expect("ec2", "describe_capacity_reservations", {"Filters": CR_FILTERS},
                    {"CapacityReservations": found})

    def zones(self) -> None:
        self.expect("ec2", "describe_availability_zones", {},
                    {"AvailabilityZones": [{"ZoneName": ZONE}, {"ZoneName": "us-east-1b"}]})


@pytest.fixture
def aws() -> Iterator[Aws]:
    a = Aws()
    for s in a.stubs.values():
        s.activate()
    yield a
    for s in a.stubs.values():
        s.assert_no_pending_responses()  # every expected call was made
        s.deactivate()


def actuator(aws: Aws) -> AwsActuator:
    return AwsActuator(client_factory=lambda service, region: aws.clients[service],
                       reserve=True)


def test_first_plan_creates_the_group_and_reserves_its_count(aws: Aws) -> None:
    aws.expect("autoscaling", "describe_auto_scaling_groups",
               {"AutoScalingGroupNames": [NAME]}, {"AutoScalingGroups": []})
    aws.expect("ec2", "describe_launch_templates", None, {"LaunchTemplates": []})
    aws.expect("ec2", "create_launch_template", None)
    zones = {"AvailabilityZones": [{"ZoneName": ZONE}, {"ZoneName": "us-east-1b"}]}
    aws.expect("ec2", "describe_availability_zones", {}, zones)
    aws.expect("autoscaling", "create_auto_scaling_group", {
        "AutoScalingGroupName": NAME, "LaunchTemplate": ANY, "MinSize": 0, "MaxSize": 3,
        "DesiredCapacity": 3, "Tags": ANY, "AvailabilityZones": [ZONE]})
    aws.reservation(None)  # the zone is asked once: the reservation reuses the group's
    aws.expect("ec2", "create_capacity_reservation", {
        "InstanceType": "g6.xlarge", "InstancePlatform": "Linux/UNIX",
        "AvailabilityZone": ZONE, "InstanceCount": 3, "InstanceMatchCriteria": "open",
        "EndDateType": "unlimited", "TagSpecifications": [{
            "ResourceType": "capacity-reservation", "Tags": [
                {"Key": "skymesh:group", "Value": NAME},
                {"Key": "skymesh:model", "Value": "llama-8b"},
                {"Key": "skymesh:gpu", "Value": "L4"}]}]},
        {"CapacityReservation": {"CapacityReservationId": "cr-0abc",
                                 "TotalInstanceCount": 3}})
    report = actuator(aws).apply_counts({KEY: 3})
    assert report.ok, report.errors
    assert [(c.before, c.after) for c in report.changed] == [(None, 3)]
    assert [(c.before, c.after) for c in report.reserved] == [(None, 3)]


def test_the_reservation_follows_the_plan_and_is_released_at_zero(aws: Aws) -> None:
    act = actuator(aws)
    aws.group(3)
    aws.expect("autoscaling", "update_auto_scaling_group",
               {"AutoScalingGroupName": NAME, "DesiredCapacity": 5, "MaxSize": 5})
    aws.reservation(3)
    aws.zones()
    aws.expect("ec2", "modify_capacity_reservation",
               {"CapacityReservationId": "cr-0abc", "InstanceCount": 5}, {"Return": True})
    up = act.apply_counts({KEY: 5})
    assert [(c.before, c.after) for c in up.reserved] == [(3, 5)]

    aws.group(5)
    aws.expect("autoscaling", "update_auto_scaling_group",
               {"AutoScalingGroupName": NAME, "DesiredCapacity": 0})
    aws.reservation(5)
    aws.expect("ec2", "cancel_capacity_reservation", {"CapacityReservationId": "cr-0abc"},
               {"Return": True})
    down = act.apply_counts({KEY: 0})
    assert [(c.before, c.after) for c in down.reserved] == [(5, 0)]


def test_a_plan_already_held_writes_nothing(aws: Aws) -> None:
    aws.group(4)
    aws.reservation(4)
    aws.zones()
    report = actuator(aws).apply_counts({KEY: 4})
    assert report.ok and report.changed == [] and report.reserved == []
    assert report.unchanged == [KEY]
    # Nothing running, nothing held, nothing asked: no group, no reservation is made.
    aws.expect("autoscaling", "describe_auto_scaling_groups",
               {"AutoScalingGroupNames": [NAME]}, {"AutoScalingGroups": []})
    aws.reservation(None)
    empty = actuator(aws).apply_counts({KEY: 0})
    assert empty.ok and empty.reserved == []


def test_a_refused_reservation_is_reported_for_its_key(aws: Aws) -> None:
    aws.group(2)
    aws.reservation(None)
    aws.expect("ec2", "describe_availability_zones", {},
               {"AvailabilityZones": [{"ZoneName": ZONE}]})
    aws.stubs["ec2"].add_client_error(
        "create_capacity_reservation", "InsufficientInstanceCapacity",
        "There is no Spot capacity available that matches your request.")
    report = actuator(aws).apply_counts({KEY: 2})
    assert "InsufficientInstanceCapacity" in report.errors[KEY]
    assert report.reserved == []


def test_a_group_over_two_zones_holds_its_share_in_each(aws: Aws) -> None:
    act = AwsActuator(client_factory=lambda service, region: aws.clients[service],
                      reserve=True, subnets={"us-east-1": "subnet-a, subnet-b"})
    aws.group(0)
    aws.expect("autoscaling", "update_auto_scaling_group",
               {"AutoScalingGroupName": NAME, "DesiredCapacity": 5, "MaxSize": 5})
    aws.reservation(None)
    aws.expect("ec2", "describe_subnets", {"SubnetIds": ["subnet-a", "subnet-b"]},
               {"Subnets": [{"SubnetId": "subnet-b", "AvailabilityZone": "us-east-1b"},
                            {"SubnetId": "subnet-a", "AvailabilityZone": ZONE}]})
    for zone, n, cr in ((ZONE, 3, "cr-0abc"), ("us-east-1b", 2, "cr-0def")):
        aws.expect("ec2", "create_capacity_reservation", {
            "InstanceType": "g6.xlarge", "InstancePlatform": "Linux/UNIX",
            "AvailabilityZone": zone, "InstanceCount": n, "InstanceMatchCriteria": "open",
            "EndDateType": "unlimited", "TagSpecifications": ANY},
            {"CapacityReservation": {"CapacityReservationId": cr}})
    up = act.apply_counts({KEY: 5})
    assert up.ok, up.errors
    assert [(c.before, c.after) for c in up.reserved] == [(None, 5)]

    # Down to one instance: the second zone's reservation goes, the first shrinks to 1.
    aws.group(5)
    aws.expect("autoscaling", "update_auto_scaling_group",
               {"AutoScalingGroupName": NAME, "DesiredCapacity": 1})
    aws.reservation(3, ("cr-0def", "us-east-1b", 2))
    aws.expect("ec2", "modify_capacity_reservation",
               {"CapacityReservationId": "cr-0abc", "InstanceCount": 1}, {"Return": True})
    aws.expect("ec2", "cancel_capacity_reservation", {"CapacityReservationId": "cr-0def"},
               {"Return": True})
    down = act.apply_counts({KEY: 1})
    assert [(c.before, c.after) for c in down.reserved] == [(5, 1)]


@given(count=st.integers(0, 200), k=st.integers(1, 6))
def test_shares_sum_to_the_count_and_differ_by_at_most_one(count: int, k: int) -> None:
    zones = [f"z{i}" for i in range(k)]
    shares = split_over(count, zones)
    assert sum(shares.values()) == count
    assert all(n > 0 for n in shares.values())
    if count >= k:
        assert max(shares.values()) - min(shares.values()) <= 1
    assert list(shares) == zones[:len(shares)]  # the first zones take the remainder
