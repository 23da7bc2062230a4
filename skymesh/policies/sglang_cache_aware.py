"""SGLang router's cache-aware policy: ``sglang-cache-aware``.

Follows sglang-router's ``cache_aware`` policy (``sgl-router/src/policies/cache_aware.rs``
and its approximate radix tree ``sgl-router/src/tree.rs``):

1. Load first. With ``loads`` the outstanding requests of the candidates, the system is
   *imbalanced* when ``max - min > balance_abs_threshold`` and
   ``max > min * balance_rel_threshold``; then the request goes to the least loaded
   candidate (shortest queue), cache or not.
2. Otherwise, prefix match. The match rate is the matched fraction of the request's
   prefix keys (sglang: matched characters of the request text). Above
   ``cache_threshold`` the request goes to a target at the deepest match; at or below it,
   to the candidate with the smallest tree (sglang's ``get_smallest_tenant``: the target
   recorded on the fewest nodes, i.e. presumed to have the most free cache).
3. The tree records the request's prefix for the chosen target either way.

Where this differs from sglang, and why:

- Matching and the smallest tree consider only the available candidates (sglang matches
  over every tenant and falls back to the first healthy worker if the winner is not
  usable); the pushing mode has already said which targets may take a request.
- Among several targets at the deepest match, the least loaded wins (ties: seeded RNG);
  sglang takes whichever tenant its map yields first.
- One trie shared by all targets with a global node cap and inline oldest-first eviction;
  sglang keeps per-tenant character counts and evicts each tenant's LRU leaves down to
  ``max_tree_size`` characters every ``eviction_interval_secs`` on a background thread.
  Routing here must be pure (no threads, no clock), and a strict cap bounds memory.

Parameters (defaults are sglang-router's launch defaults, ``RouterArgs`` in
``sgl-router/py_src/sglang_router/router_args.py``: cache_threshold 0.3,
balance_abs_threshold 64, balance_rel_threshold 1.5; the Rust ``CacheAwareConfig::default``
in ``sgl-router/src/policies/mod.rs`` has the older 0.5 / 32 / 1.1):

- ``cache_threshold`` = 0.3: match rate above which the matched target is used
- ``balance_abs_threshold`` = 64: absolute load gap that may mean imbalance
- ``balance_rel_threshold`` = 1.5: load ratio that, together with the gap, means imbalance
- ``max_nodes`` = 100_000: trie node cap (sglang: ``max_tree_size`` = 2**26 characters
  per tenant, evicted every ``eviction_interval_secs`` = 120)
- ``tie_break`` = ``"least-loaded"``: among targets at the deepest match, the least loaded;
  among the smallest trees, the RNG. ``"first"`` takes the first as sglang does: the
  target recorded first at the deepest match, the first candidate (configuration order)
  among the smallest trees. An experiment: live, sglang-router keeps far more requests on
  the replicas listed first than this port does (docs/notes/lab-diary.md, "Results:
  SkyLB's evaluation, reproduced").
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest, outstanding
from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie


class SglangCacheAware(Policy, name="sglang-cache-aware"):
    uses_prefix_keys = True

    def __init__(
        self,
        *,
        cache_threshold: float = 0.3,
        balance_abs_threshold: int = 64,
        balance_rel_threshold: float = 1.5,
        max_nodes: int = DEFAULT_MAX_NODES,
        tie_break: str = "least-loaded",
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(rng=rng)
        if tie_break not in ("least-loaded", "first"):
            raise ValueError(f"tie_break must be 'least-loaded' or 'first', got {tie_break!r}")
        self.first = tie_break == "first"
        if not 0.0 <= cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {cache_threshold}")
        if balance_abs_threshold < 0 or balance_rel_threshold < 0:
            raise ValueError("balance thresholds must be >= 0")
        self.cache_threshold = cache_threshold
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.trie = PrefixTrie(max_nodes)

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        if not candidates:
            return None
        outs = outstanding(view, candidates)
        hi, lo = max(outs), min(outs)
        if hi - lo > self.balance_abs_threshold and hi > lo * self.balance_rel_threshold:
            return self._argmin(candidates, outs, request)
        keys = request.prefix_keys
        if keys:
            depth, matched = self.trie.match(keys, candidates)
            if matched and depth / len(keys) > self.cache_threshold:
                return matched[0] if self.first else self._least_loaded(matched, view, request)
        sizes = self.trie.sizes_of(candidates)
        if self.first:
            return candidates[sizes.index(min(sizes))]
        return self._argmin(candidates, sizes, request)

    def on_dispatch(self, request: RouteRequest, target: str, view: LoadView) -> None:
        self.trie.insert(request.prefix_keys, target)

    def on_membership(self, targets: Sequence[str]) -> None:
        self.trie.retain(targets)
