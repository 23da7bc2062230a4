"""vLLM's load-only router score: ``vllm-load`` (the baseline of LMETRIC's evaluation).

Follows LMETRIC ("Multiplication May Be All You Need for LLM Request Scheduling", sec. 4.1,
Figure 6a), which quotes vLLM's global scheduler as ``score = 4 x Q-BS + 1 x R-BS``: the
requests queued on an instance weigh four times the ones it runs, and the minimum wins
(ties: seeded RNG). It is a join-the-shortest-queue variant that ignores the KV cache.

- ``Q-BS``: requests waiting on the target, as the balancer knows it: the probe's waiting
  count plus what we pushed since that the probe cannot show yet, i.e.
  ``outstanding - running`` (never below 0).
- ``R-BS``: the probe's running count.

Parameters: ``queued_weight`` = 4.0, ``running_weight`` = 1.0 (vLLM's).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from skymesh.policies.base import LoadView, Policy, RouteRequest, TargetLoad


def vllm_score(load: TargetLoad, queued_weight: float = 4.0,
               running_weight: float = 1.0) -> float:
    running = load.running
    queued = max(0, load.outstanding - running)
    return queued_weight * queued + running_weight * running


class VllmLoad(Policy, name="vllm-load"):
    def __init__(self, *, queued_weight: float = 4.0, running_weight: float = 1.0,
                 rng: random.Random | None = None) -> None:
        super().__init__(rng=rng)
        if queued_weight < 0 or running_weight < 0:
            raise ValueError("weights must be >= 0")
        self.queued_weight = queued_weight
        self.running_weight = running_weight

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        qw, rw = self.queued_weight, self.running_weight
        return self._least(candidates, lambda c: vllm_score(view.load(c), qw, rw),
                           request)
