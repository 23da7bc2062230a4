"""Batch across the mesh (issue #37, docs/tenancy.md "Batch across the mesh"): where a
request of the batch class goes while its region is busy.

Batch work has hours to finish, interactive work has seconds, so batch should run only on
capacity nobody better needs, and wait otherwise. Waiting is what costs nothing: a batch
request beside interactive ones slows their decoding (its prefill takes whole engine
steps, its context is read at every step), the more so the more of them share its
replica, and closed-loop clients then send less. The rule, per batch request, each time
the dispatcher looks at it (the lane is read earliest deadline first, :func:`lane_order`):

- **peer, fail fast**: no healthy local replica serves its model (the last one went
  down): it goes to the nearest live peer that serves it, busy or not, due or not (the
  peer places it in its own lane); with none, it waits for the caller's stranded check,
  which answers 503 with Retry-After at once;
- **due**: within ``urgent_s`` of its deadline (``deadline_at``) it is served: at the
  lightest peer that would take a forward if that one runs ``lighter_by`` fewer requests
  per replica than here (``here_load``), where it shares a replica with fewer clients;
  else here, in this region's ordinary queue, first come first served with the other
  classes. Either way it is never forwarded again;
- **local**: this region has more *quiet* replicas (running fewer than
  ``room_per_replica`` better-class requests and fewer than ``max_per_replica`` batch
  requests) than the better-class requests waiting plus a *reserve* (``reserve`` of its
  replicas, rounded down); the caller places it on a quiet one;
- **peer**: a peer has *room* (:func:`room`): ``room_per_replica`` requests on each of
  its replicas beyond its reserve, less the requests on them (its heartbeat's, net of
  what was sent to it since), nothing queued; the one with the most room. A request a
  peer forwarded to us is never forwarded again (one hop), and the pass that runs before
  the better classes' own dispatch forwards only: batch takes the room before any
  better-class request overflows there;
- **wait**: otherwise, until a replica goes quiet, a peer has room or it is due.

Parameters (``tenants.batch_mesh``): ``reserve`` 0.25, ``urgent_h`` 1, ``max_per_replica``
4, ``room_per_replica`` 8 (:data:`DEFAULT_ROOM_PER_REPLICA`; also ``lighter_by``). 1 is
the rule as first written (quiet: nothing better running; room: a replica running
nothing): a region at night that takes a peak region's interactive overflow then never
has room. 8 sits between the few requests per replica of a region at night and the
dozens of one at its peak in the simulator's diurnal workload, where both scenarios meet
the goal with it (docs/results/tenancy-mesh.md).

Pure: the caller (``skymesh.balancer.dispatch``) counts quiet replicas, waiting requests
and peers' room, and carries the decision out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from skymesh.policies.peers import PeerLoad

# The header a client names a batch request's deadline with (milliseconds from arrival,
# as X-SkyMesh-Deadline-Ms; unlike that one, passing it fails nothing), and the header a
# forwarded request's remaining deadline is replayed with at the peer.
BATCH_DEADLINE_HEADER = "X-SkyMesh-Batch-Deadline-Ms"
# Better-class requests a replica may run beside which batch still joins it, per replica
# a peer's room for batch (``room_per_replica``): see the header for the figure.
DEFAULT_ROOM_PER_REPLICA = 8


class BatchMove(Enum):
    DUE = "due"
    LOCAL = "local"
    PEER = "peer"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class PeerRoom:
    """A peer that may take a forward: its round trip, its ``room`` for batch (requests,
    :func:`room`) and its ``load`` (requests per replica, queue included)."""

    peer: str
    rtt_s: float
    room: int = 1
    load: float = 0.0


def reserved(replicas: int, reserve: float) -> int:
    """Replicas kept for the better classes: ``reserve`` of ``replicas``, rounded down, so
    a region of a few replicas keeps none (rounded up, one replica of one would be kept
    and batch would wait there for its deadline)."""
    return math.floor(reserve * replicas + 1e-9) if replicas > 0 else 0


def quiet(better_running: int, batch_running: int, max_per_replica: int,
          room_per_replica: int = 1) -> bool:
    """A replica batch may join: fewer better-class requests on it than
    ``room_per_replica`` (1: none at all), and room for one more batch."""
    return better_running < room_per_replica and batch_running < max_per_replica


def busy(quiet_replicas: int, better_waiting: int, keep: int = 0) -> bool:
    """No quiet replica is left over once the better classes' waiting requests take
    theirs and ``keep`` more stay free for them."""
    return quiet_replicas <= better_waiting + keep


def room(outstanding: int, replicas: int, queue: int, reserve: float,
         room_per_replica: int = 1) -> int:
    """A peer's room for batch, in requests: ``room_per_replica`` on each of its replicas
    beyond its reserve, less the requests on them; none while anything waits in its queue.
    (Free replicas are no sign of room: a replica decoding for dozens of clients is free
    to take one more, and a batch job beside them slows every one of them.) With
    ``room_per_replica`` 1, a peer has room when one replica, at least, runs nothing."""
    if queue > 0:
        return 0
    return max(0, (replicas - reserved(replicas, reserve)) * room_per_replica - outstanding)


def peer_room(name: str, peer: PeerLoad, model: str, reserve: float,
              room_per_replica: int) -> PeerRoom:
    """``peer``'s room and load for ``model`` from its last heartbeat, net of what we sent
    it since. A peer that does not report its requests (an older balancer) is judged by
    its busy replicas: room only on one running nothing, and no load to compare."""
    m = peer.models[model]
    free, total, queue = peer.spare_for(model)
    sent = m.available - free  # ours since its heartbeat
    if m.outstanding is None:
        return PeerRoom(name, peer.rtt_s,
                        room(total - m.available + sent, total, queue, reserve), math.inf)
    on = m.outstanding + sent
    return PeerRoom(name, peer.rtt_s, room(on, total, queue, reserve, room_per_replica),
                    (on + queue) / total if total > 0 else math.inf)


def nearest(peers: Sequence[PeerRoom]) -> str:
    return min(peers, key=lambda p: (p.rtt_s, p.peer)).peer


def roomiest(peers: Sequence[PeerRoom]) -> str:
    """The peer with the most room for batch; of equals, the nearest."""
    return min(peers, key=lambda p: (-p.room, p.rtt_s, p.peer)).peer


def lightest(peers: Sequence[PeerRoom]) -> PeerRoom:
    return min(peers, key=lambda p: (p.load, p.rtt_s, p.peer))


def batch_move(*, now: float, deadline_at: float | None, forwarded: bool, quiet: int,
               better_waiting: int, peers: Sequence[PeerRoom], keep: int = 0,
               local: bool = True, urgent_s: float = 0.0, local_up: bool = True,
               live_peers: Sequence[PeerRoom] = (), here_load: float | None = None,
               lighter_by: float = 0.0) -> tuple[BatchMove, str | None]:
    """Where a batch request goes now: ``(move, peer)``; ``peer`` only with PEER.

    ``quiet``: the quiet replicas it could take here; ``peers``: the peers that may take
    a forward, with their room and load; ``local_up``: some healthy local replica serves
    its model; ``live_peers``: the live peers that serve it, whatever their load.
    ``here_load``: requests per replica here (None: a due request is never forwarded);
    a due request goes to the lightest peer if that one runs ``lighter_by`` fewer
    requests per replica, at least. ``local`` False: the pass before the better classes
    are placed, which may only forward (their demand is not settled yet)."""
    if not local_up:  # nothing here will take it, due or not: fail fast
        if not forwarded and live_peers:
            return BatchMove.PEER, nearest(live_peers)
        return BatchMove.WAIT, None
    if deadline_at is not None and now >= deadline_at - urgent_s:
        if not forwarded and here_load is not None and peers:
            best = lightest(peers)
            if best.load + lighter_by <= here_load:  # beside fewer clients there
                return BatchMove.PEER, best.peer
        return BatchMove.DUE, None
    if not busy(quiet, better_waiting, keep):
        return (BatchMove.LOCAL, None) if local else (BatchMove.WAIT, None)
    roomy = [p for p in peers if p.room > 0]
    if not forwarded and roomy:
        return BatchMove.PEER, roomiest(roomy)
    return BatchMove.WAIT, None


def lane_order(deadline_at: float | None) -> float:
    """A lane's order: earliest deadline first, none last. In arrival order, a request a
    peer forwarded near its deadline would wait behind that peer's own later ones, past
    the window of tickets each pump reads, and miss its deadline."""
    return math.inf if deadline_at is None else deadline_at


def deadline_of(header: str | None, default_s: float | None) -> float | None:
    """A batch request's deadline, seconds from arrival: the header's (milliseconds), else
    ``default_s``; None: none. Raises ValueError for a header that is no positive number."""
    if header is None or not header.strip():
        return default_s
    try:
        ms = float(header.strip())
    except ValueError:
        ms = math.nan
    if not 0 < ms < math.inf:
        raise ValueError(f"{BATCH_DEADLINE_HEADER} must be a positive number of "
                         f"milliseconds, got {header.strip()[:32]!r}")
    return ms / 1000.0


def lane_timeout(deadline_s: float | None, queue_timeout_s: float, max_wait_s: float) -> float:
    """How long a batch request may wait before it is dispatched, in all: until its
    deadline (seconds from arrival; it may wait that long for quiet capacity), then as
    long as any request waits in the queue; never past ``max_wait_s``, nor past it when
    it has no deadline. ``queue.timeout_s`` alone would end the wait for the trough at a
    minute."""
    if deadline_s is None:
        return max_wait_s
    return min(deadline_s + queue_timeout_s, max_wait_s)


__all__ = ["BATCH_DEADLINE_HEADER", "DEFAULT_ROOM_PER_REPLICA", "BatchMove", "PeerRoom",
           "batch_move", "busy", "deadline_of", "lane_order", "lane_timeout", "lightest", "nearest",
           "peer_room", "quiet", "reserved", "room", "roomiest"]
