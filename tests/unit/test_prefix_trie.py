"""PrefixTrie (bounded, oldest-first eviction, pruning) and text prefix keys."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from support import chain, common_prefix

from skymesh.prefix import PrefixTrie, text_prefix_keys


def check_structure(trie: PrefixTrie, *, chained: bool = True) -> None:
    """Segments hold the keys, target sets shrink downwards, links agree, and each run
    is indexed by its first key (every run, when keys are chained)."""
    index, segs = trie._index, trie._segments
    assert sum(len(s.keys) for s in segs) == len(trie)
    assert all(seg in segs and seg.keys[0] == k for k, seg in index.items())
    if chained:
        assert len(index) == len(segs)
    for seg in segs:
        assert seg.mask and seg.keys
        assert seg.end == seg.start + len(seg.keys)
        for child in seg.children:
            assert child.parent is seg and child in segs
            assert child.start == seg.start + len(seg.keys)
        if seg.parent is None:
            assert seg.start == 0
        else:
            assert seg.parent in segs and seg in seg.parent.children
            assert seg.mask & ~seg.parent.mask == 0
    for t in trie.targets():
        b = trie._bits[t]
        assert trie.size_of(t) == sum(len(s.keys) for s in segs if s.mask >> b & 1)


def names_on_nodes(trie: PrefixTrie) -> set[str]:
    return {t for seg in trie._segments for t in trie._decode(seg.mask)}


lcp = common_prefix


# -- table-driven behaviour ------------------------------------------------------------------
def test_match_finds_the_deepest_allowed_target_and_stops_early() -> None:
    trie = PrefixTrie()
    sys_prompt = [1, 2, 3]
    trie.insert(chain([*sys_prompt, 10, 11]), "a")
    trie.insert(chain([*sys_prompt, 20]), "b")
    trie.insert(chain(sys_prompt), "c")
    q = chain([*sys_prompt, 10, 11, 12])
    cases = [
        (["a", "b", "c"], 5, ("a",)),
        (["b", "c"], 3, ("b", "c")),  # a's deeper path is not available: stop at depth 3
        (["c"], 3, ("c",)),
        (["z"], 0, ()),
        ([], 0, ()),
    ]
    for allowed, depth, targets in cases:
        assert trie.match(q, allowed) == (depth, targets), allowed
    assert trie.depths(q, ["a", "b", "c", "z"]) == {"a": 5, "b": 3, "c": 3}
    assert trie.match([], ["a"]) == (0, ())
    assert len(trie) == 6
    assert (trie.size_of("a"), trie.size_of("b"), trie.size_of("c")) == (5, 4, 3)


def test_oldest_leaf_is_evicted_first_and_match_refreshes() -> None:
    trie = PrefixTrie(max_nodes=6)
    p, q, r = chain([1, 2]), chain([3, 4]), chain([5, 6])

    def kept(keys: list[int]) -> int:  # how much of a path survives, without touching it
        return trie.depth_of(keys)

    trie.insert(p, "a")
    trie.insert(q, "b")
    trie.insert(r, "c")
    assert trie.match(p, ["a"]) == (2, ("a",))  # p is now the most recent
    trie.insert(chain([7]), "d")  # one node too many: q's leaf (the oldest) goes
    assert len(trie) == 6
    assert (kept(p), kept(q), kept(r)) == (2, 1, 2)
    # q's first node is a leaf now, as old as its evicted child: it goes next, then r's leaf.
    trie.insert(chain([8, 9]), "e")
    assert (kept(p), kept(q), kept(r)) == (2, 0, 1)
    check_structure(trie)


def test_a_sequence_longer_than_the_cap_keeps_its_head() -> None:
    trie = PrefixTrie(max_nodes=4)
    keys = chain(list(range(10)))
    trie.insert(keys, "a")
    assert len(trie) == 4
    assert trie.match(keys, ["a"]) == (4, ("a",))


def test_remove_target_and_retain_prune_nodes() -> None:
    trie = PrefixTrie()
    trie.insert(chain([1, 2, 3]), "a")
    trie.insert(chain([1, 2, 4]), "b")
    trie.insert(chain([1, 5]), "c")
    trie.remove_target("a")
    assert "a" not in names_on_nodes(trie)
    assert len(trie) == 4  # 1, 2, 4 (b) and 5 (c)
    trie.retain(["c"])
    assert names_on_nodes(trie) == {"c"}
    assert len(trie) == 2
    check_structure(trie)
    # A freed bit is reused by a new target without leaking old state.
    trie.insert(chain([9]), "d")
    assert trie.match(chain([1, 2, 4]), ["d"]) == (0, ())
    assert sorted(trie.targets()) == ["c", "d"]


def test_holds_100k_nodes_for_64_targets() -> None:
    rng = random.Random(0)
    trie = PrefixTrie(max_nodes=100_000)
    targets = [f"http://replica-{i}:8000" for i in range(64)]
    systems = [[rng.getrandbits(30) for _ in range(20)] for _ in range(8)]
    for i in range(2500):
        seq = rng.choice(systems) + [rng.getrandbits(30) for _ in range(rng.randint(10, 100))]
        trie.insert(chain(seq), targets[i % 64])
        assert len(trie) <= 100_000
    # Full, less at most one eviction pass's low watermark.
    assert 100_000 - 100_000 // 1024 <= len(trie) <= 100_000
    check_structure(trie)
    assert sum(1 for t in targets if trie.size_of(t)) == 64


# -- properties -------------------------------------------------------------------------------
TARGETS = ["a", "b", "c", "d"]
seqs = st.lists(st.integers(0, 3), min_size=0, max_size=8)
ops = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), seqs, st.sampled_from(TARGETS)),
        st.tuples(st.just("match"), seqs, st.lists(st.sampled_from(TARGETS), unique=True)),
        st.tuples(st.just("remove"), seqs, st.sampled_from(TARGETS)),
    ),
    max_size=40,
)


@settings(max_examples=200, deadline=None)
@given(ops=ops, cap=st.integers(1, 12))
def test_invariants_hold_under_any_operations(
    ops: list[tuple[str, list[int], object]], cap: int
) -> None:
    trie = PrefixTrie(max_nodes=cap)
    for op, seq, arg in ops:
        keys = chain(seq)
        if op == "insert":
            assert isinstance(arg, str)
            trie.insert(keys, arg)
        elif op == "match":
            assert isinstance(arg, list)
            depth, found = trie.match(keys, arg)
            assert set(found) <= set(arg)
            assert (depth == 0) == (not found)
            assert set(trie.depths(keys, arg)) <= set(arg)
        else:
            assert isinstance(arg, str)
            trie.remove_target(arg)
            assert arg not in names_on_nodes(trie)
            assert trie.size_of(arg) == 0
        assert len(trie) <= cap
        check_structure(trie)


def dump(trie: PrefixTrie) -> list[tuple[int, tuple[int, ...], tuple[str, ...], int]]:
    return sorted((g.start, tuple(g.keys), trie._decode(g.mask), g.stamp)
                  for g in trie._segments)


@settings(max_examples=300, deadline=None)
@given(ops=ops, cap=st.integers(1, 12))
def test_an_insert_reusing_the_lookups_walk_records_what_a_fresh_walk_would(
    ops: list[tuple[str, list[int], object]], cap: int
) -> None:
    # ``fast`` sees the same tuple for a sequence every time, so an insert after a lookup
    # of it reuses the lookup's walk (when nothing changed in between); ``slow`` gets a
    # new list each time and always walks. Same operations otherwise, same recency.
    fast, slow = PrefixTrie(max_nodes=cap), PrefixTrie(max_nodes=cap)
    same: dict[tuple[int, ...], tuple[int, ...]] = {}
    for op, seq, arg in ops:
        keys = same.setdefault(tuple(seq), tuple(chain(seq)))
        if op == "match":  # the lookup a policy makes before it inserts
            assert isinstance(arg, list)
            assert fast.depth_groups(keys, arg) == slow.depth_groups(list(keys), arg)
        elif op == "insert":
            assert isinstance(arg, str)
            fast.insert(keys, arg)
            slow.insert(list(keys), arg)
        else:
            assert isinstance(arg, str)
            fast.remove_target(arg)
            slow.remove_target(arg)
        assert dump(fast) == dump(slow) and len(fast) == len(slow)
        check_structure(fast)


@settings(max_examples=200, deadline=None)
@given(
    inserted=st.lists(st.tuples(seqs, st.sampled_from(TARGETS)), max_size=12),
    query=seqs,
)
def test_match_depth_is_the_longest_common_prefix_without_eviction(
    inserted: list[tuple[list[int], str]], query: list[int]
) -> None:
    trie = PrefixTrie(max_nodes=10_000)
    for seq, target in inserted:
        trie.insert(chain(seq), target)
    q = chain(query)
    expected = {
        t: max((lcp(query, s) for s, u in inserted if u == t), default=0) for t in TARGETS
    }
    got = trie.depths(q, TARGETS)
    assert got == {t: d for t, d in expected.items() if d}
    for t in TARGETS:
        depth, found = trie.match(q, [t])
        assert depth == expected[t]
        assert found == ((t,) if depth else ())
    best = max(expected.values())
    depth, found = trie.match(q, TARGETS)
    assert depth == best
    assert set(found) == {t for t, d in expected.items() if d == best and d > 0}


@settings(max_examples=100, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 6), min_size=1, max_size=15),
    cap=st.integers(1, 20),
    data=st.data(),
)
def test_unrelated_sequences_are_evicted_oldest_first(
    lengths: list[int], cap: int, data: st.DataObject
) -> None:
    trie = PrefixTrie(max_nodes=cap)
    seqs = [chain([1000 + i, *range(n - 1)]) for i, n in enumerate(lengths)]
    for i, keys in enumerate(seqs):
        trie.insert(keys, data.draw(st.sampled_from(TARGETS), label=f"target {i}"))
    kept = [trie.depth_of(keys) for keys in seqs]
    # Newest sequences whole, then at most one cut short from its end, older ones gone.
    room = cap
    for keys, k in zip(reversed(seqs), reversed(kept), strict=True):
        want = min(len(keys), room)
        assert k == want
        room -= want
    assert len(trie) == min(cap, sum(lengths))
    check_structure(trie)


# -- text keys ---------------------------------------------------------------------------------
def test_text_keys_chain_full_chunks_and_share_exactly_the_common_prefix() -> None:
    base = "You are a helpful assistant. " * 20  # 580 characters
    a = text_prefix_keys(base + "What is 2+2?" * 10, chunk_chars=64)
    b = text_prefix_keys(base + "Tell me a story" * 10, chunk_chars=64)
    assert len(a) == (len(base) + 120) // 64
    assert lcp(a, b) == len(base) // 64
    assert text_prefix_keys("x" * 63) == []
    assert text_prefix_keys("x" * 640, max_keys=3) == text_prefix_keys("x" * 640)[:3]
    # Non-ASCII text and odd chunk sizes take the same path semantics.
    s = "héllo wörld ☃ " * 40
    assert text_prefix_keys(s, chunk_chars=7)[:5] == text_prefix_keys(s[:35], chunk_chars=7)
    assert len(set(text_prefix_keys(s, chunk_chars=7))) == len(s) // 7


def test_text_keys_are_stable_across_processes() -> None:
    # Pinned values: a salted or platform-dependent hash would change them.
    assert text_prefix_keys("a" * 128, chunk_chars=64) == PINNED_A128


PINNED_A128 = [6966924215663199737, 15995218077299146568]


def test_a_full_trie_evicts_down_to_its_low_watermark_oldest_first() -> None:
    trie = PrefixTrie(max_nodes=2048)  # watermark: 2048 // 1024 = 2 keys below the cap
    seqs = [chain([5000 + i, *range(63)]) for i in range(32)]  # 32 x 64 keys: full
    for i, keys in enumerate(seqs):
        trie.insert(keys, TARGETS[i % len(TARGETS)])
    assert len(trie) == 2048
    newest = chain([9999])
    trie.insert(newest, TARGETS[0])
    # One key over the cap frees 1 + 2, all from the oldest sequence's deepest keys.
    assert len(trie) == 2048 - 2
    assert trie.depth_of(seqs[0]) == 64 - 3
    assert all(trie.depth_of(s) == 64 for s in seqs[1:]) and trie.depth_of(newest) == 1
    check_structure(trie)


@settings(max_examples=200, deadline=None)
@given(ops=ops, cap=st.integers(1, 12))
def test_unchained_keys_give_approximate_answers_but_keep_the_invariants(
    ops: list[tuple[str, list[int], object]], cap: int
) -> None:
    # Raw small ints repeat inside one sequence and across depths: the worst collisions.
    trie = PrefixTrie(max_nodes=cap)
    for op, seq, arg in ops:
        if op == "insert":
            assert isinstance(arg, str)
            trie.insert(seq, arg)
        elif op == "match":
            assert isinstance(arg, list)
            depth, found = trie.match(seq, arg)
            assert set(found) <= set(arg) and 0 <= depth <= len(seq)
            assert (depth == 0) == (not found)
            groups = trie.depth_groups(seq, arg)
            assert [d for d, _ in groups] == sorted({d for d, _ in groups}, reverse=True)
            assert all(0 < d <= len(seq) for d, _ in groups)
        else:
            assert isinstance(arg, str)
            trie.remove_target(arg)
        assert len(trie) <= cap
        check_structure(trie, chained=False)


def test_many_targets_on_one_prefix_come_back_in_first_recorded_order() -> None:
    # More than 64 targets (masks past one machine word) and more than four per prefix
    # (the decoder's bulk path), with freed and reused bits in between.
    trie = PrefixTrie()
    names = [f"http://replica-{i:02d}:8000" for i in range(70)]
    system = chain([1, 2, 3])
    for t in names:
        trie.insert(system, t)
    assert trie.match(system, names) == (3, tuple(names))
    gone = set(names[5:40:3])
    trie.remove_targets(gone)
    kept = [t for t in names if t not in gone]
    assert trie.match(system, names) == (3, tuple(kept))
    newcomers = [f"http://new-{i}:8000" for i in range(len(gone))]
    for t in newcomers:  # they take the freed bits, which sit below the kept ones
        trie.insert(system, t)
    depth, found = trie.match(system, kept + newcomers)
    assert depth == 3 and sorted(found) == sorted(kept + newcomers)
    assert [t for t in found if t in kept] == kept
    assert trie.depth_groups(chain([1, 2, 3, 4]), names[:10]) == [
        (3, tuple(t for t in names[:10] if t not in gone))]
    check_structure(trie)


def test_text_keys_take_a_lone_surrogate_as_one_character() -> None:
    """A JSON body may carry "\\ud800"; the keys must not raise on it (it reached the
    balancer's prefix policies from the fuzz suite) and it stays one character wide."""
    plain = "a" * 64 + "b" * 64
    odd = "a" * 63 + "\ud800" + "b" * 64
    assert len(text_prefix_keys(odd, chunk_chars=64)) == 2
    assert text_prefix_keys(odd, chunk_chars=64)[0] != text_prefix_keys(plain, chunk_chars=64)[0]


def test_leaves_share_one_empty_children_set() -> None:
    # A full trie is mostly leaves: an empty set of their own each was about a quarter
    # of its memory (docs/notes/memory-1m.md).
    from skymesh.prefix import trie as trie_mod

    t = trie_mod.PrefixTrie(max_nodes=1_000)
    for i in range(50):
        t.insert([1, 2, 100 + i], "a" if i % 2 else "b")
    leaves = [s for s in t._segments if not s.children]
    assert len(leaves) >= 50
    assert all(s.children is trie_mod._NO_CHILDREN for s in leaves)
    t.insert([1, 2, 100, 7], "a")  # a leaf that gains a child gets a set of its own
    parents = [s for s in t._segments if s.children]
    assert parents and all(s.children is not trie_mod._NO_CHILDREN for s in parents)
    assert not trie_mod._NO_CHILDREN
