"""Batch across the mesh (issue #37, docs/tenancy.md "Batch across the mesh"): where a
request of the batch class goes while its region is busy.

Batch work has hours to finish, interactive work has seconds, so batch should run only on
capacity nobody better needs, and wait otherwise. Waiting is what costs nothing: a batch
request beside interactive ones slows their decoding (its prefill takes whole engine
steps, its context is read at every step), and closed-loop clients then send less. The
rule, per batch request, each time the dispatcher looks at it:

- **peer, fail fast**: no healthy local replica serves its model (the last one went
  down): it goes to the nearest live peer that serves it, busy or not, due or not (the
  peer places it in its own lane); with none, it waits for the caller's stranded check,
  which answers 503 with Retry-After at once;
- **due**: within ``urgent_s`` of its deadline (``deadline_at``) it is served wherever it
  is: it joins this region's ordinary queue, first come first served with the other
  classes, and is never forwarded again;
- **local**: this region has more *quiet* replicas (running no better-class work and
  fewer than ``max_per_replica`` batch requests) than the better-class requests waiting
  plus a *reserve* (``reserve`` of its replicas, rounded down); the caller places it on a
  quiet one. A replica busy with interactive work never takes batch before it is due;
- **peer**: a peer region reports *idle* room for the model: nothing queued and fewer
  requests on its replicas than replicas beyond its reserve, net of what was sent to it
  since its heartbeat; the nearest such peer. A request a peer forwarded to us is never
  forwarded again (one hop), and the pass that runs before the better classes' own
  dispatch forwards only: batch goes to the idle peer before any better-class request
  overflows there;
- **wait**: otherwise, until a replica goes quiet, a peer goes idle or it is due.

Pure: the caller (``skymesh.balancer.dispatch``) counts quiet replicas, waiting requests
and idle peers, and carries the decision out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

# The header a client names a batch request's deadline with (milliseconds from arrival,
# as X-SkyMesh-Deadline-Ms; unlike that one, passing it fails nothing), and the header a
# forwarded request's remaining deadline is replayed with at the peer.
BATCH_DEADLINE_HEADER = "X-SkyMesh-Batch-Deadline-Ms"


class BatchMove(Enum):
    DUE = "due"
    LOCAL = "local"
    PEER = "peer"
    WAIT = "wait"


@dataclass(frozen=True, slots=True)
class IdlePeer:
    peer: str
    rtt_s: float


def reserved(replicas: int, reserve: float) -> int:
    """Replicas kept for the better classes: ``reserve`` of ``replicas``, rounded down, so
    a region of a few replicas keeps none (rounded up, one replica of one would be kept
    and batch would wait there for its deadline)."""
    return math.floor(reserve * replicas + 1e-9) if replicas > 0 else 0


def quiet(better_running: int, batch_running: int, max_per_replica: int) -> bool:
    """A replica batch may join: no better-class work on it, room for one more batch."""
    return better_running <= 0 and batch_running < max_per_replica


def busy(quiet_replicas: int, better_waiting: int, keep: int = 0) -> bool:
    """No quiet replica is left over once the better classes' waiting requests take
    theirs and ``keep`` more stay free for them."""
    return quiet_replicas <= better_waiting + keep


def idle(outstanding: int, replicas: int, queue: int, reserve: float) -> bool:
    """A peer's room for batch: nothing queued and fewer requests on its replicas than
    replicas beyond its reserve, so one of them, at least, runs nothing. (Free replicas
    are no sign of idleness: a replica decoding for dozens of clients is free to take
    one more.)"""
    return queue == 0 and outstanding < replicas - reserved(replicas, reserve)


def nearest(peers: Sequence[IdlePeer]) -> str:
    return min(peers, key=lambda p: (p.rtt_s, p.peer)).peer


def batch_move(*, now: float, deadline_at: float | None, forwarded: bool, quiet: int,
               better_waiting: int, idle_peers: Sequence[IdlePeer], keep: int = 0,
               local: bool = True, urgent_s: float = 0.0, local_up: bool = True,
               live_peers: Sequence[IdlePeer] = ()) -> tuple[BatchMove, str | None]:
    """Where a batch request goes now: ``(move, peer)``; ``peer`` only with PEER.

    ``quiet``: the quiet replicas it could take here; ``local_up``: some healthy local
    replica serves its model; ``live_peers``: the live peers that serve it, idle or not.
    ``local`` False: the pass before the better classes are placed, which may only
    forward (their demand is not settled yet)."""
    if not local_up:  # nothing here will take it, due or not: fail fast
        if not forwarded and live_peers:
            return BatchMove.PEER, nearest(live_peers)
        return BatchMove.WAIT, None
    if deadline_at is not None and now >= deadline_at - urgent_s:
        return BatchMove.DUE, None
    if not busy(quiet, better_waiting, keep):
        return (BatchMove.LOCAL, None) if local else (BatchMove.WAIT, None)
    if not forwarded and idle_peers:
        return BatchMove.PEER, nearest(idle_peers)
    return BatchMove.WAIT, None


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


__all__ = ["BATCH_DEADLINE_HEADER", "BatchMove", "IdlePeer", "batch_move", "busy",
           "deadline_of", "idle", "lane_timeout", "nearest", "quiet", "reserved"]
