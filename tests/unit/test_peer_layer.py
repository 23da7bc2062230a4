"""Two-layer routing (SkyLB Algorithm 1) in the dispatcher, and the mesh in the simulator."""

from __future__ import annotations

import pytest

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import (
    Balancing,
    ForwardingRule,
    ModelLoad,
    PeerOption,
    balanced_peer,
)
from skymesh_lab.sim.runner import SimConfig, Simulation
from skymesh_lab.sim.workloads import build_workload


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


# -- the balanced forwarding rule ----------------------------------------------------------
B = Balancing(margin=1.0, locality=4.0, rtt_weight=10.0)


def test_balanced_peer_forwards_only_past_margin_and_rtt() -> None:
    near = PeerOption("eu", load=5.0, rtt_s=0.1)  # costs 5 + 1 + 1 = 7
    assert balanced_peer(7.0, False, [near], None, B) is None  # a tie stays local
    assert balanced_peer(7.5, False, [near], None, B) == "eu"
    # A far peer needs a bigger gap: the same load 0.2 s away costs 8.
    far = PeerOption("asia", load=5.0, rtt_s=0.2)
    assert balanced_peer(7.5, False, [far], None, B) is None
    assert balanced_peer(7.5, False, [far, near], None, B) == "eu"
    # A lighter far peer beats a heavier near one.
    assert balanced_peer(9.0, False, [PeerOption("eu", 6.5, 0.1),
                                      PeerOption("asia", 4.0, 0.2)], None, B) == "asia"


def test_balanced_peer_keeps_a_request_where_its_prefix_is() -> None:
    eu = PeerOption("eu", load=5.0, rtt_s=0.1)  # 7 without a prefix anywhere
    # Cached here: the peer must be lighter by the locality margin too (7 + 4 = 11).
    assert balanced_peer(10.0, True, [eu], None, B) is None
    assert balanced_peer(11.5, True, [eu], None, B) == "eu"
    # Cached at the peer (a conversation that moved): it follows even at equal load,
    # and comes back only when the peer is heavier by the locality margin.
    assert balanced_peer(5.0, False, [eu], "eu", B) == "eu"
    assert balanced_peer(3.0, False, [eu], "eu", B) is None
    # Cached at both (we served its older turns): no locality term either way.
    assert balanced_peer(7.0, True, [eu], "eu", B) is None


def test_balancing_rejects_negative_parameters() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        Balancing(margin=-1.0)


def balanced_dispatcher(rule: ForwardingRule = ForwardingRule.BALANCED,
                        policy: str = "least-load") -> Dispatcher:
    # SP-O with a large cap: local replicas stay available, as L4s under continuous
    # batching do, so overflow alone would never forward.
    d = Dispatcher(build_policy(policy), PushMode.SP_O, max_outstanding=100,
                   peer_policy=build_policy("prefix-tree"), hold_s=0.0,
                   forwarding_rule=rule, balancing=Balancing(1.0, 4.0, 10.0))
    d.set_targets({"r1": ["m"], "r2": ["m"]})
    d.set_peers(["eu"])
    d.set_peer_rtt("eu", 0.1)
    return d


def load_beat(d: Dispatcher, seq: int, outstanding: int | None, total: int = 2,
              now: float = 0.0) -> None:
    assert d.on_peer_heartbeat("eu", now, 1, seq,
                               {"m": ModelLoad(total, total, 0, outstanding=outstanding)})


def fill(d: Dispatcher, n: int) -> None:
    for i in range(n):
        d.offer(ticket(100 + i), 0.0)
    assert all(not t.to_peer for t in d.pump(0.0))


def test_balanced_rule_moves_load_that_overflow_keeps() -> None:
    for rule, expect_peer in ((ForwardingRule.OVERFLOW, False),
                              (ForwardingRule.BALANCED, True)):
        d = balanced_dispatcher(rule)
        fill(d, 20)  # 10 per local replica
        load_beat(d, 1, outstanding=2)  # 1 per replica at the peer
        t = ticket(1)
        d.offer(t, 0.0)
        assert d.pump(0.0) == [t]
        assert t.to_peer is expect_peer


def test_balanced_rule_counts_what_it_forwarded_since_the_heartbeat() -> None:
    d = balanced_dispatcher()
    fill(d, 20)  # local: 10 per replica
    load_beat(d, 1, outstanding=80, total=10)  # 8 per replica, 10 replicas free
    burst = [ticket(i) for i in range(8)]
    for t in burst:
        d.offer(t, 0.0)
    d.pump(0.0)
    # After k forwards the peer costs (80 + k + 1) / 10 + margin 1 + RTT 1 and staying
    # costs (20 + 8 - k) / 2 (our queue counts as ours): forwarding stops at k = 7
    # (10.8 >= 10.5). Without counting its own forwards it would send all 8.
    assert [t.to_peer for t in burst] == [True] * 7 + [False]


def test_balanced_rule_ignores_peers_that_do_not_report_outstanding() -> None:
    d = balanced_dispatcher()
    fill(d, 20)
    load_beat(d, 1, outstanding=None)  # a balancer from before the field
    t = ticket(1)
    d.offer(t, 0.0)
    assert d.pump(0.0) == [t] and not t.to_peer


def test_balanced_rule_never_forwards_a_forwarded_request() -> None:
    d = balanced_dispatcher()
    fill(d, 20)
    load_beat(d, 1, outstanding=0)
    t = ticket(1, forwarded=True)
    d.offer(t, 0.0)
    assert d.pump(0.0) == [t] and not t.to_peer


def test_balanced_rule_weighs_a_locally_cached_prefix() -> None:
    def placed(local_requests: int) -> bool:
        d = balanced_dispatcher(policy="prefix-tree")
        first = Ticket(RouteRequest("c0", model="m", prefix_keys=(1, 2, 3, 4)), 0.0)
        d.offer(first, 0.0)
        assert d.pump(0.0) == [first] and not first.to_peer
        fill(d, local_requests - 1)
        load_beat(d, 1, outstanding=2)
        turn = Ticket(RouteRequest("c1", model="m", prefix_keys=(1, 2, 3, 4, 5)), 0.0)
        d.offer(turn, 0.0)
        assert d.pump(0.0) == [turn]
        return turn.to_peer

    # Peer: (2 + 1) / 2 + 1 + 1 = 3.5; us: (n + 1) / 2. A new conversation would move
    # at n = 7 (4 > 3.5); this one's history is cached here, so it moves only past
    # 3.5 + 4 = 7.5, i.e. from n = 15.
    assert not placed(7)
    assert not placed(14)
    assert placed(15)


def test_model_loads_report_outstanding_requests_per_model() -> None:
    d = balanced_dispatcher()
    d.set_targets({"r1": ["m"], "r2": ["m", "x"]})
    for t in (ticket(1), ticket(2), ticket(3)):
        d.offer(t, 0.0)
    d.pump(0.0)
    loads = d.model_loads(0.0)
    assert loads["m"].outstanding == 3 and loads["m"].total == 2
    assert loads["x"].total == 1 and loads["x"].outstanding == d.targets["r2"].load.outstanding


def test_the_simulator_feeds_outstanding_and_rtt_to_peers() -> None:
    regions = ["us", "eu"]
    cfg = SimConfig(workload="sharegpt-chat", regions=regions, replicas={"us": 1, "eu": 1},
                    policy="prefix-tree", forwarding_rule="balanced", duration_s=30)
    wl = build_workload("sharegpt-chat", regions=regions, seed=0, duration_s=30,
                        clients_per_region={"us": 12, "eu": 2})
    sim = Simulation(cfg, wl)
    res = sim.run()
    eu_seen_by_us = sim.balancers["us"].dispatcher.peers["lb-eu"]
    assert eu_seen_by_us.rtt_s == pytest.approx(0.075)
    assert all(m.outstanding is not None for m in eu_seen_by_us.models.values())
    # us (12 clients, 1 replica) sends work to the idle eu while its own replica is free.
    assert res["region_stats"]["us"]["forwarded_out"] > res["region_stats"]["eu"][
        "forwarded_out"]
    assert res["completed"] == res["requests"]


def test_diurnal_replicas_to_match_is_the_fewest_within_two_percent() -> None:
    from skymesh_lab.bench.diurnal import replicas_to_match

    runs = [{"system": "mesh-balanced", "replicas": n, "throughput_rps": rps}
            for n, rps in ((8, 9.15), (9, 9.34), (10, 9.30), (12, 9.78))]
    runs.append({"system": "mesh-overflow", "replicas": 8, "throughput_rps": 9.5})
    assert replicas_to_match(runs, "mesh-balanced", 9.45) == 9  # 0.98 x 9.45 = 9.261
    assert replicas_to_match(runs, "mesh-balanced", 10.0) is None
