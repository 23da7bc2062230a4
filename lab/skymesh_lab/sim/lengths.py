"""Where a simulated request's predicted output length comes from (``SimConfig.length_predictor``).

- ``none``: no prediction (policies fall back to their defaults);
- ``oracle``: the true length;
- ``noisy-oracle``: the true length times ``exp(N(0, length_noise))``, drawn per request
  from the run's seed (a stand-in for a predictor with that error spread);
- ``history``: :class:`skymesh.predict.history.HistoryPredictor`, fed the true length of
  every request that completes (what a balancer learns from its own responses);
- ``meta``: ``WorkItem.meta["predicted_output_tokens"]``, set by the workload (e.g. the
  goodput benchmark's ShareGPT replay, predicted by the MoE-MLP model in one batch).
"""

from __future__ import annotations

import math
import random

from skymesh.predict.history import HistoryPredictor
from skymesh_lab.sim.workload import WorkItem

LENGTH_PREDICTORS = ("none", "oracle", "noisy-oracle", "history", "meta")


class LengthSource:
    def __init__(self, kind: str, noise: float = 0.5, seed: int = 0) -> None:
        if kind not in LENGTH_PREDICTORS:
            raise ValueError(f"unknown length predictor {kind!r}; "
                             f"valid: {', '.join(LENGTH_PREDICTORS)}")
        if noise < 0:
            raise ValueError(f"length noise must be >= 0, got {noise}")
        self.kind = kind
        self.noise = noise
        self.seed = seed
        self.history = HistoryPredictor() if kind == "history" else None

    def predict(self, item: WorkItem) -> int | None:
        kind = self.kind
        if kind == "oracle":
            return item.output_len
        if kind == "noisy-oracle":
            z = random.Random(f"{self.seed}/{item.request_id}").gauss(0.0, self.noise)
            return max(1, round(item.output_len * math.exp(z)))
        if kind == "history":
            assert self.history is not None
            return self.history.predict(item.prompt_len)
        if kind == "meta":
            v = item.meta.get("predicted_output_tokens")
            if not isinstance(v, int):
                raise ValueError(f"work item {item.request_id} has no predicted_output_tokens "
                                 "in its meta (length_predictor 'meta')")
            return v
        return None

    def observe(self, item: WorkItem, ok: bool) -> None:
        if self.history is not None and ok:
            self.history.observe(item.prompt_len, item.output_len)
