"""``tenants.reserve_pace: 0``: while a better request arrived within
``reserve_window_s``, no request of the reserved class is released (it runs only in the
better classes' lulls), except that the aging guard still bounds its wait: a class
unserved for ``max_wait_s`` is paced as at 1 (one per replica). The frontier's
far end (docs/results/tenancy-frontier.md). Fake clocks throughout."""

from __future__ import annotations

from dataclasses import replace

import pytest
from pydantic import ValidationError

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.tenancy import FairQueue, Reserve, Waiter, release_into, reserve_of

CLASSES = ("interactive", "standard", "batch")
PACE0 = Reserve(CLASSES, {}, idle_s=120.0, pace=0, adaptive=frozenset({"batch"}),
                pace_s=5.0)
FREE = [(16, 16, 0), (16, 16, 0)]


def _released(q: FairQueue, now: float, reserve: Reserve = PACE0) -> list[Waiter]:
    return release_into(q, lambda m: 0, {}, 1000, now, reserve=reserve,
                        slots={"m": FREE}.__getitem__)


def test_the_config_takes_pace_0_and_still_refuses_a_negative_one() -> None:
    cfg = TenantsConfig(reserve={"batch": "auto"}, reserve_pace=0, reserve_window_s=5.0)
    assert reserve_of(cfg).pace == 0
    with pytest.raises(ValidationError):
        TenantsConfig(reserve_pace=-1)


def test_pace_0_holds_the_batch_class_while_a_better_request_arrived_in_the_window() -> None:
    q = FairQueue(CLASSES, max_wait_s={"batch": 60.0}, capacity=1000, started=0.0)
    for _ in range(20):
        q.push(Waiter("m", "bulk", "batch", 400, 0.0))
    q.push(Waiter("m", "web", "interactive", 200, 10.0))
    got = _released(q, 10.0)
    assert [w.cls for w in got] == ["interactive"]  # the batch class: none
    assert _released(q, 14.9) == []  # still within the 5 s window
    # Past the window (no better request since 10 s), the free slots beyond the reserve
    # go: 15 of each replica's 16, less the interactive one's share (one slot each).
    late = _released(q, 15.1)
    assert {w.cls for w in late} == {"batch"} and len(late) == 20
    # With pace 1 the same moment in the window releases one per replica.
    q1 = FairQueue(CLASSES, max_wait_s={"batch": 60.0}, capacity=1000, started=0.0)
    for _ in range(4):
        q1.push(Waiter("m", "bulk", "batch", 400, 0.0))
    q1.arrived["interactive"] = 10.0
    assert len(_released(q1, 12.0, replace(PACE0, pace=1))) == 2


def test_the_aging_guard_still_bounds_the_wait_under_pace_0() -> None:
    """A better class that never pauses: the batch class is overdue after max_wait_s
    (60 s) and goes as at pace 1 (one per replica, two here), then the bound counts from
    that release again."""
    q = FairQueue(CLASSES, max_wait_s={"batch": 60.0}, capacity=1000, started=0.0)
    for _ in range(5):
        q.push(Waiter("m", "bulk", "batch", 400, 0.0))
    released: list[float] = []
    t = 0.0
    while t <= 130.0:
        q.arrived["interactive"] = t  # a better request every second
        released += [t for w in _released(q, t) if w.cls == "batch"]
        t += 1.0
    assert released == [60.0, 60.0, 120.0, 120.0]
    assert not q.overdue("m", "batch", 121.0) and q.overdue("m", "batch", 180.0)
    assert not q.overdue("m", "standard", 180.0)  # nothing of it waits
