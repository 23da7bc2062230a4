"""sp-p's n x margin for several balancers per region (``pushing.balancers_per_region``).

A fake clock throughout: times are plain floats handed to the bookkeeping. The reference
``as_shipped`` below is sp-p's rule as it was before the margin, kept verbatim so that
n = 1 is checked against it on random histories, not against itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh.balancer.config import ConfigError, parse_config
from skymesh.balancer.controller_link import region_balancers
from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode, ReplicaLoad, is_available

LAG = 1.0


def as_shipped(load: ReplicaLoad, kv_headroom: float = 0.9, request_tokens: int = 0) -> bool:
    """sp-p's availability before the margin (commit 2dcce82), for the n = 1 check."""
    seqs = load.max_num_seqs
    if load.waiting > (load.freed_since_probe if seqs is not None else 0):
        return False
    if seqs is not None and load.slots_taken >= seqs:
        return False
    if not load.unadmitted:
        return True
    cap = load.kv_capacity_tokens
    if cap is None:
        return False
    new = load.unadmitted_tokens + request_tokens
    return new <= load.step_tokens and load.kv_usage * cap + new <= kv_headroom * cap


# -- n = 1 is the rule as shipped ------------------------------------------------------------
# One event of a random history: (kind, a small int, a time step).
EVENT = st.tuples(st.sampled_from(["probe", "dispatch", "first_byte", "complete",
                                   "complete_untimed"]),
                  st.integers(0, 12), st.floats(0.0, 0.6, allow_nan=False))


@settings(max_examples=300, deadline=None)
@given(seqs=st.one_of(st.none(), st.integers(1, 8)),
       cap=st.one_of(st.none(), st.integers(1_000, 50_000)),
       events=st.lists(EVENT, max_size=60), tokens=st.integers(0, 3_000))
def test_one_balancer_decides_exactly_as_before(seqs: int | None, cap: int | None,
                                                events: list[tuple[str, int, float]],
                                                tokens: int) -> None:
    ld = ReplicaLoad("r", max_num_seqs=seqs, metrics_lag_s=LAG, kv_capacity_tokens=cap)
    now, live, started, k = 0.0, [], set(), 0
    for kind, x, dt in events:
        now += dt
        if kind == "probe":
            ld.on_probe(now, waiting=x % 3, running=x, kv_usage=x / 20)
        elif kind == "dispatch":
            k += 1
            ld.on_dispatch(f"q{k}", now, tokens=100 * x)
            live.append(f"q{k}")
        elif live and kind == "first_byte":
            started.add(live[x % len(live)])
            ld.on_first_byte(live[x % len(live)])
        elif live:
            rid = live.pop(x % len(live))
            ld.on_complete(rid, now if kind == "complete" else None)
        want = as_shipped(ld, request_tokens=tokens)
        assert is_available(ld, PushMode.SP_P, request_tokens=tokens) is want
        assert is_available(ld, PushMode.SP_P, request_tokens=tokens, balancers=1) is want
        if seqs is None:  # the margin needs the admission limit: without it, no change
            assert is_available(ld, PushMode.SP_P, request_tokens=tokens, balancers=3) is want
        assert ld.recent == sum(1 for rid in live if ld._dispatched[rid] >= ld._shown_before)


# -- n = 2: siblings that see the same probe never overfill a replica ----------------------
@dataclass
class Sibling:
    """One balancer of the two, and what it has on the replica."""

    load: ReplicaLoad
    shown: list[str] = field(default_factory=list)  # dispatched before the probe's horizon
    pushed: list[str] = field(default_factory=list)  # since the horizon, still running


def two_siblings(seqs: int, own_shown: tuple[int, int], others: int
                 ) -> tuple[Sibling, Sibling, int]:
    """Both balancers' requests before the horizon, started; then one probe (published at
    2.0, horizon 1.0) that both read, showing theirs and ``others`` running."""
    sibs = []
    for b, n in enumerate(own_shown):
        s = Sibling(ReplicaLoad("r", max_num_seqs=seqs, metrics_lag_s=LAG))
        for i in range(n):
            rid = f"{b}-old{i}"
            s.load.on_dispatch(rid, 0.1 * i)
            s.load.on_first_byte(rid)
            s.shown.append(rid)
        sibs.append(s)
    running = sum(own_shown) + others
    for s in sibs:
        s.load.on_probe(2.0, waiting=0, running=running, kv_usage=0.0)
    return sibs[0], sibs[1], running


@settings(max_examples=300, deadline=None)
@given(seqs=st.integers(2, 12), data=st.data())
def test_two_balancers_on_one_probe_never_overfill_the_replica(seqs: int,
                                                               data: st.DataObject) -> None:
    mine = data.draw(st.tuples(st.integers(0, seqs), st.integers(0, seqs)))
    others = data.draw(st.integers(0, max(0, seqs - sum(mine))))
    if sum(mine) > seqs:
        mine = (mine[0], seqs - mine[0])
    a, b, occupancy = two_siblings(seqs, mine, others)
    # Until the next probe: pushes (started at once or not), and completions of requests
    # the probe showed, in any order the strategy picks, on either balancer.
    now, k = 2.0, 0
    steps = data.draw(st.lists(st.tuples(st.booleans(), st.sampled_from(
        ["push", "push_started", "complete_shown", "complete_pushed"])), max_size=40))
    for on_a, what in steps:
        s = a if on_a else b
        now += 0.01
        if what.startswith("push"):
            if not is_available(s.load, PushMode.SP_P, balancers=2):
                continue
            k += 1
            s.load.on_dispatch(f"n{k}", now)
            if what == "push_started":
                s.load.on_first_byte(f"n{k}")
            s.pushed.append(f"n{k}")
            occupancy += 1
        elif what == "complete_shown" and s.shown:
            s.load.on_complete(s.shown.pop(), now)
            occupancy -= 1
        elif what == "complete_pushed" and s.pushed:
            s.load.on_complete(s.pushed.pop(), now)
            occupancy -= 1
        assert occupancy <= seqs, (mine, others, steps)


@settings(max_examples=200, deadline=None)
@given(seqs=st.integers(2, 12), shown=st.integers(0, 12))
def test_siblings_leave_at_most_one_slot_idle_and_one_fills_its_share(seqs: int,
                                                                      shown: int) -> None:
    """Without the margin both fill every free slot (overfill); with it, pushing until
    both refuse leaves at most n - 1 = 1 slot idle."""
    shown = min(shown, seqs)
    for n, want_overfill in ((1, True), (2, False)):
        total, k = shown, 0
        a, b, _ = two_siblings(seqs, (0, 0), shown)
        while True:
            pushed = False
            for s in (a, b):
                if is_available(s.load, PushMode.SP_P, balancers=n):
                    k += 1
                    s.load.on_dispatch(f"n{k}", 2.0 + 0.01 * k)
                    s.load.on_first_byte(f"n{k}")
                    total, pushed = total + 1, True
            if not pushed:
                break
        if want_overfill:
            assert total > seqs or shown == seqs
        else:
            assert seqs - 1 <= total <= seqs


def test_the_share_counts_started_requests_the_sibling_cannot_see() -> None:
    """A request of ours that started after the probe's horizon is on the replica and in
    no probe yet: it takes n slots of the share, not one (the hole the unadmitted count
    left open with two balancers)."""
    a, _, _ = two_siblings(4, (0, 0), 0)
    a.load.on_dispatch("n1", 2.1)
    a.load.on_first_byte("n1")
    assert a.load.recent == 1 and a.load.unadmitted == 0
    assert is_available(a.load, PushMode.SP_P, balancers=2)  # 0 + 2 x 2 <= 4
    a.load.on_dispatch("n2", 2.2)
    a.load.on_first_byte("n2")
    assert not is_available(a.load, PushMode.SP_P, balancers=2)
    assert is_available(a.load, PushMode.SP_P, balancers=1)  # one balancer: 2 of 4 used
    # A probe whose horizon passes both shows them: they leave the share.
    a.load.on_probe(3.3, waiting=0, running=2, kv_usage=0.0)
    assert a.load.recent == 0 and is_available(a.load, PushMode.SP_P, balancers=2)


def test_a_replica_below_the_balancer_count_still_gets_work() -> None:
    a, _, _ = two_siblings(1, (0, 0), 0)
    assert is_available(a.load, PushMode.SP_P, balancers=3)
    a.load.on_dispatch("n1", 2.1)
    assert not is_available(a.load, PushMode.SP_P, balancers=3)


def test_the_dispatcher_applies_its_balancer_count() -> None:
    d = Dispatcher(build_policy("least-load"), PushMode.SP_P, hold_s=0,
                   balancers_per_region=2)
    d.set_targets({"r": ["m"]})
    d.on_probe("r", 2.0, waiting=0, running=1, kv_usage=0.0, kv_capacity_tokens=1 << 20,
               max_num_seqs=4, metrics_lag_s=LAG)
    for i in range(3):
        d.offer(Ticket(RouteRequest(f"k{i}", model="m"), 2.1), 2.1)
    # Free 3, share floor(3 / 2) = 1: one goes, two wait at the balancer.
    assert len(d.pump(2.1)) == 1 and d.queued == 2
    d.balancers_per_region = 1  # as a reload or the controller's count would set it
    assert len(d.pump(2.2)) == 2


# -- configuration and the controller's count ----------------------------------------------
@pytest.mark.parametrize("value", [0, -1, "two", True, 1.5, None])
def test_a_bad_balancer_count_is_refused_naming_the_key(value: object) -> None:
    with pytest.raises(ConfigError, match=r"pushing\.balancers_per_region.*integer >= 1"):
        parse_config({"pushing": {"balancers_per_region": value}})


def test_balancer_count_values() -> None:
    assert parse_config({}).pushing.balancers() == 1
    assert parse_config({"pushing": {"balancers_per_region": 3}}).pushing.balancers() == 3
    with pytest.raises(ConfigError, match=r"balancers_per_region.*controller"):
        parse_config({"pushing": {"balancers_per_region": "auto"}})
    cfg = parse_config({"pushing": {"balancers_per_region": "auto"},
                        "controller": {"url": "http://127.0.0.1:1", "balancer_id": "a"}})
    assert cfg.pushing.balancers() == 1  # until the controller answers


def test_region_balancers_from_membership() -> None:
    peers = [{"id": "b", "region": "us"}, {"id": "c", "region": "eu"}]
    assert region_balancers({"peers": peers, "region_balancers": 3}, "us") == 3
    # From a controller that does not send the count: this one and its same-region peers.
    assert region_balancers({"peers": peers}, "us") == 2
    assert region_balancers({"peers": []}, "us") == 1
