"""Power of two choices: ``power-of-two``.

Samples two distinct candidates uniformly with the injected RNG and sends the request to
the one with fewer outstanding requests (Mitzenmacher, "The Power of Two Choices in
Randomized Load Balancing", 2001; sglang-router's ``power_of_two`` does the same with its
own load counts). It needs no global scan, and avoids the herd that pure least-load
causes when several balancers act on the same stale load reports. A tie goes to either
of the two at random; a single candidate is taken as is. No parameters.
"""

from __future__ import annotations

from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest


class PowerOfTwo(Policy, name="power-of-two"):
    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        n = len(candidates)
        if n <= 1:
            return candidates[0] if n else None
        i = self.rng.randrange(n)
        j = self.rng.randrange(n - 1)
        if j >= i:  # skip i, so the two picks are distinct and still uniform
            j += 1
        return self._least_loaded((candidates[i], candidates[j]), view, request)
