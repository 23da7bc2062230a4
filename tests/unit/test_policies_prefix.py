"""Power of two, consistent hashing and the prefix-aware policies, against a fake view."""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support import Load, View, chain

from skymesh.policies import Policy, RouteRequest, build_policy, policy_names
from skymesh.policies.consistent_hash import ConsistentHash
from skymesh.policies.lmetric import LMetric


def req(rid: str, keys: Sequence[int] = (), prompt_len: int = 0,
        affinity: str | None = None) -> RouteRequest:
    return RouteRequest(rid, prompt_len=prompt_len, prefix_keys=tuple(keys),
                        affinity_key=affinity)


SYSTEM = list(range(100, 108))  # 8 shared blocks
ALL = ["a", "b", "c", "d"]


def routed(p: Policy, r: RouteRequest, cands: list[str], view: View) -> str | None:
    """select + on_dispatch, as the balancer does."""
    t = p.select(r, cands, view)
    if t is not None:
        p.on_dispatch(r, t, view)
    return t


# -- every policy -----------------------------------------------------------------------------
def test_every_builtin_policy_is_registered() -> None:
    assert policy_names() == sorted([
        "round-robin", "random", "least-load", "power-of-two", "consistent-hash",
        "prefix-tree", "sglang-cache-aware", "lmetric",  # the [balancer] contract's names
        "goodserve", "preserve", "vllm-load",  # [predictive]
    ])


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(sorted(policy_names())),
    steps=st.lists(
        st.tuples(
            st.lists(st.sampled_from(ALL), unique=True, max_size=4),  # candidates
            st.lists(st.integers(0, 3), max_size=6),  # prompt blocks
            st.sampled_from([None, "u1", "u2"]),
            st.lists(st.integers(0, 80), min_size=4, max_size=4),  # loads
        ),
        min_size=1, max_size=25,
    ),
    membership=st.booleans(),
)
def test_every_policy_returns_a_candidate_or_none_only_when_empty(
    name: str, steps: list[tuple[list[str], list[int], str | None, list[int]]],
    membership: bool,
) -> None:
    p = build_policy(name, rng=random.Random(0))
    if membership:
        p.on_membership(ALL)
    view = View()
    for i, (cands, blocks, aff, loads) in enumerate(steps):
        view.set(**dict(zip(ALL, loads, strict=True)))
        view.now = float(i)
        r = req(f"q{i}", chain(blocks), prompt_len=16 * len(blocks) + 5, affinity=aff)
        t = routed(p, r, cands, view)
        if cands:
            assert t in cands
        else:
            assert t is None
        p.on_complete(r, t or "a", True)


@pytest.mark.parametrize("name", ["prefix-tree", "sglang-cache-aware", "lmetric"])
def test_prefix_state_is_pruned_when_a_target_leaves(name: str) -> None:
    p = build_policy(name)
    p.on_membership(ALL)
    view = View()
    for i, t in enumerate(ALL):
        p.on_dispatch(req(f"q{i}", chain([*SYSTEM, i])), t, view)
    p.on_membership(["a", "b"])
    trie = p.trie  # type: ignore[attr-defined]
    assert sorted(trie.targets()) == ["a", "b"]
    assert len(trie) == len(SYSTEM) + 2


# -- power of two ------------------------------------------------------------------------------
def test_power_of_two_never_picks_the_unique_most_loaded() -> None:
    p = build_policy("power-of-two", rng=random.Random(3))
    view = View().set(a=9, b=1, c=2, d=3)
    picks = [p.select(req(f"q{i}"), ALL, view) for i in range(3000)]
    assert "a" not in picks
    # Of the 6 equally likely pairs, b wins 3, c wins 2 ({a,c}, {c,d}) and d wins 1.
    for t, share in (("b", 3 / 6), ("c", 2 / 6), ("d", 1 / 6)):
        assert abs(picks.count(t) / 3000 - share) < 0.04, t
    assert build_policy("power-of-two").select(req("x"), ["only"], view) == "only"


# -- consistent hashing ------------------------------------------------------------------------
def test_consistent_hash_is_sticky_and_skips_unavailable_targets() -> None:
    p = build_policy("consistent-hash")
    p.on_membership(ALL)
    view = View()
    home = p.select(req("1", affinity="user-7"), ALL, view)
    assert home is not None
    assert all(p.select(req(str(i), affinity="user-7"), ALL, view) == home for i in range(5))
    others = [t for t in ALL if t != home]
    spill = p.select(req("6", affinity="user-7"), others, view)
    assert spill in others
    # The spill target is the next owner on the ring: stable while home is away.
    assert p.select(req("7", affinity="user-7"), others, view) == spill
    assert p.select(req("8", affinity="user-7"), ALL, view) == home


def test_consistent_hash_key_falls_back_to_prefix_then_request_id() -> None:
    p = build_policy("consistent-hash")
    p.on_membership([f"r{i}" for i in range(16)])
    cands = [f"r{i}" for i in range(16)]
    view = View()
    keys = chain(SYSTEM)
    by_prefix = {p.select(req(f"q{i}", keys), cands, view) for i in range(20)}
    assert len(by_prefix) == 1  # same first block, same target, whatever the request id
    by_id = {p.select(req(f"q{i}"), cands, view) for i in range(40)}
    assert len(by_id) > 4
    # An affinity key wins over the prefix.
    pa = p.select(req("z", keys, affinity="k1"), cands, view)
    assert pa == p.select(req("y", affinity="k1"), cands, view)


def test_consistent_hash_builds_its_ring_lazily_without_membership() -> None:
    p = build_policy("consistent-hash")
    view = View()
    t = p.select(req("1", affinity="s"), ["a", "b"], view)
    assert t in ("a", "b")
    assert p.select(req("2", affinity="s"), ["a", "b", "c"], view) in ("a", "b", "c")
    assert set(p._members) == {"a", "b", "c"}  # type: ignore[attr-defined]


@settings(max_examples=25, deadline=None)
@given(n=st.integers(4, 12), seed=st.integers(0, 1000))
def test_consistent_hash_moves_about_one_nth_of_keys(n: int, seed: int) -> None:
    targets = [f"replica-{seed}-{i}" for i in range(n)]
    keys = [f"session-{seed}-{k}" for k in range(1500)]
    view = View()

    def assign(members: list[str]) -> dict[str, str | None]:
        p = ConsistentHash()
        p.on_membership(members)
        return {k: p.select(req(k, affinity=k), members, view) for k in keys}

    before = assign(targets)
    # Removing one target moves exactly its keys, about 1/N of them.
    gone = targets[seed % n]
    after = assign([t for t in targets if t != gone])
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] == gone for k in moved)
    assert abs(len(moved) / len(keys) - 1 / n) < 0.6 / n
    # Adding one target moves keys only onto it, about 1/(N+1) of them.
    added = assign([*targets, f"replica-{seed}-new"])
    moved = [k for k in keys if before[k] != added[k]]
    assert all(added[k] == f"replica-{seed}-new" for k in moved)
    assert abs(len(moved) / len(keys) - 1 / (n + 1)) < 0.6 / (n + 1)


# -- prefix tree (SkyLB) -----------------------------------------------------------------------
def test_prefix_tree_cases() -> None:
    p = build_policy("prefix-tree")
    view = View().set(a=5, b=0, c=0, d=0)
    conv = chain([*SYSTEM, 1, 2, 3, 4])
    assert routed(p, req("r0", conv[:10]), ["a"], view) == "a"
    cases = [
        # (keys, candidates, loads, expected, why)
        (conv, ALL, {}, "a", "10 of 12 keys matched on a: follow it despite its load"),
        (conv, ["b", "c"], {"c": 1}, "b", "a unavailable: the system prompt (8/12) is on "
         "nobody else, so least loaded"),
        (chain([*SYSTEM, 9, 9, 9, 9, 9, 9, 9, 9, 9]), ALL, {}, None,
         "8 of 17 keys (< 70%): least loaded among all, not a"),
        (chain([*SYSTEM, 9, 9, 9, 9]), ALL, {}, None,
         "8 of 12 keys (67%, which SkyLB's 50% would follow): a shared template only"),
    ]
    for keys, cands, loads, expected, why in cases:
        view.set(**loads)
        got = p.select(req("x", keys), cands, view)
        if expected is None:
            assert got != "a", why
        else:
            assert got == expected, why


def test_prefix_tree_picks_the_least_loaded_of_the_matched_targets() -> None:
    p = build_policy("prefix-tree", {"match_threshold": 0.3})
    view = View().set(a=0, b=0, c=0, d=0)
    keys = chain([*SYSTEM, 1])
    for t in ("a", "b"):
        p.on_dispatch(req("seed", keys), t, view)
    view.set(a=4, b=2, c=0, d=0)
    assert p.select(req("x", keys), ALL, view) == "b"
    with pytest.raises(Exception, match="match_threshold"):
        build_policy("prefix-tree", {"match_threshold": 1.5})


@pytest.mark.parametrize("name", ["prefix-tree", "lmetric"])
def test_a_conversation_follows_its_cached_reply(name: str) -> None:
    """The trie learns what the replica caches after a turn (prompt and reply), so the
    next turn, which resends both, goes back to it even when the reply dwarfs the prompt.
    Recorded at dispatch alone, the old prompt is 4 of the new 16 keys."""
    p = build_policy(name)
    view = View().set(a=3, b=0, c=0, d=0)
    turn1 = chain([7, 1, 2, 3])
    reply_and_turn2 = chain([7, 1, 2, 3, *range(200, 212)])
    p.on_dispatch(req("t1", turn1, 64), "a", view)
    p.on_complete(req("t1", turn1, 64), "a", True)
    turn2 = req("t2", reply_and_turn2, 256)
    assert p.select(turn2, ALL, view) != "a", "prompt-only record: too weak to pay a's load"
    p.on_cached(req("t1", turn1, 64), "a", reply_and_turn2[:14])  # prompt + reply
    assert p.select(turn2, ALL, view) == "a"
    assert p.preferred(turn2, ALL, view) == "a"  # delay scheduling holds it for a


def test_dispatcher_hands_cached_keys_to_the_layer_that_served() -> None:
    from skymesh.balancer.dispatch import Dispatcher, PushMode

    seen: list[tuple[str, str, tuple[int, ...]]] = []

    class Spy(Policy):
        def __init__(self, layer: str) -> None:
            super().__init__()
            self.layer = layer

        def select(self, request: RouteRequest, candidates: Sequence[str], view: object
                   ) -> str | None:
            return candidates[0] if candidates else None

        def on_cached(self, request: RouteRequest, target: str, keys: Sequence[int]) -> None:
            seen.append((self.layer, target, tuple(keys)))

    d = Dispatcher(Spy("replicas"), PushMode.BP, peer_policy=Spy("peers"))
    d.set_targets({"r1": frozenset({"default"})})
    d.set_peers(["eu"])
    r = req("x", [1, 2])
    d.cached(r, "r1", [1, 2, 3])
    d.cached(r, "eu", [1, 2, 3, 4])
    d.cached(r, "gone", [5])  # left the membership meanwhile: nobody records it
    d.cached(r, "r1", [])
    assert seen == [("replicas", "r1", (1, 2, 3)), ("peers", "eu", (1, 2, 3, 4))]


# -- sglang cache-aware ------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("loads", "keys", "expected", "why"),
    [
        ({"a": 100, "b": 10, "c": 20, "d": 30}, chain([*SYSTEM, 1]), "b",
         "imbalanced (gap 90 > 64, 100 > 1.5 x 10): shortest queue, cache ignored"),
        ({"a": 300, "b": 200, "c": 250, "d": 250}, chain([*SYSTEM, 1]), "a",
         "gap 100 > 64 but 300 is not > 1.5 x 200: balanced, follow the cache"),
        ({"a": 65, "b": 50, "c": 50, "d": 50}, chain([*SYSTEM, 1]), "a",
         "gap 15: balanced, match 9/9 > 0.3 -> the cached target"),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, chain([7, 7, 7]), "d",
         "no match: the smallest tree (d never served anything)"),
    ],
)
def test_sglang_cache_aware_cases(
    loads: dict[str, int], keys: list[int], expected: str, why: str
) -> None:
    p = build_policy("sglang-cache-aware")
    view = View()
    p.on_dispatch(req("s0", chain([*SYSTEM, 1])), "a", view)
    p.on_dispatch(req("s1", chain([50, 51])), "b", view)
    p.on_dispatch(req("s2", chain([60])), "c", view)
    view.set(**loads)
    assert p.select(req("x", keys), ALL, view) == expected, why


def test_sglang_cache_aware_low_match_rate_goes_to_smallest_tree() -> None:
    p = build_policy("sglang-cache-aware")
    view = View()
    p.on_dispatch(req("s0", chain([1, 2, 3, 4])), "a", view)
    p.on_dispatch(req("s1", chain([5])), "b", view)
    # 1 of 4 keys matches on a: 0.25 <= 0.3, so the target with the smallest tree wins.
    got = p.select(req("x", chain([1, 9, 9, 9])), ["a", "b"], view)
    assert got == "b"


@pytest.mark.parametrize("tie_break", ["least-loaded", "first"])
def test_sglang_cache_aware_ties(tie_break: str) -> None:
    p = build_policy("sglang-cache-aware", {"tie_break": tie_break})
    view = View()
    # c, then a, record the same prompt: both sit at the deepest match, c first.
    p.on_dispatch(req("s0", chain([1, 2, 3])), "c", view)
    p.on_dispatch(req("s1", chain([1, 2, 3])), "a", view)
    view.set(a=1, b=1, c=5, d=1)
    matched = p.select(req("x", chain([1, 2, 3, 4])), ALL, view)
    # No match: b and d tie on the smallest (empty) tree.
    fresh = p.select(req("y", chain([9])), ALL, view)
    if tie_break == "first":
        assert (matched, fresh) == ("c", "b")  # sglang: the first tenant, busy or not
    else:
        assert matched == "a" and fresh in ("b", "d")  # the less loaded of a and c
    with pytest.raises(ValueError, match="tie_break"):
        build_policy("sglang-cache-aware", {"tie_break": "random"})


# -- LMETRIC -----------------------------------------------------------------------------------
def test_lmetric_multiplies_uncached_prefill_by_batch_size() -> None:
    p = build_policy("lmetric", {"hotspot_detector": False})
    p.on_membership(ALL)
    view = View()
    keys = chain([*SYSTEM, 1, 2])  # 10 keys; prompt 160 tokens
    p.on_dispatch(req("s", keys), "a", view)
    cases = [
        # loads, expected: scores are (P + 1) x (BS + 1)
        ({"a": 0, "b": 0, "c": 0, "d": 0}, "a"),  # 1 x 1 vs 161 x 1: zeros don't tie
        ({"a": 40, "b": 0, "c": 0, "d": 0}, "a"),  # 1 x 41 = 41 < 161
        ({"a": 200, "b": 0, "c": 0, "d": 0}, None),  # 201 > 161: go elsewhere
        ({"a": 200, "b": 3, "c": 0, "d": 5}, "c"),
    ]
    for loads, expected in cases:
        view.set(**loads)
        got = p.select(req("x", keys, prompt_len=160), ALL, view)
        if expected is None:
            assert got != "a"
        else:
            assert got == expected, loads


def test_lmetric_hotspot_detector_filters_after_two_m_consecutive_wins() -> None:
    p = build_policy("lmetric", {"class_keys": 4})
    assert isinstance(p, LMetric)
    p.on_membership(ALL)
    view = View().set(a=1, b=1, c=1, d=1)
    hot_keys = chain([*SYSTEM, 1])
    p.on_dispatch(req("seed", hot_keys), "a", view)
    # Every request is in a's class: x = 1, M = {a}, M-bar = 3: phase 1 alarms at once.
    picks = []
    for i in range(4):
        view.now = float(i)
        picks.append(p.select(req(f"q{i}", hot_keys, prompt_len=144), ALL, view))
    # a wins on score twice (2|M| = 2); the third consecutive win trips the filter.
    assert picks[:2] == ["a", "a"]
    assert "a" not in picks[2:]
    assert p.alarms == 4 and p.filtered == 2
    # Once the class sits on every target, M-bar is empty: no alarm, back to the score.
    for t in ("b", "c", "d"):
        p.on_dispatch(req("spread", hot_keys), t, view)
    view.set(a=0)
    assert p.select(req("q9", hot_keys, prompt_len=144), ALL, view) == "a"
    assert p.alarms == 4


def test_lmetric_falls_back_to_load_only_when_every_candidate_is_hot() -> None:
    p = build_policy("lmetric", {"class_keys": 4})
    p.on_membership(ALL)
    view = View().set(a=5, b=2, c=0, d=0)
    keys = chain([*SYSTEM, 1])
    for t in ("a", "b"):
        p.on_dispatch(req("seed", keys), t, view)
    got = []
    for i in range(8):
        view.now = float(i)
        got.append(p.select(req(f"q{i}", keys, prompt_len=144), ["a", "b"], view))
    # M = {a, b}, M-bar = {c, d} (not candidates): the filter empties the pool after
    # 2|M| = 4 wins, and the least loaded of the hot pair takes the request.
    assert got == ["b"] * 8


def test_lmetric_window_forgets_old_classes() -> None:
    p = build_policy("lmetric", {"window_s": 10.0})
    assert isinstance(p, LMetric)
    view = View()
    for i in range(5):
        view.now = float(i)
        p.select(req(f"q{i}", chain([i, i, i])), ALL, view)
    assert len(p._counts) == 5
    view.now = 100.0
    p.select(req("late", chain([42])), ALL, view)
    assert len(p._window) == 1 and list(p._counts) == [chain([42])[0]]


def test_consistent_hash_prefers_the_key_owner_even_when_it_is_busy() -> None:
    p = build_policy("consistent-hash")
    targets = ["a", "b", "c", "d"]
    p.on_membership(targets)
    view = View()
    req = RouteRequest("r1", affinity_key="session-7")
    owner = p.select(req, targets, view)
    assert p.preferred(req, targets, view) == owner
    # With the owner busy, select spills the key, but the preference still names the owner:
    # that is what lets the dispatcher hold the request for its cache.
    others = [t for t in targets if t != owner]
    assert p.select(req, others, view) != owner
    assert p.preferred(req, targets, view) == owner
    assert p.preferred(req, [], view) is None


def test_lmetric_prefers_the_target_holding_most_of_the_prompt() -> None:
    p = build_policy("lmetric")
    p.on_membership(["a", "b", "c"])
    view = View()
    served = RouteRequest("r1", prompt_len=64, prefix_keys=(1, 2, 3, 4))
    p.on_dispatch(served, "b", view)
    again = RouteRequest("r2", prompt_len=64, prefix_keys=(1, 2, 3, 4, 5))
    assert p.preferred(again, ["a", "b", "c"], view) == "b"
    barely = RouteRequest("r3", prompt_len=64, prefix_keys=(1, 9, 9, 9, 9, 9))
    assert p.preferred(barely, ["a", "b", "c"], view) is None  # 1 of 6 keys: no reason
    assert p.preferred(again, ["a", "c"], view) is None  # the holder is not serving


@settings(max_examples=300, deadline=None)
@given(
    n_targets=st.integers(1, 10),
    history=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=6),
                               st.integers(0, 9)), max_size=12),
    prompt=st.lists(st.integers(0, 3), min_size=1, max_size=8),
    extra_tokens=st.integers(0, 40),
    loads=st.lists(st.integers(0, 4), min_size=10, max_size=10),
    data=st.data(),
)
def test_lmetric_picks_as_the_bare_formula_would_with_the_same_draw(
    n_targets: int, history: list[tuple[list[int], int]], prompt: list[int],
    extra_tokens: int, loads: list[int], data: st.DataObject,
) -> None:
    # The scoring takes shortcuts (the largest class as a default, unique minima without
    # a list of ties); the answer and the RNG draw must be the formula's: argmin over the
    # candidates of (P-token + 1) x (BS + 1), ties drawn in candidate order.
    members = [f"t{i}" for i in range(n_targets)]
    cands = data.draw(st.permutations(members).flatmap(
        lambda p: st.integers(1, len(p)).map(lambda k: p[:k])), label="candidates")
    p = LMetric(hotspot_detector=False, rng=random.Random(7))
    p.on_membership(members)
    for seq, t in history:  # some members may never be recorded: not in the trie at all
        p.trie.insert(chain(seq), members[t % n_targets])
    view = View({t: Load(outstanding=loads[i]) for i, t in enumerate(members)})
    keys = chain(prompt)
    r = req("q", keys, prompt_len=16 * len(keys) + extra_tokens)
    depth = {t: d for d, g in p.trie.depth_groups(keys, members) for t in g}
    scores = [(r.prompt_len - r.prompt_len * depth.get(c, 0) // len(keys) + 1)
              * (view.load(c).outstanding + 1) for c in cands]
    ties = [c for c, s in zip(cands, scores, strict=True) if s == min(scores)]
    expected = ties[0] if len(ties) == 1 else random.Random(7).choice(ties)
    assert p.select(r, cands, view) == expected
