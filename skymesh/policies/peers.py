"""What a balancer knows about its peer balancers, for the peer layer of two-layer routing.

SkyLB Algorithm 1: a request goes to a local replica if one is available; else to a peer
balancer that is alive, has at least one available replica and a queue no longer than a
small ``tau``; else it waits at the head of the queue. A peer's load comes from its
heartbeats (per model: available and total replicas, queue length, pending prefill
tokens), stamped ``(epoch, seq)`` and applied only if newer, plus our own bookkeeping
between heartbeats: requests we forwarded since the last heartbeat and that have not
started count against the peer's available replicas, so a burst cannot all go to a peer
that had one free replica.

``PeerLoad`` satisfies the policies' ``TargetLoad`` protocol, so the same policy objects
(round robin, least load, consistent hashing, the prefix tree as a per-peer snapshot of
what we forwarded) serve the peer layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

DEFAULT_TAU = 2


@dataclass(frozen=True, slots=True)
class ModelLoad:
    available: int
    total: int
    queue: int
    pending_prefill_tokens: int = 0


@dataclass(slots=True)
class PeerLoad:
    target: str
    # Owned by whoever tracks reachability (the live balancer's liveness loop); the
    # simulator never partitions, so peers start alive.
    alive: bool = True
    epoch: int = -1
    seq: int = -1
    heard_at: float = -math.inf
    rtt_s: float = 0.0
    models: dict[str, ModelLoad] = field(default_factory=dict)
    in_flight: int = 0
    # Forwarded after the last heartbeat and not started (no first byte), per model.
    _unstarted: dict[str, tuple[float, str]] = field(default_factory=dict)
    _since: dict[str, int] = field(default_factory=dict)

    # -- TargetLoad -----------------------------------------------------------------------
    @property
    def waiting(self) -> int:
        return sum(m.queue for m in self.models.values())

    @property
    def running(self) -> int:
        return sum(m.total - m.available for m in self.models.values())

    @property
    def outstanding(self) -> int:
        return self.in_flight + self.waiting

    @property
    def kv_usage(self) -> float:
        total = sum(m.total for m in self.models.values())
        return self.running / total if total else 0.0

    # -- updates --------------------------------------------------------------------------
    def on_heartbeat(self, now: float, epoch: int, seq: int, models: dict[str, ModelLoad]
                     ) -> bool:
        """Apply a heartbeat if it is newer than the last one applied; True if applied."""
        if (epoch, seq) <= (self.epoch, self.seq):
            return False
        self.epoch, self.seq = epoch, seq
        self.heard_at = now
        self.models = dict(models)
        since: dict[str, int] = {}
        for d, model in self._unstarted.values():
            if d >= now:
                since[model] = since.get(model, 0) + 1
        self._since = since
        return True

    def on_dispatch(self, request_id: str, model: str, now: float) -> None:
        self.in_flight += 1
        self._unstarted[request_id] = (now, model)
        if now >= self.heard_at:
            self._since[model] = self._since.get(model, 0) + 1

    def _started(self, request_id: str) -> None:
        entry = self._unstarted.pop(request_id, None)
        if entry is not None and entry[0] >= self.heard_at:
            self._since[entry[1]] -= 1

    def on_first_byte(self, request_id: str) -> None:
        self._started(request_id)

    def on_complete(self, request_id: str) -> None:
        self._started(request_id)
        self.in_flight -= 1

    def available_for(self, model: str, tau: int) -> bool:
        if not self.alive:
            return False
        m = self.models.get(model)
        if m is None:
            return False
        return m.available - self._since.get(model, 0) >= 1 and m.queue <= tau
