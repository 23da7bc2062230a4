"""KV-cache events from an engine: vLLM's wire schema, and one subscriber per replica.

vLLM (``--kv-events-config``, ``vllm/distributed/kv_events.py``) and SGLang publish what
their prefix cache holds over ZeroMQ. The wire, which :mod:`skymesh_replica` publishes too:

- PUB socket, one multipart message per engine step: ``(topic, seq, payload)``; ``seq``
  is 8 bytes big-endian, counting from 0 when the publisher starts; ``payload`` is a
  msgpack ``EventBatch``, an array ``[ts, events, data_parallel_rank]``.
- Each event is a tagged struct: ``BlockStored`` (the new full blocks' engine hashes, the
  parent block's hash, their token ids, ``block_size``), ``BlockRemoved`` (evicted
  hashes) or ``AllBlocksCleared``. vLLM >= 0.11 encodes events as maps with a ``type``
  key; SGLang and older vLLM as arrays whose first item is the tag. Both are read.
- ROUTER replay endpoint: a DEALER sends ``(b"", start_seq)`` and gets every buffered
  batch with ``seq >= start_seq`` as ``(b"", topic, seq, payload)``, then the end marker
  ``(b"", b"", -1, b"")``.

The subscriber (:class:`KVEventSubscriber`) applies batches in sequence order to a
:class:`~skymesh.prefix.kv_index.ReplicaBlockIndex`. Its decisions are the pure
:class:`SeqTracker`: a gap is filled from the replay endpoint; ``seq`` going backwards on
the live stream means the publisher restarted (the engine lost its cache): the index is
cleared and rebuilt from the replay buffer. A gap the buffer cannot fill also clears the
index: a missed ``BlockRemoved`` would leave the balancer pointing at blocks the engine
no longer holds, and a missing block only costs a lower score.

Heartbeat: vLLM sends nothing while idle, so the subscriber asks the replay endpoint for
``seq >= last applied`` every ``heartbeat_s``. The answer proves the publisher alive and
checks it is the same one: it must return the last applied batch, byte for byte (a
restarted publisher has not reached that seq, or holds a different batch under it).
Without a replay endpoint only live traffic counts as a heartbeat. Events are *live*
when something was heard within ``stale_after_s``, else *stale*, and the balancer then
uses its approximate trie.

Bounds: every frame is capped by ZeroMQ (``max_frame_bytes``: larger messages drop the
connection), the receive queues by ``rcv_hwm`` messages (the publisher drops beyond it;
the gap is then replayed), a replay by ``replay_timeout_s``; unknown event tags and
unknown fields are skipped, malformed batches counted and treated as a gap.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio

from skymesh.obs.ratelog import RateLimitedLog
from skymesh.prefix.kv_index import ReplicaBlockIndex

log = logging.getLogger(__name__)
_cap_log = RateLimitedLog(log)  # one line per publisher per 10 s while the cap bites

EngineHash = bytes | int
END_SEQ = -1
FULL_ATTENTION = (None, "full_attention")


# -- the schema (vLLM 0.32's field names and order) -----------------------------------
class BlockStored(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # Per block: what besides the tokens went into the engine's hash (LoRA, multimodal
    # inputs, cache salt). Such a block is stored under a key no prompt's tokens give.
    extra_keys: list[Any] | None = None
    # vLLM >= 0.30 with hybrid models: one group per attention kind. Only full-attention
    # blocks make a reusable prefix; a sliding window's blocks are skipped.
    kv_cache_spec_kind: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, gc=False):
    pass


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EventBatch(msgspec.Struct, array_like=True, gc=False):
    """What the publisher sends; decoding keeps each event raw until its form is known."""

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: int | None = None


# SGLang's and older vLLM's array form: same fields, same order, tag first.
class _BlockStoredArr(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    block_hashes: list[EngineHash]
    parent_block_hash: EngineHash | None = None
    token_ids: list[int] = []
    block_size: int = 0
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None


class _BlockRemovedArr(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[EngineHash]
    medium: str | None = None


class _AllBlocksClearedArr(msgspec.Struct, array_like=True, tag="AllBlocksCleared",
                           gc=False):
    pass


_batch_decoder = msgspec.msgpack.Decoder(_RawBatch)
_map_decoder = msgspec.msgpack.Decoder(KVEvent)
_arr_decoder = msgspec.msgpack.Decoder(_BlockStoredArr | _BlockRemovedArr | _AllBlocksClearedArr)
_encoder = msgspec.msgpack.Encoder()


def encode_batch(ts: float, events: list[KVEvent], dp_rank: int = 0) -> bytes:
    return _encoder.encode(EventBatch(ts, list(events), dp_rank))


class MalformedBatch(ValueError):
    """The payload is not an EventBatch."""


def decode_batch(payload: bytes) -> tuple[list[Any], int]:
    """The batch's events we know (map or array form) and how many were skipped."""
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise MalformedBatch(str(exc)) from None
    out: list[Any] = []
    skipped = 0
    for raw in batch.events:
        view = memoryview(raw)
        first = view[0] if len(view) else 0
        # msgpack arrays: fixarray 0x90-0x9f, array16 0xdc, array32 0xdd.
        arr = 0x90 <= first <= 0x9F or first in (0xDC, 0xDD)
        try:
            out.append((_arr_decoder if arr else _map_decoder).decode(raw))
        except msgspec.DecodeError:
            skipped += 1  # an event type this version does not know
    return out, skipped


def apply_events(index: ReplicaBlockIndex, events: list[Any]) -> None:
    for ev in events:
        if isinstance(ev, BlockStored) and ev.kv_cache_spec_kind not in FULL_ATTENTION:
            continue
        if isinstance(ev, BlockStored):
            index.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                         ev.block_size, ev.lora_name, ev.extra_keys)
        elif isinstance(ev, _BlockStoredArr):
            index.stored(ev.block_hashes, ev.parent_block_hash, ev.token_ids,
                         ev.block_size, ev.lora_name)
        elif isinstance(ev, BlockRemoved | _BlockRemovedArr):
            index.removed(ev.block_hashes)
        else:
            index.clear()


# -- sequence decisions (pure) --------------------------------------------------------
class Verdict(enum.Enum):
    APPLY = "apply"
    SKIP = "skip"  # already applied (a replay overlapping the live stream)
    GAP = "gap"  # replay from applied + 1 first
    FIRST = "first"  # nothing applied yet: replay from 0 first
    RESTART = "restart"  # a new publisher: clear, then replay from 0


@dataclass(slots=True)
class SeqTracker:
    """Sequence numbers of one publisher: the live stream's and what the index holds."""

    live_last: int | None = None
    applied: int | None = None

    def on_live(self, seq: int) -> Verdict:
        if self.live_last is not None and seq <= self.live_last:
            # PUB delivers in order: going backwards is a new publisher.
            self.live_last = seq
            self.applied = None
            return Verdict.RESTART
        self.live_last = seq
        if self.applied is None:
            return Verdict.FIRST
        if seq <= self.applied:
            return Verdict.SKIP
        return Verdict.APPLY if seq == self.applied + 1 else Verdict.GAP

    def on_replayed(self, seq: int) -> Verdict:
        """A replayed batch: APPLY, SKIP, or GAP when the buffer no longer reaches back."""
        if self.applied is not None and seq <= self.applied:
            return Verdict.SKIP
        if self.applied is None or seq == self.applied + 1:
            return Verdict.APPLY
        return Verdict.GAP

    def mark(self, seq: int) -> None:
        self.applied = seq


# -- the subscriber (I/O) --------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class SubscriberSettings:
    heartbeat_s: float = 1.0
    stale_after_s: float = 5.0
    replay_timeout_s: float = 2.0
    max_frame_bytes: int = 4 << 20
    rcv_hwm: int = 256
    topic: bytes = b""


@dataclass(slots=True)
class FeedCounters:
    batches: int = 0
    replayed: int = 0
    gaps: int = 0
    restarts: int = 0
    resyncs: int = 0  # index cleared because a gap could not be filled
    malformed: int = 0
    unknown_events: int = 0


@dataclass
class KVEventSubscriber:
    """Follows one replica's publisher into ``index``; run :meth:`run` as a task."""

    endpoint: str
    replay_endpoint: str | None
    index: ReplicaBlockIndex
    settings: SubscriberSettings = field(default_factory=SubscriberSettings)
    clock: Callable[[], float] = time.monotonic
    tracker: SeqTracker = field(default_factory=SeqTracker)
    counters: FeedCounters = field(default_factory=FeedCounters)
    last_heard: float | None = None
    _last_digest: int | None = None
    _ctx: zmq.asyncio.Context | None = None
    _sub: zmq.asyncio.Socket | None = None
    _replay: zmq.asyncio.Socket | None = None

    def is_live(self, now: float | None = None) -> bool:
        now = self.clock() if now is None else now
        return self.last_heard is not None and now - self.last_heard <= self.settings.stale_after_s

    def _socket(self, kind: int) -> zmq.asyncio.Socket:
        assert self._ctx is not None
        s = self._ctx.socket(kind)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.MAXMSGSIZE, self.settings.max_frame_bytes)
        s.setsockopt(zmq.RCVHWM, self.settings.rcv_hwm)
        return s

    def _open(self) -> None:
        # One context (one I/O thread) for every subscriber of the process.
        self._ctx = zmq.asyncio.Context.instance()
        self._sub = self._socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, self.settings.topic)
        self._sub.connect(self.endpoint)
        self._reopen_replay()

    def _reopen_replay(self) -> None:
        # A DEALER that timed out may still get the old answer: a fresh socket never does.
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None
        if self.replay_endpoint:
            self._replay = self._socket(zmq.DEALER)
            self._replay.connect(self.replay_endpoint)

    def close(self) -> None:
        for s in (self._sub, self._replay):
            if s is not None:
                s.close(linger=0)
        self._sub = self._replay = None

    async def run(self) -> None:
        self._open()
        assert self._sub is not None
        try:
            # Catch up at once: a late subscriber learns what the buffer holds.
            await self._heartbeat()
            while True:
                if await self._sub.poll(int(self.settings.heartbeat_s * 1000)):
                    frames = await self._sub.recv_multipart()
                    await self._on_live(frames)
                elif self._replay is not None:
                    await self._heartbeat()
        finally:
            self.close()

    async def _on_live(self, frames: list[bytes]) -> None:
        if len(frames) != 3 or len(frames[1]) != 8:
            self.counters.malformed += 1
            return
        self.last_heard = self.clock()
        seq = int.from_bytes(frames[1], "big", signed=True)
        verdict = self.tracker.on_live(seq)
        if verdict is Verdict.SKIP:
            return
        if verdict is Verdict.RESTART:
            self.counters.restarts += 1
            log.info("kv events from %s: publisher restarted (seq %d), resyncing",
                     self.endpoint, seq)
            self.index.clear()
        if verdict in (Verdict.RESTART, Verdict.FIRST):
            await self._fill(0)
        elif verdict is Verdict.GAP:
            self.counters.gaps += 1
            await self._fill((self.tracker.applied or 0) + 1)
        # Whatever the replay left out, this batch comes next.
        follow = self.tracker.on_replayed(seq)
        if follow is Verdict.GAP:
            self._resync(seq)
        if follow is not Verdict.SKIP:
            self._apply(seq, frames[2])

    def _resync(self, seq: int) -> None:
        self.counters.resyncs += 1
        log.warning("kv events from %s: batches before seq %d are lost; index cleared",
                    self.endpoint, seq)
        self.index.clear()

    def _apply(self, seq: int, payload: bytes) -> None:
        self.counters.batches += 1
        self.tracker.mark(seq)
        self._last_digest = hash(payload)
        try:
            events, skipped = decode_batch(payload)
        except MalformedBatch:
            self.counters.malformed += 1
            self._resync(seq)
            return
        self.counters.unknown_events += skipped
        evicted = self.index.evicted
        apply_events(self.index, events)
        if self.index.evicted != evicted:
            _cap_log(logging.WARNING, self.endpoint,
                     f"kv events from {self.endpoint}: index at its cap of "
                     f"{self.index.max_blocks} blocks, forgetting the least recently stored "
                     f"(kv_events.max_blocks)")

    async def _fill(self, start: int) -> None:
        """Apply the replayed batches from ``start`` (none when the endpoint is silent)."""
        await self._request_replay(start, self._apply_replayed)

    async def _request_replay(self, start: int, handle: Callable[[int, bytes], None]
                              ) -> bool:
        """Ask for the batches from ``start``; each goes to ``handle`` as it arrives (a
        replay holds no more than one batch at a time). False: no (complete) answer."""
        sock = self._replay
        if sock is None:
            return False
        await sock.send_multipart([b"", start.to_bytes(8, "big", signed=True)])
        deadline = self.clock() + self.settings.replay_timeout_s
        while True:
            left = deadline - self.clock()
            if left <= 0 or not await sock.poll(max(1, int(left * 1000))):
                self._reopen_replay()
                return False
            frames = await sock.recv_multipart()
            if len(frames) != 4 or len(frames[2]) != 8:
                self.counters.malformed += 1
                continue
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == END_SEQ:
                self.last_heard = self.clock()
                return True
            handle(seq, frames[3])

    async def _heartbeat(self) -> None:
        applied = self.tracker.applied
        if applied is None:
            await self._fill(0)
            return
        # The first batch back must be our last one, byte for byte; else the buffer does
        # not hold it as we saw it: a new publisher (or one so far ahead that its buffer
        # no longer reaches back), and we start over.
        seen = {"first": True, "same": False}

        def check(seq: int, payload: bytes) -> None:
            if seen["first"]:
                seen["first"] = False
                seen["same"] = seq == applied and hash(payload) == self._last_digest
            elif seen["same"]:
                self._apply_replayed(seq, payload)

        if await self._request_replay(applied, check) and not seen["same"]:
            self.counters.restarts += 1
            log.info("kv events from %s: publisher restarted, resyncing", self.endpoint)
            self.index.clear()
            self.tracker = SeqTracker()
            await self._fill(0)

    def _apply_replayed(self, seq: int, payload: bytes) -> None:
        v = self.tracker.on_replayed(seq)
        if v is Verdict.SKIP:
            return
        if v is Verdict.GAP:
            self._resync(seq)
        self.counters.replayed += 1
        self._apply(seq, payload)


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
