"""What the workers of one ``skymesh-lb`` share (skymesh.balancer.workers), over private unix
sockets in the supervisor's directory.

- **One view.** Each worker serves its own ``/metrics`` and a short status on
  ``w<I>.http``. The worker a scrape reaches fetches its siblings' over those sockets and
  answers with all of them, each series labelled ``worker="<I>"``, parsed and re-rendered
  by prometheus_client (:func:`merge_expositions`), plus ``skymesh_worker_up``: a
  Prometheus ``sum by (...)`` gives the balancer's totals, and a worker that stopped
  answering shows as 0 there rather than as a silent drop in the sums. ``/status`` is the
  answering worker's, with a ``workers`` list (each one's pid, queue and requests in flight).
- **Cache locality.** The kernel spreads connections, not prefixes: each worker's prefix
  trie would see only its share of the traffic. So each worker tells its siblings every
  insert into its policy's trie that *changed* its record (``PrefixTrie.on_insert``: a
  prefix it did not hold, or a target new to a prefix), batched for ``FLUSH_S``, as unix
  datagrams to ``w<I>.share``; they apply them to their own tries (:class:`TrieShare`).
  A repeat of a decision the trie holds already is not sent: the siblings were told the
  first time, and at a high hit rate nearly every insert is a repeat (each request
  inserts at dispatch and again with its reply's keys). The siblings' recency of such a
  prefix comes from their own traffic: the kernel spreads every prefix's requests over
  all the workers, so a prefix hot in one worker is hot in each (the lb-workers results
  page measures the hit rate with the rule, live and in the simulator). A datagram a
  sibling cannot take at once (its buffer is full, it is restarting) is dropped and
  counted (``skymesh_worker_share_dropped_total``): routing stays correct, only a little
  less local. ``/status`` shows each worker's counts (``share``: inserts sent and
  applied, datagrams sent).

Parameters: ``FLUSH_S`` = 0.001 (a decision reaches the siblings within about a
millisecond: in the simulator a 2 ms delay already cost 2 points of hit rate on
tree-of-thoughts clients, whose children follow their parent at once, and 1 ms none),
``MAX_DATAGRAM`` = 60,000 bytes per message, ``MAX_PENDING`` = 10,000 inserts waiting
(beyond, new ones are dropped and counted), ``FETCH_TIMEOUT_S`` = 2.0 for a sibling's view.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import socket
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

from skymesh.obs.ratelog import RateLimitedLog
from skymesh.prefix.trie import PrefixTrie

log = logging.getLogger("skymesh-lb.workers")

FLUSH_S = 0.001
MAX_DATAGRAM = 60_000
MAX_PENDING = 10_000
FETCH_TIMEOUT_S = 2.0
_KEY_BYTES = 8


# -- one /metrics view -------------------------------------------------------------------
class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def merge_expositions(texts: Mapping[str, str | None]) -> bytes:
    """Prometheus expositions by worker (``None``: it did not answer) as one, each sample
    labelled with its ``worker``, plus ``skymesh_worker_up``."""
    families: dict[str, Metric] = {}
    up = Metric("skymesh_worker_up", "1 if the worker answered this scrape", "gauge")
    for worker, text in texts.items():
        up.add_sample("skymesh_worker_up", {"worker": worker}, 0.0 if text is None else 1.0)
        for fam in text_string_to_metric_families(text or ""):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type,
                                                  fam.unit)
            out.samples.extend(Sample(s.name, {**s.labels, "worker": worker}, s.value,
                                      s.timestamp, s.exemplar) for s in fam.samples)
    return generate_latest(_Families([*families.values(), up]))


# -- cache locality ----------------------------------------------------------------------
# A datagram: this header (the bytes of the target names, the number of inserts), the
# names joined by NUL, per insert its target's index and key count (uint32 pairs), then
# every insert's keys (uint64), all little-endian. Binary rather than a JSON header: at
# up to one datagram per millisecond, JSON's encode and decode (3.4 and 2.4 us) were
# half of a datagram's CPU with its send and receive; this takes 1.8 and 1.6.
_HEAD = struct.Struct("<II")
_NAME_SEP = "\0"  # never in a target URL


def encode_inserts(inserts: Sequence[tuple[Sequence[int], str]],
                   limit: int = MAX_DATAGRAM) -> list[bytes]:
    """Trie inserts as datagrams of at most ``limit`` bytes (the format above)."""
    out: list[bytes] = []
    # Keys per datagram: each takes 8 bytes, and each insert (a key at least) 8 more for
    # its target index and count; the names and the header fit the receiver's slack.
    room = limit // (2 * _KEY_BYTES)
    i = 0
    while i < len(inserts):
        targets: dict[str, int] = {}
        entries: list[int] = []  # target index, key count, target index, ...
        keys: list[int] = []
        while i < len(inserts):
            k, target = inserts[i]
            k = k[:room]  # a longer prompt's tail is not worth a datagram
            if entries and len(keys) + len(k) > room:
                break
            entries += (targets.setdefault(target, len(targets)), len(k))
            keys.extend(k)
            i += 1
        names = _NAME_SEP.join(targets).encode()
        out.append(b"".join((_HEAD.pack(len(names), len(entries) >> 1), names,
                             np.asarray(entries, dtype="<u4").tobytes(),
                             np.asarray(keys, dtype="<u8").tobytes())))
    return out


def decode_inserts(data: bytes) -> list[tuple[list[int], str]]:
    """:func:`encode_inserts`' inserts back; ValueError (or struct.error) if malformed."""
    size, n = _HEAD.unpack_from(data)
    at = _HEAD.size + size
    targets = data[_HEAD.size:at].decode().split(_NAME_SEP)
    entries = np.frombuffer(data, "<u4", 2 * n, at).tolist()
    keys = np.frombuffer(data, "<u8", offset=at + 4 * 2 * n).tolist()
    out: list[tuple[list[int], str]] = []
    start = 0
    for j in range(0, 2 * n, 2):
        end = start + entries[j + 1]
        if end > len(keys):
            raise ValueError("trie share datagram: fewer keys than its inserts count")
        out.append((keys[start:end], targets[entries[j]]))
        start = end
    return out


class TrieShare:
    """Sends this worker's trie inserts to its siblings and applies theirs (module doc)."""

    def __init__(self, directory: Path, index: int, count: int,
                 trie_of: Callable[[], PrefixTrie | None], known: Callable[[str], bool],
                 dropped: Any) -> None:
        self.path = directory / f"w{index}.share"
        self.peers = [str(directory / f"w{j}.share") for j in range(count) if j != index]
        self.trie_of = trie_of  # the current policy's trie (None: the policy has none)
        self.known = known  # a target in this worker's membership
        self.dropped = dropped  # a prometheus counter
        self.outbox: list[tuple[Sequence[int], str]] = []
        self.sent = self.applied = self.inserts_sent = 0  # /status's ``share``
        self._trie: PrefixTrie | None = None
        self._applying = False
        self._flush_handle: asyncio.TimerHandle | None = None
        self._sock: socket.socket | None = None
        self._watch: asyncio.Task[None] | None = None
        self._say = RateLimitedLog(log)

    def start(self) -> None:
        s = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        with contextlib.suppress(FileNotFoundError):
            self.path.unlink()  # a previous incarnation of this worker
        s.bind(str(self.path))
        s.setblocking(False)
        asyncio.get_running_loop().add_reader(s.fileno(), self._receive)
        self._attach()
        self._watch = asyncio.create_task(self._watch_policy(), name="skymesh-trie-share")

    async def stop(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self._flush_handle is not None:
            self._flush_handle.cancel()
        if self._trie is not None:
            self._trie.on_insert = None
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
            self._sock.close()

    def _attach(self) -> None:
        """Watch the current policy's trie (a live policy switch brings a new one)."""
        trie = self.trie_of()
        if trie is self._trie:
            return
        if self._trie is not None:
            self._trie.on_insert = None
        self._trie = trie
        if trie is not None:
            trie.on_insert = self.record

    async def _watch_policy(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self._attach()

    def record(self, keys: Sequence[int], target: str) -> None:
        if self._applying or not self.peers or not len(keys):
            return  # a prompt shorter than a chunk has no keys: nothing to share
        if len(self.outbox) >= MAX_PENDING:
            self.dropped.inc()
            return
        self.outbox.append((keys, target))
        if self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(FLUSH_S, self.flush)

    def flush(self) -> None:
        self._flush_handle = None
        batch, self.outbox = self.outbox, []
        if not batch or self._sock is None:
            return
        self.inserts_sent += len(batch)
        for msg in encode_inserts(batch):
            for peer in self.peers:
                try:
                    self._sock.sendto(msg, peer)
                    self.sent += 1
                except OSError as exc:  # full (BlockingIOError), or the sibling is down
                    self.dropped.inc()
                    self._say(logging.WARNING, peer,
                              f"trie share to {peer} dropped ({exc.__class__.__name__}); "
                              "counted in skymesh_worker_share_dropped_total")

    def _receive(self) -> None:
        # One datagram per call: the reader is level-triggered, so the loop calls again
        # while more wait, and the usual single datagram costs no failing recv.
        assert self._sock is not None
        try:
            data = self._sock.recv(MAX_DATAGRAM + 4096)
        except (BlockingIOError, InterruptedError):
            return
        trie = self._trie
        if trie is None:
            return
        try:
            inserts = decode_inserts(data)
        except (ValueError, IndexError, struct.error):
            log.warning("a malformed trie share datagram (%d bytes) ignored", len(data))
            return
        self._applying = True
        try:
            for keys, target in inserts:
                if self.known(target):
                    trie.insert(keys, target)
                    self.applied += 1
        finally:
            self._applying = False


# -- the siblings ------------------------------------------------------------------------
class Siblings:
    """This worker's end of what the workers share: serves its own view on ``w<I>.http``,
    fetches the others', and runs the trie share."""

    def __init__(self, directory: str, index: int, count: int,
                 local_metrics: Callable[[], bytes], local_status: Callable[[], dict[str, Any]],
                 trie_of: Callable[[], PrefixTrie | None], known: Callable[[str], bool],
                 registry: CollectorRegistry) -> None:
        self.dir = Path(directory)
        self.index, self.count = index, count
        self.local_metrics = local_metrics
        self.local_status = local_status
        dropped = Counter("skymesh_worker_share_dropped_total",
                          "Prefix-trie inserts not shared with a sibling worker (its socket "
                          "full or down, or too many waiting)", registry=registry)
        self.share = TrieShare(self.dir, index, count, trie_of, known, dropped)
        self._runner: web.AppRunner | None = None
        self._sessions: dict[int, aiohttp.ClientSession] = {}

    def http_path(self, index: int) -> str:
        return str(self.dir / f"w{index}.http")

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/metrics", self._handle_metrics)
        app.router.add_get("/status", self._handle_status)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        path = self.http_path(self.index)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a previous incarnation of this worker
        await web.UnixSite(self._runner, path).start()
        self.share.start()

    async def stop(self) -> None:
        await self.share.stop()
        for s in self._sessions.values():
            await s.close()
        if self._runner is not None:
            await self._runner.cleanup()
        # Normally the supervisor removes the directory; one killed outright cannot, so
        # the last worker out of an orphaned directory does.
        for path in (self.http_path(self.index), str(self.share.path)):
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(OSError):
            self.dir.rmdir()  # fails while a sibling's sockets are still there

    async def _handle_metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=self.local_metrics(),
                            headers={"Content-Type": "text/plain; version=0.0.4"})

    async def _handle_status(self, request: web.Request) -> web.Response:
        return web.json_response(self._status())

    def _status(self) -> dict[str, Any]:
        sh = self.share
        return {**self.local_status(),
                "share": {"inserts_sent": sh.inserts_sent, "datagrams_sent": sh.sent,
                          "inserts_applied": sh.applied}}

    async def _fetch(self, index: int, path: str) -> bytes | None:
        session = self._sessions.get(index)
        if session is None:
            session = self._sessions[index] = aiohttp.ClientSession(
                connector=aiohttp.UnixConnector(path=self.http_path(index)),
                timeout=aiohttp.ClientTimeout(total=FETCH_TIMEOUT_S))
        try:
            async with session.get(f"http://worker{index}{path}") as resp:
                resp.raise_for_status()
                return await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            log.warning("worker %d did not answer %s: %s", index, path, exc)
            return None

    async def _gather(self, path: str, own: bytes) -> dict[int, bytes | None]:
        others = [j for j in range(self.count) if j != self.index]
        got = await asyncio.gather(*(self._fetch(j, path) for j in others))
        return {self.index: own, **dict(zip(others, got, strict=True))}

    async def metrics(self) -> bytes:
        views = await self._gather("/metrics", self.local_metrics())
        return merge_expositions({str(j): None if v is None else v.decode()
                                  for j, v in sorted(views.items())})

    async def statuses(self) -> list[dict[str, Any]]:
        views = await self._gather("/status", json.dumps(self._status()).encode())
        return [{"index": j, "up": v is not None, **(json.loads(v) if v else {})}
                for j, v in sorted(views.items())]


__all__ = ["Siblings", "TrieShare", "decode_inserts", "encode_inserts", "merge_expositions"]
