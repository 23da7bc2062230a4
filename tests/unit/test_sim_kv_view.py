"""The simulator's KV-event delay (skymesh_lab.sim.kv_view): the "exact" prefix state a
balancer routes on is the replica's published events, applied a delay after each step."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh.policies import RouteRequest
from skymesh_lab.sim.cluster import SimReplica
from skymesh_lab.sim.events import EventLoop
from skymesh_lab.sim.kv_view import EventView
from skymesh_lab.sim.runner import SimConfig, Simulation, run, with_exact_prefix
from skymesh_lab.sim.workloads import build_workload
from skymesh_replica.engine.profiles import DEFAULT_PROFILE, get_profile

KEYS = (11, 12, 13)


def visible_at(loop: EventLoop, view: EventView, t: float) -> int:
    loop.run(until=t)
    return view.held(KEYS)


def test_a_stored_block_is_visible_only_after_the_delay() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0, delay_s=0.05)
    view.stored(11, None, [], 16)
    view.stored(12, 11, [], 16)
    assert view.held(KEYS) == 0  # recorded, not yet published
    view.publish(step_s=0.01)
    assert visible_at(loop, view, 0.049) == 0
    assert visible_at(loop, view, 0.051) == 2


def test_a_removed_block_stays_visible_until_the_delay() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0, delay_s=0.05)
    view.stored(11, None, [], 16)
    view.publish(0.01)
    assert visible_at(loop, view, 0.06) == 1
    view.removed(11)
    t0 = loop.now
    view.publish(0.01)
    assert visible_at(loop, view, t0 + 0.049) == 1  # the balancer still believes it cached
    assert visible_at(loop, view, t0 + 0.051) == 0


def test_default_delay_is_one_step_plus_the_transit() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.002)
    view.stored(11, None, [], 16)
    view.publish(step_s=0.03)
    assert visible_at(loop, view, 0.0319) == 0
    assert visible_at(loop, view, 0.0321) == 1


def test_batches_apply_in_order_even_when_a_later_step_is_shorter() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0)
    view.stored(11, None, [], 16)
    view.publish(step_s=0.5)  # a long prefill step: applied at 0.5
    loop.run(until=0.1)
    view.removed(11)
    view.publish(step_s=0.01)  # would land at 0.11, before the store it undoes
    loop.run()
    assert view.held(KEYS) == 0 and view.batches == 2


def test_cleared_empties_the_view_after_the_delay() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0, delay_s=0.0)
    view.stored(11, None, [], 16)
    view.publish(0.01)
    loop.run()
    view.cleared()
    view.publish(0.01)
    assert view.held(KEYS) == 1
    loop.run()
    assert view.held(KEYS) == 0


def test_a_dropped_leading_block_is_lost_once_its_event_applies() -> None:
    """As the daemon's index: the replica whose engine evicted a prompt's first block is
    named in ``exact_lost`` (its trie record of the prompt is stale) until it stores the
    block again; a later block's eviction loses nothing."""
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0, delay_s=0.05)
    view.stored(11, None, [], 16)
    view.stored(12, 11, [], 16)
    view.publish(0.01)
    loop.run()
    view.removed(12)
    view.publish(0.01)
    loop.run()
    assert not view.lost(11) and not view.lost(12)
    view.removed(11)
    view.publish(0.01)
    assert not view.lost(11)  # not yet applied
    loop.run()
    assert view.lost(11)
    view.stored(11, None, [], 16)
    view.publish(0.01)
    loop.run()
    assert not view.lost(11)


def test_a_reset_loses_every_leading_block_and_the_memory_is_bounded() -> None:
    loop = EventLoop()
    view = EventView(loop, transit_s=0.0, delay_s=0.0, max_lost=2)
    for h in (11, 21, 31):
        view.stored(h, None, [], 16)
    view.stored(12, 11, [], 16)
    view.publish(0.01)
    loop.run()
    view.cleared()
    view.publish(0.01)
    loop.run()
    assert sum(view.lost(h) for h in (11, 21, 31)) == 2  # the oldest forgotten
    assert not view.lost(12)


def test_the_route_names_the_replicas_that_dropped_its_prompt() -> None:
    loop = EventLoop()
    reps = [SimReplica(f"r{i}", "us", get_profile(DEFAULT_PROFILE), loop, lambda *a: None)
            for i in range(2)]
    views = [r.follow_events(transit_s=0.0, delay_s=0.0) for r in reps]
    for v in views:
        v.stored(11, None, [], 16)
        v.publish(0.01)
    views[0].removed(11)
    views[0].publish(0.01)
    loop.run()
    route = with_exact_prefix(RouteRequest("r", prefix_keys=KEYS), reps)
    assert route.exact_lost == {"r0"} and route.exact_prefix == {"r0": 0, "r1": 1}
    assert with_exact_prefix(RouteRequest("r", prefix_keys=()), reps).exact_lost == set()


def test_negative_delays_are_refused() -> None:
    with pytest.raises(ValueError, match="delays must be >= 0"):
        EventView(EventLoop(), transit_s=0.0, delay_s=-1.0)


def test_the_route_reads_the_published_view_not_the_cache() -> None:
    loop = EventLoop()
    rep = SimReplica("r0", "us", get_profile(DEFAULT_PROFILE), loop, lambda *a: None)
    view = rep.follow_events(transit_s=0.0, delay_s=0.05)
    kv = rep.engine.kv
    blocks = kv.allocate(2)
    for b, h in zip(blocks, KEYS[:2], strict=True):
        kv.register(b, h)
        view.stored(h, None, [], 16)  # as Engine.complete tells its recorder
    route = RouteRequest("r", prefix_keys=KEYS)
    assert with_exact_prefix(route, [rep]).exact_prefix == {"r0": 0}  # cached, unpublished
    view.publish(0.01)
    loop.run()
    assert with_exact_prefix(route, [rep]).exact_prefix == {"r0": 2}


def sim(**extra: Any) -> Simulation:
    cfg = SimConfig(workload="tot-gsm8k", regions=["us", "eu"], replicas={"us": 2, "eu": 2},
                    policy="prefix-tree", seed=0, duration_s=20.0, **extra)
    return Simulation(cfg, build_workload(cfg.workload, regions=cfg.regions, seed=0,
                                          duration_s=cfg.duration_s))


def test_engines_publish_events_only_with_exact_prefix_state() -> None:
    # The other simulator pages run without it: their replicas record nothing.
    assert all(r.kv_view is None and r.engine.kv.recorder is None for r in sim().replicas)
    s = sim(exact_prefix_state=True)
    assert all(r.kv_view is not None and r.engine.kv.recorder is r.kv_view
               for r in s.replicas)
    s.run()
    for r in s.replicas:
        assert r.kv_view is not None and r.kv_view.batches > 0
        # The run has drained: what the balancers know is what the cache holds.
        assert r.kv_view.visible == set(r.engine.kv._cached)


def test_several_balancers_per_region_each_peer_every_other_regions_balancer() -> None:
    s = sim(balancers_per_region=3)
    for region in ("us", "eu"):
        bals = s.workers[region]
        assert len(bals) == 3 and all(b.dispatcher.balancers_per_region == 3 for b in bals)
        for b in bals:
            assert {p.region for p in b.peers.values()} == {"eu", "us"} - {region}
            assert len(b.peers) == 3
    res = s.run()
    assert res["completed"] > 0


@pytest.mark.parametrize("extra", [{"workers": 2, "forwarding": False},
                                   {"single_balancer": "us"}])
def test_several_balancers_per_region_refuse_workers_and_a_single_balancer(
        extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="balancers_per_region"):
        sim(balancers_per_region=2, **extra)


def test_delayed_events_keep_one_balancers_hit_rate_across_regions() -> None:
    def tot(n: int, **extra: Any) -> dict[str, Any]:
        return run(SimConfig(workload="tot-gsm8k", regions=["us", "eu"],
                             replicas={"us": 3, "eu": 3}, policy="prefix-tree", seed=0,
                             duration_s=40.0, balancers_per_region=n, **extra))

    one, trie, exact = tot(1), tot(4), tot(4, exact_prefix_state=True)
    assert trie["prefix_hit_rate"] < one["prefix_hit_rate"] - 0.05
    assert exact["prefix_hit_rate"] >= 0.95 * one["prefix_hit_rate"]
