"""The policy registry and the load-only baselines."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest

from skymesh.policies import PolicyConfigError, RouteRequest, build_policy, policy_names
from skymesh.policies.load import PushMode, ReplicaLoad, is_available


@dataclass
class View:
    loads: dict[str, ReplicaLoad] = field(default_factory=dict)
    now: float = 0.0

    def load(self, target: str) -> ReplicaLoad:
        return self.loads.setdefault(target, ReplicaLoad(target))


REQ = RouteRequest("x")


def test_registry_lists_the_baselines_and_rejects_unknowns() -> None:
    assert {"round-robin", "random", "least-load"} <= set(policy_names())
    with pytest.raises(PolicyConfigError, match="no-such"):
        build_policy("no-such")
    with pytest.raises(PolicyConfigError, match="'bogus'"):
        build_policy("round-robin", {"bogus": 1})


def test_round_robin_rotates_and_skips_unavailable_targets_fairly() -> None:
    p = build_policy("round-robin")
    view = View()
    picks = [p.select(REQ, ["a", "b", "c"], view) for _ in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]
    assert p.select(REQ, ["a", "b"], view) == "a"  # after c wraps to a
    assert p.select(REQ, ["a", "c"], view) == "c"
    assert p.select(REQ, [], view) is None


def test_random_is_reproducible_from_its_seed() -> None:
    view = View()
    cands = [f"r{i}" for i in range(8)]
    a = build_policy("random", rng=random.Random(1))
    b = build_policy("random", rng=random.Random(1))
    seq_a = [a.select(REQ, cands, view) for _ in range(20)]
    assert seq_a == [b.select(REQ, cands, view) for _ in range(20)]
    assert len(set(seq_a)) > 3


def test_least_load_picks_the_fewest_outstanding() -> None:
    view = View()
    view.load("a").on_dispatch("1", 0.0)
    view.load("a").on_dispatch("2", 0.0)
    view.load("b").on_dispatch("3", 0.0)
    view.load("c").on_probe(0.0, waiting=3, running=2, kv_usage=0.5)
    p = build_policy("least-load")
    assert p.select(REQ, ["a", "b", "c"], view) == "b"


def test_pushing_modes() -> None:
    ld = ReplicaLoad("r")
    assert is_available(ld, PushMode.SP_P)
    ld.on_probe(1.0, waiting=0, running=3, kv_usage=0.2)
    ld.on_dispatch("q1", 1.5)
    # Pushed after the probe and not started: the probe can't show it yet.
    assert not is_available(ld, PushMode.SP_P)
    ld.on_first_byte("q1")
    assert is_available(ld, PushMode.SP_P)
    ld.on_probe(2.0, waiting=2, running=4, kv_usage=0.9)
    assert not is_available(ld, PushMode.SP_P)
    assert is_available(ld, PushMode.BP)
    assert is_available(ld, PushMode.SP_O, max_outstanding=2)
    ld.on_dispatch("q2", 2.1)
    assert not is_available(ld, PushMode.SP_O, max_outstanding=2)
    ld.on_complete("q1")
    ld.on_complete("q2")
    assert ld.in_flight == 0 and ld.unadmitted == 0


def test_pushed_requests_stay_unadmitted_until_a_probe_past_the_metrics_lag() -> None:
    ld = ReplicaLoad("r", metrics_lag_s=1.0)
    ld.on_probe(0.0, waiting=0, running=0, kv_usage=0.0)
    ld.on_dispatch("q1", 0.5, tokens=100)
    ld.on_dispatch("q2", 0.6, tokens=50)
    ld.on_probe(1.0, waiting=0, running=0, kv_usage=0.0)  # shows the state of 0.0
    assert (ld.unadmitted, ld.unadmitted_tokens) == (2, 150)
    ld.on_probe(1.55, waiting=0, running=1, kv_usage=0.0)  # shows 0.55: q1 is in it
    assert (ld.unadmitted, ld.unadmitted_tokens) == (1, 50)
    ld.on_first_byte("q2")  # started: no longer unadmitted, still ours on the replica
    assert ld.unadmitted == 0 and ld.in_flight == 2 and ld.outstanding == 2
    ld.on_probe(0.2, waiting=0, running=0, kv_usage=0.0)  # a late answer: not backwards
    ld.on_dispatch("q3", 1.56)
    assert ld.unadmitted == 1
    ld.on_complete("q1")
    ld.on_complete("q2")
    ld.on_complete("q3")
    assert (ld.in_flight, ld.unadmitted, ld.unadmitted_tokens) == (0, 0, 0)


@pytest.mark.parametrize(("running", "in_flight", "waiting", "available"), [
    (3, 0, 0, True),
    (4, 0, 0, False),  # the engine's limit reached, as its probe shows
    (0, 4, 0, False),  # ours, started but not in the (lagging) probe yet
    (2, 3, 0, True),
    (0, 0, 1, False),  # waiting inside: never push more
])
def test_sp_p_keeps_a_replica_under_its_max_num_seqs(
        running: int, in_flight: int, waiting: int, available: bool) -> None:
    ld = ReplicaLoad("r", max_num_seqs=4, kv_capacity_tokens=1 << 20)
    ld.on_probe(1.0, waiting=waiting, running=running, kv_usage=0.0)
    for i in range(in_flight):
        ld.on_dispatch(f"q{i}", 0.5)  # before the probe, which (lag 0) shows them
        ld.on_first_byte(f"q{i}")
    assert is_available(ld, PushMode.SP_P) is available
    ld.max_num_seqs = None  # unknown: only waiting and the KV rule hold it back
    assert is_available(ld, PushMode.SP_P) is (waiting == 0)
