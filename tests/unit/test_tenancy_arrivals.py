"""The slot reserve sized by arrivals (``tenants.reserve_miss``, skymesh.balancer.tenancy):
an ``auto`` reserve keeps the fewest slots free that leave at most ``reserve_miss`` of the
better requests finding none, from their arrival rate against the rate slots free up by
themselves (:class:`Flow`, :func:`buffer_slots`), instead of ``reserve_headroom`` x
their mean in service. Fake clocks throughout."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import (
    FairQueue,
    Flow,
    Reserve,
    Waiter,
    buffer_slots,
    queue_of,
    release_into,
    reserve_of,
)

CLASSES = ("interactive", "standard", "batch")
BY_LOAD = Reserve(CLASSES, {}, idle_s=1000.0, adaptive=frozenset({"batch"}), headroom=1.5)
BY_ARRIVALS = Reserve(CLASSES, {}, idle_s=1000.0, adaptive=frozenset({"batch"}),
                      headroom=1.5, miss=0.01)


def none_queued(model: str) -> int:
    return 0


def _p_empty(rho: float, k: int) -> float:
    """The buffer's chance of being empty at an arrival, summed from its chain's
    stationary weights rho^d (d: slots missing), independent of buffer_slots' formula."""
    weights = [rho ** d for d in range(k + 1)]
    return weights[-1] / sum(weights)


@pytest.mark.parametrize(("rho", "miss", "want"), [
    (0.5, 0.05, 4),   # 1/3, 1/7, 1/15, 1/31: the fourth is the first within 5%
    (1.0, 0.1, 9),    # 1 / (k + 1)
    (0.0, 0.01, 1),   # no better arrivals: the one slot kept while the reserve holds
    (0.01, 0.05, 1),
    (3.0, 0.05, 16),  # arrivals outrun the ends: every slot (slots() keeps the last)
])
def test_buffer_slots_is_the_fewest_within_the_miss(rho: float, miss: float,
                                                    want: int) -> None:
    assert buffer_slots(rho, miss, 16) == want


@given(st.floats(0.0, 5.0), st.floats(0.001, 0.5), st.integers(1, 64))
def test_buffer_slots_meets_the_miss_with_the_fewest_slots(rho: float, miss: float,
                                                           cap: int) -> None:
    k = buffer_slots(rho, miss, cap)
    assert 1 <= k <= cap
    if k < cap:
        assert _p_empty(rho, k) <= miss + 1e-9
    if k > 1:
        assert _p_empty(rho, k - 1) > miss - 1e-9  # one fewer would miss more often
    # More better traffic for the same ends never keeps fewer slots.
    assert buffer_slots(rho * 1.5 + 0.01, miss, cap) >= k


def test_flow_reads_a_steady_rate_from_the_start_and_forgets_a_stop() -> None:
    f = Flow(tau_s=10.0)
    assert f.rate("m", "interactive", 0.0) is None
    assert f.ratio("m", ["interactive"], 0.0) is None
    # 2 arrivals/s from t = 0; ends at 4/s from t = 1 (all classes together).
    for i in range(120):
        f.arrived("m", "interactive", i * 0.5)
    for i in range(4, 240):
        f.ended("m", i * 0.25)
    # Corrected for how long the model has been seen: right after the start, not a
    # tenth of it (a plain decayed count over 10 s would read ~0.2/s at 1 s).
    g = Flow(tau_s=10.0)
    for i in range(3):
        g.arrived("m", "interactive", i * 0.5)
    assert g.rate("m", "interactive", 1.4) == pytest.approx(2.0, rel=0.2)
    at_60 = f.rate("m", "interactive", 60.0)
    assert at_60 == pytest.approx(2.0, rel=0.05)
    assert f.rate("m", None, 60.0) == pytest.approx(4.0, rel=0.05)
    assert f.ratio("m", ["interactive", "standard"], 60.0) == pytest.approx(0.5, rel=0.05)
    assert f.rate("other", "interactive", 60.0) is None  # models apart
    # They stop: the rate falls over tau_s.
    assert f.rate("m", "interactive", 100.0) == pytest.approx(at_60 * math.exp(-4), rel=0.05)
    # Long quiet, both rates are forgotten, and the model with them: memory stays bounded.
    assert f.rate("m", "interactive", 200.0) is None
    assert f.ratio("m", ["interactive"], 200.0) is None
    assert not f._r and not f._seen


def test_slots_pool_the_replicas_and_fall_back_to_the_load_rule() -> None:
    # rho 0.5 and miss 1% on two replicas: one buffer of 6 slots (0.5^6 x 0.5 / (1 -
    # 0.5^7) < 1%, 5 is not), so 3 on each; alone, a replica would keep 6.
    assert buffer_slots(0.5, 0.01, 32) == 6
    assert BY_ARRIVALS.slots("batch", 16, better=6.0, replicas=2, rho=0.5) == 3
    assert BY_ARRIVALS.slots("batch", 16, better=6.0, replicas=1, rho=0.5) == 6
    assert BY_ARRIVALS.slots("batch", 4, better=0.0, replicas=1, rho=5.0) == 3  # not the last
    # No end seen yet (rho None): reserve_headroom's rule, as without reserve_miss.
    assert BY_ARRIVALS.slots("batch", 16, better=6.0, replicas=2) == \
        BY_LOAD.slots("batch", 16, better=6.0, replicas=2) == 5
    assert BY_ARRIVALS.slots("standard", 16, better=6.0, replicas=2, rho=0.5) == 0
    assert BY_ARRIVALS.room("batch", [(8, 16, 0), (3, 16, 0)], better=2.0, rho=0.5) == 5


def _run(reserve: Reserve, interactive_s: float, batch_s: float) -> int:
    """Two replicas of 16, 1 interactive request/s per replica arriving for 60 s (each in
    service ``interactive_s``), the batch requests ending every ``batch_s`` / 14 s per
    replica; then a batch backlog: how many the reserve lets in onto replicas with 12
    free slots each."""
    q = FairQueue(CLASSES, capacity=10_000, started=0.0)
    q.occupancy.fall_s = q.flow.tau_s = 10.0
    running: list[tuple[float, Waiter]] = []
    t = 0.0
    batch_every = batch_s / 14 / 2
    next_batch = 0.0
    while t < 60.0:
        q.push(Waiter("m", "web", "interactive", 10, t))
        w = q.pop("m", t)
        assert w is not None
        running.append((t + interactive_s, w))
        while next_batch <= t:
            q.push(Waiter("m", "bulk", "batch", 10, next_batch))
            b = q.pop("m", next_batch)
            assert b is not None
            q.finished(b, next_batch + 1e-6)  # a batch request's slot freed
            next_batch += batch_every
        for end, done in [x for x in running if x[0] <= t]:
            q.finished(done, end)
            running.remove((end, done))
        t += 0.5
    for _ in range(40):
        q.push(Waiter("m", "bulk", "batch", 10, t))
    return len(release_into(q, none_queued, {}, 1000, t, reserve=reserve,
                            slots={"m": [(12, 16, 0), (12, 16, 0)]}.__getitem__))


def test_long_better_requests_on_fast_turning_slots_keep_fewer_slots_free() -> None:
    """Interactive requests 4 s in service (4 per replica on average) while the batch
    ones end every 6 s: by load the reserve keeps 1.5 x 4 = 6 slots free on each; by
    arrivals it needs only enough for the interactive requests that arrive before a slot
    frees by itself (rho = 1 / (14/6 + 1) = 0.3: 4 pooled, 2 on each), so the batch
    class gets the idle slots."""
    by_load = _run(BY_LOAD, interactive_s=4.0, batch_s=6.0)
    by_arrivals = _run(BY_ARRIVALS, interactive_s=4.0, batch_s=6.0)
    assert by_load == 2 * (12 - 6)
    assert by_arrivals == 2 * (12 - 2)


def test_short_better_requests_on_slow_turning_slots_keep_more_free() -> None:
    """Interactive requests short (0.5 s in service) while the batch ones take a minute:
    by load the reserve keeps its one slot, though a second interactive request arriving
    within the half minute before a batch slot frees would find none; by arrivals it
    keeps enough for them."""
    by_load = _run(BY_LOAD, interactive_s=0.5, batch_s=60.0)
    by_arrivals = _run(BY_ARRIVALS, interactive_s=0.5, batch_s=60.0)
    assert by_load == 2 * (12 - 1)
    assert by_arrivals < by_load - 4


def test_the_queue_counts_arrivals_and_each_end_once() -> None:
    q = FairQueue(CLASSES, capacity=100, started=0.0)
    w = Waiter("m", "web", "interactive", 10, 0.0)
    q.push(w)
    assert q.flow.rate("m", "interactive", 0.0) is not None
    q.finished(w, 1.0)  # never released: not an end
    assert q.flow.rate("m", None, 1.0) is None
    popped = q.pop("m", 0.5)
    assert popped is w
    q.finished(w, 1.0)
    q.finished(w, 1.0)  # once per waiter
    ends = q.flow.rate("m", None, 1.0)
    assert ends is not None and ends == pytest.approx(1 / (10 * -math.expm1(-0.1)))


def test_config_sets_the_miss_and_the_window() -> None:
    cfg = TenantsConfig(reserve_miss=0.02, reserve_window_s=30.0)
    assert reserve_of(cfg).miss == 0.02
    assert queue_of(cfg, 100).flow.tau_s == 30.0
    assert reserve_of(TenantsConfig()).miss is None  # by load unless set
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(ValidationError, match="reserve_miss"):
            TenantsConfig(reserve_miss=bad)
