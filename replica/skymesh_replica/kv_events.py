"""vLLM's KV-cache event publisher, for the emulated engine (``--kv-events-config``).

Same flag shape as vLLM (``{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}``) and the same wire
(:mod:`skymesh.prefix.kv_events`): a PUB socket sends ``(topic, seq, payload)`` per engine
step that changed the cache, a ROUTER replays the last ``buffer_steps`` batches from a
requested seq. Differences from vLLM: endpoints are always bound (vLLM connects to a
non-wildcard host, for a forwarder), and there is one data-parallel rank.

The engine's block manager tells an :class:`EventRecorder` what it stores (full blocks,
with their token ids and parent hash), evicts and clears; the driver flushes the recorder
into one batch after each step (:meth:`KVEventPublisher.flush`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, fields

import zmq
import zmq.asyncio

from skymesh.prefix.kv_events import (
    END_SEQ,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEvent,
    encode_batch,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` keys (``max_queue_size`` accepted and unused)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """From the flag's JSON; ValueError naming the bad key."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        for key, _value in raw.items():
            if key not in known:
                raise ValueError(f"unknown key {key!r}; known: {', '.join(known)}")
        cfg = cls(**raw)
        if cfg.publisher not in ("zmq", "null"):
            raise ValueError(f"publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        if not isinstance(cfg.endpoint, str) or not cfg.endpoint.startswith(("tcp://", "ipc://")):
            raise ValueError(f"endpoint must be tcp://HOST:PORT or ipc://PATH, got "
                             f"{cfg.endpoint!r}")
        for key in ("buffer_steps", "hwm"):
            v = getattr(cfg, key)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{key} must be a positive integer, got {v!r}")
        return cfg


class EventRecorder:
    """What one step did to the cache, coalesced as vLLM does (a chain per store)."""

    __slots__ = ("pending",)

    def __init__(self) -> None:
        self.pending: list[KVEvent] = []

    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int],
               block_size: int) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockStored) and parent is not None and \
                last.block_hashes[-1] == parent:
            last.block_hashes.append(block_hash)
            last.token_ids.extend(token_ids)
            return
        self.pending.append(BlockStored([block_hash], parent, list(token_ids), block_size,
                                        None, "GPU", None))

    def removed(self, block_hash: int) -> None:
        last = self.pending[-1] if self.pending else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(block_hash)
        else:
            self.pending.append(BlockRemoved([block_hash], "GPU"))

    def cleared(self) -> None:
        # Everything before a clear is moot for a subscriber.
        self.pending = [AllBlocksCleared()]

    def take(self) -> list[KVEvent]:
        out, self.pending = self.pending, []
        return out


class KVEventPublisher:
    """PUB + replay ROUTER; :meth:`flush` after each step, :meth:`close` at shutdown."""

    def __init__(self, config: KVEventsConfig, recorder: EventRecorder) -> None:
        self.config = config
        self.recorder = recorder
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._topic = config.topic.encode()
        self._ctx = zmq.asyncio.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.bind(config.endpoint)
        self._router: zmq.asyncio.Socket | None = None
        if config.replay_endpoint:
            self._router = self._ctx.socket(zmq.ROUTER)
            self._router.setsockopt(zmq.LINGER, 0)
            # A subscriber asks for at most the whole buffer; bigger requests are bogus.
            self._router.setsockopt(zmq.MAXMSGSIZE, 64)
            self._router.bind(config.replay_endpoint)
        self._task: asyncio.Task[None] | None = None

    @property
    def endpoint(self) -> str:
        return str(self._pub.getsockopt_string(zmq.LAST_ENDPOINT))

    @property
    def replay_endpoint(self) -> str | None:
        if self._router is None:
            return None
        return str(self._router.getsockopt_string(zmq.LAST_ENDPOINT))

    def start(self) -> None:
        if self._router is not None and self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._serve_replay(),
                                                                name="kv-events-replay")

    def flush(self) -> None:
        events = self.recorder.take()
        if not events:
            return
        seq, self._seq = self._seq, self._seq + 1
        payload = encode_batch(time.time(), events)
        frames = (self._topic, seq.to_bytes(8, "big"), payload)
        # PUB never blocks: past the high-water mark a slow subscriber loses batches,
        # sees the gap and asks the replay endpoint.
        self._pub.send_multipart(frames, flags=zmq.NOBLOCK)
        self._buffer.append((seq, payload))

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: invalid replay request (%d frames)", len(frames))
                continue
            client, _empty, start_b = frames
            start = int.from_bytes(start_b, "big", signed=True)
            for seq, payload in list(self._buffer):
                if seq >= start:
                    await router.send_multipart(
                        (client, b"", self._topic, seq.to_bytes(8, "big"), payload))
            await router.send_multipart(
                (client, b"", b"", END_SEQ.to_bytes(8, "big", signed=True), b""))

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._pub.close(linger=0)
        if self._router is not None:
            self._router.close(linger=0)
