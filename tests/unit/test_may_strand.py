"""``overload.may_strand``: the pump's cheap question before it looks for stranded requests
and dead retries. Differential: whatever the dispatcher went through, when it says no,
``stranded`` and ``dead_retries`` find nothing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.breaker import BreakerState
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.overload import dead_retries, may_strand, stranded
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad

TARGETS = ("a", "b", "c")
MODELS = ("m", "n")

op = st.one_of(
    st.tuples(st.just("offer"), st.sampled_from(MODELS), st.booleans(),
              st.sets(st.sampled_from(TARGETS), max_size=2), st.booleans()),
    st.tuples(st.just("pump")),
    st.tuples(st.just("end"), st.integers(0, 50), st.sampled_from(("ok", "fault", "neutral"))),
    st.tuples(st.just("healthy"), st.sampled_from(TARGETS), st.booleans()),
    st.tuples(st.just("models"), st.sampled_from(TARGETS),
              st.sets(st.sampled_from(MODELS))),
    st.tuples(st.just("peer"), st.booleans()),
    st.tuples(st.just("time"), st.floats(0.0, 3.0)),
)


def _fresh_summary(d: Dispatcher) -> tuple[frozenset[str], bool]:
    return (frozenset(m for t in d.targets.values() if t.healthy for m in t.models),
            any(t.breaker.state is BreakerState.OPEN for t in d.targets.values()))


@settings(max_examples=300, deadline=None)
@given(st.lists(op, max_size=40), st.booleans())
def test_when_may_strand_says_no_nothing_is_stranded_or_dead(ops: list[tuple],
                                                             peers: bool) -> None:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, max_outstanding=1,
                   peer_policy=build_policy("round-robin") if peers else None,
                   breaker_threshold=1, breaker_open_s=2.0)
    d.set_targets({"a": ["m"], "b": ["m", "n"], "c": ["n"]})
    if peers:
        d.set_peers(["eu"])
        d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(1, 1, 0, 0)})
    now, sent, i = 0.0, [], 0
    for o in ops:
        kind = o[0]
        if kind == "offer":
            _, model, forwarded, excluded, front = o
            i += 1
            t = Ticket(RouteRequest(f"r{i}", model=model, forwarded=forwarded), now,
                       excluded=set(excluded))
            d.offer(t, now, front=front)
        elif kind == "pump":
            sent.extend(d.pump(now))
        elif kind == "end" and sent:
            t = sent.pop(o[1] % len(sent))
            d.complete(t, now, ok=o[2] == "ok", replica_fault=o[2] == "fault")
        elif kind == "healthy":
            d.set_healthy(o[1], o[2])
        elif kind == "models":
            d.set_models(o[1], o[2])
        elif kind == "peer" and peers:
            d.set_peer_alive("eu", o[1])
        elif kind == "time":
            now += o[1]
        assert d.health_summary() == _fresh_summary(d)
        if not may_strand(d):
            every = {t.key for q in d.queues.values() for t in q}
            assert list(stranded(d, every)) == []
            assert list(stranded(d, every, now)) == []  # and behind open breakers
            assert list(dead_retries(d, every, now)) == []


def test_may_strand_under_an_ordinary_backlog_and_after_a_fall() -> None:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, max_outstanding=1,
                   breaker_threshold=1)
    d.set_targets({"a": ["m"], "b": ["m"]})
    ts = [Ticket(RouteRequest(f"r{i}", model="m"), 0.0) for i in range(4)]
    for t in ts:
        d.offer(t, 0.0)
    sent = d.pump(0.0)
    assert d.queued == 2 and not may_strand(d)  # a standing queue, both up
    d.set_healthy("a", False)
    assert not may_strand(d)  # b still serves m
    d.complete(sent[1], 0.0, ok=False, replica_fault=True)  # b's breaker opens
    assert may_strand(d)
    d.set_healthy("a", True)
    d.set_healthy("b", False)
    assert may_strand(d)  # b is down: the breaker's still open
