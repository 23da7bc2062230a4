"""``tenants.reserve_fall_s``: how fast the adaptive slot reserve gives back the slots of a
falling better-class load (the fall of :class:`Occupancy`'s mean), apart from
``reserve_window_s`` (pacing's window and the arrival rates). Fake clocks throughout."""

from __future__ import annotations

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import FairQueue, Waiter, queue_of, release_into, reserve_of


def none_queued(model: str) -> int:
    return 0


def _batch_room(q: FairQueue, cfg: TenantsConfig, now: float) -> int:
    """Batch requests let out of ``q`` at ``now`` onto two empty replicas of 16 slots."""
    free = {"m": [(16, 16, 0), (16, 16, 0)]}.__getitem__
    for _ in range(40):
        q.push(Waiter("m", "bulk", "batch", 10, now))
    out = release_into(q, none_queued, {}, 1000, now, reserve=reserve_of(cfg), slots=free)
    q.drain("m")
    return len(out)


def _after_a_burst(cfg: TenantsConfig, since_end: float) -> int:
    """12 interactive requests in service for 20 s that all end at 20 s; the batch room
    ``since_end`` seconds later (pacing off: the reserve alone)."""
    q = queue_of(cfg, 1000, now=0.0)
    web = []
    for _ in range(12):
        q.push(Waiter("m", "web", "interactive", 10, 0.0))
        w = q.pop("m", 0.0)
        assert w is not None
        web.append(w)
    for w in web:
        q.finished(w, 20.0)
    return _batch_room(q, cfg, 20.0 + since_end)


def test_config_sets_the_fall_apart_from_the_window() -> None:
    q = queue_of(TenantsConfig(reserve_fall_s=1.5, reserve_window_s=10.0), 10)
    assert q.occupancy.fall_s == 1.5
    assert q.flow.tau_s == 10.0  # the arrival rates keep the window
    old = queue_of(TenantsConfig(reserve_window_s=7.0), 10)
    assert old.occupancy.fall_s == old.flow.tau_s == 7.0  # null: the window, as before
    with pytest.raises(ValueError):
        TenantsConfig(reserve_fall_s=0)


def test_a_short_fall_gives_the_slots_back_soon_after_the_load_ends() -> None:
    """Mean 12 in service at 20 s (x 1.5 over 2 replicas: 9 free kept on each). 5 s after
    they end, with the window's 10 s fall the mean is still 12 x e^-0.5 = 7.3 (6 free on
    each: 20 batch); with a 1.5 s fall it is 0.43 (1 free on each, the floor: 30 batch)."""
    # reserve_fall_gaps null: the 12 arrive at once, so their gaps would set the fall.
    paced_off = {"reserve_pace": 1 << 20, "reserve_fall_gaps": None}
    assert _after_a_burst(TenantsConfig(**paced_off), 0.0) == 2 * (16 - 9)
    assert _after_a_burst(TenantsConfig(**paced_off), 5.0) == 2 * (16 - 6)
    assert _after_a_burst(TenantsConfig(reserve_fall_s=1.5, **paced_off), 5.0) == 2 * 15
    # Still held while the load is there: the fall changes nothing before it ends.
    assert _after_a_burst(TenantsConfig(reserve_fall_s=1.5, **paced_off), 0.0) == 2 * 7
