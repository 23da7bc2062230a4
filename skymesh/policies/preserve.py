"""Anticipated-load routing with a per-replica look-ahead map: ``preserve`` (PreServe).

Follows PreServe (Wang et al., "PreServe: Intelligent Management for LMaaS Systems via
Hierarchical Prediction", sec. 4.3.1 and 4.3.3).

Load anticipator (one :class:`LookAheadMap` per replica): the KV tokens the replica is
expected to hold in each of its next ``horizon`` iterations (decode steps). A request with
``P`` prompt tokens and ``D`` predicted output tokens adds ``P + i`` tokens at its ``i``-th
iteration, ``i in [0, D)``. Corrections (sec. 4.3.1):

- it ends early (fewer than ``D`` tokens): what it would still have held is subtracted;
- it runs past ``D``: a virtual extension of ``extension x D`` iterations (0.2, the
  paper's value) is added, again each time the extension runs out, until it ends. The
  paper writes the extension as 0.2 times the true length, which is not known while the
  request runs; we take 0.2 times the length predicted so far, extensions included.

Router score (sec. 4.3.3), the minimum wins (ties: seeded RNG)::

    L = queued_prefill + P + current_decode + D + beta * max(0, U_peak - T_mem) * M

``queued_prefill``: prompt tokens routed to the replica that have not produced a first
token; ``current_decode``: predicted output tokens its running requests still have to
generate (from the map); ``U_peak``: the peak of the map over the next ``window``
iterations with this request virtually added, as a fraction of the replica's KV capacity
``M``; ``T_mem`` = 0.8 and ``beta`` = 1 (the paper's).

Iterations are counted per replica from the clock: ``elapsed / iteration_s``, with
``iteration_s`` learnt per replica as an EMA of the time per output token of its finished
requests (``on_timing``), starting from the ``iteration_s`` parameter. The map is updated
at dispatch (the paper: after prefill; the router only sees the dispatch). Predicted
lengths come from ``RouteRequest.predicted_output_tokens``, else ``output_len_hint``, else
``default_output_tokens``.

Parameters:

- ``beta`` = 1.0, ``mem_threshold`` = 0.8, ``window`` = 100 (iterations),
  ``horizon`` = 4096 (iterations; the model's longest output), ``extension`` = 0.2
- ``iteration_s`` = 0.05: first guess of a decode step (Llama-3.1-8B on an L4)
- ``ema_alpha`` = 0.2: weight of a new iteration-time observation
- ``kv_capacity_tokens`` = 38_400: ``M`` for a replica that does not publish its capacity
- ``default_output_tokens`` = 256: ShareGPT's median response
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from skymesh.policies.base import LoadView, Policy, RequestTiming, RouteRequest


@dataclass(slots=True)
class _Entry:
    start: int  # absolute iteration of its first output token
    prompt: int
    predicted: int  # iterations mapped so far, extensions included


class LookAheadMap:
    """Anticipated KV tokens of one replica over its next ``horizon`` iterations.

    Index 0 of :attr:`usage` is iteration :attr:`origin` (absolute, counted from 0).
    """

    def __init__(self, horizon: int = 4096, extension: float = 0.2) -> None:
        if horizon < 1:
            raise ValueError(f"horizon must be >= 1, got {horizon}")
        if extension <= 0:
            raise ValueError(f"extension must be > 0, got {extension}")
        self.horizon = horizon
        self.extension = extension
        import numpy as np  # here: the config check of skymesh-lb's supervisor needs none

        self.usage = np.zeros(horizon)
        self.origin = 0
        self.entries: dict[str, _Entry] = {}
        self.extensions = 0  # virtual extensions applied (observability, tests)
        # Sum of the entries' ends (start + predicted), so remaining_decode is O(1): the
        # router asks it for every candidate on every request.
        self._end_sum = 0
        # For one window w: prefix maxima of usage[i] + i and suffix maxima of usage[i],
        # so peak() with any virtual request is two lookups (see peak). Rebuilt lazily
        # after the map changes: a decision asks every candidate, a dispatch changes one.
        self._peaks: tuple[int, list[float], list[float]] | None = None

    def _apply(self, e: _Entry, lo: int, hi: int, sign: float) -> None:
        """Add (sign +1) or remove (-1) ``e``'s tokens at absolute iterations [lo, hi)."""
        lo = max(lo, self.origin, e.start)
        hi = min(hi, self.origin + self.horizon)
        if hi <= lo:
            return
        self._peaks = None
        import numpy as np

        held = e.prompt + np.arange(lo - e.start, hi - e.start, dtype=float)
        self.usage[lo - self.origin: hi - self.origin] += sign * held

    def add(self, request_id: str, prompt_tokens: int, predicted_tokens: int) -> None:
        e = _Entry(self.origin, max(0, prompt_tokens), max(1, predicted_tokens))
        self.entries[request_id] = e
        self._end_sum += e.start + e.predicted
        self._apply(e, e.start, e.start + e.predicted, 1.0)

    def finish(self, request_id: str) -> None:
        """The request ended now: drop what it would still have held (early end)."""
        e = self.entries.pop(request_id, None)
        if e is not None:
            self._end_sum -= e.start + e.predicted
            self._apply(e, self.origin, e.start + e.predicted, -1.0)

    def advance(self, to_iteration: int) -> None:
        """Move the origin to ``to_iteration``; extend requests that outlived their
        predicted length (they are still running: nobody called :meth:`finish`)."""
        shift = to_iteration - self.origin
        if shift <= 0:
            return
        self._peaks = None
        if shift >= self.horizon:
            self.usage[:] = 0.0
        else:
            self.usage[:-shift] = self.usage[shift:]
            self.usage[-shift:] = 0.0
        old_end = self.origin + self.horizon
        self.origin = to_iteration
        for e in self.entries.values():
            # Iterations that were beyond the old window and are inside the new one.
            self._apply(e, old_end, e.start + e.predicted, 1.0)
            while e.start + e.predicted <= self.origin:
                ext = max(1, math.ceil(self.extension * e.predicted))
                self._apply(e, e.start + e.predicted, e.start + e.predicted + ext, 1.0)
                e.predicted += ext
                self._end_sum += ext
                self.extensions += 1

    def remaining_decode(self) -> int:
        """Predicted output tokens the mapped requests still have to generate.

        Every entry started at or before the origin (entries start at the origin when
        added, and it only moves on) and ends after it (``advance`` extends any that
        would not), so each still has ``end - origin`` to go.
        """
        return self._end_sum - len(self.entries) * self.origin

    def peak(self, window: int, prompt_tokens: int = 0, predicted_tokens: int = 0) -> float:
        """Peak tokens over the next ``window`` iterations, with a request of
        ``prompt_tokens`` + ``predicted_tokens`` virtually added from now."""
        w = max(1, min(window, self.horizon))
        n = min(w, max(0, predicted_tokens))
        peaks = self._peaks
        if peaks is None or peaks[0] != w:
            import numpy as np

            u = self.usage[:w]
            with_request = np.maximum.accumulate(u + np.arange(w, dtype=float))
            after = np.maximum.accumulate(u[::-1])[::-1]
            peaks = (w, with_request.tolist(), [*after.tolist(), -math.inf])
            self._peaks = peaks
        _, with_request_max, after_max = peaks
        # The virtual request holds prompt + i at iteration i < n; usage alone after that.
        if n == 0:
            return after_max[0]
        return max(with_request_max[n - 1] + prompt_tokens, after_max[n])


@dataclass(slots=True)
class _Replica:
    amap: LookAheadMap
    clock: float | None = None  # view time matching amap.origin + frac
    frac: float = 0.0  # fraction of an iteration past the origin
    iteration_s: float = 0.05
    queued_prefill: int = 0


def predicted_output(request: RouteRequest, default: int) -> int:
    for v in (request.predicted_output_tokens, request.output_len_hint):
        if v is not None and v > 0:
            return v
    return default


def preserve_score(queued_prefill: int, prompt: int, current_decode: int, predicted: int,
                   peak_tokens: float, capacity: int, beta: float = 1.0,
                   mem_threshold: float = 0.8) -> float:
    """PreServe's L = L_p + L_d + beta * L_m (sec. 4.3.3)."""
    overflow = max(0.0, peak_tokens / capacity - mem_threshold) * capacity
    return queued_prefill + prompt + current_decode + predicted + beta * overflow


class PreServe(Policy, name="preserve"):
    uses_length_prediction = True

    def __init__(
        self,
        *,
        beta: float = 1.0,
        mem_threshold: float = 0.8,
        window: int = 100,
        horizon: int = 4096,
        extension: float = 0.2,
        iteration_s: float = 0.05,
        ema_alpha: float = 0.2,
        kv_capacity_tokens: int = 38_400,
        default_output_tokens: int = 256,
        rng: random.Random | None = None,
    ) -> None:
        super().__init__(rng=rng)
        if beta < 0 or not 0 < mem_threshold <= 1:
            raise ValueError("need beta >= 0 and 0 < mem_threshold <= 1")
        if window < 1 or iteration_s <= 0 or not 0 < ema_alpha <= 1:
            raise ValueError("need window >= 1, iteration_s > 0, 0 < ema_alpha <= 1")
        if kv_capacity_tokens < 1 or default_output_tokens < 1:
            raise ValueError("kv_capacity_tokens and default_output_tokens must be >= 1")
        LookAheadMap(horizon, extension)  # validates both
        self.beta = beta
        self.mem_threshold = mem_threshold
        self.window = window
        self.horizon = horizon
        self.extension = extension
        self.iteration_s = iteration_s
        self.ema_alpha = ema_alpha
        self.kv_capacity_tokens = kv_capacity_tokens
        self.default_output_tokens = default_output_tokens
        self.replicas: dict[str, _Replica] = {}
        # request id -> (target, prompt tokens still counted as queued prefill)
        self._queued: dict[str, tuple[str, int]] = {}

    def _replica(self, target: str, now: float) -> _Replica:
        r = self.replicas.get(target)
        if r is None:
            r = _Replica(LookAheadMap(self.horizon, self.extension), now,
                         iteration_s=self.iteration_s)
            self.replicas[target] = r
        if r.clock is None:
            r.clock = now
        elif now > r.clock:
            pos = r.frac + (now - r.clock) / r.iteration_s
            steps = int(pos)
            r.frac = pos - steps
            r.clock = now
            if steps:
                r.amap.advance(r.amap.origin + steps)
        return r

    def _capacity(self, view: LoadView, target: str) -> int:
        cap = getattr(view.load(target), "kv_capacity_tokens", None)
        return cap if isinstance(cap, int) and cap > 0 else self.kv_capacity_tokens

    def score(self, request: RouteRequest, target: str, view: LoadView) -> float:
        r = self._replica(target, view.now)
        predicted = predicted_output(request, self.default_output_tokens)
        peak = r.amap.peak(self.window, request.prompt_len, predicted)
        return preserve_score(r.queued_prefill, request.prompt_len, r.amap.remaining_decode(),
                              predicted, peak, self._capacity(view, target), self.beta,
                              self.mem_threshold)

    def select(
        self, request: RouteRequest, candidates: Sequence[str], view: LoadView
    ) -> str | None:
        scores = {c: self.score(request, c, view) for c in candidates}
        return self._least(candidates, scores.__getitem__, request)

    def on_dispatch(self, request: RouteRequest, target: str, view: LoadView) -> None:
        r = self._replica(target, view.now)
        r.amap.add(request.request_id, request.prompt_len,
                   predicted_output(request, self.default_output_tokens))
        r.queued_prefill += request.prompt_len
        self._queued[request.request_id] = (target, request.prompt_len)

    def _started(self, request_id: str) -> None:
        q = self._queued.pop(request_id, None)
        if q is not None and q[0] in self.replicas:
            self.replicas[q[0]].queued_prefill -= q[1]

    def on_timing(self, request: RouteRequest, target: str, timing: RequestTiming) -> None:
        if timing.first_token_at is not None:
            self._started(request.request_id)
        r = self.replicas.get(target)
        if (r is not None and timing.finished and timing.first_token_at is not None
                and timing.output_tokens > 1):
            tpot = (timing.now - timing.first_token_at) / (timing.output_tokens - 1)
            if tpot > 0:
                a = self.ema_alpha
                r.iteration_s = a * tpot + (1 - a) * r.iteration_s

    def on_complete(self, request: RouteRequest, target: str, ok: bool) -> None:
        self._started(request.request_id)
        r = self.replicas.get(target)
        if r is not None:
            r.amap.finish(request.request_id)

    def on_membership(self, targets: Sequence[str]) -> None:
        keep = set(targets)
        for t in list(self.replicas):
            if t not in keep:
                del self.replicas[t]
        self._queued = {k: v for k, v in self._queued.items() if v[0] in keep}
