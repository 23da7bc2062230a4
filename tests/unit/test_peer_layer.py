"""Two-layer routing (SkyLB Algorithm 1) in the dispatcher, and the mesh in the simulator."""

from __future__ import annotations

import pytest

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad
from skymesh.sim.runner import SimConfig, Simulation
from skymesh.sim.workloads import build_workload


def mesh_dispatcher(tau: int = 2) -> Dispatcher:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=1,
                   peer_policy=build_policy("least-load"), tau=tau, hold_s=0.0)
    d.set_targets({"r1": ["m"]})
    d.set_peers(["eu", "asia"])
    return d


def ticket(i: int, forwarded: bool = False) -> Ticket:
    return Ticket(RouteRequest(f"q{i}", model="m", forwarded=forwarded), 0.0)


def beat(d: Dispatcher, peer: str, seq: int, available: int, queue: int = 0,
         now: float = 0.0) -> bool:
    return d.on_peer_heartbeat(peer, now, 1, seq, {"m": ModelLoad(available, 4, queue)})


def test_local_first_then_an_available_peer_then_wait() -> None:
    d = mesh_dispatcher()
    beat(d, "eu", 1, available=1)
    t1, t2, t3 = ticket(1), ticket(2), ticket(3)
    for t in (t1, t2, t3):
        d.offer(t, 0.0)
    out = d.pump(0.0)
    assert [(t.target, t.to_peer) for t in out] == [("r1", False), ("eu", True)]
    # eu had one free replica and we just sent it a request: nothing more goes there
    # until its next heartbeat; asia never reported; so the third request waits.
    assert d.queue_length() == 1
    beat(d, "asia", 1, available=2, now=0.1)
    assert d.pump(0.1) == [t3] and t3.target == "asia"


def test_a_forwarded_request_is_never_forwarded_again() -> None:
    d = mesh_dispatcher()
    beat(d, "eu", 1, available=3)
    busy, fwd = ticket(1), ticket(2, forwarded=True)
    d.offer(busy, 0.0)
    d.offer(fwd, 0.0)
    assert d.pump(0.0) == [busy]  # the forwarded one waits for a local replica
    d.complete(busy, 1.0, ok=True)
    assert d.pump(1.0) == [fwd] and fwd.target == "r1" and not fwd.to_peer


def test_peers_with_long_queues_or_down_are_skipped_and_stale_heartbeats_ignored() -> None:
    d = mesh_dispatcher(tau=2)
    busy = ticket(0)
    d.offer(busy, 0.0)
    d.pump(0.0)
    assert beat(d, "eu", 5, available=2, queue=3)  # queue > tau
    assert not beat(d, "eu", 4, available=2, queue=0)  # older seq: ignored
    beat(d, "asia", 1, available=2)
    d.set_peer_alive("asia", False)
    t = ticket(1)
    d.offer(t, 0.0)
    assert d.pump(0.0) == []
    d.set_peer_alive("asia", True)
    assert d.pump(0.0) == [t] and t.target == "asia"
    d.first_byte(t)
    d.complete(t, 0.5, ok=True)
    assert d.peers["asia"].in_flight == 0


def test_a_region_without_replicas_still_takes_requests_its_peers_can_serve() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_P,
                   peer_policy=build_policy("least-load"), hold_s=0.0)
    d.set_targets({})
    d.set_peers(["eu"])
    assert not d.reachable("m")
    beat(d, "eu", 1, available=1)
    assert d.reachable("m") and not d.serves("m") and not d.reachable("other")
    t = ticket(1)
    d.offer(t, 0.0)
    assert d.pump(0.0) == [t] and t.to_peer


def test_region_local_mode_never_forwards() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=1, hold_s=0.0)
    d.set_targets({"r1": ["m"]})
    d.set_peers(["eu"])
    beat(d, "eu", 1, available=4)
    for i in range(3):
        d.offer(ticket(i), 0.0)
    assert len(d.pump(0.0)) == 1


@pytest.mark.parametrize("forwarding", [False, True])
def test_skewed_regions_in_the_simulator(forwarding: bool) -> None:
    regions = ["us", "eu", "asia"]
    cfg = SimConfig(workload="sharegpt-chat", regions=regions,
                    replicas={"us": 1, "eu": 2, "asia": 2}, policy="prefix-tree",
                    forwarding=forwarding, duration_s=120)
    wl = build_workload("sharegpt-chat", regions=regions, seed=0, duration_s=120,
                        clients_per_region={"us": 60, "eu": 10, "asia": 10})
    sim = Simulation(cfg, wl)
    res = sim.run()
    stats = res["region_stats"]
    assert res["completed"] == res["requests"]
    assert all(len(r.path) <= 2 for r in sim.records)  # one hop at most
    if forwarding:
        assert stats["us"]["forwarded_out"] > 0
        assert sum(s["forwarded_in"] for s in stats.values()) == \
            sum(s["forwarded_out"] for s in stats.values())
        assert stats["eu"]["forwarded_out"] + stats["asia"]["forwarded_out"] < \
            stats["us"]["forwarded_out"]
    else:
        assert all(s["forwarded_out"] == 0 for s in stats.values())
        assert stats["us"]["served"] == stats["us"]["clients_requests"]


def test_mesh_serves_more_than_region_local_under_skew() -> None:
    def throughput(forwarding: bool) -> float:
        regions = ["us", "eu", "asia"]
        cfg = SimConfig(workload="sharegpt-chat", regions=regions,
                        replicas={"us": 1, "eu": 2, "asia": 2}, forwarding=forwarding,
                        duration_s=120)
        wl = build_workload("sharegpt-chat", regions=regions, seed=0, duration_s=120,
                            clients_per_region={"us": 60, "eu": 10, "asia": 10})
        return float(Simulation(cfg, wl).run()["throughput_rps"])

    assert throughput(True) > 1.1 * throughput(False)
