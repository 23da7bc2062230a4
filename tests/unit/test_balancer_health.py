"""The balancer's health tracker on a fake clock: up/down transitions with their
thresholds, models listing and its interval, probe age, a dead replica's null figures,
membership, and what the dispatcher is told (it routes on the tracker's state only)."""

from __future__ import annotations

import pytest

from skymesh.balancer.config import ReplicaConfig
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.balancer.health import HealthTracker
from skymesh.common.health import HealthRule, Streak
from skymesh.common.probe import ProbeResult
from skymesh.policies import build_policy
from skymesh.policies.base import RouteRequest

A, B = "http://10.0.0.1:8000", "http://10.0.0.2:8000"
LOAD = ProbeResult(waiting=3, running=2, kv_usage=0.25)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def tracker(*urls: str, models: list[str] | None = None, failures: int = 3, successes: int = 2,
            sink: Dispatcher | None = None) -> tuple[HealthTracker, FakeClock]:
    clock = FakeClock()
    reps = [ReplicaConfig(url=u, models=models) for u in urls]
    return HealthTracker(reps, HealthRule(failures, successes), models_interval_s=10.0,
                         clock=clock, sink=sink), clock


def dispatcher() -> Dispatcher:
    return Dispatcher(build_policy("round-robin"))


@pytest.mark.parametrize(("current", "results", "expected"), [
    # unknown (the controller's start state) moves only when a threshold is reached
    (None, [True], None),
    (None, [True, True], True),
    (None, [False, False], None),
    (None, [False, False, False], False),
    # one lost probe does not take a replica down; a streak is broken by the other kind
    (True, [False, False, True, False, False], True),
    (True, [False, False, False], False),
    (False, [True, False, True], False),
    (False, [True, True], True),
])
def test_the_rule_needs_a_streak_to_move(current: bool | None, results: list[bool],
                                         expected: bool | None) -> None:
    rule, streak = HealthRule(failure_threshold=3, success_threshold=2), Streak()
    state = current
    for ok in results:
        state = rule.step(streak, ok, state)
    assert state is expected


def test_first_contact_with_listed_models_is_up_at_once() -> None:
    health, clock = tracker(A)  # models not configured: the probe lists them
    h = health.replicas[A]
    assert health.wants_models(h, clock())
    health.models_listed(h, {"m"}, clock())
    assert health.probe_ok(h, LOAD, clock())
    assert h.healthy and health.healthy_count() == 1


def test_configured_models_need_the_success_threshold() -> None:
    health, clock = tracker(A, models=["m"], successes=2)
    h = health.replicas[A]
    assert not health.wants_models(h, clock())
    assert not health.probe_ok(h, LOAD, clock())
    assert not h.healthy
    clock.t += 0.1
    assert health.probe_ok(h, LOAD, clock())
    assert h.healthy


def test_down_after_the_failure_threshold_and_back_after_the_success_threshold() -> None:
    d = dispatcher()
    health, clock = tracker(A, B, models=["m"], sink=d)
    for url in (A, B):
        for _ in range(2):
            health.probe_ok(health.replicas[url], LOAD, clock())
    assert d.targets[A].healthy and d.targets[B].healthy
    h = health.replicas[A]
    assert not health.probe_failed(h, "connection refused")
    assert not health.probe_failed(h, "connection refused")
    assert h.healthy and d.targets[A].healthy  # two lost probes: still up
    assert health.probe_failed(h, "connection refused")
    assert not h.healthy and not d.targets[A].healthy
    assert health.healthy_count() == 1
    # Coming back takes success_threshold good probes in a row (a flapping replica does
    # not get traffic on its first good answer).
    assert not health.probe_ok(h, LOAD, clock())
    assert not health.probe_failed(h, "timeout")
    assert not health.probe_ok(h, LOAD, clock())
    assert not d.targets[A].healthy
    assert health.probe_ok(h, LOAD, clock())
    assert d.targets[A].healthy


def test_the_dispatcher_routes_only_to_what_the_tracker_says_is_up() -> None:
    d = dispatcher()
    health, clock = tracker(A, B, models=["m"], successes=1, failures=1, sink=d)
    health.probe_ok(health.replicas[A], LOAD, clock())
    ticket = Ticket(RouteRequest("r", model="m"), clock())
    assert d.candidates(ticket, clock()) == [A]  # B never answered
    health.probe_ok(health.replicas[B], LOAD, clock())
    health.probe_failed(health.replicas[A], "down")
    assert d.candidates(ticket, clock()) == [B]


def test_models_are_listed_again_only_after_the_interval() -> None:
    d = dispatcher()
    health, clock = tracker(A, sink=d)
    h = health.replicas[A]
    health.models_listed(h, {"m"}, clock())
    assert d.targets[A].models == frozenset({"m"})
    clock.t += 9.9
    assert not health.wants_models(h, clock())
    clock.t += 0.1
    assert health.wants_models(h, clock())
    health.models_listed(h, {"m", "n"}, clock())
    assert d.targets[A].models == frozenset({"m", "n"})


def test_probe_age_counts_from_when_the_last_good_probe_was_sent() -> None:
    health, clock = tracker(A, models=["m"])
    assert health.figures(A)["probe_age_s"] is None  # never probed
    sent = clock()
    clock.t += 0.05  # the answer comes later; the figures are as of the sending
    health.probe_ok(health.replicas[A], LOAD, sent)
    clock.t += 2.0
    assert health.figures(A)["probe_age_s"] == pytest.approx(2.05)
    assert health.figures(A)["waiting"] == 3


def test_a_dead_replica_shows_null_figures_not_its_last_good_ones() -> None:
    health, clock = tracker(A, models=["m"])
    h = health.replicas[A]
    sent = clock()
    health.probe_ok(h, LOAD, sent)
    assert health.figures(A) == {"waiting": 3, "running": 2, "kv_usage": 0.25,
                                 "probe_age_s": 0.0, "probe_error": None,
                                 "max_num_seqs_source": "unknown"}
    clock.t += 1.0
    health.probe_failed(h, "connection refused")
    assert health.figures(A) == {"waiting": None, "running": None, "kv_usage": None,
                                 "probe_age_s": 1.0, "probe_error": "connection refused",
                                 "max_num_seqs_source": "unknown"}
    # A good probe clears the error and shows fresh figures again.
    health.probe_ok(h, ProbeResult(waiting=0, running=1, kv_usage=0.1), clock())
    assert health.figures(A)["probe_error"] is None
    assert health.figures(A)["running"] == 1
    assert health.figures("http://unknown:1")["waiting"] is None


def test_membership_keeps_the_state_of_replicas_that_stay() -> None:
    d = dispatcher()
    health, clock = tracker(A, models=["m"], successes=1, sink=d)
    health.probe_ok(health.replicas[A], LOAD, clock())
    added, removed = health.set_replicas([ReplicaConfig(url=A, models=["m"]),
                                          ReplicaConfig(url=B, models=["m"])])
    assert (added, removed) == ({B}, set())
    assert health.replicas[A].healthy and d.targets[A].healthy
    assert not health.replicas[B].healthy and not d.targets[B].healthy
    added, removed = health.set_replicas([ReplicaConfig(url=B, models=["n"])])
    assert (added, removed) == (set(), {A})
    assert set(d.targets) == {B} and d.targets[B].models == frozenset({"n"})


def test_a_probe_that_ends_after_its_replica_left_touches_nothing_shared() -> None:
    d = dispatcher()
    health, clock = tracker(A, B, models=["m"], successes=1, sink=d)
    gone = health.replicas[A]
    health.set_replicas([ReplicaConfig(url=B, models=["m"])])
    health.probe_ok(gone, LOAD, clock())  # its probe was on the way
    assert A not in health.replicas and A not in d.targets
    assert health.healthy_count() == 0


def test_the_controller_judges_with_the_same_rule() -> None:
    """The controller's probing (skymesh_controller.service) maps its stored states onto
    the rule ('unknown' and any other state it does not name are unknown)."""
    from skymesh_controller.config import parse_config
    from skymesh_controller.service import Controller
    from skymesh_controller.store import MemoryStore

    ctl = Controller(parse_config({"probe": {"failure_threshold": 2, "success_threshold": 2}}),
                     MemoryStore())
    key = ("r", "r1")
    state = "unknown"
    seen = []
    for ok in (True, True, False, False, True, False, False):
        state = ctl._judge(key, ok, state, "healthy", "unhealthy")
        seen.append(state)
    assert seen == ["unknown", "healthy", "healthy", "unhealthy", "unhealthy", "unhealthy",
                    "unhealthy"]
