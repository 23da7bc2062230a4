"""The slot reserve by load counting the slots the better classes hold
(``tenants.reserve_held``, skymesh.balancer.tenancy): ``reserve_headroom`` x their recent
mean in service is their part of the replicas, in service and free together, so the
free slots kept are that less those in service now, at least one per replica; without
it, that many slots stay free beside the ones they hold. Fake clocks throughout."""

from __future__ import annotations

from dataclasses import replace

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import FairQueue, Occupancy, Reserve, Waiter, release_into, reserve_of

CLASSES = ("interactive", "standard", "batch")
BESIDE = Reserve(CLASSES, {}, idle_s=1000.0, adaptive=frozenset({"batch"}), headroom=1.5)
HELD = replace(BESIDE, held=True)


def none_queued(model: str) -> int:
    return 0


def test_held_slots_count_toward_the_reserve() -> None:
    # 6 interactive requests in service on average on 2 replicas, headroom 1.5: their
    # part is 9 slots; all 6 in service now: 3 more free, 2 per replica (rounded up).
    assert BESIDE.slots("batch", 16, better=6.0, replicas=2, busy=6) == 5
    assert HELD.slots("batch", 16, better=6.0, replicas=2, busy=6) == 2
    # None in service now (they came and went): the whole part free.
    assert HELD.slots("batch", 16, better=6.0, replicas=2, busy=0) == 5
    # More in service than the part (a burst the mean has not caught up with): still
    # one slot per replica for the next.
    assert HELD.slots("batch", 16, better=2.0, replicas=2, busy=8) == 1
    # Never the last slot, and a fixed reserve or a class without one is unchanged.
    assert HELD.slots("batch", 4, better=40.0, replicas=2, busy=0) == 3
    assert HELD.slots("standard", 16, better=6.0, replicas=2, busy=6) == 0
    fixed = replace(HELD, fractions={"batch": 0.25}, adaptive=frozenset())
    assert fixed.slots("batch", 16, better=6.0, replicas=2, busy=6) == 4


def test_occupancy_counts_in_service_now_per_model_and_class() -> None:
    occ = Occupancy()
    for _ in range(3):
        occ.start("m", "interactive", 0.0)
    occ.start("m", "standard", 0.0)
    occ.start("other", "interactive", 0.0)
    occ.end("m", "interactive", 1.0)
    assert occ.now_in("m", ["interactive"]) == 2
    assert occ.now_in("m", ["interactive", "standard"]) == 3
    assert occ.now_in("m", ["batch"]) == 0
    assert occ.now_in("gone", ["interactive"]) == 0


def _batch_released(reserve: Reserve, busy: int, now: float) -> int:
    """Batch requests let go on 2 replicas of 16 with ``busy`` interactive requests in
    service (spread over them, as the dispatcher does) after 8 had been for a while."""
    q = FairQueue(CLASSES, capacity=1000, started=0.0)
    q.occupancy.fall_s = 30.0
    web = []
    for i in range(8):
        q.push(Waiter("m", "web", "interactive", 10, 0.0, payload=i))
        w = q.pop("m", 0.0)
        assert w is not None
        web.append(w)
    for w in web[busy:]:
        q.finished(w, now)
    free = {"m": [(16 - busy // 2, 16, 0), (16 - busy + busy // 2, 16, 0)]}.__getitem__
    for _ in range(40):
        q.push(Waiter("m", "bulk", "batch", 10, now))
    return len(release_into(q, none_queued, {}, 1000, now, reserve=reserve, slots=free))


def test_the_queue_gives_batch_the_slots_the_interactive_requests_hold() -> None:
    """8 interactive requests in service for a while (mean 8): beside them the reserve
    keeps 1.5 x 8 / 2 = 6 free on each replica; counting them, 12 slots are theirs, 8 held,
    so 2 free on each and batch gets 8 more slots. Once they end, the two rules agree."""
    assert _batch_released(BESIDE, 8, 100.0) == 2 * (12 - 6)
    assert _batch_released(HELD, 8, 100.0) == 2 * (12 - 2)
    assert _batch_released(BESIDE, 0, 100.0) == _batch_released(HELD, 0, 100.0) == 2 * (16 - 6)


def test_config_sets_held() -> None:
    assert reserve_of(TenantsConfig(reserve_held=True)).held
    assert not reserve_of(TenantsConfig()).held  # beside the held slots unless set
