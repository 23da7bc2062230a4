"""Which full KV blocks each replica holds, from its engine's KV-cache events.

Follows the exact-state indexes of llm-d's precise prefix-cache scorer and Dynamo's KV
router: the engine tells which blocks it stored and evicted
(:mod:`skymesh.prefix.kv_events`), the balancer asks, for a request's token ids, how many
leading full blocks each replica holds.

The engine's own block hashes cannot be recomputed here (vLLM seeds them per process,
``PYTHONHASHSEED`` or a random seed), so each block is keyed by *our* chained hash of its
tokens: ``key_i = H(key_(i-1), tokens of block i)`` from a root that folds in the LoRA
name. On ``BlockStored`` the parent's key is found through the engine-hash -> key map,
which also resolves removals. A store whose parent is unknown (evicted here, or stored
before the subscriber joined) cannot be keyed and is skipped: the index may hold less than
the engine, never blocks the engine has dropped (as far as the events tell).

``H`` is CPython's tuple hash of ints, which is not salted, so keys agree across processes
(the balancer's queries and any sibling's); it is not cryptographic, and a collision only
misroutes a request.

Lost prompts: the index also remembers which *first* blocks (a prompt's leading block)
the engine removed or lost in a clear or restart, until the engine stores them again
(:meth:`ReplicaBlockIndex.lost`, :func:`lost_first`). The balancer's trie still says the
replica holds such a prompt (it cannot tell an evicted prompt from one in flight, not yet
published); this is how the router knows not to believe it.

Parameters: ``max_blocks`` (default 100_000 per replica, config ``kv_events.max_blocks``):
beyond it the least recently stored block is forgotten (LRU), counted in ``evicted``; the
lost first blocks are capped at the same number (oldest forgotten first).

:meth:`ReplicaBlockIndex.hot_runs` walks the held blocks most recently stored first, each
with its not yet walked ancestors and their depths: the mesh heartbeat's exact prefix
summary (:func:`skymesh.mesh.summary.build_block_summary`) samples it. For that each key
remembers its parent's key (one more dict entry per held key).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

DEFAULT_MAX_BLOCKS = 100_000
_MASK = (1 << 63) - 1
_ROOT = 0x6B76_6576  # "kvev"
_EXTRA = 0x6578_7472  # "extr"

_TOP = -1  # the parent of a first block (keys are masked non-negative)

EngineHash = bytes | int
# A request's block keys per (scoring key, block size) (skymesh.balancer.kv_feed): what a
# peer's exact prefix summary is probed with.
BlockKeys = Mapping[tuple[str, int], Sequence[int]]


def root_key(lora_name: str | None = None) -> int:
    return _ROOT if lora_name is None else hash((_ROOT, lora_name)) & _MASK


def block_keys(token_ids: Sequence[int], block_size: int, lora_name: str | None = None,
               limit: int | None = None) -> list[int]:
    """Our chained keys of the full blocks of ``token_ids`` (at most ``limit``)."""
    out: list[int] = []
    h = root_key(lora_name)
    n = len(token_ids) // block_size
    if limit is not None:
        n = min(n, limit)
    for i in range(n):
        h = hash((h, *token_ids[i * block_size : (i + 1) * block_size])) & _MASK
        out.append(h)
    return out


class ReplicaBlockIndex:
    """One replica's cached blocks. Not thread-safe: one event loop owns it."""

    __slots__ = ("_by_engine", "_firsts", "_keys", "_lost", "_parent", "block_size",
                 "evicted", "max_blocks", "orphans")

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks <= 0:
            raise ValueError("max_blocks must be positive")
        self.max_blocks = max_blocks
        self.block_size = 0  # learned from the first BlockStored
        # engine hash -> our key, in store order (the head is evicted first)
        self._by_engine: OrderedDict[EngineHash, int] = OrderedDict()
        # our key -> how many engine blocks carry it (the same tokens under two LoRA
        # adapters or salts are two engine blocks and one key only if their roots agree)
        self._keys: dict[int, int] = {}
        self._parent: dict[int, int] = {}  # held key -> its parent's key (or _TOP)
        # engine hashes of leading blocks (stored with no parent), and the keys of leading
        # blocks the engine dropped since (oldest first): see lost()
        self._firsts: set[EngineHash] = set()
        self._lost: OrderedDict[int, None] = OrderedDict()
        self.evicted = 0
        self.orphans = 0

    def __len__(self) -> int:
        return len(self._by_engine)

    def stored(self, block_hashes: Sequence[EngineHash], parent: EngineHash | None,
               token_ids: Sequence[int], block_size: int,
               lora_name: str | None = None, extra_keys: Sequence[Any] | None = None
               ) -> None:
        if block_size <= 0 or len(token_ids) < len(block_hashes) * block_size:
            self.orphans += len(block_hashes)  # malformed: cannot key the blocks
            return
        if self.block_size != block_size:
            if self._by_engine:
                # The engine changed its block size: what we hold is keyed differently.
                self.clear()
            self.block_size = block_size
        if parent is None:
            h = root_key(lora_name)
            up = _TOP
        else:
            found = self._by_engine.get(parent)
            if found is None:
                self.orphans += len(block_hashes)
                return
            h = up = found
        by_engine, keys, parents = self._by_engine, self._keys, self._parent
        for i, eh in enumerate(block_hashes):
            if i:
                up = h
            h = hash((h, *token_ids[i * block_size : (i + 1) * block_size])) & _MASK
            extra = extra_keys[i] if extra_keys and i < len(extra_keys) else None
            if extra is not None:
                # Multimodal placeholders or a salt: equal tokens, other content. The key
                # (and every child's) leaves the space prompts' tokens reach.
                h = hash((h, _EXTRA, repr(extra))) & _MASK
            if parent is None and i == 0:
                self._firsts.add(eh)
                self._lost.pop(h, None)
            old = by_engine.get(eh)
            if old is not None:
                by_engine.move_to_end(eh)
                if old == h:
                    continue
                self._drop_key(old)
            by_engine[eh] = h
            keys[h] = keys.get(h, 0) + 1
            parents[h] = up
        while len(by_engine) > self.max_blocks:
            # Our cap, not the engine's eviction: nothing is marked lost.
            eh, k = by_engine.popitem(last=False)
            self._firsts.discard(eh)
            self._drop_key(k)
            self.evicted += 1

    def removed(self, block_hashes: Iterable[EngineHash]) -> None:
        by_engine = self._by_engine
        for eh in block_hashes:
            k = by_engine.pop(eh, None)
            if k is not None:
                self._drop_key(k)
                if eh in self._firsts:
                    self._firsts.discard(eh)
                    if k not in self._keys:
                        self._mark_lost(k)

    def clear(self) -> None:
        """The engine dropped everything (``AllBlocksCleared``, a restart, a lost gap)."""
        for eh in self._firsts:
            self._mark_lost(self._by_engine[eh])
        self._firsts.clear()
        self._by_engine.clear()
        self._keys.clear()
        self._parent.clear()

    def _mark_lost(self, k: int) -> None:
        lost = self._lost
        lost[k] = None
        lost.move_to_end(k)
        while len(lost) > self.max_blocks:
            lost.popitem(last=False)

    def lost(self, first_key: int) -> bool:
        """Whether the engine dropped this leading block (by eviction, a clear or a
        restart) and has not stored it again."""
        return first_key in self._lost

    def _drop_key(self, k: int) -> None:
        n = self._keys.get(k, 0) - 1
        if n > 0:
            self._keys[k] = n
        else:
            self._keys.pop(k, None)
            self._parent.pop(k, None)

    def hot_runs(self) -> Iterator[list[tuple[int, int]]]:
        """``(key, depth)`` runs, deepest first: the most recently stored block and its
        ancestors, then the next most recent block and those of its ancestors not given
        yet, and so on. A block whose chain to the first block has a hole (an ancestor
        evicted here or never seen) is left out: the engine cannot reuse it for a prompt
        either. Read-only; do not change the index while iterating. Each held block is
        visited once, so a whole walk costs O(blocks held)."""
        held, parents = self._keys, self._parent
        n_held = len(held)
        depth: dict[int, int] = {}  # walked key -> its depth; 0: its chain has a hole
        for k in reversed(self._by_engine.values()):
            if k in depth:
                continue
            path: list[int] = []
            p, base, broken = k, 0, False
            while True:
                if p in depth:
                    base = depth[p]
                    broken = base == 0
                    break
                if p not in held or len(path) >= n_held:
                    # A hole; or a cycle, which only a hash collision can make: a walk
                    # longer than the index would never end.
                    broken = True
                    break
                path.append(p)
                p = parents.get(p, _TOP)
                if p == _TOP:
                    break
            if broken:
                for q in path:
                    depth[q] = 0
                continue
            top = base + len(path)
            run = [(q, top - i) for i, q in enumerate(path)]
            for q, d in run:
                depth[q] = d
            yield run

    def has_key(self, key: int) -> bool:
        return key in self._keys

    def match(self, keys: Sequence[int]) -> int:
        """How many leading ``keys`` this replica holds."""
        held = self._keys
        n = 0
        for k in keys:
            if k not in held:
                break
            n += 1
        return n

    def match_tokens(self, token_ids: Sequence[int], lora_name: str | None = None) -> int:
        """Leading full blocks of ``token_ids`` cached here (0 before any event)."""
        if not self.block_size:
            return 0
        return self.match(block_keys(token_ids, self.block_size, lora_name))


def longest_prefix(indexes: dict[str, ReplicaBlockIndex], token_ids: Sequence[int],
                   lora_name: str | None = None,
                   keys_by_size: dict[int, list[int]] | None = None) -> dict[str, int]:
    """Leading full blocks of ``token_ids`` cached per replica (keys computed once per
    block size, shared by the replicas, and taken from or left in ``keys_by_size``)."""
    out: dict[str, int] = {}
    by_size: dict[int, list[int]] = {} if keys_by_size is None else keys_by_size
    for name, idx in indexes.items():
        bs = idx.block_size
        if not bs or not len(idx):
            out[name] = 0
            continue
        keys = by_size.get(bs)
        if keys is None:
            keys = by_size[bs] = block_keys(token_ids, bs, lora_name)
        out[name] = idx.match(keys)
    return out


def lost_first(indexes: dict[str, ReplicaBlockIndex], token_ids: Sequence[int],
               lora_name: str | None = None) -> set[str]:
    """The replicas whose engine dropped the leading block of ``token_ids`` (evicted it,
    cleared or restarted) and has not stored it since."""
    out: set[str] = set()
    by_size: dict[int, list[int]] = {}
    for name, idx in indexes.items():
        bs = idx.block_size
        if not bs:
            continue
        first = by_size.get(bs)
        if first is None:
            first = by_size[bs] = block_keys(token_ids, bs, lora_name, limit=1)
        if first and idx.lost(first[0]):
            out.add(name)
    return out
