"""The balancer's pure decision core: queue, availability, breaker, outcomes."""

from __future__ import annotations

from typing import Any

import pytest

from skymesh.balancer.breaker import Breaker, BreakerState
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import Overloaded
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode


def make(mode: PushMode = PushMode.SP_P, **kw: object) -> Dispatcher:
    d = Dispatcher(build_policy("round-robin"), mode, **kw)  # type: ignore[arg-type]
    d.set_targets({"a": ["m"], "b": ["m"], "c": ["other"]})
    return d


def ticket(i: int, model: str = "m", deadline: float | None = None) -> Ticket:
    return Ticket(RouteRequest(f"r{i}", model=model), 0.0, deadline=deadline)


def test_fcfs_and_model_filtering() -> None:
    d = make(PushMode.BP)
    ts = [ticket(i) for i in range(4)]
    for t in ts:
        d.offer(t, 0.0)
    out = d.pump(0.0)
    assert out == ts
    assert [t.target for t in out] == ["a", "b", "a", "b"]  # never "c": it serves "other"
    assert d.queue_length() == 0


def test_full_queue_raises_overloaded_with_retry_after() -> None:
    d = make(max_queue=2)
    d.offer(ticket(1), 0.0)
    d.offer(ticket(2), 0.0)
    with pytest.raises(Overloaded) as exc:
        d.offer(ticket(3), 0.0)
    assert exc.value.status == 429 and "Retry-After" in exc.value.headers()
    # A retry re-enters at the front even when the queue is full.
    d.offer(ticket(4), 0.0, front=True)
    assert d.queue_length("m") == 3


def test_sp_p_holds_requests_until_a_probe_shows_room() -> None:
    d = make()
    for i in range(3):
        d.offer(ticket(i), 0.0)
    first = d.pump(0.0)
    # One push per replica: each is unadmitted until its first byte or a newer probe.
    assert sorted(t.target for t in first) == ["a", "b"]  # type: ignore[type-var]
    assert d.pump(0.01) == []
    d.on_probe("a", 0.1, waiting=1, running=3, kv_usage=0.5)  # a has a queue now
    assert d.pump(0.1) == []
    d.on_probe("b", 0.1, waiting=0, running=2, kv_usage=0.5)
    [t] = d.pump(0.1)
    assert t.target == "b"


def test_first_byte_frees_the_replica_for_sp_p() -> None:
    d = make()
    d.set_targets({"a": ["m"]})
    t1, t2 = ticket(1), ticket(2)
    d.offer(t1, 0.0)
    d.offer(t2, 0.0)
    assert d.pump(0.0) == [t1]
    d.first_byte(t1)
    assert d.pump(0.0) == [t2]


def test_completion_returns_in_flight_to_zero_and_retry_excludes_failed_replica() -> None:
    d = make(PushMode.BP)
    t = ticket(1)
    d.offer(t, 0.0)
    [t] = d.pump(0.0)
    first = t.target
    assert first is not None
    assert d.load(first).in_flight == 1
    d.complete(t, 0.0, ok=False, replica_fault=True)
    assert d.load(first).in_flight == 0 and t.target is None
    t.excluded.add(first)
    d.offer(t, 0.0, front=True)
    [again] = d.pump(0.0)
    assert again.target not in (None, first) and again.attempts == 2


def test_breaker_opens_after_failures_and_recovers_through_half_open() -> None:
    d = make(PushMode.BP, breaker_threshold=2, breaker_open_s=5.0)
    d.set_targets({"a": ["m"]})
    for _ in range(2):
        t = ticket(0)
        d.offer(t, 0.0)
        d.pump(0.0)
        d.complete(t, 0.0, ok=False, replica_fault=True)
    assert d.targets["a"].breaker.state is BreakerState.OPEN
    t = ticket(9)
    d.offer(t, 1.0)
    assert d.pump(1.0) == []
    assert d.pump(6.0) == [t]  # half-open: one trial
    t2 = ticket(10)
    d.offer(t2, 6.0)
    assert d.pump(6.0) == []  # no second request while the trial runs
    d.complete(t, 6.5, ok=True)
    assert d.pump(6.5) == [t2]


def test_client_errors_never_trip_the_breaker() -> None:
    b = Breaker(failure_threshold=1)
    for _ in range(10):
        b.on_neutral()
    assert b.allows(0.0)


def test_expired_and_cancel_leave_no_trace() -> None:
    d = make()
    d.set_targets({})
    t1, t2 = ticket(1, deadline=5.0), ticket(2)
    d.offer(t1, 0.0)
    d.offer(t2, 0.0)
    assert d.expired(4.0) == []
    assert d.expired(5.0) == [t1]
    assert d.cancel(t2) and not d.cancel(t2)
    assert d.queue_length() == 0


def test_membership_change_keeps_state_of_staying_targets() -> None:
    d = make(PushMode.BP)
    t = ticket(1)
    d.offer(t, 0.0)
    [t] = d.pump(0.0)
    assert t.target == "a"
    d.set_targets({"a": ["m"], "z": ["m"]})
    assert d.load("a").in_flight == 1
    d.complete(t, 0.0, ok=True)
    assert d.load("a").in_flight == 0
    d.set_targets({"z": ["m"]})
    d.complete(t, 0.0, ok=True)  # a late completion for a departed target is harmless


def _prefer(target: str | None) -> Dispatcher:
    from skymesh.policies.base import Policy

    class Prefer(Policy):
        def select(self, request, candidates, view):  # type: ignore[no-untyped-def]
            return sorted(candidates)[0]

        def preferred(self, request, targets, view):  # type: ignore[no-untyped-def]
            return target if request.request_id.startswith("cached") else None

    d = Dispatcher(Prefer(), PushMode.SP_O, max_outstanding=1, hold_s=2.0)
    d.set_targets({"a": ["m"], "b": ["m"]})
    return d


def test_delay_scheduling_holds_a_request_for_its_replica_while_others_overtake() -> None:
    d = _prefer("a")
    busy = Ticket(RouteRequest("x", model="m"), 0.0)
    d.offer(busy, 0.0)
    assert [t.target for t in d.pump(0.0)] == ["a"]  # a is now full (cap 1)
    held = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    other = Ticket(RouteRequest("plain-2", model="m"), 0.0)
    d.offer(held, 0.0)
    d.offer(other, 0.0)
    # b is free, but the head prefers a: the request behind it takes b instead.
    assert d.pump(0.1) == [other] and other.target == "b"
    d.complete(busy, 0.5, ok=True)
    assert d.pump(0.5) == [held] and held.target == "a"


def test_a_held_request_goes_anywhere_once_its_hold_expires() -> None:
    d = _prefer("a")
    busy = Ticket(RouteRequest("x", model="m"), 0.0)
    d.offer(busy, 0.0)
    d.pump(0.0)
    held = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    d.offer(held, 0.0)
    assert d.pump(1.0) == []  # held since 1.0
    assert d.pump(2.9) == []
    assert d.pump(3.0) == [held] and held.target == "b"


def test_no_hold_means_strict_fcfs() -> None:
    d = _prefer("a")
    d.hold_s = 0.0
    busy = Ticket(RouteRequest("x", model="m"), 0.0)
    d.offer(busy, 0.0)
    d.pump(0.0)
    held = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    d.offer(held, 0.0)
    assert d.pump(0.1) == [held] and held.target == "b"


_RoundRobin: Any = type(build_policy("round-robin"))


class _Recorder(_RoundRobin):
    """Round robin that notes the deadline each decision saw."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[float | None] = []

    def select(self, request: RouteRequest, candidates: Any, view: Any) -> str | None:
        self.seen.append(request.deadline_s)
        return super().select(request, candidates, view)


def test_policies_see_the_deadline_left_after_queueing_and_failed_attempts() -> None:
    rec = _Recorder()
    d = Dispatcher(rec, PushMode.SP_P)
    d.set_targets({"a": ["m"]})
    busy = ticket(0)
    d.offer(busy, 0.0)
    assert d.pump(0.0) == [busy]  # a is taken: the next request waits here
    t = Ticket(RouteRequest("r1", model="m", deadline_s=10.0), 1.0)
    d.offer(t, 1.0)
    assert d.pump(2.0) == []
    d.first_byte(busy)
    assert d.pump(4.0) == [t]
    assert rec.seen[-1] == pytest.approx(7.0)  # 3 s queued came off the 10 s budget
    assert t.route.deadline_s == pytest.approx(7.0)  # now counted from this dispatch
    d.complete(t, 5.5, ok=False, replica_fault=True)
    d.offer(t, 5.5, front=True)
    d.first_byte(busy)
    assert d.pump(6.0) == [t]
    assert rec.seen[-1] == pytest.approx(5.0)  # and so did the failed attempt's 2 s
    no_deadline = ticket(2)
    d.complete(t, 6.0, ok=True)
    d.offer(no_deadline, 6.0)
    d.pump(9.0)
    assert rec.seen[-1] is None and no_deadline.route.deadline_s is None
