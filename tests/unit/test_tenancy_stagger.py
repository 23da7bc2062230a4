"""``tenants.reserve_stagger``: while pacing holds, the lower classes are released one at
a time over the replicas (none while one of theirs is pending its start on any replica of
the model), and the dispatcher sends a better request to a replica with none of theirs
pending, so with two replicas or more it does not wait out a batch prefill step (the path
the frontier's engine bound leaves open, docs/results/tenancy-frontier.md). Fake clocks
throughout."""

from __future__ import annotations

from dataclasses import replace

from skymesh.balancer.config import TenantsConfig
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.tenancy import FairQueue, Reserve, Stagger, Waiter, release_into, reserve_of
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode

CLASSES = ("interactive", "standard", "batch")
RESERVE = Reserve(CLASSES, {}, idle_s=120.0, pace=1, adaptive=frozenset({"batch"}),
                  pace_s=10.0)
STAGGER = replace(RESERVE, stagger=True)
FREE = [(16, 16, 0), (16, 16, 0)]


def _released(q: FairQueue, now: float, reserve: Reserve = STAGGER) -> list[Waiter]:
    return release_into(q, lambda m: 0, {}, 1000, now, reserve=reserve,
                        slots={"m": FREE}.__getitem__)


def _flooded(n: int = 20) -> FairQueue:
    q = FairQueue(CLASSES, max_wait_s={"batch": 60.0}, capacity=1000, started=0.0)
    for _ in range(n):
        q.push(Waiter("m", "bulk", "batch", 400, 0.0))
    q.arrived["interactive"] = 10.0  # pacing holds for 10 s from here
    return q


def test_the_knob_is_off_by_default_and_lb_yaml_turns_it_on() -> None:
    assert reserve_of(TenantsConfig()).stagger is False
    assert reserve_of(TenantsConfig(reserve_stagger=True)).stagger is True
    assert reserve_of(TenantsConfig(reserve={}, reserve_stagger=True)).stagger is True


def test_one_lower_request_at_a_time_over_the_fleet_while_pacing_holds() -> None:
    q = _flooded()
    # Pace 1 alone lets one go per replica (two); the stagger one over both.
    assert len(_released(_flooded(), 11.0, RESERVE)) == 2
    [w] = _released(q, 11.0)
    assert w.cls == "batch"
    assert _released(q, 11.1) == []  # released, not yet placed: pending
    q.stagger.placed("t1", "m", "batch", "a", 11.1)
    assert _released(q, 11.2) == []  # placed, no first byte yet: pending
    q.stagger.started("t1")  # its first byte: the next one goes
    [w2] = _released(q, 11.3)
    assert w2.cls == "batch"
    # Past the window (no interactive request since 10 s) the stagger holds no more.
    assert len(_released(q, 20.1)) == 18


def test_the_stagger_alone_needs_no_slot_reserve() -> None:
    """``reserve: {}`` with the stagger: no slots are kept, but the lower class still
    goes one at a time while a better request arrived within the window."""
    alone = replace(STAGGER, adaptive=frozenset())
    q = _flooded()
    assert len(_released(q, 11.0, alone)) == 1
    assert _released(q, 11.1, alone) == []


def test_better_requests_pass_while_the_lower_class_is_held() -> None:
    q = _flooded()
    assert len(_released(q, 11.0)) == 1
    q.push(Waiter("m", "web", "interactive", 200, 11.1))
    assert [w.cls for w in _released(q, 11.1)] == ["interactive"]


def test_pending_starts_expire_after_some_steps_or_a_second_when_no_step_is_known() -> None:
    """A request that is not streamed shows no first byte before its end, and one whose
    client left before it was offered is never placed: neither holds the class for
    good."""
    step: dict[str, float] = {}
    s = Stagger(CLASSES, step, steps=8.0, unknown_s=1.0)
    s.released("m", "batch", 0.0)
    s.released("m", "interactive", 0.0)  # the best class is never pending here
    assert s.lower_pending("m", 0.5) == 1
    assert s.lower_pending("m", 1.01) == 0  # no step known: a second at most
    step["m"] = 0.05  # the engine's step as the balancer sees it: 8 steps are 0.4 s
    s.released("m", "batch", 2.0)
    s.placed("t1", "m", "batch", "a", 2.1)
    assert s.lower_pending("m", 2.45) == 1
    assert s.lower_pending("m", 2.51) == 0


def test_a_better_request_keeps_clear_of_replicas_with_a_lower_start_pending() -> None:
    s = Stagger(CLASSES)
    s.placed("t1", "m", "batch", "a", 0.0)
    assert s.narrow("m", "interactive", ["a", "b"], 0.1) == ["b"]
    assert s.narrow("m", "interactive", ["a"], 0.1) == ["a"]  # never to none
    assert s.narrow("other", "interactive", ["a", "b"], 0.1) == ["a", "b"]  # per model
    assert s.narrow("m", None, ["a", "b"], 0.1) == ["a", "b"]  # no class: untouched
    s.placed("t2", "m", "batch", "b", 0.1)
    assert s.narrow("m", "interactive", ["a", "b"], 0.2) == ["a", "b"]  # none clear
    s.started("t1")
    assert s.narrow("m", "interactive", ["a", "b"], 0.3) == ["a"]


def test_a_lower_request_rotates_and_keeps_clear_of_better_starts_pending() -> None:
    s = Stagger(CLASSES)
    s.placed("t1", "m", "batch", "a", 0.0)
    s.started("t1")
    assert s.narrow("m", "batch", ["a", "b"], 0.1) == ["b"]  # a had the last one
    s.placed("w1", "m", "interactive", "b", 0.2)
    assert s.narrow("m", "batch", ["a", "b"], 0.3) == ["a"]  # b is about to prefill w1
    s.started("w1")
    s.placed("t2", "m", "batch", "b", 0.4)
    s.started("t2")
    assert s.narrow("m", "batch", ["a", "b", "c"], 0.5) == ["c"]  # never given one


def _dispatcher(stagger: Stagger) -> Dispatcher:
    d = Dispatcher(build_policy("round-robin"), PushMode.BP)
    d.set_targets({"a": ["m"], "b": ["m"]})
    d.stagger = stagger
    return d


def _ticket(i: int, cls: str | None) -> Ticket:
    t = Ticket(RouteRequest(f"r{i}", model="m"), 0.0)
    t.tenant_class = cls
    return t


def test_the_dispatcher_narrows_a_classed_request_and_tells_where_it_went() -> None:
    s = Stagger(CLASSES)
    d = _dispatcher(s)
    bulk = _ticket(1, "batch")
    d.offer(bulk, 0.0)
    [out] = d.pump(0.0)
    assert s.lower_pending("m", 0.0) == 1 and s._placed[bulk.key][1] == out.target
    # Round robin would send the next ones to the other replica and back; the
    # interactive ones keep clear of the batch request's replica until its first byte.
    webs = [_ticket(2 + i, "interactive") for i in range(3)]
    for t in webs:
        d.offer(t, 0.1)
    busy = bulk.target
    assert {t.target for t in d.pump(0.1)} == {"a", "b"} - {busy}
    d.first_byte(bulk)
    assert s.lower_pending("m", 0.2) == 0
    more = [_ticket(10 + i, "interactive") for i in range(2)]
    for t in more:
        d.offer(t, 0.2)
    assert {t.target for t in d.pump(0.2)} == {"a", "b"}  # both free again
    # An end counts as a start (a request that fails or is not streamed).
    late = _ticket(20, "batch")
    d.offer(late, 0.3)
    d.pump(0.3)
    d.complete(late, 0.4, ok=False)
    assert s.lower_pending("m", 0.4) == 0


def test_without_the_stagger_the_dispatcher_routes_as_before() -> None:
    d = Dispatcher(build_policy("round-robin"), PushMode.BP)
    d.set_targets({"a": ["m"], "b": ["m"]})
    ts = [_ticket(i, "interactive" if i else "batch") for i in range(4)]
    for t in ts:
        d.offer(t, 0.0)
    assert [t.target for t in d.pump(0.0)] == ["a", "b", "a", "b"]


async def test_the_live_balancer_wires_the_stagger_only_when_configured() -> None:
    from skymesh.balancer.config import parse_config
    from skymesh.balancer.server import Balancer

    on = Balancer(parse_config({"region": "us", "tenants": {"reserve_stagger": True}}))
    gate = on.handlers.gate
    assert gate is not None and on.dispatcher.stagger is gate.queue.stagger
    off = Balancer(parse_config({"region": "us", "tenants": {}}))
    assert off.handlers.gate is not None and off.dispatcher.stagger is None
