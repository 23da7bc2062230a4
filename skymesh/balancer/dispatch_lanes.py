"""The dispatcher's batch lanes (``tenants.batch_mesh``): tickets marked ``batch`` wait
per model, earliest deadline first, and are placed by ``skymesh.balancer.batch_routing``
(see the module docstring of ``skymesh.balancer.dispatch``)."""

from __future__ import annotations

from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Sequence

from skymesh.balancer.batch_routing import (
    BatchMove,
    PeerRoom,
    batch_move,
    lane_order,
    peer_room,
    quiet,
    reserved,
)
from skymesh.balancer.dispatch_peers import PeerLayer
from skymesh.balancer.dispatch_state import Ticket


class BatchLanes(PeerLayer):
    lanes: dict[str, deque[Ticket]]
    window: int
    batch_lane: bool
    batch_forward: bool
    batch_reserve: float
    batch_urgent_s: float
    batch_max_per_replica: int
    batch_room_per_replica: int
    better_waiting: Callable[[str], int] | None

    def _enqueue(self, ticket: Ticket, front: bool) -> deque[Ticket]:
        """Put ``ticket`` in its model's queue, or its batch lane; returns that queue."""
        lane = ticket.batch and self.batch_lane and not ticket.stay
        # get before setdefault: a deque built on every offer to be thrown away.
        queues = self.lanes if lane else self.queues
        model = ticket.route.model
        q = queues.get(model)
        if q is None:
            q = queues[model] = deque()
        if front:
            q.appendleft(ticket)
        elif lane:  # earliest deadline first (batch_routing.lane_order)
            q.insert(bisect_right(q, lane_order(ticket.batch_due),
                                  key=lambda t: lane_order(t.batch_due)), ticket)
        else:
            q.append(ticket)
        return q

    def _pump_lanes(self, now: float, out: list[Ticket], *, local: bool) -> None:
        """Place the batch lanes' first ``window`` tickets (``batch_routing.batch_move``)."""
        for model, lane in self.lanes.items():
            k = 0
            while k < min(len(lane), self.window):
                ticket = lane[k]
                self._refresh()
                view = self._view(model)
                cands = self._batch_room(self._candidates(ticket, now, view))
                q = self.queues.get(model)
                better = (len(q) if q else 0) + (
                    self.better_waiting(model) if self.better_waiting is not None else 0)
                up = bool(view.serving)  # healthy replicas serving the model
                move, peer = batch_move(
                    now=now, deadline_at=ticket.batch_due, forwarded=ticket.route.forwarded,
                    quiet=len(cands), better_waiting=better,
                    peers=self._idle_peers(ticket) if up else (), local=local,
                    keep=reserved(len(view.serving), self.batch_reserve),
                    urgent_s=self.batch_urgent_s, local_up=up,
                    live_peers=() if up else self._live_peers(ticket),
                    here_load=sum(self.targets[t].load.outstanding for t in view.serving)
                    / len(view.serving) if up else None,
                    lighter_by=self.batch_room_per_replica)
                if move is BatchMove.WAIT:
                    k += 1  # the next differs only by its deadline or its exclusions
                    continue
                target = peer
                if move is BatchMove.LOCAL:
                    target = self._policy.select(ticket.route_at(now), cands, self)
                    if target is None:
                        k += 1
                        continue
                del lane[k]
                if move is BatchMove.DUE:  # served where it is, in turn with the rest
                    ticket.stay = True
                    self.queues.setdefault(model, deque()).append(ticket)
                    self._stir += 1
                    continue
                assert target is not None
                ticket.queued = False
                ticket.memo = None
                self.queued -= 1
                if move is BatchMove.PEER:
                    self._assign_peer(ticket, target, now)
                else:
                    self._assign(ticket, target, now)
                out.append(ticket)

    def _batch_room(self, cands: Sequence[str]) -> list[str]:
        """The candidates batch may join (``batch_routing.quiet``): what is on each, as
        far as we can tell, less our batch there."""
        on, cap, targets = self.batch_on, self.batch_max_per_replica, self.targets
        return [tid for tid in cands
                if quiet(targets[tid].load.outstanding - (b := on.get(tid, 0)), b, cap,
                         self.batch_room_per_replica)]

    def _idle_peers(self, ticket: Ticket) -> list[PeerRoom]:
        """Peers that may take a forward, with their room for batch and their load
        (``batch_routing.peer_room``), net of what was sent to them since."""
        if not self.batch_forward or ticket.stay:
            return []
        return [peer_room(pid, self.peers[pid], ticket.route.model, self.batch_reserve,
                          self.batch_room_per_replica)
                for pid in self.peer_candidates(ticket)]

    def _live_peers(self, ticket: Ticket) -> list[PeerRoom]:
        """Live peers serving the ticket's model, busy or not: where batch goes when no
        local replica is up (it would otherwise wait for one until its deadline)."""
        if not self.batch_forward or not self.forwarding or ticket.stay:
            return []
        model = ticket.route.model
        return [PeerRoom(pid, p.rtt_s) for pid, p in self.peers.items()
                if p.alive and model in p.models and pid not in ticket.excluded]
