"""Prefix summaries: what a region holds hot, in a bounded heartbeat field, and the
receiving side's view that combines them with what we forwarded (SkyLB sec. 3.2).

SkyLB keeps, per balancer, a *snapshot* trie of the prefixes it forwarded to each peer.
SkyMesh adds the peers' own word: every heartbeat may carry a :class:`PrefixSummary`, a
few hundred chained prefix keys the peer's replicas served most recently. Keys are
chained (key ``i`` names the whole prefix ``keys[: i + 1]``, see
:mod:`skymesh.prefix.trie`), so one key stands for a whole prefix, and the summary need
not carry paths: it samples each hot path at a fixed *depth ladder* (1, 2, 3, 4, 6, 8,
12, ... about x1.5 apart) and the receiver probes a request's keys at those depths only.
A match found that way is exact at the ladder depth and at most ~1.5x shallower than the
true match, which is all a routing decision needs.

Sender: :func:`build_summary` takes a :class:`~skymesh.prefix.PrefixTrie` (the local
replica trie) or key paths (most recent first) and returns at most ``max_keys`` keys,
most recently used paths first, each path's deepest ladder key first.

Receiver: :class:`PeerSnapshot` is a drop-in for the peer layer's ``PrefixTrie`` (same
``insert``/``match``/``depth_groups``/``depths``/``retain``) plus
``insert_summary(peer, keys, depths)``. A peer's summary replaces its previous one whole
(the latest summary *is* what is hot there; merging would keep cold keys forever).

Exact summaries (docs/kv-events.md, "Across the mesh"): where a region follows its
replicas' KV-cache events, the heartbeat also carries, per scoring key (how prompts are
tokenized) and block size, the region's hottest cached *blocks*:
:func:`build_block_summary` samples :meth:`ReplicaBlockIndex.hot_runs
<skymesh.prefix.kv_index.ReplicaBlockIndex.hot_runs>` at :data:`BLOCK_DEPTHS` (the
same ladder, in blocks, on to 4096: a 64k-token prompt in blocks of 16). Keys are our
chained block keys, equal across processes that tokenize alike, so the receiver probes a
request's own block keys (``RouteRequest.block_keys``) at those depths. For a peer with
an exact summary of a tag the request has keys for, that summary alone gives the peer's
depth: its text summary and our forwarding trie would still show prefixes the peer's
engines evicted. Other peers, and requests without block keys, use the text summary.

Parameters: ``max_keys`` = 512 (4 KiB of fixed64 on the wire; the same per exact
summary), ``depths`` = :data:`DEFAULT_DEPTHS`, per-peer receive cap ``max_summary_keys``
= 4096 (per summary).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Collection, Iterable, Sequence
from operator import attrgetter

from skymesh.prefix.kv_index import BlockKeys, ReplicaBlockIndex
from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie, _Segment

DEFAULT_MAX_KEYS = 512
# About x1.5 apart up to 512, the live balancer's key cap (skymesh.prefix.keys).
DEFAULT_DEPTHS: tuple[int, ...] = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256,
                                   384, 512)
BLOCK_DEPTHS: tuple[int, ...] = (*DEFAULT_DEPTHS, 768, 1024, 1536, 2048, 3072, 4096)
_U64 = (1 << 64) - 1


def _ladder_keys(keys: Sequence[int], start: int, depths: Sequence[int]) -> list[int]:
    """Keys of a run covering depths ``(start, start + len(keys)]`` that sit on the
    ladder, deepest first."""
    lo = bisect.bisect_right(depths, start)
    hi = bisect.bisect_right(depths, start + len(keys))
    return [keys[d - 1 - start] for d in reversed(depths[lo:hi])]


def build_summary(
    source: PrefixTrie | Iterable[Sequence[int]],
    max_keys: int = DEFAULT_MAX_KEYS,
    depths: Sequence[int] = DEFAULT_DEPTHS,
) -> list[int]:
    """At most ``max_keys`` hot prefix keys, sampled at ``depths``, most recent first.

    ``source`` is a trie (recency is its own: the last insert or match of each run) or
    key paths ordered most recent first.
    """
    if max_keys <= 0:
        return []
    ladder = sorted(set(depths))
    out: list[int] = []
    seen: set[int] = set()

    def take(keys: list[int]) -> bool:
        for k in keys:
            if k not in seen:
                seen.add(k)
                out.append(k & _U64)
                if len(out) >= max_keys:
                    return True
        return False

    if isinstance(source, PrefixTrie):
        for keys in _trie_runs(source, ladder):
            if take(keys):
                break
    else:
        for path in source:
            if take(_ladder_keys(path, 0, ladder)):
                break
    return out


def _trie_runs(trie: PrefixTrie, ladder: list[int]) -> Iterable[list[int]]:
    """Ladder keys of the trie's runs: the most recently used run, then its ancestors
    (shared system prompts are hot whenever a child is), then the next run, ...

    The trie has no public walk, so this adapter reads its segments (``_segments``:
    keys, start depth, parent, recency stamp); test_mesh_state pins that contract.
    """
    done: set[int] = set()
    for seg in sorted(trie._segments, key=attrgetter("stamp"), reverse=True):
        node: _Segment | None = seg
        while node is not None and id(node) not in done:
            done.add(id(node))
            keys = _ladder_keys(node.keys, node.start, ladder)
            if keys:
                yield keys
            node = node.parent


def build_block_summary(
    indexes: Sequence[ReplicaBlockIndex],
    max_keys: int = DEFAULT_MAX_KEYS,
    depths: Sequence[int] = BLOCK_DEPTHS,
) -> list[int]:
    """At most ``max_keys`` block keys the ``indexes`` hold (one region's replicas of one
    scoring key and block size), sampled at ``depths``: each replica's most recently
    stored blocks first (the replicas taken in turn), each run's deepest key first."""
    if max_keys <= 0:
        return []
    ladder = frozenset(depths)
    out: list[int] = []
    seen: set[int] = set()
    walks = [idx.hot_runs() for idx in indexes]
    while walks:
        for walk in list(walks):
            run = next(walk, None)
            if run is None:
                walks.remove(walk)
                continue
            for k, d in run:
                if d in ladder and k not in seen:
                    seen.add(k)
                    out.append(k)
                    if len(out) >= max_keys:
                        return out
    return out


# tag (scoring key, block size) -> (keys, ladder)
_Exact = dict[tuple[str, int], tuple[frozenset[int], tuple[int, ...]]]


class PeerSnapshot:
    """The peer layer's prefix view: a :class:`PrefixTrie` of what this balancer forwarded
    to each peer, plus each peer's latest gossiped summary.

    Answers ``match``/``depth_groups``/``depths`` like ``PrefixTrie``: a peer's depth is
    the deeper of its trie match and its summary match.
    """

    def __init__(self, max_nodes: int = DEFAULT_MAX_NODES, *,
                 max_summary_keys: int = 4 * 1024) -> None:
        self.trie = PrefixTrie(max_nodes)
        self.max_summary_keys = max_summary_keys
        self._summaries: dict[str, frozenset[int]] = {}
        self._owners: dict[int, set[str]] = {}  # summary key -> peers whose summary has it
        self._ladders: dict[str, tuple[int, ...]] = {}
        self._probe: tuple[int, ...] = ()  # union of the ladders, deepest first
        self._exact: dict[str, _Exact] = {}  # peer -> its exact summaries

    def __len__(self) -> int:
        return len(self.trie)

    # -- summaries -------------------------------------------------------------------------
    def insert_summary(self, peer: str, keys: Iterable[int],
                       depths: Sequence[int] = DEFAULT_DEPTHS) -> None:
        """Replace ``peer``'s summary with ``keys`` sampled at ``depths``."""
        new = frozenset(k & _U64 for k in itertools.islice(keys, self.max_summary_keys))
        self._drop_summary(peer)
        if not new:
            return
        self._summaries[peer] = new
        for k in new:
            self._owners.setdefault(k, set()).add(peer)
        self._ladders[peer] = tuple(sorted({d for d in depths if d > 0}))
        self._reprobe()

    def insert_block_summaries(
            self, peer: str, summaries: Iterable[tuple[str, int, Iterable[int], Sequence[int]]]
    ) -> None:
        """Replace ``peer``'s exact summaries with ``summaries``: (scoring key, block size,
        keys, depths) each. An empty key list is kept: the peer's engines hold nothing
        of that tag, which is news (a restart, a reset), not silence."""
        exact: _Exact = {}
        for key, block_size, keys, depths in summaries:
            if block_size <= 0:
                continue
            ladder = tuple(sorted({d for d in depths if d > 0}, reverse=True))
            exact[(key, block_size)] = (
                frozenset(k & _U64 for k in itertools.islice(keys, self.max_summary_keys)),
                ladder)
        if exact:
            self._exact[peer] = exact
        else:
            self._exact.pop(peer, None)

    def exact_of(self, peer: str) -> dict[tuple[str, int], int]:
        """Keys per tag of ``peer``'s exact summaries (``/status``)."""
        return {tag: len(keys) for tag, (keys, _l) in self._exact.get(peer, {}).items()}

    def _block_depths(self, n_keys: int, blocks: BlockKeys, allowed: Collection[str]
                      ) -> dict[str, int]:
        """Depth of each allowed peer whose exact summary covers one of the request's
        block key tags (0 if it holds none of them).

        Units: the policy compares depths with the request's text keys (``depth >=
        match_threshold * len(keys)``), so a match of ``b`` of the prompt's ``n`` full
        blocks counts as ``b * n_keys // n`` text keys: the same fraction of the prompt,
        rounded down so a partial block match never reads as a full one."""
        out: dict[str, int] = {}
        for p in allowed:
            exact = self._exact.get(p)
            if not exact:
                continue
            for tag, keys in blocks.items():
                held = exact.get(tag)
                n = len(keys)
                if held is None or not n:
                    continue
                have, ladder = held
                b = next((d for d in ladder if d <= n and (keys[d - 1] & _U64) in have), 0)
                out[p] = b * n_keys // n
                break
        return out

    def summary_of(self, peer: str) -> frozenset[int]:
        return self._summaries.get(peer, frozenset())

    def _drop_summary(self, peer: str) -> None:
        old = self._summaries.pop(peer, None)
        if old is None:
            return
        for k in old:
            owners = self._owners[k]
            owners.discard(peer)
            if not owners:
                del self._owners[k]
        self._ladders.pop(peer, None)
        self._reprobe()

    def _reprobe(self) -> None:
        self._probe = tuple(sorted({d for lad in self._ladders.values() for d in lad},
                                   reverse=True))

    def _summary_depths(self, keys: Sequence[int], allowed: Collection[str]) -> dict[str, int]:
        if not self._owners:
            return {}
        want = {p for p in allowed if p in self._summaries}
        out: dict[str, int] = {}
        n = len(keys)
        for d in self._probe:
            if not want:
                break
            if d > n:
                continue
            owners = self._owners.get(keys[d - 1] & _U64)
            if owners:
                for p in owners & want:
                    out[p] = d  # probing deepest first: the first hit is the deepest
                want -= owners
        return out

    # -- the PrefixTrie surface ------------------------------------------------------------
    def depths(self, keys: Sequence[int], allowed: Collection[str],
               blocks: BlockKeys | None = None) -> dict[str, int]:
        """Match depth of every allowed peer that matched at least one key; with the
        request's ``blocks``, a peer's exact summary of one of their tags overrides the
        rest of what we know of it (module docstring)."""
        if not keys:
            return {}
        exact = self._block_depths(len(keys), blocks, allowed) if blocks and self._exact \
            else {}
        if exact:
            allowed = [p for p in allowed if p not in exact]
        got = self.trie.depths(keys, allowed)
        for p, d in self._summary_depths(keys, allowed).items():
            if d > got.get(p, 0):
                got[p] = d
        got.update((p, d) for p, d in exact.items() if d)
        return got

    def depth_groups(self, keys: Sequence[int], allowed: Collection[str],
                     blocks: BlockKeys | None = None) -> list[tuple[int, tuple[str, ...]]]:
        """Allowed peers that matched, grouped by depth, deepest first (peers in
        ``allowed`` order, so seeded tie-breaks stay reproducible)."""
        got = self.depths(keys, allowed, blocks)
        groups: dict[int, list[str]] = {}
        for p in allowed:
            d = got.get(p)
            if d:
                groups.setdefault(d, []).append(p)
        return [(d, tuple(groups[d])) for d in sorted(groups, reverse=True)]

    def match(self, keys: Sequence[int], allowed: Collection[str],
              blocks: BlockKeys | None = None) -> tuple[int, tuple[str, ...]]:
        groups = self.depth_groups(keys, allowed, blocks)
        return groups[0] if groups else (0, ())

    def insert(self, keys: Sequence[int], target: str) -> None:
        """Record that we forwarded the prefix ``keys`` to ``target``."""
        self.trie.insert(keys, target)

    def targets(self) -> list[str]:
        return sorted(set(self.trie.targets()) | set(self._summaries) | set(self._exact))

    def size_of(self, target: str) -> int:
        return self.trie.size_of(target) + len(self._summaries.get(target, ()))

    def remove_target(self, target: str) -> None:
        self.remove_targets((target,))

    def remove_targets(self, targets: Iterable[str]) -> None:
        targets = list(targets)
        self.trie.remove_targets(targets)
        for t in targets:
            self._drop_summary(t)
            self._exact.pop(t, None)

    def retain(self, targets: Iterable[str]) -> None:
        """Forget every peer not in ``targets`` (a membership change)."""
        keep = set(targets)
        self.trie.retain(keep)
        for t in [t for t in self._summaries if t not in keep]:
            self._drop_summary(t)
        for t in [t for t in self._exact if t not in keep]:
            del self._exact[t]
