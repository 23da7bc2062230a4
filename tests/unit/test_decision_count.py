"""``Balancer._pump``'s routing-decision counter: every dispatched request is counted
once, after the turn of the loop that dispatched it (its upstream write goes first: TTFT
at low rates), by one callback for all the decisions of that turn."""

from __future__ import annotations

import asyncio

from skymesh.balancer.config import parse_config
from skymesh.balancer.dispatch import Ticket
from skymesh.balancer.server import Balancer, balancer_of, build_app
from skymesh.policies import RouteRequest


def decisions(lb: Balancer, target: str) -> float:
    return lb.metrics.decisions.labels(lb.dispatcher.policy.name, target).value


async def test_each_decision_is_counted_once_after_its_turn() -> None:
    lb = balancer_of(build_app(parse_config({"policy": {"name": "round-robin"},
                                                          "pushing": {"mode": "bp"}})))
    d = lb.dispatcher
    d.set_targets({"http://a": ["m"], "http://b": ["m"]})
    for target in ("http://a", "http://b"):
        d.set_healthy(target, True)
    loop = asyncio.get_running_loop()
    tickets = []
    for i in range(5):  # one turn: five requests dispatched, each by its own pump
        t = Ticket(RouteRequest(f"r{i}", model="m"), 0.0)
        t.payload = loop.create_future()
        d.offer(t, 0.0)
        lb.pump()
        tickets.append(t)
    assert all(t.target is not None and t.payload.done() for t in tickets)
    sent_to = {x: sum(t.target == x for t in tickets) for x in ("http://a", "http://b")}
    assert decisions(lb, "http://a") == decisions(lb, "http://b") == 0  # not in this turn
    await asyncio.sleep(0)  # the loop comes round
    assert {x: decisions(lb, x) for x in sent_to} == sent_to
    for i in range(2):  # a later turn's decisions: counted by a callback of their own
        t = Ticket(RouteRequest(f"s{i}", model="m"), 0.0)
        t.payload = loop.create_future()
        d.offer(t, 0.0)
        lb.pump()
        sent_to[t.target or ""] += 1
    await asyncio.sleep(0)
    assert {x: decisions(lb, x) for x in sent_to} == sent_to


async def test_a_pump_of_an_empty_queue_stops_the_drain_clock_and_dispatches_nothing(
) -> None:
    # Balancer.pump tests for a queue itself, before its pass (``_pump``): a queue that
    # cancels emptied still stops the drain meter's backlog clock, as the pass did.
    lb = balancer_of(build_app(parse_config({"policy": {"name": "round-robin"},
                                             "pushing": {"mode": "bp"}})))
    d = lb.dispatcher
    d.set_targets({"http://a": ["m"]})
    t = Ticket(RouteRequest("r", model="other"), 0.0)  # a model no replica serves
    t.payload = asyncio.get_running_loop().create_future()
    d.offer(t, 0.0)
    lb.pump()
    assert d.queued == 1 and lb.drain.backlog_since is not None
    assert d.cancel(t) and not d.queued  # the client left
    lb.pump()
    assert lb.drain.backlog_since is None and not t.payload.done()
    await asyncio.sleep(0)
    assert decisions(lb, "http://a") == 0
