"""Routing policies: one registry, pure objects, used by the balancer and the simulator."""

from skymesh.policies.base import (
    LoadView,
    Policy,
    PolicyConfigError,
    RequestTiming,
    RouteRequest,
    TargetLoad,
)
from skymesh.policies.registry import build_policy, policy_class, policy_names

__all__ = [
    "LoadView",
    "Policy",
    "PolicyConfigError",
    "RequestTiming",
    "RouteRequest",
    "TargetLoad",
    "build_policy",
    "policy_class",
    "policy_names",
]
