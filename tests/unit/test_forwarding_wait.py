"""``Forwarder.wait_dispatch``: a queued request's wait for its dispatch, against a real
Dispatcher driven as the balancer's pump drives it (one timer per wait, no wait_for)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, cast

import pytest

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import NoCapacity
from skymesh.balancer.forwarding import Forwarder
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode

RETRY_AFTER_S = 7.0
LONG_S = 3600.0  # a queue timeout that never comes within a test
HANG_S = 30.0  # far beyond any timeout below: only a wait that never ends reaches it


class Core:
    """What ``wait_dispatch`` uses of ``RequestCore``: its dispatcher, its loop, and a
    pump that resolves dispatched tickets' futures as ``Balancer._pump`` does."""

    def __init__(self) -> None:
        self.dispatcher = Dispatcher(build_policy("round-robin"), PushMode.BP)
        self.dispatcher.set_targets({})  # nothing up: every request waits in the queue

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return asyncio.get_running_loop()

    def pump(self) -> None:
        for t in self.dispatcher.pump(0.0):
            fut: asyncio.Future[None] = t.payload
            if not fut.done():
                fut.set_result(None)


def forwarder(core: Core, failfast: dict[str, Ticket]) -> Forwarder:
    none = cast(Any, None)
    return Forwarder(cast(Any, core), none, none, none, None, none, none, failfast,
                     lambda model: RETRY_AFTER_S)


def queued(core: Core) -> Ticket:
    t = Ticket(RouteRequest("r1", model="m"), 0.0)
    core.dispatcher.offer(t, 0.0)
    return t


async def test_a_queue_timeout_is_a_503_with_the_queues_retry_after() -> None:
    core, failfast = Core(), {}
    t = queued(core)
    with pytest.raises(NoCapacity) as exc:
        await forwarder(core, failfast).wait_dispatch(t, 0.01)
    assert exc.value.status == 503 and exc.value.retry_after_s == RETRY_AFTER_S
    assert core.dispatcher.queue_length() == 0 and not t.queued
    assert failfast == {}


async def test_a_dispatch_before_the_timeout_gives_the_target_and_disarms_the_timer() -> None:
    core, failfast = Core(), {}
    t = queued(core)
    wait = asyncio.create_task(forwarder(core, failfast).wait_dispatch(t, LONG_S))
    await asyncio.sleep(0)  # the wait is parked on its future
    assert failfast == {t.key: t}
    loop = asyncio.get_running_loop()
    core.dispatcher.set_targets({"a": ["m"]})
    core.pump()
    assert await wait == "a"
    assert failfast == {}
    # The timer was cancelled with the dispatch (asyncio keeps cancelled handles in its
    # heap until it prunes them): no live queue timeout is left behind.
    live = [h for h in getattr(loop, "_scheduled", []) if not h.cancelled()
            and h.when() >= loop.time() + LONG_S / 2]
    assert live == []


async def test_a_client_that_leaves_is_not_answered_later_and_leaves_the_queue_clean(
) -> None:
    core, failfast = Core(), {}
    t = queued(core)
    wait = asyncio.create_task(forwarder(core, failfast).wait_dispatch(t, LONG_S))
    await asyncio.sleep(0)
    wait.cancel()  # the client went away while queued
    with pytest.raises(asyncio.CancelledError):
        await wait
    assert failfast == {}
    # What the request handler's ``finally`` does: the ticket leaves the queue.
    assert core.dispatcher.cancel(t) and core.dispatcher.queue_length() == 0
    core.dispatcher.set_targets({"a": ["m"]})
    core.pump()  # a pump after the client left dispatches nothing and raises nothing
    assert t.target is None


async def test_a_timeout_that_races_a_dispatch_goes_on_to_the_target() -> None:
    core, failfast = Core(), {}
    t = queued(core)
    fwd = forwarder(core, failfast)
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    t.payload = fut
    core.dispatcher.set_targets({"a": ["m"]})
    assert core.dispatcher.pump(0.0) == [t]  # dispatched, its future not yet resolved
    fwd._time_out(t, fut, 0.01)
    assert fut.done() and fut.exception() is None  # no 503 for a dispatched request


def queued_as(core: Core, rid: str) -> Ticket:
    t = Ticket(RouteRequest(rid, model="m"), 0.0)
    core.dispatcher.offer(t, 0.0)
    return t


async def test_a_shorter_timeout_behind_a_longer_one_leaves_first() -> None:
    # One timer sweeps every waiter's timeout: a later waiter with an earlier deadline
    # re-arms it, and the first waiter keeps waiting past that sweep.
    core, failfast = Core(), {}
    fwd = forwarder(core, failfast)
    long_t, short_t = queued_as(core, "long"), queued_as(core, "short")
    long_wait = asyncio.create_task(fwd.wait_dispatch(long_t, LONG_S))
    await asyncio.sleep(0)
    with pytest.raises(NoCapacity):
        await fwd.wait_dispatch(short_t, 0.01)
    assert not long_wait.done() and long_t.queued and failfast == {long_t.key: long_t}
    core.dispatcher.set_targets({"a": ["m"]})
    core.pump()
    assert await long_wait == "a"
    assert failfast == {} and fwd._deadlines == [] and fwd._sweep is None


async def test_a_request_taken_at_once_makes_no_future_and_no_timeout() -> None:
    core, failfast = Core(), {}
    core.dispatcher.set_targets({"a": ["m"]})
    fwd = forwarder(core, failfast)
    t = queued(core)
    assert await fwd.wait_dispatch(t, LONG_S) == "a"
    first = t.payload
    t2 = queued_as(core, "r2")
    assert await fwd.wait_dispatch(t2, LONG_S) == "a"
    assert t2.payload is first and first.done()  # the shared, resolved one
    assert fwd._deadlines == [] and fwd._sweep is None


async def test_dead_timeouts_are_pruned_while_a_request_waits() -> None:
    # Dispatched waiters leave their entries in the sweep's heap; it is rebuilt once
    # they outnumber the live ones, so a standing queue keeps it bounded.
    core, failfast = Core(), {}
    fwd = forwarder(core, failfast)
    stays = Ticket(RouteRequest("stays", model="other"), 0.0)  # no replica serves it
    core.dispatcher.offer(stays, 0.0)
    staying = asyncio.create_task(fwd.wait_dispatch(stays, LONG_S))
    for i in range(300):
        t = queued_as(core, f"r{i}")
        wait = asyncio.create_task(fwd.wait_dispatch(t, LONG_S))
        await asyncio.sleep(0)
        core.dispatcher.set_targets({"a": ["m"]})
        core.pump()
        assert await wait == "a"
        core.dispatcher.complete(t, 0.0, ok=True)
        core.dispatcher.set_targets({})
    assert len(fwd._deadlines) <= 2 + 64
    assert not staying.done() and failfast == {stays.key: stays}
    staying.cancel()
    with pytest.raises(asyncio.CancelledError):
        await staying
    assert fwd._deadlines == [] and fwd._sweep is None


async def test_a_timeout_that_raises_leaves_the_other_waiters_timed() -> None:
    # The waiters share one timer: a failure while timing one out (here its Retry-After)
    # must not leave the next without its queue timeout.
    core, failfast = Core(), {}
    loop = asyncio.get_running_loop()
    errors: list[dict[str, Any]] = []
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))

    def retry_after(model: str) -> float:
        if model == "bad":
            raise RuntimeError("no drain rate")
        return RETRY_AFTER_S

    none = cast(Any, None)
    fwd = Forwarder(cast(Any, core), none, none, none, None, none, none, failfast,
                    retry_after)
    bad = Ticket(RouteRequest("bad", model="bad"), 0.0)
    core.dispatcher.offer(bad, 0.0)
    bad_wait = asyncio.create_task(fwd.wait_dispatch(bad, 0.01))
    await asyncio.sleep(0)
    good = queued_as(core, "good")
    try:
        # A generous bound turns "never timed out" into a failure instead of a hang.
        async with asyncio.timeout(HANG_S):
            with pytest.raises(NoCapacity):
                await fwd.wait_dispatch(good, 0.02)
    finally:
        loop.set_exception_handler(None)
    assert errors and isinstance(errors[0].get("exception"), RuntimeError)
    assert not bad_wait.done()  # its timeout failed; the handler's finally cleans up
    bad_wait.cancel()
    with pytest.raises(asyncio.CancelledError):
        await bad_wait


# -- serve's own wait: the same steps inline, with no wait_queued coroutine -----------------
class ServeCore(Core):
    """``Core`` with the clock ``serve`` reads (the loop's)."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()


class Series:
    """A model's metrics as ``serve`` uses them; a queue timeout observes none."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"series.{name} used before a dispatch")


def serving_forwarder(core: ServeCore, failfast: dict[str, Ticket]) -> Forwarder:
    none = cast(Any, None)
    cfg = cast(Any, SimpleNamespace(retry=SimpleNamespace(max_attempts=1)))
    return Forwarder(cast(Any, core), cfg, none, none, None, none, none, failfast,
                     lambda model: RETRY_AFTER_S)


def serve(fwd: Forwarder, core: ServeCore, t: Ticket, timeout: float) -> Any:
    none = cast(Any, None)
    return fwd.serve(none, t, b"{}", none, core.now(), timeout, cast(Any, Series()))


async def test_serve_times_a_queued_request_out_in_its_own_frame() -> None:
    core, failfast = ServeCore(), cast(dict[str, Ticket], {})
    fwd = serving_forwarder(core, failfast)
    t = queued(core)
    waits_before = Forwarder.wait_queued
    try:
        # Not a coroutine of its own any more: a call to it would fail the request.
        Forwarder.wait_queued = None  # type: ignore[assignment,method-assign]
        with pytest.raises(NoCapacity) as exc:
            await serve(fwd, core, t, 0.01)
    finally:
        Forwarder.wait_queued = waits_before  # type: ignore[method-assign]
    assert exc.value.status == 503 and exc.value.retry_after_s == RETRY_AFTER_S
    assert not t.queued and core.dispatcher.queue_length() == 0
    assert failfast == {} and fwd._deadlines == [] and fwd._sweep is None


async def test_a_client_that_leaves_serves_queue_leaves_no_timeout_behind() -> None:
    core, failfast = ServeCore(), cast(dict[str, Ticket], {})
    fwd = serving_forwarder(core, failfast)
    t = queued(core)
    task = asyncio.create_task(serve(fwd, core, t, LONG_S))
    await asyncio.sleep(0)  # parked on its future, its timeout in the sweep
    assert failfast == {t.key: t} and fwd._waiting == 1 and fwd._sweep is not None
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert failfast == {} and fwd._waiting == 0
    assert fwd._deadlines == [] and fwd._sweep is None
