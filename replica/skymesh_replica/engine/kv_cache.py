"""Paged KV cache with block-hash prefix reuse (vLLM v1's KVCacheManager, in miniature).

Blocks hold ``BLOCK_SIZE`` tokens. A block that has been filled gets the chained hash of
its content (see :mod:`skymesh_replica.engine.hashing`) and stays findable by that hash after its
last user releases it: it sits in the free queue, reusable as a prefix hit until it is
reallocated. The free queue is LRU: released blocks go to the tail, allocation takes from
the head, and a sequence's blocks are released tail-first so a shared prompt head outlives
its private tail (vLLM does the same).

Invariants (property-tested): a block's reference count is never negative; a block is in
the free queue iff its count is 0; every hash maps to exactly one block that carries it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class KVCacheError(RuntimeError):
    """An internal invariant was broken (double free, over-allocation)."""


class CacheRecorder(Protocol):
    """Told when content enters or leaves the cache (the KV-event publisher's hook)."""

    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int],
               block_size: int) -> None: ...

    def removed(self, block_hash: int) -> None: ...

    def cleared(self) -> None: ...


class BlockManager:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_blocks
        self._hash: list[int | None] = [None] * num_blocks
        self._cached: dict[int, int] = {}
        # Insertion order is eviction order: the head is the least recently released.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        # None unless KV events are on: then told of evictions and resets.
        self.recorder: CacheRecorder | None = None

    # -- queries ---------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that can be allocated now (unreferenced, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by a live sequence (vLLM's kv cache usage)."""
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def match_prefix(self, hashes: Sequence[int]) -> list[int]:
        """Block ids holding the longest cached prefix of ``hashes`` (no side effects)."""
        if not self.enable_prefix_caching:
            return []
        out: list[int] = []
        cached = self._cached
        for h in hashes:
            b = cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_in(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` sit in the free queue (acquiring them uses up free space)."""
        ref = self._ref
        return sum(1 for b in blocks if ref[b] == 0)

    # -- mutations -------------------------------------------------------------------
    def acquire(self, blocks: Sequence[int]) -> None:
        """Take a reference on cached blocks found by :meth:`match_prefix`."""
        ref, free = self._ref, self._free
        for b in blocks:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting the least recently released cached ones."""
        if n > len(self._free):
            raise KVCacheError(f"allocate({n}) with only {len(self._free)} free blocks")
        out: list[int] = []
        free, ref, hashes, cached = self._free, self._ref, self._hash, self._cached
        for _ in range(n):
            b, _unused = free.popitem(last=False)
            h = hashes[b]
            if h is not None:
                if cached.get(h) == b:
                    del cached[h]
                    if self.recorder is not None:
                        self.recorder.removed(h)
                hashes[b] = None
            ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference on each block; tail blocks become evictable first."""
        ref, free = self._ref, self._free
        for b in reversed(blocks):
            r = ref[b] - 1
            if r < 0:
                raise KVCacheError(f"block {b} released more often than acquired")
            ref[b] = r
            if r == 0:
                free[b] = None

    def register(self, block: int, block_hash: int) -> bool:
        """Record that ``block`` now holds the full content named by ``block_hash``.

        True when the content became findable (a new cached block).
        """
        if not self.enable_prefix_caching or self._hash[block] is not None:
            return False
        if block_hash in self._cached:
            # The same content computed twice (two concurrent misses): keep the first copy
            # findable; this one is freed normally and simply never hit.
            return False
        self._hash[block] = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> None:
        for h, b in list(self._cached.items()):
            self._hash[b] = None
            del self._cached[h]
        if self.recorder is not None:
            self.recorder.cleared()

    def check_invariants(self) -> None:
        for b in range(self.num_blocks):
            if self._ref[b] < 0:
                raise KVCacheError(f"block {b} has negative refcount")
            if (self._ref[b] == 0) != (b in self._free):
                raise KVCacheError(f"block {b} free-queue membership disagrees with ref")
        for h, b in self._cached.items():
            if self._hash[b] != h:
                raise KVCacheError(f"cache maps {h} to block {b} which holds {self._hash[b]}")
