"""The adaptive slot reserve of skymesh.balancer.tenancy (``tenants.reserve: {batch:
auto}``, the default): a lower class leaves ``reserve_headroom`` x the better classes'
recent mean in service free on each replica (Little's law: their arrival rate x their
time in service), at least one slot, so the idle capacity goes to the lower class.
Fake clocks throughout."""

from __future__ import annotations

import math

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.tenancy import FairQueue, Occupancy, Reserve, Waiter, release_into
from skymesh.balancer.tenant_gate import TenantGate

CLASSES = ("interactive", "standard", "batch")
AUTO = Reserve(CLASSES, {}, idle_s=1000.0, adaptive=frozenset({"batch"}), headroom=1.5)
FIXED = Reserve(CLASSES, {"batch": 0.25}, idle_s=1000.0)


def none_queued(model: str) -> int:
    return 0


def test_occupancy_follows_a_rise_fast_and_a_fall_slowly() -> None:
    occ = Occupancy(rise_s=1.0, fall_s=30.0)
    for _ in range(4):
        occ.start("m", "interactive", 0.0)
    assert occ.mean("m", ["interactive"], 0.0) == 0.0
    assert occ.mean("m", ["interactive"], 1.0) == pytest.approx(4 * (1 - math.exp(-1)))
    assert occ.mean("m", ["interactive"], 20.0) == pytest.approx(4.0, abs=1e-6)
    for _ in range(4):
        occ.end("m", "interactive", 20.0)
    # Gone from service at 20 s: the mean forgets them over fall_s, not at once.
    assert occ.mean("m", ["interactive"], 50.0) == pytest.approx(4 * math.exp(-1))
    # Other classes and models apart; an end without a start does not go below zero.
    occ.start("m", "standard", 50.0)
    occ.end("other", "interactive", 50.0)
    assert occ.mean("other", ["interactive"], 60.0) == 0.0
    assert occ.mean("m", ["interactive", "standard"], 60.0) == pytest.approx(
        4 * math.exp(-40 / 30) + 1 - math.exp(-10))
    # Idle long enough, a (model, class) is forgotten: memory stays bounded.
    assert occ.mean("m", ["interactive"], 1000.0) == 0.0
    assert ("m", "interactive") not in occ._s


def test_adaptive_slots_are_headroom_times_the_better_load_per_replica() -> None:
    # 6 better requests in service on 2 replicas, headroom 1.5: 4.5 -> 5 free on each.
    assert AUTO.slots("batch", 16, better=6.0, replicas=2) == 5
    assert AUTO.slots("batch", 16, better=0.0, replicas=2) == 1  # at least one slot
    assert AUTO.slots("batch", 4, better=40.0, replicas=2) == 3  # never the last one
    assert AUTO.slots("batch", 1, better=3.0, replicas=1) == 0
    assert AUTO.slots("standard", 16, better=6.0, replicas=2) == 0  # no reserve: none
    assert AUTO.room("batch", [(8, 16, 0), (3, 16, 0)], better=2.0) == 6 + 1
    assert AUTO.applies("batch", {"interactive": 0.0}, 10.0)
    assert not AUTO.applies("standard", {"interactive": 0.0}, 10.0)


def _interactive(q: FairQueue, n: int, now: float) -> list[Waiter]:
    for i in range(n):
        q.push(Waiter("m", "web", "interactive", 10, now, payload=i))
    out = []
    while (w := q.pop("m", now)) is not None:
        out.append(w)
    return out


def test_light_better_load_leaves_the_idle_slots_to_the_lower_class() -> None:
    """One interactive request in service now and then on two replicas of 16: the fixed
    quarter keeps 4 slots free on each, the adaptive reserve 1 (the batch tenant gets the
    idle capacity); while the interactive load grows, the reserve grows with it."""
    free = {"m": [(15, 16, 0), (16, 16, 0)]}.__getitem__

    def batch_room(reserve: Reserve, q: FairQueue, now: float) -> int:
        for _ in range(40):
            q.push(Waiter("m", "bulk", "batch", 10, now))
        out = release_into(q, none_queued, {}, 1000, now, reserve=reserve, slots=free)
        q.drain("m")
        return len(out)

    q = FairQueue(CLASSES, capacity=1000, started=0.0)
    q.occupancy.fall_s = 30.0
    (one,) = _interactive(q, 1, 0.0)
    assert batch_room(FIXED, q, 60.0) == 11 + 12
    assert batch_room(AUTO, q, 60.0) == 14 + 15  # ceil(1.5 x 1 / 2) = 1 on each
    # A burst: 12 interactive requests in service at once; within a few seconds the
    # reserve covers 1.5x their load per replica (13 x 1.5 / 2 -> 10 free on each).
    burst = _interactive(q, 12, 60.0)
    assert batch_room(AUTO, q, 70.0) == 5 + 6
    # They end: the reserve shrinks back over reserve_window_s (fall_s), not at once.
    for w in [one, *burst]:
        q.finished(w, 70.0)
        q.finished(w, 70.0)  # once per waiter: a second call does nothing
    assert batch_room(AUTO, q, 71.0) == 5 + 6
    assert batch_room(AUTO, q, 400.0) == 14 + 15


async def test_gate_counts_a_released_request_until_it_leaves_and_a_refused_one_never(
        ) -> None:
    now = [0.0]
    # reserve_fall_gaps null: no arrival noted for the class's gaps, so an entry for batch
    # can only come from counting it in service.
    cfg = TenantsConfig(reserve_window_s=60.0, reserve_fall_gaps=None)
    g = TenantGate(cfg, share=1, capacity=10, queued=lambda m: 0,
                   metrics=BalancerMetrics().enable_tenants(), clock=lambda: now[0],
                   wall=lambda: 0.0, slots=lambda m: [(16, 16, 0)])
    assert g.queue.occupancy.fall_s == 60.0  # forgets over reserve_window_s
    adm = g.admit("default", "interactive", "m", 10)
    assert await g.wait_turn(adm, 1.0)
    g.settle(adm)
    now[0] = 30.0
    assert g.queue.occupancy.mean("m", ["interactive"], 30.0) == pytest.approx(1.0)
    g.leave(adm, 20)
    g.leave(adm, 20)  # twice: counted once
    assert g.queue.occupancy._s[("m", "interactive")][0] == 0
    # A request that never got its turn (timed out in the queue) was never in service.
    g2 = TenantGate(cfg, share=1, capacity=10, queued=lambda m: 0,
                    metrics=BalancerMetrics().enable_tenants(), clock=lambda: now[0],
                    wall=lambda: 0.0, slots=lambda m: [(1, 16, 0)])
    late = g2.admit("default", "batch", "m", 10)
    g2.queue.arrived["interactive"] = 30.0  # a better class seen: the reserve holds
    assert not await g2.wait_turn(late, 0.0)
    g2.leave(late, 0)
    assert ("m", "batch") not in g2.queue.occupancy._s


def test_pacing_holds_only_while_better_requests_arrived_within_pace_s() -> None:
    """Pacing (one batch start at a time per replica) costs the batch class most, as its
    starts wait on a lagging probe: it stops reserve_window_s after the last better
    arrival, while the reserve's slot stays until reserve_idle_s."""
    r = Reserve(CLASSES, {}, idle_s=120.0, pace=1, adaptive=frozenset({"batch"}),
                pace_s=10.0)
    free = {"m": [(16, 16, 1), (16, 16, 0)]}.__getitem__  # one starting on the first
    q = FairQueue(CLASSES, capacity=1000, started=-1000.0)
    _interactive(q, 1, 0.0)
    for now, want in ((5.0, 1), (11.0, 15 + 15), (121.0, 40)):
        for _ in range(40):
            q.push(Waiter("m", "bulk", "batch", 10, now))
        got = release_into(q, none_queued, {}, 1000, now, reserve=r, slots=free)
        q.drain("m")
        assert len(got) == want, now
    assert r.paces("batch", {"interactive": 0.0}, 10.0)
    assert not r.paces("batch", {"interactive": 0.0}, 10.5)
    assert not r.paces("interactive", {"interactive": 0.0}, 1.0)  # nothing better
