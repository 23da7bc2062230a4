"""Apply a plan on AWS: one Auto Scaling group per (region, model, GPU type).

Each group's desired capacity becomes the plan's count; its maximum is raised when the
count needs it (never lowered: other tooling may rely on it). A group that does not exist
is created from a launch template named by :attr:`AwsActuator.launch_template` (an
operator prepares one per model and GPU type, with the replica's boot script), so the
first plan brings a region up. Nothing is written when a group already has the desired
capacity, so applying a plan twice is a no-op.

With ``reserve=True`` each group's count is also *reserved* (SageServe's "reserve"): an
EC2 On-Demand Capacity Reservation for the group's instance type in its availability zone,
open match criteria (the group's instances there use it with no launch-template change),
no end date, tagged ``skymesh:group``, held at the plan's count: created, resized or
cancelled (count 0) to follow it. Scaling out into reserved capacity cannot fail for lack
of GPUs in the zone; the reservation is billed whether instances run or not, which is
what a plan made ahead of a peak wants. moto does not implement capacity reservations, so
these calls are checked against botocore's EC2 model (``botocore.stub.Stubber``).

Region names map to AWS regions (``us`` -> ``us-east-1`` ...) and GPU types to instance
types (L4 -> g6.xlarge, A100-80GB -> p4d.24xlarge, H100-80GB -> p5.48xlarge); both maps can
be replaced. Clients are built per AWS region through an injectable factory, so tests
point them at moto's server.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.exceptions import BotoCoreError, ClientError

from skymesh_controller.planning.actuate import ApplyReport, Change
from skymesh_controller.planning.ilp import Key, Plan

DEFAULT_REGIONS = {"us": "us-east-1", "eu": "eu-west-1", "asia": "ap-northeast-1"}
DEFAULT_INSTANCE_TYPES = {"L4": "g6.xlarge", "A10G": "g5.xlarge",
                          "A100-80GB": "p4d.24xlarge", "H100-80GB": "p5.48xlarge"}


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def group_name(model: str, region: str, gpu: str) -> str:
    return f"skymesh-{_slug(region)}-{_slug(model)}-{_slug(gpu)}"


def default_client_factory(service: str, aws_region: str) -> Any:
    return boto3.client(service, region_name=aws_region)


def split_over(count: int, zones: list[str]) -> dict[str, int]:
    """``count`` instances spread as Auto Scaling balances a group over ``zones``."""
    base, extra = divmod(count, len(zones))
    return {z: base + (i < extra) for i, z in enumerate(zones) if base + (i < extra)}


@dataclass
class AwsActuator:
    client_factory: Callable[[str, str], Any] = default_client_factory
    regions: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULT_REGIONS))
    instance_types: Mapping[str, str] = field(
        default_factory=lambda: dict(DEFAULT_INSTANCE_TYPES))
    launch_template: Callable[[str, str], str] = lambda model, gpu: (
        f"skymesh-{_slug(model)}-{_slug(gpu)}")
    subnets: Mapping[str, str] = field(default_factory=dict)  # AWS region -> subnet ids
    reserve: bool = False
    _clients: dict[tuple[str, str], Any] = field(default_factory=dict, repr=False)
    _zones_by_region: dict[str, list[str]] = field(default_factory=dict, repr=False)

    def _client(self, service: str, aws_region: str) -> Any:
        key = (service, aws_region)
        if key not in self._clients:
            self._clients[key] = self.client_factory(service, aws_region)
        return self._clients[key]

    def apply(self, plan: Plan) -> ApplyReport:
        return self.apply_counts(plan.counts)

    def apply_counts(self, counts: Mapping[Key, int]) -> ApplyReport:
        report = ApplyReport()
        for key, count in sorted(counts.items()):
            model, region, gpu = key
            if count < 0:
                report.errors[key] = f"negative count {count}"
                continue
            aws_region = self.regions.get(region)
            if aws_region is None:
                report.errors[key] = f"no AWS region mapped for {region!r}"
                continue
            try:
                change = self._apply_one(model, region, gpu, aws_region, count)
                held = self._reserve(model, region, gpu, aws_region, count) \
                    if self.reserve else None
            except (ClientError, BotoCoreError) as exc:
                report.errors[key] = str(exc)
                continue
            if change is None:
                report.unchanged.append(key)
            else:
                report.changed.append(change)
            if held is not None:
                report.reserved.append(held)
        return report

    def _apply_one(self, model: str, region: str, gpu: str, aws_region: str,
                   count: int) -> Change | None:
        asg = self._client("autoscaling", aws_region)
        name = group_name(model, region, gpu)
        found = asg.describe_auto_scaling_groups(AutoScalingGroupNames=[name])
        groups = found.get("AutoScalingGroups", [])
        if not groups:
            if count == 0:
                return None  # nothing to run and nothing running: no group needed
            self._create_group(asg, name, model, gpu, aws_region, count)
            return Change(model, region, gpu, None, count)
        group = groups[0]
        before = int(group["DesiredCapacity"])
        if before == count:
            return None
        update: dict[str, Any] = {"AutoScalingGroupName": name, "DesiredCapacity": count}
        if count > int(group["MaxSize"]):
            update["MaxSize"] = count
        if count < int(group["MinSize"]):
            update["MinSize"] = count
        asg.update_auto_scaling_group(**update)
        return Change(model, region, gpu, before, count)

    def _create_group(self, asg: Any, name: str, model: str, gpu: str, aws_region: str,
                      count: int) -> None:
        ec2 = self._client("ec2", aws_region)
        template = self.launch_template(model, gpu)
        existing = ec2.describe_launch_templates(
            Filters=[{"Name": "launch-template-name", "Values": [template]}])
        if not existing.get("LaunchTemplates"):
            instance_type = self._instance_type(gpu, "CreateLaunchTemplate")
            ec2.create_launch_template(
                LaunchTemplateName=template,
                LaunchTemplateData={"InstanceType": instance_type,
                                    "TagSpecifications": [{"ResourceType": "instance", "Tags": [
                                        {"Key": "skymesh:model", "Value": model},
                                        {"Key": "skymesh:gpu", "Value": gpu}]}]})
        kwargs: dict[str, Any] = {
            "AutoScalingGroupName": name,
            "LaunchTemplate": {"LaunchTemplateName": template, "Version": "$Latest"},
            "MinSize": 0, "MaxSize": max(count, 1), "DesiredCapacity": count,
            "Tags": [{"Key": "skymesh:model", "Value": model, "PropagateAtLaunch": True},
                     {"Key": "skymesh:gpu", "Value": gpu, "PropagateAtLaunch": True}],
        }
        subnet = self.subnets.get(aws_region)
        if subnet:
            kwargs["VPCZoneIdentifier"] = subnet
        else:
            kwargs["AvailabilityZones"] = [self._zones(aws_region)[0]]
        asg.create_auto_scaling_group(**kwargs)

    def _instance_type(self, gpu: str, operation: str) -> str:
        instance_type = self.instance_types.get(gpu)
        if instance_type is None:  # reported like AWS's own refusals, per key
            raise ClientError({"Error": {"Code": "UnknownGpu",
                                         "Message": f"no instance type for {gpu!r}"}},
                              operation)
        return instance_type

    def _zones(self, aws_region: str) -> list[str]:
        """The zones a group runs in: its subnets' (in the order given), else the region's
        first zone, where a group without subnets is created. Asked once per region."""
        if aws_region in self._zones_by_region:
            return self._zones_by_region[aws_region]
        ec2 = self._client("ec2", aws_region)
        subnet = self.subnets.get(aws_region)
        if subnet:
            ids = [s.strip() for s in subnet.split(",") if s.strip()]
            by_id = {s["SubnetId"]: str(s["AvailabilityZone"])
                     for s in ec2.describe_subnets(SubnetIds=ids)["Subnets"]}
            zones = list(dict.fromkeys(by_id[i] for i in ids if i in by_id))
        else:
            zones = [str(ec2.describe_availability_zones()["AvailabilityZones"][0]
                         ["ZoneName"])]
        self._zones_by_region[aws_region] = zones
        return zones

    def _reserve(self, model: str, region: str, gpu: str, aws_region: str,
                 count: int) -> Change | None:
        """Hold ``count`` instances of the group's type in its zones; None: already held.

        A capacity reservation is for one zone, and Auto Scaling spreads a group evenly
        over its subnets' zones, so each zone holds its share (the first zones take the
        remainder; should AWS place that instance elsewhere, one reserved slot idles).
        """
        ec2 = self._client("ec2", aws_region)
        name = group_name(model, region, gpu)
        found = ec2.describe_capacity_reservations(Filters=[
            {"Name": "tag:skymesh:group", "Values": [name]},
            {"Name": "state", "Values": ["active", "pending"]}])["CapacityReservations"]
        held = {str(r["AvailabilityZone"]): r for r in found}
        shares = split_over(count, self._zones(aws_region)) if count else {}
        changed = False
        for zone in dict.fromkeys([*shares, *held]):
            want, r = shares.get(zone, 0), held.get(zone)
            have = int(r["TotalInstanceCount"]) if r is not None else 0
            if want == have:
                continue
            changed = True
            if r is None:
                ec2.create_capacity_reservation(
                    InstanceType=self._instance_type(gpu, "CreateCapacityReservation"),
                    InstancePlatform="Linux/UNIX", AvailabilityZone=zone,
                    InstanceCount=want, InstanceMatchCriteria="open",
                    EndDateType="unlimited",
                    TagSpecifications=[{"ResourceType": "capacity-reservation", "Tags": [
                        {"Key": "skymesh:group", "Value": name},
                        {"Key": "skymesh:model", "Value": model},
                        {"Key": "skymesh:gpu", "Value": gpu}]}])
            elif want == 0:
                ec2.cancel_capacity_reservation(
                    CapacityReservationId=r["CapacityReservationId"])
            else:
                ec2.modify_capacity_reservation(
                    CapacityReservationId=r["CapacityReservationId"], InstanceCount=want)
        if not changed:
            return None
        before = sum(int(r["TotalInstanceCount"]) for r in found) if found else None
        return Change(model, region, gpu, before, count)

    def desired(self, model: str, region: str, gpu: str) -> int | None:
        """The group's current desired capacity (None when it does not exist)."""
        asg = self._client("autoscaling", self.regions[region])
        groups = asg.describe_auto_scaling_groups(
            AutoScalingGroupNames=[group_name(model, region, gpu)])["AutoScalingGroups"]
        return int(groups[0]["DesiredCapacity"]) if groups else None
