"""The balancer's pure decision core: queue, availability, breaker, outcomes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from skymesh.balancer.breaker import Breaker, BreakerState
from skymesh.balancer.config import ConfigError, parse_config
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
    t.excluded = {first}
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


# -- sp-p against an engine whose gauges lag (fake clock) ---------------------------------
@dataclass
class _Engine:
    """A replica as vLLM behaves: at most ``max_num_seqs`` running, the rest waiting; a
    request reaches the scheduler ``admit_delay`` after dispatch (the API server's own
    work), and /metrics shows the state of ``gauge_lag`` ago."""

    max_num_seqs: int
    admit_delay: float
    gauge_lag: float
    arriving: list[tuple[float, Ticket]] = field(default_factory=list)
    waiting: list[Ticket] = field(default_factory=list)
    running: dict[str, tuple[Ticket, float]] = field(default_factory=dict)  # key -> start
    history: list[tuple[float, int, int]] = field(default_factory=lambda: [(-1.0, 0, 0)])

    def published(self, now: float) -> tuple[int, int]:
        shown = now - self.gauge_lag
        _, w, r = next(h for h in reversed(self.history) if h[0] <= shown)
        return w, r


def _burst(n: int, *, max_num_seqs: int | None, gauge_lag: float, admit_delay: float,
           lag_s: float, probe_every: float = 0.1, ttft: float = 0.05, duration: float = 2.0
           ) -> tuple[int, int, int]:
    """``n`` streams at once onto two replicas of limit 4 under sp-p, on a 10 ms fake
    clock; returns (most waiting inside one engine, most queued at the balancer,
    completed)."""
    d = Dispatcher(build_policy("least-load"), PushMode.SP_P, hold_s=0)
    engines = {t: _Engine(4, admit_delay, gauge_lag) for t in ("a", "b")}
    d.set_targets({t: ["m"] for t in engines})
    for i in range(n):
        d.offer(ticket(i), 0.0)
    max_waiting = max_queue = done = 0
    next_probe = 0.0
    for step in range(6000):
        now = step * 0.01
        for tid, e in engines.items():
            for at, t in [a for a in e.arriving if a[0] <= now]:
                e.arriving.remove((at, t))
                e.waiting.append(t)
            for key, (t, start) in list(e.running.items()):
                if now >= start + duration:
                    del e.running[key]
                    d.complete(t, now, ok=True)
                    done += 1
            while e.waiting and len(e.running) < e.max_num_seqs:
                t = e.waiting.pop(0)
                e.running[t.key] = (t, now)
            for t, start in e.running.values():
                if start + ttft <= now < start + ttft + 0.01:
                    d.first_byte(t)
            e.history.append((now, len(e.waiting), len(e.running)))
            max_waiting = max(max_waiting, len(e.waiting))
            if now >= next_probe:
                w, r = e.published(now)
                d.on_probe(tid, now, w, r, 0.01, 1 << 20, max_num_seqs=max_num_seqs,
                           metrics_lag_s=lag_s)
        if now >= next_probe:
            next_probe += probe_every
        for t in d.pump(now):
            engines[t.target or ""].arriving.append((now + admit_delay, t))
        max_queue = max(max_queue, d.queue_length())
        if done == n:
            break
    return max_waiting, max_queue, done


@pytest.mark.parametrize(("gauge_lag", "admit_delay", "lag_s"), [
    (0.0, 0.0, 0.0),  # the simulator's engine: probes read the state itself
    (0.9, 0.0, 1.0),  # gauges published late (the emulator's model)
    (0.0, 0.9, 1.0),  # requests reach the scheduler late (vLLM's API server under load)
    (0.9, 0.9, 1.0),
    (0.9, 0.9, 0.0),  # a lag not configured: our own in-flight count still holds the line
])
def test_sp_p_burst_queues_at_the_balancer_not_in_the_engine(
        gauge_lag: float, admit_delay: float, lag_s: float) -> None:
    waiting, queued, done = _burst(48, max_num_seqs=4, gauge_lag=gauge_lag,
                                   admit_delay=admit_delay, lag_s=lag_s)
    assert done == 48
    assert waiting == 0  # never more than max_num_seqs pushed to one replica
    assert queued >= 48 - 2 * 4  # the rest waited here


def test_sp_p_burst_without_max_num_seqs_piles_into_the_engine() -> None:
    # What issue 20 saw on real vLLM: a published KV capacity lets short prompts through
    # by the step budget, so a burst lands inside the engines.
    waiting, _, done = _burst(48, max_num_seqs=None, gauge_lag=0.9, admit_delay=0.9,
                              lag_s=1.0)
    assert done == 48 and waiting > 4


def test_pushing_limits_come_from_the_replica_then_the_engine_then_pushing() -> None:
    cfg = parse_config({
        "pushing": {"max_num_seqs": 8},
        "replicas": [{"url": "http://127.0.0.1:1"},
                     {"url": "http://127.0.0.1:2", "kind": "sglang"},
                     {"url": "http://127.0.0.1:3", "max_num_seqs": 2, "metrics_lag_s": 0.25}],
    })
    vllm, sglang, own = cfg.replicas
    assert vllm.pushing_limits(cfg.pushing, None) == (8, 1.0)
    assert vllm.pushing_limits(cfg.pushing, 4) == (4, 1.0)  # what the engine publishes
    assert sglang.pushing_limits(cfg.pushing, None) == (8, 0.0)
    assert own.pushing_limits(cfg.pushing, 4) == (2, 0.25)
    with pytest.raises(ConfigError, match=r"pushing\.metrics_lag_s"):
        parse_config({"pushing": {"metrics_lag_s": -1}})
    with pytest.raises(ConfigError, match=r"replicas\.0\.max_num_seqs"):
        parse_config({"replicas": [{"url": "http://127.0.0.1:1", "max_num_seqs": 0}]})


def test_no_hold_for_a_replica_behind_an_open_breaker() -> None:
    # The stall of rss_soak --leave-hold-ms 5 (session 26): requests whose prefix a
    # replica holds waited hold_s for it while its breaker was open, the other replica
    # idle. An open breaker lets nothing through before open_s (10 s by default), so a
    # hold for it can only end in its expiry: the request goes where it can at once.
    d = _prefer("a")
    d.hold_s = 2.0
    d.targets["a"].breaker = Breaker(failure_threshold=1, open_s=10.0)
    d._changed()  # (a breaker swapped in place: as a membership change would)
    fail = Ticket(RouteRequest("x", model="m"), 0.0)
    d.offer(fail, 0.0)
    assert [t.target for t in d.pump(0.0)] == ["a"]
    d.complete(fail, 0.0, ok=False, replica_fault=True)
    assert d.targets["a"].breaker.state is BreakerState.OPEN
    held = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    d.offer(held, 0.1)
    assert d.pump(0.1) == [held] and held.target == "b"


def test_no_hold_for_a_replica_whose_trial_is_in_flight() -> None:
    d = _prefer("a")
    d.targets["a"].breaker = Breaker(failure_threshold=1, open_s=1.0)
    d._changed()
    fail = Ticket(RouteRequest("x", model="m"), 0.0)
    d.offer(fail, 0.0)
    d.pump(0.0)
    d.complete(fail, 0.0, ok=False, replica_fault=True)
    trial = Ticket(RouteRequest("y", model="m"), 0.0)
    d.offer(trial, 1.0)
    assert d.pump(1.0) == [trial] and trial.target == "a"  # half-open: the trial
    assert d.targets["a"].breaker.trial_in_flight
    held = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    d.offer(held, 1.1)
    assert d.pump(1.1) == [held] and held.target == "b"


def test_no_hold_for_a_replica_the_request_failed_on() -> None:
    d = _prefer("a")
    retry = Ticket(RouteRequest("cached-1", model="m"), 0.0)
    d.offer(retry, 0.0)
    [retry] = d.pump(0.0)
    assert retry.target == "a"
    d.complete(retry, 0.1, ok=False, replica_fault=True)
    retry.excluded = {"a"}
    d.offer(retry, 0.1, front=True)
    assert d.pump(0.1) == [retry] and retry.target == "b"


def test_tickets_share_an_empty_exclusion_that_a_failure_never_changes() -> None:
    # No set per request: every ticket starts with the same empty frozenset, and a failed
    # attempt gives its ticket a new set (Forwarder.serve), leaving the others' alone.
    a, b = ticket(1), ticket(2)
    assert a.excluded is b.excluded and not a.excluded
    a.excluded = a.excluded | {"x"}
    assert a.excluded == {"x"} and not b.excluded and not ticket(3).excluded
