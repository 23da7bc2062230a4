"""``MeshNode``: one balancer's whole peering side, wired the standard way.

A :class:`PeerServer` for calls from peers, one :class:`PeerClient` per peer (one
persistent channel each; the client of the pair's smaller id opens the heartbeat
stream), and the :class:`PeerState` they share. Membership changes go through
:meth:`add_peer`/:meth:`remove_peer`, which keep the allow-list, the clients and the
state in step. ``guard``: the peering port's caps (:mod:`skymesh.mesh.guard`; None
binds gRPC to the port itself); ``heartbeat_limits``: what a peer's heartbeat may claim
(:mod:`skymesh.mesh.limits`).
"""

from __future__ import annotations

from collections.abc import Mapping

from skymesh.mesh.client import ForwardCall, PeerClient, initiates_heartbeat
from skymesh.mesh.errors import PeerUnavailable
from skymesh.mesh.heartbeat import (
    DEFAULT_MAX_HEARTBEAT_BYTES,
    DEFAULT_SUMMARY_INTERVAL_S,
    LocalSummary,
    OnHeartbeat,
)
from skymesh.mesh.limits import (
    DEFAULT_GUARD_LIMITS,
    DEFAULT_HEARTBEAT_LIMITS,
    GuardLimits,
    HeartbeatLimits,
)
from skymesh.mesh.proto import pb
from skymesh.mesh.server import DEFAULT_MAX_MESSAGE_BYTES, ForwardHandler, PeerServer
from skymesh.mesh.state import (
    DEFAULT_DOWN_AFTER,
    DEFAULT_INTERVAL_S,
    DEFAULT_SUSPECT_AFTER,
    Identity,
    PeerState,
)
from skymesh.mesh.tls import TlsFiles


class MeshNode:
    def __init__(
        self,
        identity: Identity,
        tls: TlsFiles,
        *,
        local_summary: LocalSummary,
        forward_handler: ForwardHandler,
        on_heartbeat: OnHeartbeat | None = None,
        peers: Mapping[str, str] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        interval: float = DEFAULT_INTERVAL_S,
        suspect_after: float = DEFAULT_SUSPECT_AFTER,
        down_after: float = DEFAULT_DOWN_AFTER,
        summary_interval: float = DEFAULT_SUMMARY_INTERVAL_S,
        max_heartbeat_bytes: int = DEFAULT_MAX_HEARTBEAT_BYTES,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        heartbeat_limits: HeartbeatLimits = DEFAULT_HEARTBEAT_LIMITS,
        guard: GuardLimits | None = DEFAULT_GUARD_LIMITS,
    ) -> None:
        self.identity = identity
        self.tls = tls
        self.local_summary = local_summary
        self.on_heartbeat = on_heartbeat
        self.summary_interval = summary_interval
        self.max_heartbeat_bytes = max_heartbeat_bytes
        self.max_message_bytes = max_message_bytes
        self.state = PeerState(identity, interval=interval, suspect_after=suspect_after,
                               down_after=down_after, limits=heartbeat_limits)
        self.server = PeerServer(
            self.state, tls, allowed_peers=(), local_summary=local_summary,
            forward_handler=forward_handler, on_heartbeat=on_heartbeat, host=host, port=port,
            max_message_bytes=max_message_bytes, max_heartbeat_bytes=max_heartbeat_bytes,
            summary_interval=summary_interval, guard=guard)
        self.clients: dict[str, PeerClient] = {}
        self._initial_peers = dict(peers or {})
        self._started = False

    @property
    def address(self) -> str:
        return self.server.address

    async def start(self) -> None:
        await self.server.start()
        self._started = True
        for peer_id, address in self._initial_peers.items():
            await self.add_peer(peer_id, address)

    async def stop(self, grace: float | None = 0.5) -> None:
        for peer_id in list(self.clients):
            await self.clients.pop(peer_id).close()
        await self.server.stop(grace)
        self._started = False

    async def add_peer(self, peer_id: str, address: str) -> PeerClient:
        if not self._started:
            self._initial_peers[peer_id] = address
        old = self.clients.pop(peer_id, None)
        if old is not None:
            await old.close()
        self.server.set_allowed({*self.server.allowed, peer_id})
        self.state.add_peer(peer_id)
        client = PeerClient(
            peer_id, address, self.state, self.tls, local_summary=self.local_summary,
            on_heartbeat=self.on_heartbeat,
            heartbeat=initiates_heartbeat(self.identity.balancer_id, peer_id),
            summary_interval=self.summary_interval, max_message_bytes=self.max_message_bytes,
            max_heartbeat_bytes=self.max_heartbeat_bytes)
        if self._started:
            await client.start()
        self.clients[peer_id] = client
        return client

    async def remove_peer(self, peer_id: str) -> None:
        client = self.clients.pop(peer_id, None)
        if client is not None:
            await client.close()
        self.server.set_allowed(self.server.allowed - {peer_id})
        self.state.remove_peer(peer_id)

    def forward(self, peer_id: str, request: pb.ForwardRequest,
                timeout: float | None = None) -> ForwardCall:
        client = self.clients.get(peer_id)
        if client is None:
            raise PeerUnavailable(peer_id, "not a peer")
        return client.forward(request, timeout)
