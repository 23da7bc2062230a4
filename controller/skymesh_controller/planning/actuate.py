"""The actuator interface: make the world match a plan's instance counts.

An actuator takes desired counts per (model, region, GPU type) and reports what it
changed. It must be idempotent: applying the same plan twice changes nothing the second
time. Adapters: :mod:`skymesh_controller.planning.actuate_aws` (Auto Scaling groups through boto3)
and :mod:`skymesh_controller.planning.actuate_local` (``skymesh-replica`` processes registered with
the controller).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from skymesh_controller.planning.ilp import Key, Plan


@dataclass(frozen=True, slots=True)
class Change:
    model: str
    region: str
    gpu: str
    before: int | None  # None: the target did not exist yet
    after: int


@dataclass
class ApplyReport:
    changed: list[Change] = field(default_factory=list)
    unchanged: list[Key] = field(default_factory=list)
    errors: dict[Key, str] = field(default_factory=dict)
    # Capacity held for the plan (AWS: On-Demand Capacity Reservations), when the
    # actuator reserves: before None = created, after 0 = released.
    reserved: list[Change] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


@runtime_checkable
class Actuator(Protocol):
    def apply(self, plan: Plan) -> ApplyReport: ...

    def apply_counts(self, counts: Mapping[Key, int]) -> ApplyReport: ...
