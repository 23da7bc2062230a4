"""The simulator's balancers on the engines' exact prefix state (SimConfig.
exact_prefix_state, as following KV-cache events gives, docs/kv-events.md)."""

from __future__ import annotations

from typing import Any

from skymesh.policies import RouteRequest
from skymesh_lab.sim.cluster import SimReplica
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.runner import SimConfig, run, with_exact_prefix
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

SEPARATE = 1e9  # the workers never see each other's inserts: separate balancers


def tot(workers: int, **extra: Any) -> dict[str, Any]:
    return run(SimConfig(workload="tot-gsm8k", regions=["us"], replicas={"us": 4},
                         forwarding=False, policy="prefix-tree", seed=0, duration_s=60.0,
                         workers=workers, worker_share_s=SEPARATE, **extra))


def test_route_carries_each_replicas_cached_blocks() -> None:
    loop = EventLoop()
    reps = [SimReplica(f"r{i}", "us", get_profile(DEFAULT_PROFILE), loop, lambda *a: None)
            for i in range(2)]
    kv = reps[0].engine.kv
    keys = (11, 12, 13, 14)
    blocks = kv.allocate(2)
    for b, h in zip(blocks, keys[:2], strict=True):
        kv.register(b, h)
    kv.release(blocks)  # cached, evictable: still a hit
    route = with_exact_prefix(RouteRequest("r", prefix_keys=keys), reps)
    assert (route.exact_prefix, route.exact_blocks) == ({"r0": 2, "r1": 0}, 4)


def test_separate_balancers_keep_one_balancers_hit_rate_on_exact_state() -> None:
    one = tot(1)
    trie, exact = tot(4), tot(4, exact_prefix_state=True)
    # Four balancers each on its own trie lose locality; on the engines' state they do not.
    assert trie["prefix_hit_rate"] < one["prefix_hit_rate"] - 0.05
    assert exact["prefix_hit_rate"] >= one["prefix_hit_rate"] - 0.01
    assert exact["completed"] >= 0.97 * one["completed"]
