"""The slot reserve of skymesh.balancer.tenancy (``tenants.reserve``): a lower class takes
a replica's free slot only while slots stay free for the better classes. Fake clocks."""

from __future__ import annotations

import asyncio
import logging

import pytest

from skymesh.balancer.config import TenantsConfig, parse_config
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.tenancy import FairQueue, Reserve, Waiter, release_into, reserve_of
from skymesh.balancer.tenant_gate import TenantGate
from skymesh.common.config import ConfigError
from skymesh.policies import build_policy
from skymesh.policies.base import RouteRequest
from skymesh.policies.load import PushMode

CLASSES = ("interactive", "standard", "batch")
RESERVE = Reserve(CLASSES, {"batch": 0.25}, idle_s=30.0)


def w(cls: str, since: float = 0.0, tenant: str = "t") -> Waiter:
    return Waiter("m", tenant, cls, 100, since)


def none_queued(model: str) -> int:
    return 0


def test_reserve_counts_a_fraction_of_each_replicas_slots_rounded_up() -> None:
    assert RESERVE.slots("batch", 8) == 2
    assert RESERVE.slots("batch", 5) == 2  # 1.25 -> 2: a fraction is a whole slot kept
    assert RESERVE.slots("batch", 1) == 0  # never the last slot: batch is not starved
    assert RESERVE.slots("batch", 2) == 1
    assert RESERVE.slots("interactive", 8) == 0 and RESERVE.slots("standard", 8) == 0
    # Free slots beyond it, per replica: (3, 8) gives 1, (2, 8) and (0, 8) none.
    assert RESERVE.room("batch", [(3, 8, 0), (2, 8, 0), (0, 8, 0)]) == 1


def test_pace_lets_a_reserved_class_start_only_so_many_at_once_per_replica() -> None:
    paced = Reserve(CLASSES, {"batch": 0.25}, idle_s=30.0, pace=1)
    # (free, slots, not started): 6 beyond the reserve on each, but one at a time.
    assert paced.room("batch", [(8, 8, 0), (8, 8, 0)]) == 2
    assert paced.room("batch", [(8, 8, 1), (8, 8, 0)]) == 1  # one still starting there
    assert paced.room("batch", [(8, 8, 3), (2, 8, 0)]) == 0
    assert RESERVE.room("batch", [(8, 8, 3)]) == 6  # no pace: the slots alone


def test_reserve_holds_the_lower_class_while_better_ones_arrive_and_lapses_after() -> None:
    q = FairQueue(CLASSES, capacity=1000)
    for _ in range(10):
        q.push(w("batch"))
    q.push(w("interactive", since=0.0))
    free = {"m": [(4, 8, 0), (3, 8, 0)]}  # beyond the reserve of 2 each: 2 + 1
    held: set[str] = set()
    out = release_into(q, none_queued, {}, 100, 1.0, reserve=RESERVE,
                       slots=free.__getitem__, held_out=held)
    # The interactive request first, then batch only into the 3 slots beyond the reserve,
    # counting the interactive one among those pending.
    assert [x.cls for x in out] == ["interactive", "batch", "batch"]
    assert held == {"batch"}
    # Still held while the slots stay taken, within idle_s of the interactive arrival.
    assert release_into(q, none_queued, {}, 100, 30.0, reserve=RESERVE,
                        slots={"m": [(2, 8, 0), (2, 8, 0)]}.__getitem__) == []
    # No better request for idle_s: the reserve lapses and batch fills every free slot.
    out = release_into(q, none_queued, {}, 100, 31.0, reserve=RESERVE,
                       slots={"m": [(2, 8, 0), (2, 8, 0)]}.__getitem__)
    assert [x.cls for x in out] == ["batch"] * 8


def test_reserve_counts_the_dispatcher_queue_and_the_woken_as_pending() -> None:
    q = FairQueue(CLASSES, capacity=1000)
    q.push(w("interactive", since=0.0))
    q.pop("m", 0.0)
    for _ in range(5):
        q.push(w("batch", since=1.0))
    slots = {"m": [(5, 8, 0)]}.__getitem__  # 3 beyond the reserve
    out = release_into(q, lambda m: 1, {"m": 1}, 100, 1.0, reserve=RESERVE, slots=slots)
    assert len(out) == 1  # 3 less the queued one and the woken one


def test_without_known_slots_the_reserve_holds_nothing() -> None:
    q = FairQueue(CLASSES, capacity=1000)
    q.push(w("interactive"))
    for _ in range(3):
        q.push(w("batch"))
    out = release_into(q, none_queued, {}, 100, 1.0, reserve=RESERVE, slots=lambda m: [])
    assert len(out) == 4


def test_a_held_class_does_not_block_the_better_ones_or_the_aging_guard_order() -> None:
    q = FairQueue(CLASSES, max_wait_s={"batch": 5.0}, capacity=1000)
    q.push(w("batch", since=0.0))
    q.push(w("standard", since=1.0))
    # The batch head is past its bound, but held by the reserve: standard goes instead.
    out = release_into(q, none_queued, {}, 100, 10.0, reserve=RESERVE,
                       slots={"m": [(2, 8, 0)]}.__getitem__)
    assert [x.cls for x in out] == ["standard"]
    assert q.has("m", "batch")


# -- the dispatcher's slots, and the rule with a real dispatcher ---------------------------


def test_dispatcher_slots_are_sp_p_max_num_seqs_or_sp_o_max_outstanding() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_P)
    d.set_targets({"a": ["m"], "b": ["m"], "c": ["other"]})
    assert d.slots("m") == []  # max_num_seqs unknown
    d.on_probe("a", 0.0, 0, 3, 0.1, max_num_seqs=8)
    assert d.slots("m") == [(5, 8, 0)]
    d.on_probe("a", 1.0, 2, 3, 0.1)  # two wait to start inside the engine
    assert d.slots("m") == [(3, 8, 2)]
    d.set_healthy("a", False)
    assert d.slots("m") == []
    o = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=4)
    o.set_targets({"a": ["m"]})
    assert o.slots("m") == [(4, 4, 0)]
    assert Dispatcher(build_policy("least-load"), PushMode.BP).slots("m") == []


def _flood(reserve: Reserve | None) -> tuple[Dispatcher, FairQueue, list[Ticket]]:
    """Two replicas of 4 slots (sp-o), an interactive request at t=0 and done, then 20
    batch requests released and dispatched at t=1."""
    d = Dispatcher(build_policy("least-load"), PushMode.SP_O, max_outstanding=4)
    d.set_targets({"a": ["m"], "b": ["m"]})
    q = FairQueue(CLASSES, capacity=1000)
    sent: list[Ticket] = []

    def step(now: float) -> None:
        for x in release_into(q, d.queue_length, {}, 2, now, reserve=reserve,
                              slots=d.slots):
            d.offer(x.payload, now)
        sent.extend(d.pump(now))

    first = Ticket(RouteRequest("i0", model="m"), 0.0)
    q.push(Waiter("m", "web", "interactive", 10, 0.0, first))
    step(0.0)
    d.complete(first, 0.5, ok=True)
    for i in range(20):
        q.push(Waiter("m", "bulk", "batch", 10, 1.0, Ticket(RouteRequest(f"b{i}", model="m"),
                                                             1.0)))
        step(1.0)
    late = Ticket(RouteRequest("i1", model="m"), 2.0)
    q.push(Waiter("m", "web", "interactive", 10, 2.0, late))
    step(2.0)
    return d, q, sent


def test_with_the_reserve_an_interactive_request_starts_beside_a_batch_flood() -> None:
    _, q, sent = _flood(RESERVE)
    assert sent[-1].route.request_id == "i1"  # dispatched at once, no batch finished
    assert sum(t.route.request_id.startswith("b") for t in sent) == 6  # 8 less 1 each
    assert q.has("m", "batch")


def test_without_the_reserve_the_batch_flood_takes_every_slot() -> None:
    _, _, sent = _flood(None)
    assert sum(t.route.request_id.startswith("b") for t in sent) == 8
    assert "i1" not in {t.route.request_id for t in sent}


# -- configuration -----------------------------------------------------------------------


def test_default_reserve_is_for_the_last_class() -> None:
    cfg = parse_config({"tenants": {}}).tenants
    assert cfg is not None
    r = reserve_of(cfg)
    # Adaptive by default (the better classes' load x 1.5), fixed fractions when given.
    assert r.fractions == {} and r.adaptive == {"batch"} and r.headroom == 1.5
    assert r.idle_s == 120.0
    two = parse_config({"tenants": {"classes": ["hi", "lo"], "default_class": "lo",
                                    "max_wait_s": {}}}).tenants
    assert two is not None and reserve_of(two).adaptive == {"lo"}
    one = parse_config({"tenants": {"classes": ["all"], "default_class": "all",
                                    "max_wait_s": {}}}).tenants
    assert one is not None and reserve_of(one).fractions == {}
    assert not reserve_of(one).adaptive
    off = parse_config({"tenants": {"reserve": {}}}).tenants
    assert off is not None and reserve_of(off).fractions == {} and not reserve_of(off).adaptive
    fixed = parse_config({"tenants": {"reserve": {"batch": 0.25, "standard": "auto"},
                                      "reserve_headroom": 2}}).tenants
    assert fixed is not None
    rf = reserve_of(fixed)
    assert rf.fractions == {"batch": 0.25} and rf.adaptive == {"standard"}
    assert rf.headroom == 2.0


@pytest.mark.parametrize(("reserve", "match"), [
    ({"gold": 0.2}, "tenants.reserve"),
    ({"batch": 1.0}, "fractions"),
    ({"batch": -0.1}, "fractions"),
    ({"interactive": 0.2}, "best class"),
    ({"interactive": "auto"}, "best class"),
    ({"batch": "some"}, "reserve"),
])
def test_bad_reserve_names_the_culprit(reserve: dict[str, float | str], match: str) -> None:
    with pytest.raises((ConfigError, ValueError), match=match):
        parse_config({"tenants": {"reserve": reserve}})


# -- the live gate: counted, logged once a minute -------------------------------------------


async def test_gate_holds_batch_by_the_reserve_counts_it_and_logs_once_a_minute(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    metrics = BalancerMetrics().enable_tenants()
    slots = {"m": [(1, 4, 0)]}  # one free slot of 4: the reserve of 0.25 keeps it
    g = TenantGate(TenantsConfig(reserve_idle_s=120), share=1, capacity=10,
                   queued=lambda m: 0, metrics=metrics, clock=lambda: now[0],
                   wall=lambda: 0.0, slots=slots.__getitem__)
    caplog.set_level(logging.WARNING, "skymesh.balancer.tenant_gate")
    adm = g.admit("default", "batch", "m", 10)
    # A balancer that just started keeps the reserve: the batch request waits.
    waiting = asyncio.create_task(g.wait_turn(adm, 60.0))
    await asyncio.sleep(0)
    assert not waiting.done() and g.queue.has("m", "batch")
    g.release(101.0)
    assert metrics.reserve_held.labels("batch")._value.get() == 2
    assert caplog.text.count("slot reserve: holding class batch") == 1
    g.release(161.0)
    assert caplog.text.count("slot reserve: holding class batch") == 2  # a minute on
    # No better class for reserve_idle_s: the reserve lapses and batch takes the slot.
    g.release(221.0)
    assert await waiting
    assert metrics.reserve_held.labels("batch")._value.get() == 3
    g.settle(adm)
    g.leave(adm, 0)


# -- the aging guard under a long flood ------------------------------------------------------


def test_aging_counts_from_the_last_service_so_a_long_flood_does_not_outrank_all() -> None:
    """A batch backlog older than its bound, served recently: an interactive request that
    arrives goes first. (Counting from the oldest waiter's arrival, the flood's head was
    overdue for as long as the flood lasted, and batch outranked interactive: a batch
    flood older than 60 s starved the interactive tenant behind the whole backlog.)"""
    q = FairQueue(CLASSES, max_wait_s={"batch": 60.0}, capacity=1000)
    for _ in range(200):
        q.push(w("batch", since=0.0))
    for now in range(61, 100):  # batch overdue: served first, once a second
        assert q.pop("m", float(now)).cls == "batch"  # type: ignore[union-attr]
    q.push(w("interactive", since=100.0))
    assert q.pop("m", 100.0).cls == "interactive"  # type: ignore[union-attr]
    # Batch goes unserved again only up to its bound.
    for _ in range(50):
        q.push(w("interactive", since=100.0))
    assert q.pop("m", 158.0).cls == "interactive"  # type: ignore[union-attr]
    assert q.pop("m", 159.0).cls == "batch"  # type: ignore[union-attr]  # 60 s since 99
