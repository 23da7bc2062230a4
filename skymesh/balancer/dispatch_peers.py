"""The dispatcher's peer layer (SkyLB Algorithm 1, the second layer): which peer
balancers may take a request, the balanced rule's choice among them, and a dispatch to
one (see the module docstring of ``skymesh.balancer.dispatch``)."""

from __future__ import annotations

import math
from collections.abc import Iterable

from skymesh.balancer.dispatch_state import Ticket
from skymesh.balancer.dispatch_view import DispatchView
from skymesh.mesh.outlook import PeerOutlook
from skymesh.policies.base import Policy, RouteRequest
from skymesh.policies.peers import (
    Balancing,
    ForwardingRule,
    ModelLoad,
    PeerLoad,
    PeerOption,
    balanced_peer,
)


class PeerLayer(DispatchView):
    peer_policy: Policy | None
    tau: int
    forwarding_rule: ForwardingRule
    balancing: Balancing
    outlook: PeerOutlook | None

    @property
    def forwarding(self) -> bool:
        return self.peer_policy is not None and bool(self.peers)

    def reachable(self, model: str) -> bool:
        """Served here, or by a peer we could forward to (a region may have no replicas)."""
        return self.serves(model) or (self.forwarding and any(
            model in p.models for p in self.peers.values()))

    def set_peers(self, peer_ids: Iterable[str]) -> None:
        """Replace the peer set; state survives for peers that stay."""
        self.peers = {p: self.peers.get(p) or PeerLoad(p) for p in peer_ids}
        self._changed()
        self._index_loads()
        if self.peer_policy is not None:
            self.peer_policy.on_membership(sorted(self.peers))

    def on_peer_heartbeat(self, peer: str, now: float, epoch: int, seq: int,
                          models: dict[str, ModelLoad]) -> bool:
        p = self.peers.get(peer)
        return p is not None and p.on_heartbeat(now, epoch, seq, models)

    def set_peer_alive(self, peer: str, alive: bool) -> None:
        if peer in self.peers:
            self.peers[peer].alive = alive

    def set_peer_rtt(self, peer: str, rtt_s: float) -> None:
        if peer in self.peers:
            self.peers[peer].rtt_s = rtt_s

    def model_loads(self, now: float) -> dict[str, ModelLoad]:
        """This balancer's load per model, as its heartbeats tell peers: replicas that could
        take a request now (as this dispatcher would judge it), all replicas, queue, and
        requests outstanding on those replicas (the balanced rule's load figure)."""
        out: dict[str, ModelLoad] = {}
        for model in self.models():
            probe = Ticket(RouteRequest("heartbeat", model=model, tie=0), now)
            serving = [t for t in self.targets.values() if model in t.models]
            out[model] = ModelLoad(
                available=len(self.candidates(probe, now)),
                total=len(serving),
                queue=self.queue_length(model),
                outstanding=sum(t.load.outstanding for t in serving),
            )
        return out

    def peer_candidates(self, ticket: Ticket) -> list[str]:
        if not self.forwarding or ticket.route.forwarded or ticket.stay:
            return []
        model, tau = ticket.route.model, self.tau
        return [pid for pid, p in self.peers.items()
                if pid not in ticket.excluded and p.available_for(model, tau)]

    def _balanced_peer(self, ticket: Ticket) -> str | None:
        """The balanced rule's peer for ``ticket``, or None to go on as SkyLB would."""
        route = ticket.route
        peers = self.peer_candidates(ticket)
        if not peers:
            return None
        serving = [tid for tid, t in self.targets.items()
                   if route.model in t.models and t.healthy]
        if serving:
            local = (sum(self.targets[tid].load.outstanding for tid in serving)
                     + self.queue_length(route.model)) / len(serving)
        else:
            local = math.inf
        options = []
        for pid in peers:
            p = self.peers[pid]
            load = p.load_per_replica(route.model)
            if load is not None:
                options.append(PeerOption(pid, load, p.rtt_s))
        if not options:
            return None
        b = self.balancing
        # The prefix lookups are the costly part: skip them when no peer could win even
        # with every locality term in its favour.
        if min(o.load + b.margin + b.rtt_weight * o.rtt_s for o in options) \
                >= local + b.locality:
            return None
        local_prefix = serving and route.prefix_keys and \
            self._policy.preferred(route, serving, self) is not None
        prefix_peer = None
        if route.prefix_keys and self.peer_policy is not None:
            prefix_peer = self.peer_policy.preferred(route, [o.peer for o in options], self)
        return balanced_peer(local, bool(local_prefix), options, prefix_peer, b)

    def _assign_peer(self, ticket: Ticket, peer: str, now: float) -> None:
        assert self.peer_policy is not None
        ticket.target = peer
        ticket.to_peer = True
        ticket.attempts += 1
        self.peers[peer].on_dispatch(ticket.key, ticket.route.model, now)
        self.peer_policy.on_dispatch(ticket.route, peer, self)
