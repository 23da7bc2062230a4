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

Forwarding rules (``ForwardingRule``; both keep Algorithm 1's overflow step):

- ``overflow`` (SkyLB Algorithm 1 as written): a request goes to a peer only when no local
  replica is available. Under continuous batching a replica stays "available" while its
  batch grows, so a region with more clients than replicas keeps its load and its slow
  tokens while its peers idle.
- ``balanced`` (SkyMesh): a request may also go to a peer while local replicas are
  available, when the peer is lighter enough to pay for the trip. Each region's cost is
  its load per replica (outstanding requests per replica: ours from our own bookkeeping,
  a peer's from its heartbeat's ``outstanding`` plus what we forwarded since), plus, for
  a peer, ``margin`` (hysteresis: equal regions keep their requests) and
  ``rtt_weight`` x RTT (the round trip the forwarded request pays), plus ``locality``
  for every region that lacks the request's cached prefix while another has it (a
  conversation stays where its history is cached unless the imbalance is larger than a
  re-prefill is worth). The request goes to the cheapest peer if that peer is cheaper
  than staying (:func:`balanced_peer`). Peers are the same as for overflow: alive, with
  an available replica and a queue of at most ``tau``; a peer whose heartbeat carries no
  ``outstanding`` (an older balancer) is never a balanced target.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_TAU = 2


class ForwardingRule(enum.StrEnum):
    OVERFLOW = "overflow"
    BALANCED = "balanced"


DEFAULT_FORWARDING_RULE = ForwardingRule.OVERFLOW
# Units: outstanding requests per replica (rtt_weight: per second of RTT). Measured
# (docs/notes/diurnal.md): diurnal-cost's throughput is flat over margin 0-4, locality
# 2-12, RTT weight 0-30 (the mesh matches region-local-12 at 9 replicas throughout); the
# lightly loaded skylb-macro --quick pays every needless forward in TTFT, and these are
# the smallest values that leave its chat workload as overflow has it. Below a margin of
# about 1, requests ping-pong between regions and TTFT p50 grows by ~0.1 s.
DEFAULT_BALANCE_MARGIN = 4.0
DEFAULT_LOCALITY_MARGIN = 12.0
DEFAULT_RTT_WEIGHT = 30.0


@dataclass(frozen=True, slots=True)
class Balancing:
    """Parameters of the ``balanced`` rule (see the module docstring)."""

    margin: float = DEFAULT_BALANCE_MARGIN
    locality: float = DEFAULT_LOCALITY_MARGIN
    rtt_weight: float = DEFAULT_RTT_WEIGHT

    def __post_init__(self) -> None:
        if self.margin < 0 or self.locality < 0 or self.rtt_weight < 0:
            raise ValueError(f"balancing parameters must be >= 0, got {self}")


@dataclass(frozen=True, slots=True)
class PeerOption:
    peer: str
    load: float  # outstanding requests per replica, this request included
    rtt_s: float


def balanced_peer(local_load: float, local_prefix: bool, peers: Sequence[PeerOption],
                  prefix_peer: str | None, params: Balancing) -> str | None:
    """The peer a request should go to under the ``balanced`` rule, or None to stay.

    ``local_load``: our outstanding requests per replica, this request included;
    ``local_prefix``: a local replica holds the request's prefix; ``prefix_peer``: the
    peer that holds it, if any. Ties stay local: a forward must win strictly.
    """
    cached = local_prefix or prefix_peer is not None
    stay = local_load + (params.locality if cached and not local_prefix else 0.0)
    best: str | None = None
    best_cost = stay
    for o in peers:
        cost = o.load + params.margin + params.rtt_weight * o.rtt_s
        if cached and o.peer != prefix_peer:
            cost += params.locality
        if cost < best_cost:
            best, best_cost = o.peer, cost
    return best


@dataclass(frozen=True, slots=True)
class ModelLoad:
    available: int
    total: int
    queue: int
    pending_prefill_tokens: int = 0
    # Requests on the replicas serving the model; None: the sender did not say.
    outstanding: int | None = None


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

    def load_per_replica(self, model: str) -> float | None:
        """Outstanding requests per replica for ``model`` with one more (the request being
        placed): the heartbeat's figure plus its queue plus what we forwarded since.
        None when the peer did not report it."""
        m = self.models.get(model)
        if m is None or m.outstanding is None or m.total <= 0:
            return None
        return (m.outstanding + m.queue + self._since.get(model, 0) + 1) / m.total

    def spare_for(self, model: str) -> tuple[int, int, int]:
        """(free replicas net of what was sent since the heartbeat, replicas, queue) for
        ``model``; zeros when down or silent about it."""
        m = self.models.get(model) if self.alive else None
        if m is None:
            return 0, 0, 0
        return m.available - self._since.get(model, 0), m.total, m.queue

    def available_for(self, model: str, tau: int) -> bool:
        if not self.alive:
            return False
        m = self.models.get(model)
        if m is None:
            return False
        return m.available - self._since.get(model, 0) >= 1 and m.queue <= tau
