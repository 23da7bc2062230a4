"""Load-only baselines: round robin, uniform random, least load.

- ``round-robin``: cycles through the candidates in order of their ids; the cursor is the
  last target chosen, so skipping unavailable targets keeps the rotation fair.
- ``random``: uniform over the candidates, from the injected RNG.
- ``least-load``: fewest outstanding requests (SkyLB's LL baseline: requests the balancer
  has pushed and not yet seen finish, or the replica's own running + waiting count when
  that is larger); ties broken at random.
None of them take parameters.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest


class RoundRobin(Policy, name="round-robin"):
    def __init__(self, *, rng: random.Random | None = None) -> None:
        super().__init__(rng=rng)
        self._last: str | None = None

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        if not candidates:
            return None
        ordered = sorted(candidates)
        if self._last is None:
            pick = ordered[0]
        else:
            i = bisect.bisect_right(ordered, self._last)
            pick = ordered[i % len(ordered)]
        self._last = pick
        return pick


class Random(Policy, name="random"):
    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        return self.rng.choice(list(candidates)) if candidates else None


class LeastLoad(Policy, name="least-load"):
    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        return self._least_loaded(candidates, view, request)
