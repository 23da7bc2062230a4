"""A minimal discrete-event loop in virtual time."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.processed = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        # Never schedule into the past: callers compute times from `now` plus delays.
        heapq.heappush(self._heap, (t if t > self.now else self.now, next(self._seq), fn, args))

    def after(self, delay: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def __len__(self) -> int:
        return len(self._heap)

    def peek_time(self) -> float | None:
        return self._heap[0][0] if self._heap else None

    def run(self, until: float | None = None, on_tick: Callable[[float], None] | None = None
            ) -> None:
        heap = self._heap
        pop = heapq.heappop
        n = 0
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                break
            t, _, fn, args = pop(heap)
            self.now = t
            fn(*args)
            n += 1
            if on_tick is not None and n % 2048 == 0:
                on_tick(t)
        self.processed += n
