"""Longest prefix match among available targets: ``prefix-tree`` (SkyLB).

Follows SkyLB (Xia et al., 2025, sec. 3.2-3.3): the balancer keeps a prefix trie of the
requests it has routed, recording at each prefix node the targets it sent that prefix to
(:class:`skymesh.prefix.PrefixTrie`). A request matches its ``prefix_keys`` against the
trie restricted to the *available* candidates, stopping as soon as no available target
remains below a node. If the matched part is at least ``match_threshold`` of the prompt's
keys, the request goes to the least loaded (fewest outstanding) of the targets at the
deepest match; otherwise the prefix is too weak to be worth the load skew, and it goes to
the least loaded candidate overall (SkyLB: "when the prefix hit ratio is low (e.g.,
< 50%), it explores other underutilized replicas"). Ties break with the seeded RNG.

The trie is updated on dispatch with the request's keys and the chosen target, and again
when the request ends well with the keys of its prompt *and output* (``on_cached``): the
replica's cache holds both, and the next turn of a conversation or a tree's children
resend both. It is bounded (oldest entries evicted first) and forgets targets that leave
the membership.

Parameters:

- ``match_threshold`` = 0.7: minimum matched fraction of the keys to follow the match.
  SkyLB's 50% was set for a trie that holds prompts only, where a conversation's next turn
  matches just its previous prompt (often under half of the new one, the reply being
  long). With outputs recorded a continuation matches 90-100%, and a higher bar stops new
  requests from following a shared template (a few-shot prompt) onto the replicas that
  hold it, which pulled whole trees of thought together (``docs/notes/bench.md``,
  "Outputs in the trie").
- ``max_nodes`` = 100_000: trie node cap

Exact state: when the request carries the engines' own view (``exact_prefix``, from their
KV-cache events, docs/kv-events.md) for *every* candidate, the match is read from it
instead of the trie: the deepest match is the most leading blocks cached, the matched
fraction those blocks over the prompt's full blocks. A candidate without live events
sends the decision back to the trie (one scale for all candidates), and so does a prompt
no candidate holds any block of (requests for it may be in flight, not yet published). The
trie then ignores the targets whose events say they dropped the prompt's leading block
(``exact_lost``: evicted, cleared, restarted): its record of them is stale, so a prompt a
replica lost is scored by load from the batch that told it, not sent back there until the
trie's entries age out.
As the peer layer's policy, its trie is a ``PeerSnapshot`` that also reads the request's
``block_keys`` against the peers' exact summaries (skymesh.mesh.summary).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest
from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie


class PrefixTree(Policy, name="prefix-tree"):
    uses_prefix_keys = True
    # preferred() reads the trie (changed per prefix by on_dispatch/on_cached, wholesale
    # by evictions and membership: the trie's epoch) and the matched targets' loads
    # (Policy.memo_preferred).
    memo_preferred = True
    # select() over the targets preferred() was just asked about: the same match (the
    # trie's remembered lookup of the same allowed set, whose recency touch re-stamps
    # the segment that call made newest: no change of order) and the same least-loaded
    # choice among its holders, listed in the trie's order whatever the candidates'. The
    # engines' holders (exact_match) come in the candidates' order: the same order then.
    select_follows_preferred = True

    def __init__(
        self,
        *,
        match_threshold: float = 0.7,
        max_nodes: int = DEFAULT_MAX_NODES,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(rng=rng)
        if not 0.0 <= match_threshold <= 1.0:
            raise ValueError(f"match_threshold must be in [0, 1], got {match_threshold}")
        self.match_threshold = match_threshold
        self.trie = PrefixTrie(max_nodes)

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        if len(candidates) == 1:
            # Every branch below picks among a subset of the candidates: no match needed
            # (under sp-p's standing queue most dispatches have one replica to go to).
            return candidates[0]
        # The engines' view and the targets they say dropped the prompt are there only
        # with KV events configured: without, no call to find that out (the hot path).
        if request.exact_prefix is not None:
            exact = exact_match(request, candidates)
            if exact is not None:
                frac, holders = exact
                if holders and frac >= self.match_threshold:
                    return self._least_loaded(holders, view, request)
                return self._least_loaded(candidates, view, request)
        keys = request.prefix_keys
        if keys and candidates:
            depth, matched = self.trie.match(
                keys, trie_targets(request, candidates) if request.exact_lost else candidates,
                request.block_keys)
            if matched and depth >= self.match_threshold * len(keys):
                return self._least_loaded(matched, view, request)
        return self._least_loaded(candidates, view, request)

    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        if request.exact_prefix is not None:  # KV events configured (as in select)
            exact = exact_match(request, targets)
            if exact is not None:
                frac, holders = exact
                # The request carries its exact match (taken at arrival), so only the
                # holders' loads can change this answer (memo_preferred): no trie key
                # matters.
                self.considered, self.memo_keys = (), ()
                if holders and frac >= self.match_threshold:
                    self.considered = tuple(holders)
                    return self._least_loaded(holders, view, request)
                return None
        keys = request.prefix_keys
        self.considered, self.memo_keys = (), ()
        if not keys or not targets:
            return None
        depth, matched = self.trie.match(
            keys, trie_targets(request, targets) if request.exact_lost else targets,
            request.block_keys)
        # Keys are chained, so only an insert that changes the record of the deepest
        # matched key (another target there) or of the next one (a deeper match) can
        # change this answer; of the first key, if none matched.
        if not depth:
            self.memo_keys = (keys[0],)
        elif depth < len(keys):
            self.memo_keys = (keys[depth - 1], keys[depth])
        else:
            self.memo_keys = (keys[depth - 1],)
        if matched and depth >= self.match_threshold * len(keys):
            self.considered = matched
            # One holder (a prompt's usual case): no call to find the least loaded.
            return matched[0] if len(matched) == 1 else self._least_loaded(
                matched, view, request)
        return None

    def memo_epoch(self) -> int:
        return self.trie.epoch

    def on_dispatch(self, request: RouteRequest, target: str, view: LoadView) -> None:
        self.trie.insert(request.prefix_keys, target)

    def on_cached(self, request: RouteRequest, target: str, keys: Sequence[int]) -> None:
        self.trie.insert(keys, target)

    def on_membership(self, targets: Sequence[str]) -> None:
        self.trie.retain(targets)


def trie_targets(request: RouteRequest, targets: Sequence[str]) -> Sequence[str]:
    """The targets whose trie records may be believed for this request: not those whose
    events say they dropped its prompt."""
    lost = request.exact_lost
    if not lost:
        return targets
    return [t for t in targets if t not in lost]


def exact_match(request: RouteRequest, targets: Sequence[str]
                ) -> tuple[float, list[str]] | None:
    """(matched fraction, targets holding the most leading blocks) from the engines'
    events, or None when some target has no live events, the prompt has no full block, or
    no target holds any of it (the trie then decides)."""
    held = request.exact_prefix
    if held is None or not request.exact_blocks or not targets:
        return None
    if any(t not in held for t in targets):
        return None
    best = max(held[t] for t in targets)
    if best == 0:
        # Cached nowhere yet, per the events: the trie decides. It knows where this balancer
        # has just sent the prompt, which an engine publishes only once the prefill ran.
        return None
    return best / request.exact_blocks, [t for t in targets if held[t] == best]
