"""The simulator's model of skymesh-lb's workers (SimConfig.workers): each region's
balancer as N workers behind one address, pushing with a 1/N share, their tries sharing
inserts as the live workers do (skymesh.balancer.siblings)."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh_lab.sim.runner import SimConfig, Simulation, run

NO_SHARING_S = 1e6  # inserts reach the siblings after the run: each worker on its own


def tot(workers: int, **extra: Any) -> dict[str, Any]:
    return run(SimConfig(workload="tot-gsm8k", regions=["us"], replicas={"us": 4},
                         forwarding=False, policy="prefix-tree", seed=0, duration_s=60.0,
                         workers=workers, **extra))


def test_two_workers_keep_one_workers_prefix_hit_rate_by_sharing_their_tries() -> None:
    one, two = tot(1), tot(2)
    alone = tot(2, worker_share_s=NO_SHARING_S)
    assert alone["sim_seconds"] < 1000  # the far-off shares did not stretch the run
    assert abs(two["prefix_hit_rate"] - one["prefix_hit_rate"]) <= 0.02
    # Without the sharing each worker learns only its own half: locality is lost.
    assert alone["prefix_hit_rate"] < one["prefix_hit_rate"] - 0.05
    assert two["completed"] >= 0.97 * one["completed"]


def test_each_worker_pushes_with_its_share() -> None:
    from skymesh_lab.sim.workloads import build_workload

    cfg = SimConfig(workload="poisson", regions=["us"], replicas={"us": 2}, forwarding=False,
                    workers=3, duration_s=1.0)
    sim = Simulation(cfg, build_workload("poisson", regions=["us"], seed=0, duration_s=1.0))
    assert [w.dispatcher.balancers_per_region for w in sim.workers["us"]] == [3, 3, 3]
    assert len({id(w.policy) for w in sim.workers["us"]}) == 3


@pytest.mark.parametrize("extra", [{"forwarding": True}, {"workers": 0}])
def test_workers_are_region_local_only(extra: dict[str, Any]) -> None:
    cfg = SimConfig(**{"regions": ["us"], "replicas": {"us": 1}, "forwarding": False,
                       "workers": 2, **extra})
    with pytest.raises(ValueError, match="workers"):
        Simulation(cfg, workload=None)  # type: ignore[arg-type]
