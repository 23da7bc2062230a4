"""A client's ``max_tokens`` on a workload that sets none: SkyLB's chat client.

SkyLB's WildChat client (skypilot-org/skypilot, branch ``serve-multi-region-lb``,
``sky/lbbench/workloads/wildchat.py``) sends every turn with ``max_tokens=512`` at
temperature 0. Our ``sharegpt-chat`` sends none, which SGLang's admission rule reads as
"up to what the context leaves" (capped at 4,096) and reserves for; so the SGLang-mode
chat runs need the cap to model SkyLB's setup. :class:`MaxTokens` wraps any workload: each
request gets ``max_new_tokens`` and an output cut to it.

Known difference: the next turn's prompt still carries the whole recorded answer (the
workload builds it), where SkyLB's client sends the model's own, capped one; a turn after
an answer longer than the cap therefore misses the cache past the cap.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from skymesh_lab.sim.workload import Arrival, WorkItem, Workload


class MaxTokens(Workload):
    def __init__(self, inner: Workload, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.inner = inner
        self.max_tokens = max_tokens
        self.name = inner.name

    def _cap(self, arrivals: Iterable[Arrival]) -> Iterator[Arrival]:
        for t, item in arrivals:
            # In place: the inner workload may recognise its items by identity.
            item.max_new_tokens = self.max_tokens
            item.output_len = min(item.output_len, self.max_tokens)
            yield t, item

    def initial(self) -> Iterator[Arrival]:
        return self._cap(self.inner.initial())

    def on_complete(self, item: WorkItem, now: float, ok: bool = True) -> Iterable[Arrival]:
        return list(self._cap(self.inner.on_complete(item, now, ok)))
