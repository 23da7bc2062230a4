"""What a peer may do, as values: the peering port's caps (:class:`GuardLimits`, applied
by :mod:`skymesh.mesh.guard`) and the ranges a heartbeat's fields must lie in
(:class:`HeartbeatLimits`, applied by :meth:`skymesh.mesh.state.PeerState.observe`).
Pure and free of gRPC, so configuration can take its defaults from here.

A peer's heartbeat is believed only within bounds: its declared interval decides how
long it stays alive after its last heartbeat, so it is capped (``max_interval_s``, 2 s:
a peer silent for 3 of those is DOWN, whatever it declared); a replica count above
``max_replicas`` (1,024 per model), more available replicas than total, or a queue or
outstanding count above ``max_requests`` (100,000) refuses the whole heartbeat.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from skymesh.mesh.proto import pb

# Prefill tokens pending in one region: a million requests of a million tokens.
MAX_PENDING_PREFILL_TOKENS = 10**12


@dataclass(frozen=True, slots=True)
class GuardLimits:
    """The peering port's caps (see :mod:`skymesh.mesh.guard`)."""

    handshake_timeout_s: float = 5.0
    max_handshakes: int = 64
    max_handshakes_per_address: int = 8
    max_connections: int = 256
    max_connections_per_address: int = 32


@dataclass(frozen=True, slots=True)
class HeartbeatLimits:
    max_interval_s: float = 2.0
    max_replicas: int = 1024
    max_requests: int = 100_000


DEFAULT_GUARD_LIMITS = GuardLimits()
DEFAULT_HEARTBEAT_LIMITS = HeartbeatLimits()


def peer_interval(declared_ms: int, ours_s: float, cap_s: float) -> float:
    """The interval a peer's silence is measured in (seconds): what it declares, never
    shorter than ours (we cannot observe faster than we run) nor longer than the cap."""
    return max(ours_s, min(declared_ms / 1000.0, cap_s))


def heartbeat_problem(msg: pb.HeartbeatMsg, limits: HeartbeatLimits) -> str | None:
    """Why ``msg``'s loads cannot be taken at their word, or None when they can."""
    for m in msg.models:
        name = m.model[:64]
        if m.total_replicas > limits.max_replicas:
            return (f"model {name!r}: total_replicas {m.total_replicas} exceeds "
                    f"{limits.max_replicas}")
        if m.available_replicas > m.total_replicas:
            return (f"model {name!r}: available_replicas {m.available_replicas} exceeds "
                    f"total_replicas {m.total_replicas}")
        if m.queue_length > limits.max_requests:
            return f"model {name!r}: queue_length {m.queue_length} exceeds {limits.max_requests}"
        if m.HasField("outstanding_requests") and m.outstanding_requests > limits.max_requests:
            return (f"model {name!r}: outstanding_requests {m.outstanding_requests} exceeds "
                    f"{limits.max_requests}")
        if m.pending_prefill_tokens > MAX_PENDING_PREFILL_TOKENS:
            return (f"model {name!r}: pending_prefill_tokens {m.pending_prefill_tokens} "
                    f"exceeds {MAX_PENDING_PREFILL_TOKENS}")
    return None
