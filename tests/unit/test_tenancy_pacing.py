"""The slot reserve's pacing (``tenants.reserve_pace``) for requests the probe cannot
show yet: a request that is not streamed gives the balancer no first byte, and the probe
shows it started only after the engine's metrics lag (about a second), so counting it as
not started until then let one batch request start per replica per second. It now counts
as not started only for a few of the engine's steps after its release (``Starts``: the
step as the balancer sees it, from finished requests). Fake clocks throughout."""

from __future__ import annotations

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.tenancy import FairQueue, Reserve, Starts, Waiter, release_into
from skymesh.balancer.tenant_gate import TenantGate

CLASSES = ("interactive", "standard", "batch")
PACED = Reserve(CLASSES, {}, idle_s=120.0, pace=1, adaptive=frozenset({"batch"}),
                pace_s=10.0)


def none_queued(model: str) -> int:
    return 0


def test_starts_learns_the_step_from_finished_requests() -> None:
    s = Starts(alpha=0.5, steps=4.0, keep=3)
    assert s.unstarted("m", CLASSES, 0.0) is None  # no step known: the probe's count
    s.released("m", "batch", 0.0)
    s.finished("m", 0.0, 200, 8.0)  # 8 s for 200 tokens: 40 ms a step
    assert s.step_s["m"] == pytest.approx(0.04)
    s.finished("m", 0.0, 100, 2.0)  # 20 ms: the mean moves halfway
    assert s.step_s["m"] == pytest.approx(0.03)
    s.finished("m", 5.0, 0, 9.0)  # no output (refused, cancelled): nothing learnt
    assert s.step_s["m"] == pytest.approx(0.03)
    # Releases within 4 steps (0.12 s) count, of the classes asked for.
    for t in (10.0, 10.05, 10.1):
        s.released("m", "batch", t)
    s.released("m", "interactive", 10.1)
    assert s.unstarted("m", ["batch"], 10.15) == 2
    assert s.unstarted("m", CLASSES, 10.15) == 3
    assert s.unstarted("m", CLASSES, 11.0) == 0
    assert s.unstarted("other", CLASSES, 11.0) is None
    for t in range(10):  # bounded: at most keep per model and class
        s.released("m", "batch", 20.0 + t * 1e-3)
    assert len(s._at[("m", "batch")]) == 3


def _finish_one(q: FairQueue, now: float) -> None:
    """A batch request released at ``now`` - 8 s that generated 200 tokens: 40 ms a step."""
    q.push(Waiter("m", "bulk", "batch", 10, now - 8.0))
    w = q.pop("m", now - 8.0)
    assert w is not None
    q.finished(w, now, 200)


def _batch_released(q: FairQueue, now: float, free: list[tuple[int, int, int]],
                    reserve: Reserve = PACED) -> int:
    for _ in range(40):
        q.push(Waiter("m", "bulk", "batch", 10, now))
    got = release_into(q, none_queued, {}, 1000, now, reserve=reserve,
                       slots={"m": free}.__getitem__)
    q.drain("m")
    return len(got)


def test_a_lagging_probe_does_not_hold_pacing_past_the_engines_steps() -> None:
    """Two replicas of 16, each with one request of ours the probe cannot show yet (not
    streamed, dispatched within the metrics lag). Released a second ago, they have
    started long since: pacing lets the next ones go (one per replica at a time); just
    released, they still count and pacing holds."""
    q = FairQueue(CLASSES, capacity=1000, started=0.0)
    q.arrived["interactive"] = 99.0  # a better request just now: reserve and pacing hold
    _finish_one(q, 99.0)
    lagging = [(15, 16, 1), (15, 16, 1)]
    assert _batch_released(q, 100.0, lagging) == 2
    # Those two just went: within the engine's next steps they count, so nothing more.
    assert _batch_released(q, 100.05, lagging) == 0
    # Five steps on (40 ms each) they still may be queued inside the engine: counted for
    # eight steps (four let a burst after a lull delay the better requests, simulator).
    assert _batch_released(q, 100.2, lagging) == 0
    assert _batch_released(q, 101.0, lagging) == 2
    # The probe's count, when no higher, is taken as it is, per replica: the two just
    # released may be the one it shows on the first and one on the second that started.
    assert _batch_released(q, 101.05, [(15, 16, 1), (15, 16, 0)]) == 1
    # No step time known yet (nothing finished): the probe's count, as before.
    q2 = FairQueue(CLASSES, capacity=1000, started=0.0)
    q2.arrived["interactive"] = 99.0
    assert _batch_released(q2, 100.0, lagging) == 0


def test_pacing_still_bounds_a_burst_and_the_reserve_still_holds() -> None:
    q = FairQueue(CLASSES, capacity=1000, started=0.0)
    q.arrived["interactive"] = 99.0
    _finish_one(q, 99.0)
    # Replicas free, nothing pending: one each (pace 1), not 14 each.
    assert _batch_released(q, 100.0, [(16, 16, 0), (16, 16, 0)]) == 2
    # Unpaced (no better request within pace_s), the free slots beyond the reserve (one
    # each) go at once, whatever the probe shows pending.
    q.arrived["interactive"] = 80.0
    assert _batch_released(q, 100.0, [(16, 16, 3), (4, 16, 3)]) == 15 + 3


async def test_the_gate_learns_the_step_from_requests_that_leave() -> None:
    now = [0.0]
    g = TenantGate(TenantsConfig(), share=1, capacity=10, queued=lambda m: 0,
                   metrics=BalancerMetrics().enable_tenants(), clock=lambda: now[0],
                   wall=lambda: 0.0, slots=lambda m: [(16, 16, 0)])
    adm = g.admit("default", "batch", "m", 400)
    assert await g.wait_turn(adm, 1.0)
    g.settle(adm)
    now[0] = 8.0
    g.leave(adm, 400 + 200)  # prompt + output tokens: 200 generated in 8 s
    assert g.queue.starts.step_s["m"] == pytest.approx(0.04)
