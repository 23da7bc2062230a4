"""Peer state from heartbeats: versioning, liveness and round-trip time. Pure: no I/O,
the clock is injected (seconds, monotonic), so tests drive it with a fake clock.

Versioning (SkyLB sec. 3.4; sglang-router's mesh applies state only when
``version > current``): every heartbeat is stamped ``(region, balancer_id, epoch,
seq)``. One is *accepted* only if ``(epoch, seq)`` is newer than the last accepted from
that balancer; its load then replaces the previous one whole. ``epoch`` is the sender's
start time (unix ns), so a restarted balancer (seq back at 1) wins over its past life.
One exception: a peer that is DOWN may come back with a *smaller* epoch (its wall clock
stepped back across the restart); refusing it would lock it out forever.

Liveness, measured from the last accepted heartbeat in units of the heartbeat interval
(the larger of ours and the one the peer announces, capped at ``limits.max_interval_s``:
a peer cannot stay alive for minutes after one heartbeat by announcing a long interval)::

    silence <= suspect_after          ALIVE
    suspect_after < silence <= down_after   SUSPECTED   (still usable, but suspect)
    silence > down_after              DOWN        (no request goes there)

A peer never heard from is DOWN; the first accepted heartbeat makes it ALIVE again.
A heartbeat whose loads are out of range (:func:`~skymesh.mesh.limits.heartbeat_problem`)
is refused (``INVALID``) and changes nothing, so a peer sending only such ones ages out.

RTT: each heartbeat echoes the last one accepted from the receiver (its epoch, seq,
send time and how long it was held before this send). The original sender then measures
``RTT = now - echo_sent - hold`` on its own clock, no clock sync needed, and keeps an
EMA. Echoes of a previous epoch (a peer still echoing our past life) are ignored.

Parameters: ``interval`` = 0.2 s, ``suspect_after`` = 2 intervals, ``down_after`` =
3 intervals, ``rtt_alpha`` = 0.2 (EMA weight of a new sample), ``limits`` =
``HeartbeatLimits()`` (a peer's interval capped at 2 s).
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from skymesh.mesh.limits import (
    DEFAULT_HEARTBEAT_LIMITS,
    HeartbeatLimits,
    heartbeat_problem,
    peer_interval,
)
from skymesh.mesh.proto import pb

DEFAULT_INTERVAL_S = 0.2
DEFAULT_SUSPECT_AFTER = 2.0
DEFAULT_DOWN_AFTER = 3.0
DEFAULT_RTT_ALPHA = 0.2
_MAX_RTT_S = 60.0  # a larger "sample" is a bogus echo, not a network


class Liveness(enum.Enum):
    ALIVE = "alive"
    SUSPECTED = "suspected"
    DOWN = "down"


class Verdict(enum.Enum):
    """What :meth:`PeerState.observe` did with a heartbeat."""

    ACCEPTED = "accepted"
    STALE = "stale"  # (epoch, seq) not newer than the one applied
    SELF = "self"  # our own id: a peer list that names us
    INVALID = "invalid"  # a field out of range (skymesh.mesh.limits.heartbeat_problem)


@dataclass(frozen=True, slots=True)
class Identity:
    region: str
    balancer_id: str
    epoch: int


def new_identity(region: str, balancer_id: str) -> Identity:
    """An identity with a fresh epoch: now, in unix ns (larger after every restart)."""
    return Identity(region, balancer_id, time.time_ns())


@dataclass(frozen=True, slots=True)
class PeerView:
    """One peer as this balancer sees it now (for routing, metrics and status pages)."""

    balancer_id: str
    region: str
    liveness: Liveness
    rtt_s: float | None
    epoch: int
    seq: int
    age_s: float | None  # since the last accepted heartbeat; None if never heard
    accepted: int
    rejected: int
    models: tuple[pb.ModelLoad, ...]


class _Peer:
    __slots__ = ("accepted", "echo", "interval", "last_good", "latest", "rejected",
                 "reported", "rtt")

    def __init__(self) -> None:
        self.latest: pb.HeartbeatMsg | None = None
        self.last_good: float | None = None
        self.interval = 0.0
        self.rtt: float | None = None
        # (epoch, seq, sent_ns, local receive time) of the last accepted heartbeat
        self.echo: tuple[int, int, int, float] | None = None
        self.accepted = 0
        self.rejected = 0
        self.reported = Liveness.DOWN


class PeerState:
    """Heartbeat bookkeeping for one balancer and all its peers."""

    def __init__(
        self,
        identity: Identity,
        *,
        peers: Iterable[str] = (),
        interval: float = DEFAULT_INTERVAL_S,
        suspect_after: float = DEFAULT_SUSPECT_AFTER,
        down_after: float = DEFAULT_DOWN_AFTER,
        rtt_alpha: float = DEFAULT_RTT_ALPHA,
        limits: HeartbeatLimits = DEFAULT_HEARTBEAT_LIMITS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if interval <= 0:
            raise ValueError(f"interval must be > 0, got {interval}")
        if not 0 < suspect_after <= down_after:
            raise ValueError(f"need 0 < suspect_after <= down_after, got {suspect_after}, "
                             f"{down_after}")
        if not 0 < rtt_alpha <= 1:
            raise ValueError(f"rtt_alpha must be in (0, 1], got {rtt_alpha}")
        self.identity = identity
        self.interval = interval
        self.suspect_after = suspect_after
        self.down_after = down_after
        self.rtt_alpha = rtt_alpha
        self.limits = limits
        self.clock = clock
        self._seq = 0
        self._peers: dict[str, _Peer] = {}
        for p in peers:
            self.add_peer(p)

    # -- membership --------------------------------------------------------------------------
    def add_peer(self, balancer_id: str) -> None:
        if balancer_id != self.identity.balancer_id:
            self._peers.setdefault(balancer_id, _Peer())

    def remove_peer(self, balancer_id: str) -> None:
        self._peers.pop(balancer_id, None)

    def peers(self) -> list[str]:
        return sorted(self._peers)

    # -- sending -----------------------------------------------------------------------------
    def stamp(self, msg: pb.HeartbeatMsg, to_peer: str) -> pb.HeartbeatMsg:
        """Fill in our stamp, and the echo of ``to_peer``'s last heartbeat, in place."""
        now = self.clock()
        self._seq += 1
        ident = self.identity
        msg.region = ident.region
        msg.balancer_id = ident.balancer_id
        msg.epoch = ident.epoch
        msg.seq = self._seq
        msg.sent_ns = round(now * 1e9)
        msg.interval_ms = max(1, round(self.interval * 1000))
        peer = self._peers.get(to_peer)
        if peer is not None and peer.echo is not None:
            epoch, seq, sent_ns, received = peer.echo
            msg.echo_epoch = epoch
            msg.echo_seq = seq
            msg.echo_sent_ns = sent_ns
            msg.echo_hold_ns = max(0, round((now - received) * 1e9))
        return msg

    # -- receiving ---------------------------------------------------------------------------
    def observe(self, msg: pb.HeartbeatMsg) -> Verdict:
        """Apply ``msg`` if it is newer than what we hold from its sender."""
        sender = msg.balancer_id
        if sender == self.identity.balancer_id:
            return Verdict.SELF
        now = self.clock()
        peer = self._peers.get(sender)
        if peer is None:
            peer = self._peers[sender] = _Peer()
        if heartbeat_problem(msg, self.limits) is not None:
            peer.rejected += 1
            return Verdict.INVALID
        latest = peer.latest
        if latest is not None and (msg.epoch, msg.seq) <= (latest.epoch, latest.seq) and not (
            msg.epoch != latest.epoch and self._liveness(peer, now) is Liveness.DOWN
        ):
            peer.rejected += 1
            return Verdict.STALE
        peer.latest = msg
        peer.last_good = now
        peer.interval = peer_interval(msg.interval_ms, self.interval,
                                      self.limits.max_interval_s)
        peer.echo = (msg.epoch, msg.seq, msg.sent_ns, now)
        peer.accepted += 1
        if msg.echo_epoch == self.identity.epoch and msg.echo_sent_ns:
            sample = now - (msg.echo_sent_ns + msg.echo_hold_ns) / 1e9
            if 0 <= sample < _MAX_RTT_S:
                peer.rtt = sample if peer.rtt is None else (
                    peer.rtt + self.rtt_alpha * (sample - peer.rtt))
        return Verdict.ACCEPTED

    # -- reading -----------------------------------------------------------------------------
    def _liveness(self, peer: _Peer, now: float) -> Liveness:
        if peer.last_good is None:
            return Liveness.DOWN
        missed = (now - peer.last_good) / peer.interval
        if missed > self.down_after:
            return Liveness.DOWN
        if missed > self.suspect_after:
            return Liveness.SUSPECTED
        return Liveness.ALIVE

    def liveness(self, balancer_id: str) -> Liveness:
        peer = self._peers.get(balancer_id)
        return Liveness.DOWN if peer is None else self._liveness(peer, self.clock())

    def rtt_s(self, balancer_id: str) -> float | None:
        peer = self._peers.get(balancer_id)
        return None if peer is None else peer.rtt

    def latest(self, balancer_id: str) -> pb.HeartbeatMsg | None:
        """The last accepted heartbeat (its loads are the peer's current state)."""
        peer = self._peers.get(balancer_id)
        return None if peer is None else peer.latest

    def usable(self) -> list[str]:
        """Peers a request may go to: every one that is not DOWN."""
        now = self.clock()
        return [b for b, p in sorted(self._peers.items())
                if self._liveness(p, now) is not Liveness.DOWN]

    def view(self, balancer_id: str) -> PeerView:
        peer = self._peers.get(balancer_id)
        if peer is None:
            raise KeyError(balancer_id)
        now = self.clock()
        msg = peer.latest
        return PeerView(
            balancer_id=balancer_id,
            region=msg.region if msg else "",
            liveness=self._liveness(peer, now),
            rtt_s=peer.rtt,
            epoch=msg.epoch if msg else 0,
            seq=msg.seq if msg else 0,
            age_s=None if peer.last_good is None else now - peer.last_good,
            accepted=peer.accepted,
            rejected=peer.rejected,
            models=tuple(msg.models) if msg else (),
        )

    def views(self) -> list[PeerView]:
        return [self.view(b) for b in sorted(self._peers)]

    def transitions(self) -> list[tuple[str, Liveness, Liveness]]:
        """Liveness changes since the last call, as ``(peer, old, new)``: poll it (e.g.
        once per interval) to update routing membership and log."""
        now = self.clock()
        out = []
        for b, peer in sorted(self._peers.items()):
            cur = self._liveness(peer, now)
            if cur is not peer.reported:
                out.append((b, peer.reported, cur))
                peer.reported = cur
        return out
