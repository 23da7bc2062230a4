"""``Policy.select_follows_preferred``: the dispatcher takes preferred()'s answer for
select()'s only where a policy declares them equal, and a subclass that changes either
method does not inherit the declaration."""

from __future__ import annotations

import random
from collections.abc import Sequence

from hypothesis import given, settings
from hypothesis import strategies as st
from support import View, chain

from skymesh.balancer.dispatch import Dispatcher, Ticket
from skymesh.policies import Policy, RouteRequest
from skymesh.policies.base import LoadView
from skymesh.policies.load import PushMode
from skymesh.policies.prefix_tree import PrefixTree

TARGETS = ("a", "b", "c")


class OtherSelect(PrefixTree):
    """Prefers the replica holding the prefix, as PrefixTree does, but selects the last
    candidate: select() does not follow preferred()."""

    def select(self, request: RouteRequest, candidates: Sequence[str], view: LoadView
               ) -> str | None:
        return candidates[-1] if candidates else None


class OtherPreferred(PrefixTree):
    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        return targets[0] if targets else None


def test_the_declaration_is_not_inherited_past_an_override() -> None:
    assert PrefixTree.select_follows_preferred
    assert not Policy.select_follows_preferred
    assert not OtherSelect.select_follows_preferred
    assert not OtherPreferred.select_follows_preferred


def _dispatched_to(policy: PrefixTree) -> str | None:
    """A request whose prompt only ``a`` holds, every replica free: where it goes."""
    d = Dispatcher(policy, PushMode.SP_P, prefer_queue=3)
    d.set_targets({t: ("m",) for t in TARGETS})
    for t in TARGETS:
        d.on_probe(t, 0.0, 0, 0, 0.0, 100_000, max_num_seqs=8)
    keys = tuple(chain([1, 2, 3, 4]))
    policy.trie.insert(keys, "a")
    out = d.pump(0.0)
    assert out == []
    d.offer(Ticket(RouteRequest("r1", model="m", prefix_keys=keys), 0.0), 0.0)
    out = d.pump(0.0)
    assert len(out) == 1
    return out[0].target


def test_the_dispatcher_asks_select_unless_the_policy_declares_it_follows() -> None:
    assert _dispatched_to(PrefixTree(rng=random.Random(0))) == "a"
    # The same preferred() answer ("a"), but select() says otherwise: select() decides.
    assert _dispatched_to(OtherSelect(rng=random.Random(0))) == "c"


@settings(max_examples=80, deadline=None)
@given(
    inserts=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6),
                               st.sampled_from(TARGETS)), max_size=12),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=6),
    loads=st.lists(st.integers(0, 3), min_size=3, max_size=3),
    tie=st.integers(0, 2**64 - 1),
)
def test_prefix_tree_select_answers_what_preferred_named(
        inserts: list[tuple[list[int], str]], prompt: list[int], loads: list[int],
        tie: int) -> None:
    p = PrefixTree(rng=random.Random(0))
    for seq, target in inserts:
        p.trie.insert(chain(seq), target)
    view = View().set(**dict(zip(TARGETS, loads, strict=True)))
    r = RouteRequest("r", prefix_keys=tuple(chain(prompt)), tie=tie)
    pref = p.preferred(r, TARGETS, view)
    if pref is not None:
        assert p.select(r, TARGETS, view) == pref
