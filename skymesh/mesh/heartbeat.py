"""One heartbeat stream's bookkeeping, the same at both ends (client and server).

Outgoing: the balancer's ``local_summary(include_prefix)`` callback supplies the
per-model loads (and, when asked, the prefix summary); the session stamps the message
(:meth:`PeerState.stamp`) and keeps it under the byte bound. The prefix summary is the
big part (up to 512 keys = 4 KiB), so it is asked for at most every
``summary_interval`` and sent only when it changed, or every ``summary_refresh`` to
re-seed a receiver that pruned it. Loads ride on every heartbeat. Its exact part
(``blocks``, one per scoring key and block size, docs/kv-events.md) counts as part of the
summary: a change there sends the summary, and over the byte bound the text keys are
trimmed first, then the exact summaries' (a new receiver prefers those; an old one
never reads them).

Incoming: a message over the byte bound, or one whose ``balancer_id`` is not the peer
the connection was authenticated as, is a protocol error (the stream is dropped); any
other goes to :meth:`PeerState.observe`, and, if accepted, to ``on_heartbeat``. One
with loads out of range is refused there, and logged (at most every ``LOG_EVERY_S``
per stream); the stream stays, so the peer's next sane heartbeat counts.

Parameters: ``max_bytes`` = 16 KiB, ``summary_interval`` = 2 s, ``summary_refresh`` = 10 s.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Sequence

import grpc

from skymesh.mesh.errors import PeerProtocolError, PeerRefused
from skymesh.mesh.limits import heartbeat_problem
from skymesh.mesh.proto import pb
from skymesh.mesh.state import PeerState, Verdict
from skymesh.mesh.summary import (
    BLOCK_DEPTHS,
    DEFAULT_DEPTHS,
    DEFAULT_MAX_KEYS,
    build_block_summary,
    build_summary,
)
from skymesh.prefix.kv_index import ReplicaBlockIndex
from skymesh.prefix.trie import PrefixTrie

log = logging.getLogger(__name__)

DEFAULT_MAX_HEARTBEAT_BYTES = 16 * 1024
DEFAULT_SUMMARY_INTERVAL_S = 2.0
DEFAULT_SUMMARY_REFRESH_S = 10.0
LOG_EVERY_S = 10.0

# local_summary(include_prefix) -> a HeartbeatMsg with ``models`` (and ``prefix`` when
# asked); the stamp fields are filled in by the session.
LocalSummary = Callable[[bool], pb.HeartbeatMsg]
OnHeartbeat = Callable[[pb.HeartbeatMsg], None]


# (scoring key, block size, the live indexes of the region's replicas of that tag)
ExactGroup = tuple[str, int, Sequence[ReplicaBlockIndex]]


def prefix_summary(source: PrefixTrie | Iterable[Sequence[int]],
                   max_keys: int = DEFAULT_MAX_KEYS,
                   depths: Sequence[int] = DEFAULT_DEPTHS,
                   exact: Iterable[ExactGroup] = ()) -> pb.PrefixSummary:
    """The heartbeat field for :func:`~skymesh.mesh.summary.build_summary`'s keys, and
    one exact summary per group of ``exact``
    (:func:`~skymesh.mesh.summary.build_block_summary`); the receiver hands ``keys`` and
    ``depths`` to ``PeerSnapshot.insert_summary``, ``blocks`` to
    ``PeerSnapshot.insert_block_summaries``."""
    msg = pb.PrefixSummary(keys=build_summary(source, max_keys, depths), depths=depths)
    for key, block_size, indexes in exact:
        msg.blocks.add(scoring_key=key, block_size=block_size,
                       keys=build_block_summary(indexes, max_keys, BLOCK_DEPTHS),
                       depths=BLOCK_DEPTHS)
    return msg


def read_block_summaries(summary: pb.PrefixSummary
                         ) -> list[tuple[str, int, Sequence[int], Sequence[int]]]:
    """``summary``'s exact part as ``PeerSnapshot.insert_block_summaries`` takes it."""
    return [(b.scoring_key, b.block_size, b.keys, b.depths) for b in summary.blocks]


class HeartbeatTooLarge(PeerProtocolError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class WrongPeer(PeerRefused):
    """A heartbeat that names a balancer other than the authenticated peer."""


class HeartbeatSession:
    def __init__(
        self,
        state: PeerState,
        peer: str,
        local_summary: LocalSummary,
        on_heartbeat: OnHeartbeat | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_HEARTBEAT_BYTES,
        summary_interval: float = DEFAULT_SUMMARY_INTERVAL_S,
        summary_refresh: float = DEFAULT_SUMMARY_REFRESH_S,
    ) -> None:
        self.state = state
        self.peer = peer
        self.local_summary = local_summary
        self.on_heartbeat = on_heartbeat
        self.max_bytes = max_bytes
        self.summary_interval = summary_interval
        self.summary_refresh = summary_refresh
        self._asked_at = -math.inf
        self._sent_at = -math.inf
        self._sent_digest: int | None = None
        self.sent = self.received = 0
        self.bytes_sent = self.bytes_received = 0
        self.summaries_sent = 0
        self.invalid = 0
        self._invalid_logged_at = -math.inf

    def outgoing(self) -> pb.HeartbeatMsg:
        now = self.state.clock()
        ask = now - self._asked_at >= self.summary_interval
        msg = self.local_summary(ask)
        if ask:
            self._asked_at = now
        if msg.HasField("prefix"):
            digest = hash(msg.prefix.SerializeToString(deterministic=True))
            if (not ask or (digest == self._sent_digest
                            and now - self._sent_at < self.summary_refresh)):
                msg.ClearField("prefix")
            else:
                self._sent_at, self._sent_digest = now, digest
                self.summaries_sent += 1
        self.state.stamp(msg, self.peer)
        self._fit(msg)
        self.sent += 1
        self.bytes_sent += msg.ByteSize()
        return msg

    def _fit(self, msg: pb.HeartbeatMsg) -> None:
        """Trim the summary's least recent keys until ``msg`` fits the bound: the text
        summary's first, then the exact summaries', last one first."""
        size = msg.ByteSize()
        for keys in (msg.prefix.keys, *(b.keys for b in reversed(msg.prefix.blocks))):
            while size > self.max_bytes and len(keys):
                # 8 bytes a key, plus slack for the length varints shrinking
                drop = min(len(keys), (size - self.max_bytes) // 8 + 2)
                del keys[len(keys) - drop:]
                size = msg.ByteSize()
        if size > self.max_bytes:
            raise HeartbeatTooLarge(self.peer, f"our own heartbeat is {size} bytes without a "
                                               f"prefix summary (bound {self.max_bytes})")

    def incoming(self, msg: pb.HeartbeatMsg) -> Verdict:
        size = msg.ByteSize()
        if size > self.max_bytes:
            raise HeartbeatTooLarge(self.peer, f"heartbeat of {size} bytes exceeds the bound "
                                               f"of {self.max_bytes}")
        if msg.balancer_id != self.peer:
            raise WrongPeer(self.peer, f"heartbeat names balancer {msg.balancer_id!r}")
        self.received += 1
        self.bytes_received += size
        verdict = self.state.observe(msg)
        if verdict is Verdict.INVALID:
            self._log_invalid(msg)
        if verdict is Verdict.ACCEPTED and self.on_heartbeat is not None:
            try:
                self.on_heartbeat(msg)
            except Exception:
                # A bug in the consumer must not look like a dead peer (a dropped stream).
                log.exception("on_heartbeat failed for a heartbeat from %s", self.peer)
        return verdict

    def _log_invalid(self, msg: pb.HeartbeatMsg) -> None:
        self.invalid += 1
        now = self.state.clock()
        if now - self._invalid_logged_at < LOG_EVERY_S:
            return
        self._invalid_logged_at = now
        log.warning("refused a heartbeat from %s: %s (%d refused on this stream)", self.peer,
                    heartbeat_problem(msg, self.state.limits), self.invalid)
