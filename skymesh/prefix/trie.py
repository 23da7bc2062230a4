"""A bounded prefix trie recording which targets served each prefix (SkyLB sec. 3.2).

Keys are *chained*: key ``i`` of a sequence identifies the whole prefix ``keys[: i + 1]``
(``RouteRequest.prefix_keys`` are chained engine-block hashes, and
:func:`skymesh.prefix.keys.text_prefix_keys` chains text chunks the same way). One flat
dict maps every key to the node holding it.

Each prefix records the set of targets that served it, as a bitmask over interned target
names. Inserting records the target on every prefix of the path, so a prefix's set is
always a subset of its parent's. That is what lets SkyLB stop its walk as soon as no
allowed target remains below a node, and it gives every target's match depth from one
walk: the targets at the deepest match, then each ancestor's others at its end.

The trie is path-compressed (a radix tree, like sglang-router's): a *segment* holds a
run of keys with one parent and one target set, and is split only where paths diverge
or target sets differ. A lookup walks a request's path a segment at a time: one dict
probe per segment (two or three on chat traffic), the keys inside a run compared with
the run's list without hashing. So only a segment's *first* key is indexed: a request
that adds 30 blocks to a conversation appends them to a list (or starts one segment),
and eviction trims lists. An earlier version indexed every key; on a full 100,000-key
trie its inserts and evictions were dominated by cache misses in that large dict, and
the trie held 12.5 MiB instead of 3.4 (the lab's decision benchmark prints both
the decision times and this footprint).

Size is counted in keys (one key = one node of the uncompressed trie) and capped at
``max_nodes`` (default 100,000). When an insert would pass the cap, eviction frees what
it needs plus ``max_nodes // 1024`` more (a low watermark; sglang-router instead evicts
on a timer): on a full trie the fixed cost of an eviction pass is then paid about once
per eight chat inserts rather than on every one, which takes a third off the median
routing decision for 40 us more at the p99 (the lab's decision benchmark).

Eviction is oldest first: the leaf segment least recently inserted or matched loses its
deepest keys first, and a parent whose last child is gone becomes a leaf as recent as
that child (or as its own last touch, if later).
Recency is kept per segment (touching any prefix of a run refreshes the run) and is a
counter, not a clock, so the trie needs no time source.

If keys are not chained (or two prefixes collide on one 64-bit key) answers become
approximate (a key may sit in two runs; a run whose first key another run already
indexes is not reachable by lookups and ages out), but the invariants hold: the cap,
subset-of-parent target sets, and :meth:`match` never naming a target outside
``allowed``.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import cast

DEFAULT_MAX_NODES = 100_000
_CACHE_LIMIT = 4096
# Lookups remembered (``match``): a few pumps' windows of queued requests. Each entry
# keeps its keys alive, so few: a long-lived heap is what the cyclic GC walks.
_MATCHES_LIMIT = 256
_BIT_BYTES = bytes.maketrans(b"01", b"\x00\x01")  # "0"/"1" characters -> falsy/truthy


_NO_CHILDREN = cast("set[_Segment]", frozenset())


class _Segment:
    __slots__ = ("children", "end", "keys", "mask", "parent", "stamp", "start")

    def __init__(self, keys: list[int], start: int, parent: _Segment | None, mask: int) -> None:
        self.keys = keys
        self.start = start  # depth of keys[0] in the sequence (0: a child of the root)
        # start + len(keys), kept in the object so a lookup need not touch the list.
        self.end = start + len(keys)
        self.parent = parent
        self.mask = mask  # bit i set: target number i served every prefix in this run
        # Most segments are leaves: they share one empty, immutable set instead of an
        # empty set each (216 bytes, about a quarter of a full trie's memory). Only
        # ``_adopt`` adds a child, and it gives the segment a set of its own first.
        self.children: set[_Segment] = _NO_CHILDREN
        self.stamp = 0


class PrefixTrie:
    """Which targets served which prefixes, bounded to ``max_nodes`` keys."""

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES) -> None:
        if max_nodes < 1:
            raise ValueError(f"max_nodes must be >= 1, got {max_nodes}")
        self.max_nodes = max_nodes
        self._slack = max_nodes >> 10  # eviction's low watermark (module docstring)
        self._index: dict[int, _Segment] = {}  # first key of a run -> its segment
        self._size = 0  # keys held, i.e. nodes of the uncompressed trie
        self._segments: set[_Segment] = set()
        self._bits: dict[str, int] = {}  # target -> bit index
        self._names: list[str | None] = []  # bit index -> target (None: free)
        self._free: list[int] = []
        self._sizes: list[int] = []  # bit index -> keys recording the target
        self._tick = 0  # the last stamp given out
        # Eviction order: a min-heap of leaf stamps, and the leaf holding each stamp. A
        # stamp names one leaf at a time (a parent inherits its evicted child's stamp), so
        # the heap holds plain ints, which compare far faster than tuples. Entries go stale
        # when a leaf is touched again or gains a child; they are skipped when popped.
        self._heap: list[int] = []
        self._leaf_at: dict[int, _Segment] = {}
        self._mask_cache: dict[tuple[str, ...], int] = {}
        self._name_cache: dict[int, tuple[str, ...]] = {}
        # The last tuple given as ``allowed`` and its mask: a policy passes its member
        # tuple on every request, and hashing a 64-tuple costs more than the walk's probes.
        self._last_allowed: tuple[str, ...] | None = None
        self._last_mask = 0
        self._live = 0  # the bits of every interned target
        # A lookup's walk, kept for the insert that usually follows it for the same keys
        # (select, then on_dispatch): (keys, depth, segment, version it is valid for).
        self._version = 0  # bumped by every change a lookup's answer may depend on
        # Recent lookups (``match``): id(keys) -> (keys, allowed mask, version, deepest
        # segment, answer). The dispatcher asks again about the same queued requests
        # on every pump; until the trie changes, only their recency needs refreshing.
        self._matches: dict[int, tuple[Sequence[int], int, int, _Segment | None,
                                       tuple[int, tuple[str, ...]]]] = {}
        # Bumped when prefixes are lost (eviction, departed targets): a match's answer
        # can then change for any keys, not only for keys an insert shares a head with.
        self.epoch = 0
        self._walk: tuple[Sequence[int], int, _Segment | None, int] | None = None
        # Told every insert that changed the trie's record (a key added, or the target
        # added to a prefix), after it: the balancer's workers share their routing
        # decisions, and a repeat of a decision recorded already is not news to a sibling
        # that was told the first time (skymesh.balancer.siblings).
        self.on_insert: Callable[[Sequence[int], str], None] | None = None
        # Told the keys of every insert, whoever makes it, and the depth of the first
        # prefix whose record changed (``_insert``; the dispatcher's memos of queued
        # requests watch the trie's keys: skymesh.balancer.dispatch).
        self.on_keys: Callable[[Sequence[int], int], None] | None = None

    def __len__(self) -> int:
        return self._size

    # -- targets ---------------------------------------------------------------------------
    def targets(self) -> list[str]:
        """Targets recorded on at least one prefix."""
        return [t for t, b in self._bits.items() if self._sizes[b]]

    def size_of(self, target: str) -> int:
        """How many prefixes (keys) record ``target``: its share of the tree."""
        b = self._bits.get(target)
        return 0 if b is None else self._sizes[b]

    def sizes_of(self, targets: Sequence[str]) -> list[int]:
        """:meth:`size_of` of each target, in order (one call for a whole candidate list)."""
        bits, sizes = self._bits, self._sizes
        return [sizes[bits[t]] if t in bits else 0 for t in targets]

    def _intern(self, target: str) -> int:
        b = self._bits.get(target)
        if b is None:
            if self._free:
                b = self._free.pop()
                self._names[b] = target
            else:
                b = len(self._names)
                self._names.append(target)
                self._sizes.append(0)
            self._bits[target] = b
            self._live |= 1 << b
            self._mask_cache.clear()
            self._last_allowed = None
        return b

    def _mask(self, allowed: Collection[str]) -> int:
        # Routers pass the same candidate lists over and over; building the mask bit by bit
        # would cost a dict probe per candidate on every decision.
        if allowed is self._last_allowed:
            return self._last_mask
        key = tuple(allowed)
        m = self._mask_cache.get(key)
        if m is None:
            bits = self._bits
            m = 0
            for t in key:
                b = bits.get(t)
                if b is not None:
                    m |= 1 << b
            if len(self._mask_cache) >= _CACHE_LIMIT:
                self._mask_cache.clear()
            self._mask_cache[key] = m
        if type(allowed) is tuple:  # immutable, so identity means the same targets
            self._last_allowed, self._last_mask = allowed, m
        return m

    def _decode(self, mask: int) -> tuple[str, ...]:
        names = self._name_cache.get(mask)
        if names is None:
            if mask.bit_count() > 4:
                # Many bits (a shared system prompt's targets): select the names with the
                # mask's bits in C, lowest bit first (3x faster than a loop at 32 bits).
                bits = bin(mask)[:1:-1].encode().translate(_BIT_BYTES)
                names = tuple(filter(None, itertools.compress(self._names, bits)))
            else:
                out: list[str] = []
                m = mask
                while m:
                    low = m & -m
                    name = self._names[low.bit_length() - 1]
                    if name is not None:
                        out.append(name)
                    m ^= low
                names = tuple(out)
            if len(self._name_cache) >= _CACHE_LIMIT:
                self._name_cache.clear()
            self._name_cache[mask] = names
        return names

    def _adjust_sizes(self, mask: int, delta: int) -> None:
        sizes = self._sizes
        while mask:
            low = mask & -mask
            sizes[low.bit_length() - 1] += delta
            mask ^= low

    # -- lookups ---------------------------------------------------------------------------
    def _deepest(
        self, keys: Sequence[int], allowed: int, hi: int
    ) -> tuple[int, _Segment | None]:
        """The largest depth d <= hi whose prefix exists and records one of ``allowed``,
        and the segment holding key ``d - 1`` (None when d is 0).

        A walk down the request's path, one segment (one dict probe) at a time: paths
        are a few segments long, while a binary search over the keys costs a probe of a
        large dict, i.e. cache misses, per halving. Inside a segment the request's keys
        are compared with the run's list directly; chained keys agree up to the first
        difference and never after, so that comparison bisects too.
        """
        if hi <= 0:
            return 0, None
        get = self._index.get
        seg = get(keys[0])
        # Where a key is not the head of its run, keys are not chained (or collided).
        if seg is None or seg.start or seg.keys[0] != keys[0] or not seg.mask & allowed:
            return 0, None
        while True:
            start, run = seg.start, seg.keys
            end = seg.end if seg.end < hi else hi
            if keys[end - 1] != run[end - 1 - start]:
                # Leaves the run midway: bisect for the last equal key (keys[start] is).
                lo, top = start + 1, end - 1
                while lo < top:
                    mid = (lo + top + 1) >> 1
                    if keys[mid - 1] == run[mid - 1 - start]:
                        lo = mid
                    else:
                        top = mid - 1
                return lo, seg
            if end == hi or end < seg.end:
                return end, seg
            nxt = get(keys[end])
            if nxt is None or nxt.parent is not seg or nxt.keys[0] != keys[end] \
                    or not nxt.mask & allowed:
                return end, seg
            seg = nxt

    def _lookup(self, keys: Sequence[int], amask: int) -> tuple[int, _Segment | None]:
        d, seg = self._deepest(keys, amask, len(keys))
        # Every target allowed: the walk insert would make. Only for a tuple of keys,
        # which cannot change before the insert that reuses the walk.
        if amask & self._live == self._live and type(keys) is tuple:
            self._walk = (keys, d, seg, self._version)
        return d, seg

    def depth_of(self, keys: Sequence[int]) -> int:
        """How much of ``keys`` is recorded, for any target. Leaves recency alone."""
        return self._deepest(keys, -1, len(keys))[0]

    def match(
        self, keys: Sequence[int], allowed: Collection[str], blocks: object = None
    ) -> tuple[int, tuple[str, ...]]:
        """The deepest depth at which some allowed target recorded the prefix of ``keys``,
        and the allowed targets recorded there; ``(0, ())`` when none did. ``blocks`` (a
        request's block keys) is for the peer layer's ``PeerSnapshot``; a trie of routing
        decisions has no block state and ignores it.

        The targets come in first-recorded order, not as a set: a set of strings iterates
        in a per-process order, and routers break ties over this sequence with a seeded RNG.
        """
        # Once or twice per request: ``_mask``'s identity test, ``_lookup`` and
        # ``_decode``'s cache inline (a call each fewer).
        amask = self._last_mask if allowed is self._last_allowed else self._mask(allowed)
        if not amask or not keys:
            return 0, ()
        matches = self._matches
        memo = matches.get(id(keys))
        if memo is not None and memo[0] is keys and memo[1] == amask \
                and memo[2] == self._version:
            seg = memo[3]
            # As the walk would: recency decides evictions. A segment that is the newest
            # already (the last touch was this lookup's, as when the dispatcher asks
            # select after preferred) keeps its place: a new stamp changes no order.
            if seg is not None and seg.stamp != self._tick:
                self._touch(seg)
            return memo[4]
        d, seg = self._deepest(keys, amask, len(keys))
        if amask & self._live == self._live and type(keys) is tuple:
            self._walk = (keys, d, seg, self._version)  # (``_lookup``)
        answer: tuple[int, tuple[str, ...]] = (0, ())
        if seg is not None:
            self._touch(seg)
            mask = seg.mask & amask
            names = self._name_cache.get(mask)
            answer = (d, names if names is not None else self._decode(mask))
        if len(matches) >= _MATCHES_LIMIT:
            matches.clear()
        matches[id(keys)] = (keys, amask, self._version, seg, answer)
        return answer

    def depths(self, keys: Sequence[int], allowed: Collection[str]) -> dict[str, int]:
        """Match depth of every allowed target that matched at least one key."""
        return {t: d for d, group in self.depth_groups(keys, allowed) for t in group}

    def depth_groups(
        self, keys: Sequence[int], allowed: Collection[str]
    ) -> list[tuple[int, tuple[str, ...]]]:
        """The allowed targets that matched, grouped by match depth, deepest first.

        Target sets shrink down the path, so after the deepest match the others are the
        segments above it: each ancestor's new targets matched down to its end.
        """
        return self._groups(keys, self._mask(allowed))[0]

    def depth_partition(
        self, keys: Sequence[int], allowed: Sequence[str]
    ) -> tuple[list[tuple[int, tuple[str, ...]]], tuple[str, ...] | None]:
        """:meth:`depth_groups`, and the allowed targets that matched nothing (first
        recorded first), or None when some allowed target is unknown to the trie (its name
        is in no mask). Lets a caller treat the largest class, matched or not, as the
        default instead of naming its members one by one."""
        amask = self._mask(allowed)
        groups, rest = self._groups(keys, amask)
        if amask.bit_count() != len(allowed):
            return groups, None
        return groups, self._decode(rest) if rest else ()

    def _groups(self, keys: Sequence[int], amask: int
                ) -> tuple[list[tuple[int, tuple[str, ...]]], int]:
        out: list[tuple[int, tuple[str, ...]]] = []
        if not amask or not keys:
            return out, amask
        d, seg = self._lookup(keys, amask)
        if seg is None:
            return out, amask
        self._touch(seg)
        while seg is not None and amask:
            group = seg.mask & amask
            if group:
                out.append((d, self._decode(group)))
                amask &= ~group
            seg = seg.parent
            if seg is not None:
                d = seg.end
        return out, amask

    # -- updates ---------------------------------------------------------------------------
    def insert(self, keys: Sequence[int], target: str) -> None:
        """Record that ``target`` served the prefix ``keys`` (and so all its prefixes)."""
        start = self._insert(keys, target)
        if self.on_insert is not None and start < len(keys):
            self.on_insert(keys, target)
        if self.on_keys is not None:
            self.on_keys(keys, start)

    def _insert(self, keys: Sequence[int], target: str) -> int:
        """:meth:`insert`; returns the depth of the first prefix of ``keys`` whose record
        changed (a key added, or ``target`` added to its set), ``len(keys)`` if none did.
        Only a match through that prefix can answer differently after the insert (keys
        are chained): an insert that repeats a known decision changes no answer."""
        n = min(len(keys), self.max_nodes)
        if n == 0:
            return len(keys)
        b = self._bits.get(target)
        if b is None:  # (a known target, two inserts a request: no call)
            b = self._intern(target)
        bit = 1 << b
        index = self._index
        walk = self._walk
        if walk is not None and walk[0] is keys and walk[3] == self._version \
                and n == len(keys):
            _, d, last, _ = walk
        else:
            d, last = self._deepest(keys, -1, n)  # -1: any target: "the prefix exists"
        if d == n and last is not None and last.mask & bit:
            # A decision recorded already (every prefix holds the target: the subset
            # invariant): only recency moves, so lookups remembered stay valid.
            if last.stamp != self._tick:
                self._touch(last)
            return len(keys)
        self._version += 1
        self._walk = None
        changed = d if d < n else len(keys)
        if last is not None:
            cut = d - last.start  # keys of ``last`` on this path
            if d < last.end and (d < n or not last.mask & bit):
                # The path leaves ``last`` midway or gives its head a target the tail
                # lacks: split so each run keeps a single parent and target set.
                self._split(last, cut)
            # Subset invariant: once an ancestor has the target, all above it do too.
            up: _Segment | None = last
            while up is not None and not up.mask & bit:
                up.mask |= bit
                self._sizes[b] += len(up.keys)
                changed = up.start
                up = up.parent
            # Newest now, so evicting room for the new suffix never takes the path itself
            # (it is already when the lookup before this insert just touched it).
            if last.stamp != self._tick:
                self._touch(last)
        if d == n:
            return changed
        excess = self._size + (n - d) - self.max_nodes
        if excess > 0:
            # Never more than the keys off this path (excess alone never is: n <= cap),
            # so the path, touched above, survives.
            self._evict(min(excess + self._slack, self._size - d))
        if last is not None and not last.children and last.mask == bit:
            seg = last  # a conversation growing on the same target: extend its run
        else:
            seg = _Segment([], d, last, bit)
            if index.setdefault(keys[d], seg) is not seg:
                return changed  # the key heads another run: unchained keys or a collision
        seg.keys.extend(keys[d:n])
        added = n - d
        seg.end += added
        self._size += added
        self._sizes[b] += added
        if seg is last:
            return changed
        self._segments.add(seg)
        if last is not None:
            _adopt(last, seg)
        self._touch(seg)
        return changed

    def _split(self, seg: _Segment, cut: int) -> None:
        """Keep ``seg.keys[:cut]`` in ``seg``; the rest becomes its only child."""
        tail = _Segment(seg.keys[cut:], seg.start + cut, seg, seg.mask)
        tail.stamp = seg.stamp  # ``seg`` is no leaf now, so the stamp passes to ``tail``
        tail.children = seg.children
        for child in tail.children:
            child.parent = tail
        seg.children = {tail}
        del seg.keys[cut:]
        seg.end = tail.start
        # With chained keys a key inside a run heads no other run; otherwise (module
        # docstring) the tail stays unindexed rather than steal another run's entry.
        self._index.setdefault(tail.keys[0], tail)
        self._segments.add(tail)
        if not tail.children:
            self._push(tail)

    def remove_target(self, target: str) -> None:
        """Forget ``target`` everywhere, deleting prefixes no target is left on."""
        self.remove_targets((target,))

    def retain(self, targets: Iterable[str]) -> None:
        """Forget every target not in ``targets`` (a membership change)."""
        keep = set(targets)
        self.remove_targets([t for t in self._bits if t not in keep])

    def remove_targets(self, targets: Iterable[str]) -> None:
        gone = 0
        for t in targets:
            b = self._bits.pop(t, None)
            if b is not None:
                gone |= 1 << b
                self._names[b] = None
                self._sizes[b] = 0
                self._free.append(b)
        if not gone:
            return
        self._version += 1
        self.epoch += 1
        self._walk = None
        self._live &= ~gone
        self._last_allowed = None
        self._mask_cache.clear()
        self._name_cache.clear()
        dead: list[_Segment] = []
        for seg in self._segments:
            if seg.mask & gone:
                seg.mask &= ~gone
                if not seg.mask:
                    dead.append(seg)
        # A run left empty has only empty descendants (subset invariant), so whole
        # subtrees go; only a surviving parent needs its children fixed.
        for seg in dead:
            self._unindex(seg)
            self._size -= len(seg.keys)
            self._segments.discard(seg)
        # A surviving parent left childless is as recent as the newest child it lost
        # (``dead`` is in set order, so "the last one processed" would be arbitrary).
        newest: dict[_Segment, int] = {}
        for seg in dead:
            p = seg.parent
            if p is not None and p.mask:
                p.children.discard(seg)
                newest[p] = max(newest.get(p, 0), seg.stamp)
        for p, stamp in newest.items():
            if not p.children:
                p.children = _NO_CHILDREN
                p.stamp = max(p.stamp, stamp)
                self._push(p)
        self._sweep_heap()

    def _unindex(self, seg: _Segment) -> None:
        index, head = self._index, seg.keys[0]
        if index.get(head) is seg:
            del index[head]

    # -- recency and eviction ----------------------------------------------------------------
    def _touch(self, seg: _Segment) -> None:
        # Every match and insert touches a segment: ``_push`` inlined, one call not two.
        leaf_at = self._leaf_at
        if leaf_at.get(seg.stamp) is seg:
            del leaf_at[seg.stamp]
        stamp = self._tick = self._tick + 1
        seg.stamp = stamp
        if not seg.children:
            leaf_at[stamp] = seg
            heap = self._heap
            heapq.heappush(heap, stamp)
            if len(heap) > 2 * len(leaf_at) + 1024:
                self._sweep_heap()

    def _push(self, seg: _Segment) -> None:
        self._leaf_at[seg.stamp] = seg
        heapq.heappush(self._heap, seg.stamp)
        if len(self._heap) > 2 * len(self._leaf_at) + 1024:
            self._sweep_heap()

    def _live_leaf(self, stamp: int, seg: _Segment) -> bool:
        return not seg.children and seg.stamp == stamp and seg in self._segments

    def _sweep_heap(self) -> None:
        # ``_live_leaf`` inlined: a method call per leaf was most of a sweep's cost.
        segments = self._segments
        self._leaf_at = {s: g for s, g in self._leaf_at.items()
                         if not g.children and g.stamp == s and g in segments}
        self._heap = list(self._leaf_at)
        heapq.heapify(self._heap)

    def _evict(self, count: int) -> None:
        """Drop ``count`` keys, deepest keys of the oldest leaf first."""
        self.epoch += 1
        heap, leaf_at = self._heap, self._leaf_at
        while count > 0 and heap:
            stamp = heapq.heappop(heap)
            seg = leaf_at.pop(stamp, None)
            if seg is None or not self._live_leaf(stamp, seg):
                continue
            keys = seg.keys
            if len(keys) > count:
                # Trim the deepest keys: they are this run's leaves, all equally old.
                del keys[-count:]
                seg.end -= count
                self._size -= count
                self._adjust_sizes(seg.mask, -count)
                leaf_at[stamp] = seg
                heapq.heappush(heap, stamp)
                return
            self._unindex(seg)
            self._size -= len(keys)
            self._adjust_sizes(seg.mask, -len(keys))
            count -= len(keys)
            self._segments.discard(seg)
            p = seg.parent
            if p is not None:
                p.children.discard(seg)
                if not p.children:
                    p.children = _NO_CHILDREN
                    p.stamp = max(p.stamp, stamp)
                    leaf_at[p.stamp] = p
                    heapq.heappush(heap, p.stamp)
        if count > 0:
            raise RuntimeError("prefix trie: a leaf has no eviction entry (a bug)")


def _adopt(parent: _Segment, child: _Segment) -> None:
    if parent.children is _NO_CHILDREN:
        parent.children = {child}
    else:
        parent.children.add(child)
