"""Overload and outage answers: Retry-After from the drain rate, fail-fast checks."""

from __future__ import annotations

import random

import pytest

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import NoCapacity, Overloaded
from skymesh.balancer.overload import (
    JITTER,
    RETRY_MAX_S,
    RETRY_MIN_S,
    DrainMeter,
    can_serve,
    retry_after_s,
    stranded,
    unlisted_replicas,
)
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad


@pytest.mark.parametrize(("queued", "rate", "base"), [
    (0, 5.0, RETRY_MIN_S),      # nothing ahead: the floor
    (3, 10.0, RETRY_MIN_S),     # drains in 0.3 s: the floor
    (20, 4.0, 5.0),             # 20 ahead at 4/s: 5 s
    (90, 3.0, 30.0),
    (10_000, 1.0, RETRY_MAX_S / (1 + JITTER)),  # the cap, with room for the jitter
    (5, 0.0, RETRY_MAX_S / (1 + JITTER)),       # not draining at all: the cap
])
def test_retry_after_is_the_drain_time_clamped(queued: int, rate: float, base: float) -> None:
    assert retry_after_s(queued, rate, 0.0) == pytest.approx(base)
    assert retry_after_s(queued, rate, 0.999) == pytest.approx(base * (1 + JITTER * 0.999))


def test_retry_after_spreads_the_clients_a_burst_turned_away() -> None:
    rng = random.Random(7)
    for queued, rate in ((0, 1.0), (40, 2.0), (10_000, 0.5)):
        waits = [retry_after_s(queued, rate, rng.random()) for _ in range(200)]
        assert all(RETRY_MIN_S <= w <= RETRY_MAX_S for w in waits)
        # Spread over at least a third of a second even at the floor and at the cap.
        assert max(waits) - min(waits) > 0.3 * min(waits) * JITTER
        assert len({round(w, 3) for w in waits}) > 100


def test_headers_round_up_and_carry_milliseconds() -> None:
    h = NoCapacity("x", retry_after_s=1.2).headers()
    assert h == {"Retry-After": "2", "retry-after-ms": "1200"}
    assert Overloaded("x", retry_after_s=59.01).headers()["Retry-After"] == "60"


def test_drain_meter_counts_completions_per_second_over_its_window() -> None:
    m = DrainMeter(now=100.0, window_s=10.0)
    assert m.rate("m", 100.0) == 0.0
    for i in range(20):  # 20 completions over 4 s
        m.record("m", 100.0 + i * 0.2)
    assert m.rate("m", 104.0) == pytest.approx(20 / 4.0)  # younger than its window
    assert m.rate("other", 104.0) == 0.0
    # Past the window the old completions no longer count (to the second): at 113.5 the
    # window holds only second 103's five.
    assert m.rate("m", 113.5) == pytest.approx(5 / 10.0)
    assert m.rate("m", 130.0) == 0.0
    # A meter a fraction of a second old does not divide by that fraction.
    young = DrainMeter(now=0.0)
    young.record("m", 0.1)
    assert young.rate("m", 0.1) == pytest.approx(1.0)


def _dispatcher() -> Dispatcher:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, max_outstanding=1)
    d.set_targets({"a": ["m"], "b": ["m"], "c": ["other"]})
    return d


def _ticket(i: int, model: str = "m", forwarded: bool = False) -> Ticket:
    return Ticket(RouteRequest(f"r{i}", model=model, forwarded=forwarded), 0.0)


def test_can_serve_asks_health_not_load() -> None:
    d = _dispatcher()
    assert can_serve(d, "m")
    assert not can_serve(d, "m", {"a", "b"})  # failed on both
    d.set_healthy("a", False)
    assert can_serve(d, "m") and not can_serve(d, "m", {"b"})
    d.set_healthy("b", False)
    assert not can_serve(d, "m") and can_serve(d, "other")


def test_a_peer_that_serves_the_model_counts_except_for_forwarded_requests() -> None:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O,
                   peer_policy=build_policy("round-robin"))
    d.set_targets({"a": ["m"]})
    d.set_healthy("a", False)
    d.set_peers(["eu"])
    d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(1, 1, 0, 0)})
    d.set_peer_alive("eu", True)
    assert can_serve(d, "m") and not can_serve(d, "m", forwarded=True)
    d.set_peer_alive("eu", False)
    assert not can_serve(d, "m")


def test_stranded_finds_queued_requests_once_their_last_replica_is_down() -> None:
    d = _dispatcher()
    ts = [_ticket(i) for i in range(4)] + [_ticket(9, model="other")]
    for t in ts:
        d.offer(t, 0.0)
    d.pump(0.0)  # one each on a and b (max_outstanding 1), c takes "other"
    waiting = [t for t in ts if t.queued]
    assert len(waiting) == 2
    eligible = {t.key for t in ts}
    assert list(stranded(d, eligible)) == []
    d.set_healthy("a", False)
    assert list(stranded(d, eligible)) == []  # b still serves m: they wait for it
    d.set_healthy("b", False)
    assert list(stranded(d, eligible)) == waiting
    assert list(stranded(d, {waiting[0].key})) == [waiting[0]]  # only those it may fail


def test_unlisted_replicas_are_those_whose_models_are_unknown() -> None:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O)
    d.set_targets({"a": [], "b": ["m"]})
    assert unlisted_replicas(d) == 1
    d.set_models("a", ["m"])
    assert unlisted_replicas(d) == 0
