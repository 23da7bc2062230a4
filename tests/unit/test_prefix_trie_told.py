"""What a PrefixTrie tells after an insert (``on_keys``: the keys and the depth of the
first prefix whose record changed) bounds which lookups may answer differently: the
dispatcher keeps a queued request's memo unless its ``memo_keys`` are among the changed
keys, so a lookup whose memo keys are not told must answer exactly as before."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from support import chain

from skymesh.policies.base import RouteRequest
from skymesh.policies.prefix_tree import PrefixTree
from skymesh.prefix import PrefixTrie

TARGETS = ("a", "b", "c")


def memo_keys(trie: PrefixTrie, keys: list[int], allowed: tuple[str, ...]) -> tuple[int, ...]:
    """``PrefixTree.preferred``'s memo keys for ``keys`` (asked through the policy)."""
    policy = PrefixTree(match_threshold=0.0)
    policy.trie = trie
    policy.preferred(RouteRequest("q", prefix_keys=keys), allowed, _NoLoad())
    return policy.memo_keys


class _NoLoad:
    def outstanding_of(self, targets: list[str]) -> list[int]:
        return [0] * len(targets)


@settings(max_examples=150, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_an_untold_lookup_answers_as_before(seed: int) -> None:
    rng = random.Random(seed)
    trie = PrefixTrie(max_nodes=10_000)  # no eviction: its epoch bump would cover it
    told: list[tuple[list[int], int]] = []
    trie.on_keys = lambda keys, start: told.append((list(keys), start))
    # Few short token alphabets, so prompts share heads, diverge and repeat.
    def prompt() -> list[int]:
        return chain([rng.randrange(3) for _ in range(rng.randrange(1, 7))])

    queries = [prompt() for _ in range(12)]
    for _ in range(40):
        before = {}
        for i, q in enumerate(queries):
            for allowed in (TARGETS, TARGETS[:2], ("c",)):
                trie._walk = None
                before[i, allowed] = (trie.match(q, allowed),
                                      memo_keys(trie, q, allowed))
        keys, target = rng.choice([*queries, prompt()]), rng.choice(TARGETS)
        told.clear()
        trie.insert(keys, target)
        assert len(told) == 1 and told[0][0] == keys
        changed = set(keys[told[0][1]:])
        for (i, allowed), (answer, mk) in before.items():
            if not changed & set(mk):
                assert trie.match(queries[i], allowed) == answer, (queries[i], allowed)


def test_a_repeated_decision_tells_no_change() -> None:
    trie = PrefixTrie()
    told: list[int] = []
    trie.on_keys = lambda keys, start: told.append(start)
    keys = chain([1, 2, 3, 4])
    trie.insert(keys, "a")
    trie.insert(keys, "a")  # the same target again: nothing new
    trie.insert(keys[:2], "a")  # a prefix of a recorded path
    trie.insert(keys, "b")  # another target on the whole path
    longer = chain([1, 2, 3, 4, 5, 6])
    trie.insert(longer, "b")  # two new keys past the path
    assert told == [0, 4, 2, 0, 4]


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 2**32 - 1))
def test_remembered_lookups_answer_and_age_as_fresh_ones(seed: int) -> None:
    """``match`` remembers recent lookups until the trie changes; a trie that forgets
    them before every lookup answers the same, and (recency being refreshed the same
    way) evicts the same prefixes under a small cap."""
    rng = random.Random(seed)
    fast, plain = PrefixTrie(max_nodes=24), PrefixTrie(max_nodes=24)
    prompts = [chain([rng.randrange(4) for _ in range(rng.randrange(1, 8))])
               for _ in range(10)]
    for _ in range(120):
        keys = rng.choice(prompts)
        if rng.random() < 0.3:
            target = rng.choice(TARGETS)
            fast.insert(keys, target)
            plain.insert(keys, target)
        else:
            allowed = rng.choice((TARGETS, TARGETS[1:], ("a",)))
            plain._matches.clear()
            assert fast.match(keys, allowed) == plain.match(keys, allowed)
        assert set(fast._index) == set(plain._index)
        assert fast.sizes_of(TARGETS) == plain.sizes_of(TARGETS)
