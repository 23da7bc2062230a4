"""Every registered policy through the simulator on tree-of-thoughts (SkyLB's ToT setup,
scaled down: 1 region, 4 replicas, 20 clients, 60 simulated seconds)."""

from __future__ import annotations

from functools import cache
from typing import Any

import pytest

from skymesh.policies import policy_names
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workloads import build_workload


@cache
def run(policy: str, push_mode: str = "sp-p") -> dict[str, Any]:
    cfg = SimConfig(
        workload="tot-gsm8k", regions=["us"], replicas={"us": 4}, policy=policy,
        push_mode=push_mode, duration_s=60.0, seed=0,
    )
    workload = build_workload(
        "tot-gsm8k", regions=["us"], seed=0, duration_s=60.0, clients_per_region=20
    )
    return Simulation(cfg, workload).run()


@pytest.mark.parametrize("policy", policy_names())
def test_policy_completes_every_request(policy: str) -> None:
    res = run(policy)
    assert res["requests"] > 500
    assert res["completed"] == res["requests"]
    assert res["failed"] == 0
    assert res["prefix_hit_rate"] > 0.5  # the shared ToT instruction prefix always hits


@pytest.mark.parametrize("policy", ["prefix-tree", "consistent-hash", "sglang-cache-aware",
                                    "lmetric"])
def test_prefix_aware_policies_hit_the_cache_far_more_than_round_robin(policy: str) -> None:
    # Blind pushing leaves every replica a candidate, so the policy alone decides where a
    # tree's nodes land (under sp-p, availability narrows the choice and the gap shrinks).
    rr = run("round-robin", "bp")["prefix_hit_rate"]
    res = run(policy, "bp")
    assert res["prefix_hit_rate"] > rr + 0.1
    assert res["throughput_rps"] > run("round-robin", "bp")["throughput_rps"]


def test_prefix_tree_beats_round_robin_under_selective_pushing_too() -> None:
    assert run("prefix-tree")["prefix_hit_rate"] > run("round-robin")["prefix_hit_rate"] + 0.02
