"""New prefill tokens times batch size, with a hotspot detector: ``lmetric`` (LMETRIC).

Follows LMETRIC ("Simple Multiplication May Be All You Need", sec. 5): each candidate
scores ``P-token x BS`` and the minimum wins (ties: seeded RNG).

- ``P-token``: prompt tokens the request would have to prefill on that target, i.e. the
  prompt minus its expected cache hit. The hit is estimated from this policy's own
  prefix trie of what it routed where: ``prompt_len * depth / len(prefix_keys)``, with
  ``depth`` the target's match depth (one trie lookup gives every candidate's depth).
  The paper's P-token also counts prefill tokens already queued on the instance; the
  router cannot see those, and they show up in ``BS`` as waiting requests instead.
- ``BS``: the target's batch size, running + waiting from the last probe plus what we
  pushed since, which the probe cannot show yet: ``TargetLoad.outstanding`` (which
  is that sum, or our own in-flight count when larger).
- Zeros: the paper gives no rule for them, but both factors can be 0 (an idle replica, a
  full prompt hit), and a bare product of 0 wipes out the other factor: every idle
  replica would tie whatever its cache, and a full hit would win whatever its load. We
  score ``(P-token + 1) x (BS + 1)``, which keeps the order of either factor when the
  other is equal and lets neither silence the other.

Hotspot detector (sec. 5.2), two phases, per request class. A class is the requests
sharing a KV prefix (in practice an application or user); here, the requests sharing
their first ``class_keys`` prefix keys (fewer if the prompt is shorter). For the arriving
request's class ``c``:

1. ``x`` = the fraction of the requests in the last ``window_s`` seconds that belong to
   ``c``, ``M`` = the targets whose cache (per the trie) holds ``c``'s prefix, ``M-bar``
   = the other targets. If ``x / (1 - x) > |M| / |M-bar|``, a hotspot may form: raise an
   alarm. Without an alarm (or with ``M`` or ``M-bar`` empty), phase 2's count restarts.
2. Under the alarm, count consecutive requests of ``c`` whose best score on a ``M``
   candidate is smaller than the best on the others (Eq. 4). Once more than ``2 |M|``
   in a row did, filter ``M`` out of the candidates for the class's requests and score
   the rest. If no candidate is left, fall back to load balancing only: the smallest
   ``BS`` among all candidates (the paper's mitigation).

The filter lifts itself: requests routed outside ``M`` put the prefix on new targets, so
``|M|`` grows until the phase-1 condition fails. The window keeps at most
``max_window_requests`` arrivals, and per-class state lives only while the class has
requests in the window.

Parameters:

- ``class_keys`` = 8: leading prefix keys that define a class (8 engine blocks = 128
  tokens; 8 text chunks = 512 characters: roughly a system prompt)
- ``window_s`` = 60.0: the accumulation window for ``x`` (the paper's 1 minute)
- ``hotspot_detector`` = True: set False for the bare ``P-token x BS`` score
- ``max_window_requests`` = 100_000: bound on the window's memory
- ``max_nodes`` = 100_000: trie node cap
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest, outstanding
from skymesh.prefix.trie import DEFAULT_MAX_NODES, PrefixTrie

_NONE: frozenset[str] = frozenset()  # "filter nothing", the usual answer of _hotspot


def _class_size(c: tuple[int, tuple[str, ...]]) -> int:
    return len(c[1])


class LMetric(Policy, name="lmetric"):
    uses_prefix_keys = True

    def __init__(
        self,
        *,
        class_keys: int = 8,
        window_s: float = 60.0,
        hotspot_detector: bool = True,
        max_window_requests: int = 100_000,
        max_nodes: int = DEFAULT_MAX_NODES,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(rng=rng)
        if class_keys < 1:
            raise ValueError(f"class_keys must be >= 1, got {class_keys}")
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if max_window_requests < 1:
            raise ValueError(f"max_window_requests must be >= 1, got {max_window_requests}")
        self.class_keys = class_keys
        self.window_s = window_s
        self.hotspot_detector = hotspot_detector
        self.max_window_requests = max_window_requests
        self.trie = PrefixTrie(max_nodes)
        self._members: tuple[str, ...] = ()
        self._window: deque[tuple[float, int]] = deque()  # (arrival time, class)
        self._counts: dict[int, int] = {}  # class -> arrivals in the window
        self._streak: dict[int, int] = {}  # class -> consecutive wins of a suspected M
        self._last_request: str | None = None
        # Observability (and tests): phase-1 alarms raised, requests steered off M.
        self.alarms = 0
        self.filtered = 0

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        if not candidates:
            return None
        keys = request.prefix_keys
        n = len(keys)
        plen = request.prompt_len
        population = self._members or candidates
        # One trie lookup gives every target's match depth, grouped by depth; the targets
        # of a group share P-token (+ 1, see the header). The targets that matched nothing
        # come too, when the trie can name them.
        groups, rest = self.trie.depth_partition(keys, population) if n else ([], ())
        # Scores as a list aligned with ``candidates``: this runs for every candidate on
        # every request, and a list comprehension is the cheapest loop Python has.
        outs = outstanding(view, candidates)
        if groups:
            # P-token + 1 by target; the largest class (often the dozens of targets that
            # hold a shared system prompt) is left out as the lookup's default, so only
            # the few others are written per request.
            classes = [(plen - plen * depth // n + 1, names) for depth, names in groups]
            default = plen + 1
            if rest is not None:
                classes.append((default, rest))
                default, big = max(classes, key=_class_size)
            else:
                big = ()
            p1_of: dict[str, int] = {}
            for p1, names in classes:
                if names is not big:
                    for name in names:  # measured: half the cost of dict.fromkeys
                        p1_of[name] = p1
            get = p1_of.get
            # strict=False: outs is built from candidates (see _argmin on the cost).
            vals = [get(c, default) * (o + 1)
                    for c, o in zip(candidates, outs, strict=False)]
        else:  # one P-token for all: the scores order as the loads do
            vals = outs
        if self.hotspot_detector and n:
            hot = self._hotspot(request, keys, groups, len(population), candidates, vals,
                                view.now)
            if hot:
                self.filtered += 1
                pool = [(c, v) for c, v in zip(candidates, vals, strict=True) if c not in hot]
                if not pool:
                    return self._least_loaded(candidates, view, request)
                return self._argmin([c for c, _ in pool], [v for _, v in pool], request)
        return self._argmin(candidates, vals, request)

    def _hotspot(
        self,
        request: RouteRequest,
        keys: Sequence[int],
        groups: list[tuple[int, tuple[str, ...]]],
        population: int,
        candidates: Sequence[str],
        vals: list[int],
        now: float,
    ) -> frozenset[str]:
        """The suspected hot targets to filter out for this request, or an empty set."""
        class_depth = min(self.class_keys, len(keys))
        cls = keys[class_depth - 1]
        if request.request_id != self._last_request:  # a retried request counts once
            self._last_request = request.request_id
            self._observe(cls, now)
        total = len(self._window)
        in_class = self._counts.get(cls, 0)
        m = 0
        for depth, names in groups:  # deepest first
            if depth < class_depth:
                break
            m += len(names)
        m_bar = population - m
        # Phase 1, x / (1 - x) > |M| / |M-bar| without dividing (1 - x may be 0).
        if not (m and m_bar and in_class * m_bar > (total - in_class) * m):
            self._streak.pop(cls, None)
            return _NONE
        self.alarms += 1
        hot = frozenset(t for depth, names in groups if depth >= class_depth for t in names)
        # Phase 2: does the hot set win this request on the multiplicative score (Eq. 4)?
        pairs = list(zip(candidates, vals, strict=True))
        best_hot = min((v for c, v in pairs if c in hot), default=None)
        best_rest = min((v for c, v in pairs if c not in hot), default=None)
        if best_hot is None or (best_rest is not None and best_hot >= best_rest):
            self._streak[cls] = 0
            return frozenset()
        streak = self._streak.get(cls, 0) + 1
        self._streak[cls] = streak
        return hot if streak > 2 * m else frozenset()

    def _observe(self, cls: int, now: float) -> None:
        window, counts = self._window, self._counts
        window.append((now, cls))
        counts[cls] = counts.get(cls, 0) + 1
        horizon = now - self.window_s
        while window and (window[0][0] <= horizon or len(window) > self.max_window_requests):
            _, old = window.popleft()
            left = counts[old] - 1
            if left:
                counts[old] = left
            else:
                del counts[old]
                self._streak.pop(old, None)

    def preferred(self, request: RouteRequest, targets: Sequence[str], view: LoadView
                  ) -> str | None:
        """The least loaded target holding most of the prompt (at least half its keys), so
        delay scheduling can keep a request with its cache while that target is busy."""
        keys = request.prefix_keys
        if not keys or not targets:
            return None
        depth, matched = self.trie.match(keys, targets)
        if matched and 2 * depth >= len(keys):
            return self._least_loaded(matched, view, request)
        return None

    def on_dispatch(self, request: RouteRequest, target: str, view: LoadView) -> None:
        self.trie.insert(request.prefix_keys, target)

    def on_cached(self, request: RouteRequest, target: str, keys: Sequence[int]) -> None:
        self.trie.insert(keys, target)

    def on_membership(self, targets: Sequence[str]) -> None:
        self._members = tuple(targets)
        self.trie.retain(targets)
