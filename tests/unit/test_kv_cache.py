"""Invariants of the paged, prefix-cached KV block manager."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from skymesh_replica.engine.kv_cache import BlockManager, KVCacheError


def test_release_more_than_acquired_raises() -> None:
    kv = BlockManager(4)
    blocks = kv.allocate(2)
    kv.release(blocks)
    with pytest.raises(KVCacheError):
        kv.release(blocks)


def test_over_allocation_raises() -> None:
    kv = BlockManager(2)
    kv.allocate(2)
    with pytest.raises(KVCacheError):
        kv.allocate(1)


def test_cached_block_survives_release_until_reallocated() -> None:
    kv = BlockManager(3)
    [a, b] = kv.allocate(2)
    kv.register(a, 111)
    kv.register(b, 222)
    kv.release([a, b])
    assert kv.match_prefix([111, 222, 333]) == [a, b]
    # Released tail-first: b is evicted before a.
    kv.allocate(2)  # takes the never-used block, then b
    assert kv.match_prefix([111, 222]) == [a]
    assert kv.num_free == 1


def test_usage_counts_referenced_blocks() -> None:
    kv = BlockManager(10)
    kv.allocate(4)
    assert kv.usage == pytest.approx(0.4)


ops = st.lists(
    st.tuples(st.sampled_from(["alloc", "release", "hit", "register"]), st.integers(0, 7)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(ops)
def test_random_operations_keep_invariants(seq: list[tuple[str, int]]) -> None:
    kv = BlockManager(8)
    held: list[list[int]] = []  # each entry: blocks one owner holds a reference on
    for op, arg in seq:
        if op == "alloc":
            n = min(arg % 3 + 1, kv.num_free)
            if n:
                held.append(kv.allocate(n))
        elif op == "release" and held:
            kv.release(held.pop(arg % len(held)))
        elif op == "register" and held:
            owner = held[arg % len(held)]
            kv.register(owner[0], 1000 + arg)
        elif op == "hit":
            found = kv.match_prefix([1000 + arg])
            if found and kv.num_free >= kv.num_evictable_in(found):
                kv.acquire(found)
                held.append(found)
        kv.check_invariants()
        referenced = {b for owner in held for b in owner}
        assert kv.num_free == kv.num_blocks - len(referenced)
    for owner in held:
        kv.release(owner)
    kv.check_invariants()
    assert kv.num_free == kv.num_blocks
