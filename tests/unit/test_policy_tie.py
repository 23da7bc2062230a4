"""A request's tie-break key (``RouteRequest.tie``): drawn once by the dispatcher, it makes
a policy's answer a pure function of the request and the state it read, so re-asks at
later pumps can be skipped without changing a decision."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st
from support import View

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import RouteRequest, build_policy
from skymesh.policies.load import PushMode

TARGETS = ("a", "b", "c", "d")


def _view(outstanding: list[int]) -> View:
    return View().set(**dict(zip(TARGETS, outstanding, strict=False)))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 3), min_size=2, max_size=4), st.integers(0, 2**32 - 1))
def test_a_tie_key_answers_alike_at_every_ask_and_never_draws(
        loads: list[int], tie: int) -> None:
    view, cands = _view(loads), list(TARGETS[:len(loads)])
    p = build_policy("least-load", rng=random.Random(3))
    state = p.rng.getstate()
    req = RouteRequest("r", tie=tie)
    answers = {p.select(req, cands, view) for _ in range(5)}
    assert len(answers) == 1 and p.draws == 0 and p.rng.getstate() == state
    (answer,) = answers
    assert view.load(answer).outstanding == min(loads)  # still the least loaded


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=2, max_size=4, unique=True),
       st.integers(0, 2**32 - 1))
def test_without_a_tie_the_key_changes_nothing(loads: list[int], tie: int) -> None:
    """No tie: the answer is the plain path's, key or not, and nothing draws."""
    view, cands = _view(loads), list(TARGETS[:len(loads)])
    plain, keyed = (build_policy("least-load", rng=random.Random(3)) for _ in range(2))
    assert plain.select(RouteRequest("r"), cands, view) == \
        keyed.select(RouteRequest("r", tie=tie), cands, view)
    assert plain.draws == keyed.draws == 0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 3), st.integers(0, 3), st.one_of(st.none(), st.integers(0, 2**32 - 1)),
       st.booleans())
def test_two_candidates_are_settled_as_argmin_settles_them(
        a: int, b: int, tie: int | None, swap: bool) -> None:
    """``_least_loaded``'s shortcut for two candidates (one comparison) gives ``_argmin``'s
    answer over the same loads, and draws from the RNG exactly when it does (a tie without
    a key): the same decisions and the same random stream after them."""
    view, cands = _view([a, b]), ["b", "a"] if swap else ["a", "b"]
    short, full = (build_policy("least-load", rng=random.Random(5)) for _ in range(2))
    req = RouteRequest("r", tie=tie)
    loads = [view.load(t).outstanding for t in cands]
    assert short._least_loaded(cands, view, req) == full._argmin(cands, loads, req)
    assert short.draws == full.draws and short.rng.getstate() == full.rng.getstate()


def test_tie_keys_spread_requests_over_the_tied_targets() -> None:
    view = _view([1, 1, 1, 5])
    p = build_policy("least-load")
    rng = random.Random(0)
    picks = Counter(p.select(RouteRequest(f"r{i}", tie=rng.getrandbits(32)), TARGETS, view)
                    for i in range(600))
    assert set(picks) == {"a", "b", "c"} and min(picks.values()) > 150


def test_prefix_tree_breaks_a_tie_between_holders_by_the_key() -> None:
    """Two replicas hold the prompt's prefix with equal loads: the preferred one is the
    same at every ask (no draw), and differs between requests as their keys do."""
    p = build_policy("prefix-tree", rng=random.Random(1))
    keys = (11, 12, 13)
    p.on_dispatch(RouteRequest("x", prefix_keys=keys), "a", _view([0, 0]))
    p.on_dispatch(RouteRequest("y", prefix_keys=keys), "b", _view([0, 0]))
    view = _view([2, 2, 0, 0])
    prefs = set()
    for tie in range(8):
        req = RouteRequest("r", prefix_keys=keys, tie=tie)
        got = {p.preferred(req, TARGETS, view) for _ in range(3)}
        assert len(got) == 1
        prefs |= got
    assert prefs == {"a", "b"} and p.draws == 0


def test_a_key_follows_the_request_not_its_arrival() -> None:
    """Two dispatchers with identically seeded policies give a request the same key
    whatever order requests reach them in (simulated runs of one workload stay paired)."""
    keys = []
    for order in (range(20), reversed(range(20))):
        d = Dispatcher(build_policy("prefix-tree", rng=random.Random(5)), PushMode.SP_P)
        d.set_targets({"a": ("m",)})
        tickets = {i: Ticket(RouteRequest(f"r{i}", model="m"), 0.0) for i in order}
        for t in tickets.values():
            d.offer(t, 0.0)
        keys.append([tickets[i].route.tie for i in range(20)])
    assert keys[0] == keys[1] and len(set(keys[0])) == 20


def test_the_dispatcher_draws_a_request_key_once() -> None:
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(5)), PushMode.SP_P)
    d.set_targets({"a": ("m",)})
    t = Ticket(RouteRequest("r", model="m", prefix_keys=(1, 2)), 0.0)
    d.offer(t, 0.0)
    tie = t.route.tie
    assert tie is not None
    assert d.pump(0.0) == [t]
    d.complete(t, 0.1, ok=False, replica_fault=True)
    d.offer(t, 0.1, front=True)  # a retry keeps its key
    assert t.route.tie == tie
    given_key = Ticket(replace(RouteRequest("s", model="m"), tie=7), 0.0)
    d.offer(given_key, 0.2)
    assert given_key.route.tie == 7


def test_a_pump_where_nothing_can_take_a_request_asks_the_policy_nothing() -> None:
    """Every replica busy (requests waiting inside it, so none available, and none below
    its queue for requests holding their prefix there): the pump asks nothing, however
    many memos the events since dropped; a replica that frees is offered to the queue."""
    d = Dispatcher(build_policy("prefix-tree", rng=random.Random(1)), PushMode.SP_P,
                   prefer_queue=2)
    d.set_targets({"a": ("m",), "b": ("m",)})
    for tid in ("a", "b"):
        d.on_probe(tid, 0.0, waiting=2, running=4, kv_usage=0.5, kv_capacity_tokens=10_000,
                   max_num_seqs=4)
    for i in range(5):
        d.offer(Ticket(RouteRequest(f"r{i}", model="m", prompt_len=10,
                                    prefix_keys=(1, 2, 3 + i)), 0.0), 0.0)
    with mock.patch.object(d.policy, "preferred", wraps=d.policy.preferred) as asked:
        assert d.pump(0.1) == []
        for k in range(5):  # loads change, none frees
            d.on_probe("a", 0.2 + k / 10, waiting=2 + k, running=4, kv_usage=0.5,
                       max_num_seqs=4)
            assert d.pump(0.2 + k / 10) == []
        assert asked.call_count == 0
        d.on_probe("b", 1.0, waiting=0, running=0, kv_usage=0.0, max_num_seqs=4)
        assert [t.target for t in d.pump(1.0)][:1] == ["b"]
        assert asked.call_count > 0


def test_a_route_compares_and_hashes_without_its_tie_key_which_is_set_once() -> None:
    """RouteRequest is a plain slots dataclass (a frozen one's __init__ cost 0.86 us more
    per request): equality and hash are still over its fields but the tie key, which
    ``set_tie`` gives once."""
    a, b = RouteRequest("r", prefix_keys=(1, 2)), RouteRequest("r", prefix_keys=(1, 2))
    a.set_tie(7)
    a.set_tie(9)  # a request keeps its first key
    assert a.tie == 7 and b.tie is None
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert replace(a, forwarded=True) != a and replace(a, forwarded=True).tie == 7
