"""Peering between balancers: heartbeats (load, liveness, RTT, prefix summaries) and
request forwarding over one persistent mutual-TLS gRPC channel per peer.

Modules: :mod:`.state` (pure versioning, liveness and RTT), :mod:`.summary` (bounded
prefix summaries and the receiver's snapshot), :mod:`.heartbeat` (one stream's
bookkeeping), :mod:`.server`, :mod:`.client`, :mod:`.node` (the standard wiring),
:mod:`.certs` (``skymesh certs``), :mod:`.codegen` (stub generation), :mod:`.proto`
(the generated messages).

Names are loaded lazily: ``import skymesh.mesh`` costs nothing, and the generated stubs
are built on first use of anything that needs them (when missing or stale), so
``skymesh certs`` and the code generator itself work before they exist.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skymesh.mesh.client import ForwardCall, PeerClient, initiates_heartbeat
    from skymesh.mesh.errors import (
        PeerDeadlineExceeded,
        PeerError,
        PeerProtocolError,
        PeerRefused,
        PeerUnavailable,
    )
    from skymesh.mesh.heartbeat import HeartbeatTooLarge, prefix_summary
    from skymesh.mesh.node import MeshNode
    from skymesh.mesh.proto import pb
    from skymesh.mesh.server import PeerServer, peer_identity
    from skymesh.mesh.state import (
        Identity,
        Liveness,
        PeerState,
        PeerView,
        Verdict,
        new_identity,
    )
    from skymesh.mesh.summary import PeerSnapshot, build_summary
    from skymesh.mesh.tls import TlsFiles

_EXPORTS = {
    "ForwardCall": "client",
    "HeartbeatTooLarge": "heartbeat",
    "Identity": "state",
    "Liveness": "state",
    "MeshNode": "node",
    "PeerClient": "client",
    "PeerDeadlineExceeded": "errors",
    "PeerError": "errors",
    "PeerProtocolError": "errors",
    "PeerRefused": "errors",
    "PeerServer": "server",
    "PeerSnapshot": "summary",
    "PeerState": "state",
    "PeerUnavailable": "errors",
    "PeerView": "state",
    "TlsFiles": "tls",
    "Verdict": "state",
    "build_summary": "summary",
    "initiates_heartbeat": "client",
    "new_identity": "state",
    "pb": "proto",
    "peer_identity": "server",
    "prefix_summary": "heartbeat",
}

__all__ = [
    "ForwardCall",
    "HeartbeatTooLarge",
    "Identity",
    "Liveness",
    "MeshNode",
    "PeerClient",
    "PeerDeadlineExceeded",
    "PeerError",
    "PeerProtocolError",
    "PeerRefused",
    "PeerServer",
    "PeerSnapshot",
    "PeerState",
    "PeerUnavailable",
    "PeerView",
    "TlsFiles",
    "Verdict",
    "build_summary",
    "initiates_heartbeat",
    "new_identity",
    "pb",
    "peer_identity",
    "prefix_summary",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
