"""Batch across the mesh (issue #37, docs/tenancy.md "Batch across the mesh"): where a
request of the batch class goes while its region is busy.

Batch work has hours to finish, interactive work has seconds, so a region that runs out of
room should send its batch requests away first and keep its better classes at home,
where no cross-region trip is added to their time to first token. The rule, per batch
request, each time the dispatcher looks at it:

- **due**: past its deadline (``deadline_at``) it is served wherever it is: it joins
  this region's ordinary queue, first come first served with the other classes, and is
  never forwarded again;
- **local**: this region has more free replicas than the better-class requests waiting
  for them plus a *reserve* (``reserve`` of its replicas, rounded down), so one is left
  over for batch. The reserve is there because a batch request on a replica slows the
  interactive ones that arrive after it: the better classes keep some room for what
  comes next, not only for what waits now;
- **peer**: the region is *busy* (no free replica left over that way) and a peer region
  reports *idle* room for the model: nothing queued and more free replicas than its own
  share of the reserve, net of what was sent to it since its heartbeat; the nearest such
  peer. A request a peer forwarded to us is never forwarded again (one hop), and the
  pass that runs before the better classes' own dispatch forwards only: batch goes to
  the idle peer before any better-class request overflows there;
- **wait**: otherwise. Batch is admitted locally last: only what the better classes
  leave over.

Pure: the caller (``skymesh.balancer.dispatch``) counts free replicas, waiting requests
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


def busy(free: int, better_waiting: int, keep: int = 0) -> bool:
    """No free replica is left over once the better classes' waiting requests take theirs
    and ``keep`` more stay free for them."""
    return free <= better_waiting + keep


def idle(free: int, replicas: int, queue: int, reserve: float) -> bool:
    """A peer's room for batch: nothing queued, a free replica beyond its reserve."""
    return queue == 0 and free > reserved(replicas, reserve)


def batch_move(*, now: float, deadline_at: float | None, forwarded: bool, free: int,
               better_waiting: int, idle_peers: Sequence[IdlePeer], keep: int = 0,
               local: bool = True) -> tuple[BatchMove, str | None]:
    """Where a batch request goes now: ``(move, peer)``; ``peer`` only with PEER.

    ``local`` False: the pass before the better classes are placed, which may only
    forward (their demand is not settled yet)."""
    if deadline_at is not None and now >= deadline_at:
        return BatchMove.DUE, None
    if not busy(free, better_waiting, keep):
        return (BatchMove.LOCAL, None) if local else (BatchMove.WAIT, None)
    if not forwarded and idle_peers:
        best = min(idle_peers, key=lambda p: (p.rtt_s, p.peer))
        return BatchMove.PEER, best.peer
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


__all__ = ["BATCH_DEADLINE_HEADER", "BatchMove", "IdlePeer", "batch_move", "busy",
           "deadline_of", "idle", "reserved"]
