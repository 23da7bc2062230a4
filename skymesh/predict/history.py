"""History-based output-length baseline (the "history" predictor of GoodServe's Fig. 8,
after Past-Future, Gong et al., ASPLOS'25): no look at the prompt's content.

It predicts the median of the last ``window`` observed output lengths of requests whose
prompt length falls in the same power-of-two bucket, or of all requests when that bucket
has seen fewer than ``min_bucket`` of them, or ``default`` before anything was observed.
Pure and cheap: a balancer can feed it every completion.
"""

from __future__ import annotations

import statistics
from collections import deque


def prompt_bucket(prompt_len: int) -> int:
    return max(0, int(prompt_len)).bit_length()


class HistoryPredictor:
    def __init__(self, window: int = 1000, min_bucket: int = 20, default: int = 256) -> None:
        if window < 1 or min_bucket < 1 or default < 1:
            raise ValueError("window, min_bucket and default must be >= 1")
        self.window = window
        self.min_bucket = min_bucket
        self.default = default
        self._all: deque[int] = deque(maxlen=window)
        self._buckets: dict[int, deque[int]] = {}
        self._median: dict[int | None, int] = {}  # cache, cleared on observe

    def observe(self, prompt_len: int, output_len: int) -> None:
        b = prompt_bucket(prompt_len)
        self._all.append(output_len)
        self._buckets.setdefault(b, deque(maxlen=self.window)).append(output_len)
        self._median.pop(b, None)
        self._median.pop(None, None)

    def _med(self, key: int | None, values: deque[int]) -> int:
        m = self._median.get(key)
        if m is None:
            m = self._median[key] = max(1, round(statistics.median(values)))
        return m

    def predict(self, prompt_len: int) -> int:
        b = prompt_bucket(prompt_len)
        values = self._buckets.get(b)
        if values is not None and len(values) >= self.min_bucket:
            return self._med(b, values)
        if self._all:
            return self._med(None, self._all)
        return self.default
