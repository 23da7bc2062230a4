"""The live gate (skymesh.balancer.tenant_gate) leaves nothing behind: a waiter that times
out, a client that goes away while waiting, and one woken but never offered all give back
their place in the queue, among the woken, and in their tenant's concurrency."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.errors import NoHealthyReplica
from skymesh.balancer.metrics import BalancerMetrics
from skymesh.balancer.tenant_gate import TenantGate
from skymesh.balancer.tenant_limits import TenantLimited


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def gate(queued: dict[str, int]) -> TenantGate:
    cfg = TenantsConfig(fallback="t", members=[{"name": "t", "max_concurrency": 2}])
    return TenantGate(cfg, share=1, capacity=10, queued=lambda m: queued.get(m, 0),
                      metrics=BalancerMetrics().enable_tenants(), clock=Clock(),
                      wall=lambda: 0.0)


def empty(g: TenantGate) -> bool:
    return len(g.queue) == 0 and g.queue._q == {} and g.reserved == {} and \
        g.limiter.state["t"].in_flight == 0


async def test_passes_straight_through_when_the_dispatcher_queue_is_short() -> None:
    g = gate({})
    assert g.classify(None, {"X-SkyMesh-Priority": "batch"}, None) == ("t", "batch")
    adm = g.admit("t", "standard", "m", 10)
    assert await g.wait_turn(adm, 1.0)
    assert g.reserved == {"m": 1}
    g.settle(adm)
    g.leave(adm, 30)
    assert empty(g)
    assert g.queue.counters["t"] == 30  # prompt at release, output at the end


async def test_a_timeout_leaves_nothing_behind() -> None:
    g = gate({"m": 5})  # the dispatcher's queue is long: nothing is released
    adm = g.admit("t", "standard", "m", 10)
    assert not await g.wait_turn(adm, 0.01)
    g.leave(adm, 0)
    assert empty(g)


async def test_a_client_gone_while_waiting_leaves_nothing_behind() -> None:
    g = gate({"m": 5})
    adm = g.admit("t", "standard", "m", 10)
    task = asyncio.create_task(g.wait_turn(adm, 60.0))
    while not len(g.queue):
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    g.leave(adm, 0)
    assert empty(g)


async def test_woken_but_never_offered_gives_its_place_back() -> None:
    queued = {"m": 5}
    g = gate(queued)
    adm = g.admit("t", "standard", "m", 10)
    task = asyncio.create_task(g.wait_turn(adm, 60.0))
    while not len(g.queue):
        await asyncio.sleep(0)
    queued["m"] = 0
    g.release(0.0)  # the pump: woken, counted among the woken
    assert g.reserved == {"m": 1}
    task.cancel()  # the client leaves before the handler offers it
    with contextlib.suppress(asyncio.CancelledError):  # or it had already returned
        await task
    g.leave(adm, 0)
    g.leave(adm, 0)  # twice (a finally after an except): still once
    assert empty(g)


async def test_concurrency_limit_counts_until_leave() -> None:
    g = gate({})
    a, b = g.admit("t", "standard", "m", 1), g.admit("t", "standard", "m", 1)
    with pytest.raises(TenantLimited):
        g.admit("t", "standard", "m", 1)
    g.leave(a, 0)
    g.leave(b, 0)
    g.leave(g.admit("t", "standard", "m", 1), 0)
    assert empty(g)


async def test_waiters_for_a_model_nothing_serves_fail_at_once() -> None:
    g = gate({"m": 5})
    adm = g.admit("t", "standard", "m", 10)
    task = asyncio.create_task(g.wait_turn(adm, 60.0))
    while not len(g.queue):
        await asyncio.sleep(0)
    g.fail_stranded(lambda m: True, lambda m: NoHealthyReplica(m))
    assert len(g.queue) == 1  # still served somewhere: it waits
    g.fail_stranded(lambda m: m != "m", lambda m: NoHealthyReplica(m))
    with pytest.raises(NoHealthyReplica):
        await task
    g.leave(adm, 0)
    assert empty(g)


async def test_waiters_failed_at_once_are_named_in_the_log_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """As the dispatcher's queue does (overload.stranded_line): how many, which, why."""
    g = gate({"m": 5})
    adms = [g.admit("t", "standard", "m", 1, "req-a"), g.admit("t", "standard", "m", 1, "req-b")]
    tasks = [asyncio.create_task(g.wait_turn(a, 60.0)) for a in adms]
    while len(g.queue) < 2:
        await asyncio.sleep(0)
    with caplog.at_level("WARNING", logger="skymesh.balancer.tenant_gate"):
        g.fail_stranded(lambda m: True, lambda m: NoHealthyReplica(f"{m} is down"))
        assert caplog.records == []  # still served somewhere: nobody failed, no line
        g.fail_stranded(lambda m: False, lambda m: NoHealthyReplica(f"{m} is down"))
    for task in tasks:
        with pytest.raises(NoHealthyReplica):
            await task
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["2 queued request(s) for model 'm' ended at once with 503 "
                     "no_healthy_replica (request ids req-a, req-b): m is down"]
    for a in adms:
        g.leave(a, 0)
    assert empty(g)
