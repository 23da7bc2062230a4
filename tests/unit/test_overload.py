"""Overload and outage answers: Retry-After from the drain rate and the place a retry
would take (fake clock), fail-fast checks."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import make_mocked_request

from skymesh.balancer.breaker import Breaker, BreakerState
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.errors import (
    NoCapacity,
    NoHealthyReplica,
    Overloaded,
    SkyMeshError,
    retry_headers,
)
from skymesh.balancer.handlers import RETRY_COUNT_HEADER, _is_retry
from skymesh.balancer.overload import (
    BREAKER_SPREAD_S,
    CLAIM_WINDOW_S,
    COLD_RETRY_S,
    JITTER,
    PLAN_FRACTION,
    RETRY_MAX_S,
    RETRY_MIN_S,
    DrainMeter,
    RetryBook,
    breakers_open,
    can_retry,
    can_serve,
    check_servable,
    cold_retry_s,
    dead_retries,
    next_slot,
    servable_fully,
    stranded,
    unlisted_replicas,
)
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.base import Policy
from skymesh.policies.load import PushMode
from skymesh.policies.peers import ModelLoad


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def drained(meter: DrainMeter, clock: Clock, per_s: float, seconds: float,
            queued: int = 16) -> None:
    """``per_s`` requests a second leave a queue that keeps ``queued`` waiting."""
    step = 1 / per_s
    for _ in range(round(seconds * per_s)):
        clock.t += step
        meter.observe(clock.t, 1, queued)


def test_the_meter_reads_dispatches_over_backlogged_time_only() -> None:
    clock, m = Clock(), DrainMeter(tau_s=10.0, min_span_s=1.0)
    assert m.rate(clock.t) is None
    m.observe(clock.t, 3, 0)  # dispatched at once, nothing left waiting: no backlog
    assert m.rate(clock.t) is None and m.backlog_since is None
    m.observe(clock.t, 2, 5)  # five left waiting: the backlog starts now
    assert m.backlog_since == clock.t
    drained(m, clock, 8.0, 0.5)
    assert m.rate(clock.t) is None  # half a second of backlog: not measured yet
    drained(m, clock, 8.0, 2.5)
    assert m.rate(clock.t) == pytest.approx(8.0, rel=0.02)
    # The queue empties; an idle hour later a burst is read as it is, not divided by the
    # hour (a window over wall time read a cold burst 10x too slow).
    clock.t += 0.1
    m.observe(clock.t, 1, 0)
    assert m.backlog_since is None
    clock.t += 3600
    assert m.rate(clock.t) == pytest.approx(8.0, rel=0.05)
    m.observe(clock.t, 0, 16)
    drained(m, clock, 20.0, 30.0)  # three time constants: the new rate dominates
    assert m.rate(clock.t) == pytest.approx(20.0, rel=0.1)


def test_a_cold_wait_is_the_backlog_s_age_at_least_the_floor_and_jittered() -> None:
    assert cold_retry_s(0.0, 0.0) == COLD_RETRY_S
    assert cold_retry_s(0.0, 0.999) == pytest.approx(COLD_RETRY_S * (1 + JITTER * 0.999))
    assert cold_retry_s(10.0, 0.0) == 10.0
    assert cold_retry_s(1e6, 0.999) <= RETRY_MAX_S


@pytest.mark.parametrize(("queued", "last_due", "cold_until", "due"), [
    (16, -math.inf, -math.inf, 100.0 + (16 - 8) / 4),  # drains to half the queue
    (4, -math.inf, -math.inf, 100.0 - 1.0),            # already below half: (the floor)
    (16, 110.0, -math.inf, 110.25),                    # one interval after the last
    (16, -math.inf, 103.0, 103.0 + (16 - 8) / 4),      # the cold clients fill it first
])
def test_next_slot(queued: int, last_due: float, cold_until: float, due: float) -> None:
    assert next_slot(100.0, queued, 16, 8, 4.0, last_due, cold_until) == pytest.approx(due)


def measured(clock: Clock, per_s: float) -> DrainMeter:
    m = DrainMeter(tau_s=10.0, min_span_s=1.0)
    m.observe(clock.t, 0, 16)
    drained(m, clock, per_s, 5.0)
    return m


def test_a_burst_is_booked_one_drain_interval_apart_at_the_measured_rate() -> None:
    """The defect (issue #33, item 9): every client a cold burst turned away was told the
    same 40-60 s, long after the queue had drained. Now each is booked a place: the k-th
    comes back when the queue has room for it, and no faster than it drains."""
    clock = Clock()
    meter, book = measured(clock, 5.0), RetryBook()
    plan = 5.0 * PLAN_FRACTION
    waits = [book.promise(clock.t, 16, 16, meter, 0.5) for _ in range(150)]
    assert waits[0] == pytest.approx(8 / plan, rel=0.02)  # the queue down to half
    gaps = [b - a for a, b in itertools.pairwise(waits)]
    assert all(g == pytest.approx(1 / plan, rel=0.02) for g in gaps)
    assert waits[-1] == pytest.approx((8 + 149) / plan, rel=0.02)  # all within the SDK's
    assert waits[-1] < RETRY_MAX_S                                   # limit: all booked
    assert book.booked(clock.t) == 150
    # Their return rate never exceeds what the queue drains (at the planned share).
    t = clock.t
    for lo in range(0, 40):
        back = sum(1 for w in waits if lo <= w < lo + 1)
        assert back <= plan + 1
    # Time passes: a client turned away later is booked after them.
    clock.t = t + 5.0
    later = book.promise(clock.t, 16, 16, meter, 0.5)
    assert later == pytest.approx(waits[-1] - 5.0 + 1 / plan, rel=0.02)


def test_a_wait_past_the_ceiling_is_not_booked_and_is_spread() -> None:
    clock = Clock()
    meter, book = measured(clock, 1.0), RetryBook()
    plan = meter.rate(clock.t) * PLAN_FRACTION  # type: ignore[operator]
    waits = [book.promise(clock.t, 16, 16, meter, u / 100) for u in range(100)]
    assert all(RETRY_MIN_S <= w <= RETRY_MAX_S for w in waits)
    n = math.floor((RETRY_MAX_S - 8 / plan) * plan) + 1  # places within the ceiling
    assert all(b - a == pytest.approx(1 / plan) for a, b in itertools.pairwise(waits[:n]))
    assert waits[n - 1] <= RETRY_MAX_S
    # Past it: no place in line (the book did not move), the ceiling spread by the jitter.
    rest = waits[n:]
    assert all(RETRY_MAX_S / (1 + JITTER) <= w <= RETRY_MAX_S for w in rest)
    assert max(rest) - min(rest) > 0.3 * (RETRY_MAX_S - RETRY_MAX_S / (1 + JITTER))
    assert book.last_due == pytest.approx(clock.t + waits[n - 1])


def test_before_the_rate_is_measured_the_wait_is_cold_and_delays_the_first_booking(
        ) -> None:
    clock = Clock()
    meter, book = DrainMeter(tau_s=10.0, min_span_s=1.0), RetryBook()
    meter.observe(clock.t, 0, 16)  # a cold burst: the queue fills at once
    cold = [book.promise(clock.t, 16, 16, meter, u / 10) for u in range(10)]
    assert all(COLD_RETRY_S <= w <= COLD_RETRY_S * (1 + JITTER) for w in cold)
    drained(meter, clock, 10.0, 1.2)
    first = book.promise(clock.t, 16, 16, meter, 0.0)
    # After the last cold client is due, and the queue they refill has drained to half.
    assert clock.t + first == pytest.approx(
        1000.0 + max(cold) + 8 / (meter.rate(clock.t) * PLAN_FRACTION), rel=1e-6)


def test_a_booked_client_back_when_told_claims_its_place_once() -> None:
    """A drain rate read high must not cost a client that came back when told its retry:
    the edge queues it past the cap when it claims a booked place."""
    clock = Clock()
    meter, book = measured(clock, 10.0), RetryBook()
    t0 = clock.t
    waits = [book.promise(t0, 16, 16, meter, 0.0) for _ in range(3)]
    assert book.booked(t0) == 3
    assert not book.claim(t0 + waits[0] - 0.01)  # nobody is due yet
    assert book.claim(t0 + waits[0])
    assert not book.claim(t0 + waits[0])  # that place is taken
    assert book.claim(t0 + waits[2]) and book.claim(t0 + waits[2])  # two due by then
    assert not book.claim(t0 + waits[2] + 1)
    # A booked client that never comes back frees its place after CLAIM_WINDOW_S.
    late = book.promise(t0, 16, 16, meter, 0.0)
    assert book.booked(t0 + late + CLAIM_WINDOW_S + 0.01) == 0
    assert not book.claim(t0 + late + CLAIM_WINDOW_S + 0.01)


def test_headers_round_up_and_carry_milliseconds() -> None:
    h = NoCapacity("x", retry_after_s=1.2).headers()
    assert h == {"Retry-After": "2", "retry-after-ms": "1200"}
    assert Overloaded("x", retry_after_s=59.01).headers()["Retry-After"] == "60"


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


@pytest.mark.parametrize(("value", "retry"), [
    (None, False), ("", False), ("0", False), ("00", False), ("1", True), ("02", True),
    ("17", True), ("-1", False), ("1.0", False), ("²", False), ("9" * 5000, True),
])
def test_only_a_request_marked_as_a_retry_may_claim_a_booked_place(
        value: str | None, retry: bool) -> None:
    """The OpenAI SDKs mark their retries; new requests under sustained overload must not
    take the places booked for the clients told to come back (nor crash on the header)."""
    headers = {} if value is None else {RETRY_COUNT_HEADER: value}
    request = make_mocked_request("POST", "/v1/chat/completions", headers=headers)
    assert _is_retry(request) is retry


def _failing(d: Dispatcher, target: str, now: float, times: int) -> None:
    """``times`` requests on ``target`` that end in a replica fault at ``now``."""
    for i in range(times):
        t = _ticket(100 + i)
        t.excluded = set(d.targets) - {target}
        d.offer(t, now)
        d.pump(now)
        assert t.target == target
        d.complete(t, now, ok=False, replica_fault=True)


def test_a_retry_does_not_count_a_replica_whose_breaker_is_open() -> None:
    """Issue #35: a retry that waited for a replica behind an open breaker took the
    breaker's trial, failed it (the prompt fails everywhere) and opened it again, for
    good, while the retries behind it filled the queue's window. can_serve still counts
    that replica (a new request may wait for it); can_retry does not, until its trial."""
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, breaker_threshold=2,
                   breaker_open_s=10.0)
    d.set_targets({"a": ["m"], "b": ["m"]})
    assert can_retry(d, "m", {"b"}, 0.0)
    _failing(d, "a", 0.0, 1)
    assert can_retry(d, "m", {"b"}, 0.0)  # one failure: the breaker is still closed
    _failing(d, "a", 1.0, 1)
    assert d.targets["a"].breaker.shut(5.0)
    assert can_serve(d, "m", {"b"})
    assert not can_retry(d, "m", {"b"}, 5.0)
    assert can_retry(d, "m", set(), 5.0)  # b itself is fine
    assert can_retry(d, "m", {"b"}, 11.0)  # a's trial is due: a retry may take it
    assert d.targets["a"].breaker.state is BreakerState.OPEN  # asking moved nothing


def test_queued_retries_leave_when_the_breakers_they_wait_for_open() -> None:
    """A retry queued for a busy replica whose breaker then opens has nowhere to go: the
    pump fails it (dead_retries) instead of letting it wait for the breaker's trial; new
    requests wait, and nothing is found once the trial is due."""
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, max_outstanding=1,
                   breaker_threshold=1, breaker_open_s=10.0)
    d.set_targets({"a": ["m"], "b": ["m"]})
    busy = _ticket(0)
    busy.excluded = {"b"}
    d.offer(busy, 0.0)
    d.pump(0.0)
    assert busy.target == "a"
    retry, fresh = _ticket(1), _ticket(2)
    retry.excluded, retry.attempts = {"b"}, 1  # failed on b: only a is left
    d.offer(retry, 0.5, front=True)
    d.offer(fresh, 0.5)
    d.pump(0.5)  # fresh takes b; the retry waits for a (busy)
    assert retry.queued and fresh.target == "b"
    eligible = {retry.key, fresh.key}
    assert list(dead_retries(d, eligible, 0.5)) == []
    d.complete(busy, 1.0, ok=False, replica_fault=True)  # a's breaker opens
    late = _ticket(3)
    d.offer(late, 1.0)
    assert list(dead_retries(d, eligible | {late.key}, 1.0)) == [retry]
    assert list(dead_retries(d, {late.key}, 1.0)) == []  # only those it may fail
    assert list(dead_retries(d, eligible, 11.0)) == []  # the trial is due


# A new request when every replica of its model is behind an open breaker: a 503 at once,
# told when the first breaker lets a trial through (``breakers_open``), instead of a wait
# in the queue up to ``queue.timeout_s``.
OPEN_S = 30.0


def _breakers(peer_policy: Policy | None = None) -> Dispatcher:
    d = Dispatcher(build_policy("round-robin"), PushMode.SP_O, breaker_threshold=1,
                   breaker_open_s=OPEN_S, peer_policy=peer_policy)
    d.set_targets({"a": ["m"], "b": ["m"], "c": ["other"]})
    return d


def test_trial_in_counts_down_to_the_half_open_time() -> None:
    b = Breaker(failure_threshold=1, open_s=10.0)
    b.on_failure(100.0)
    assert b.trial_in(100.0) == 10.0
    assert b.trial_in(104.0) == 6.0
    assert b.trial_in(111.0) == 0.0  # due: never negative


def test_every_breaker_open_answers_with_the_first_trial() -> None:
    d = _breakers()
    _failing(d, "a", 0.0, 1)
    assert breakers_open(d, "m", 1.0) is None  # b still takes requests
    _failing(d, "b", 5.0, 1)
    exc = breakers_open(d, "m", 6.0)
    assert isinstance(exc, NoHealthyReplica)
    assert exc.status == 503 and exc.code == "no_healthy_replica"
    assert exc.retry_after_s == pytest.approx(OPEN_S - 6.0)  # a's, the earlier one
    assert exc.headers() == retry_headers(OPEN_S - 6.0)
    assert breakers_open(d, "other", 6.0) is None  # c serves it, its breaker closed
    with pytest.raises(NoHealthyReplica):
        check_servable(d, "m", 0.0, now=6.0)
    check_servable(d, "m", 0.0)  # without a time: the old answer (the request queues)


def test_clients_turned_away_by_open_breakers_come_back_spread_after_the_trial() -> None:
    """Before the fix every client told to wait for the first trial was told the same
    instant: a queue's worth came back at once, one took the trial, the rest were queued
    behind it or refused again."""
    d = _breakers()
    _failing(d, "a", 0.0, 1)
    _failing(d, "b", 5.0, 1)
    trial = OPEN_S - 6.0  # a's
    answers = [breakers_open(d, "m", 6.0, u) for u in (0.0, 0.25, 0.5, 0.999)]
    waits = [exc.retry_after_s for exc in answers if exc is not None]
    assert waits == sorted(set(waits)) and len(waits) == 4  # one wait per draw, rising
    assert waits[0] == pytest.approx(trial)  # never before the trial: refused again
    assert waits[-1] == pytest.approx(trial + 0.999 * BREAKER_SPREAD_S)
    assert len({exc.message for exc in answers if exc is not None}) == 1  # the trial's time
    with pytest.raises(NoHealthyReplica) as exc:
        check_servable(d, "m", 0.5, now=6.0)  # the request's own draw
    assert exc.value.retry_after_s == pytest.approx(trial + 0.5 * BREAKER_SPREAD_S)
    # A trial due in a moment still spreads them over whole seconds of Retry-After.
    soon = [breakers_open(d, "m", OPEN_S - 0.1, u) for u in (0.0, 0.9)]
    assert [exc.headers()["Retry-After"] for exc in soon if exc is not None] == ["1", "2"]


def test_a_due_trial_lets_the_request_queue() -> None:
    d = _breakers()
    _failing(d, "a", 0.0, 1)
    _failing(d, "b", 5.0, 1)
    assert breakers_open(d, "m", OPEN_S) is None  # a's trial is due: it may take one
    check_servable(d, "m", 0.0, now=OPEN_S)


def test_an_unhealthy_replica_is_not_waited_for() -> None:
    """A replica that is down is outage's business; the one up decides alone."""
    d = _breakers()
    d.set_healthy("b", False)
    _failing(d, "a", 2.0, 1)
    exc = breakers_open(d, "m", 3.0)
    assert exc is not None and exc.retry_after_s == pytest.approx(OPEN_S - 1.0)


def test_a_peer_that_serves_the_model_takes_it_unless_forwarded() -> None:
    d = _breakers(peer_policy=build_policy("round-robin"))
    d.set_peers(["eu"])
    d.on_peer_heartbeat("eu", 0.0, 1, 1, {"m": ModelLoad(1, 1, 0, 0)})
    d.set_peer_alive("eu", True)
    _failing(d, "a", 0.0, 1)
    _failing(d, "b", 0.0, 1)
    assert breakers_open(d, "m", 1.0) is None
    assert breakers_open(d, "m", 1.0, forwarded=True) is not None
    d.set_peer_alive("eu", False)
    assert breakers_open(d, "m", 1.0) is not None


def _answer(check: Callable[..., None], *args: Any, **kw: Any
            ) -> tuple[str, str, float | None] | None:
    try:
        check(*args, **kw)
    except SkyMeshError as exc:
        return type(exc).__name__, exc.message, getattr(exc, "retry_after_s", None)
    return None


@pytest.mark.parametrize("down", [(), ("a",), ("a", "b"), ("c",), ("a", "b", "c")])
@pytest.mark.parametrize("open_", [(), ("a",), ("a", "b")])
@pytest.mark.parametrize("now", [None, 6.0, OPEN_S])
@pytest.mark.parametrize("unlisted", [False, True])
def test_check_servable_s_shortcut_answers_as_the_full_checks(
        down: tuple[str, ...], open_: tuple[str, ...], now: float | None,
        unlisted: bool) -> None:
    """The usual case (a healthy replica serves the model and no breaker is open) is
    read from the dispatcher's health summary; every state answers as the full checks
    (``servable_fully``, the function before the shortcut)."""
    d = _breakers()
    if unlisted:  # a replica that has not said which models it serves
        d.set_targets({**{t: d.targets[t].models for t in d.targets}, "d": []})
    for i, target in enumerate(open_):
        _failing(d, target, float(i * 5), 1)
    for target in down:
        d.set_healthy(target, False)
    for model in ("m", "other", "nope"):
        for u in (0.0, 0.5):
            want = _answer(servable_fully, d, model, u, now=now)
            assert _answer(check_servable, d, model, u, now=now) == want
