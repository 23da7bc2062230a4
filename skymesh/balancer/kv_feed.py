"""The balancer's KV-event feeds: one subscriber task per replica that publishes events.

A replica whose config has ``kv_events: {endpoint, replay_endpoint}`` gets a
:class:`~skymesh.prefix.kv_events.KVEventSubscriber` filling its own
:class:`~skymesh.prefix.kv_index.ReplicaBlockIndex`. Membership changes start and stop
tasks (an endpoint that changes restarts its task with an empty index); a replica that
leaves takes its index with it. Each replica's events are ``off`` (not configured),
``live`` or ``stale`` (nothing heard within ``stale_after_s``): only live indexes are
offered for routing (:meth:`KVFeeds.live_indexes`), so a policy falls back to its
approximate trie for the others.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable

from skymesh.balancer.config import KVEventsConfig, KVEventsEndpoint, ReplicaConfig
from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings, stop
from skymesh.prefix.kv_index import ReplicaBlockIndex

log = logging.getLogger(__name__)

OFF, LIVE, STALE = "off", "live", "stale"


class KVFeeds:
    def __init__(self, cfg: KVEventsConfig, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.cfg = cfg
        self.clock = clock
        self.settings = SubscriberSettings(
            heartbeat_s=cfg.heartbeat_s, stale_after_s=cfg.stale_after_s,
            replay_timeout_s=cfg.replay_timeout_s, max_frame_bytes=cfg.max_frame_bytes)
        self._subs: dict[str, tuple[KVEventsEndpoint, KVEventSubscriber,
                                    asyncio.Task[None]]] = {}

    def set_replicas(self, replicas: Iterable[ReplicaConfig]) -> None:
        """Start feeds for new publishers, stop those of replicas that left or changed.
        Needs a running loop."""
        want = {r.url: r.kv_events for r in replicas if r.kv_events is not None}
        for url in list(self._subs):
            if want.get(url) != self._subs[url][0]:
                self._drop(url)
        loop = asyncio.get_running_loop()
        for url, ep in want.items():
            if url in self._subs:
                continue
            sub = KVEventSubscriber(ep.endpoint, ep.replay_endpoint,
                                    ReplicaBlockIndex(self.cfg.max_blocks), self.settings,
                                    self.clock)
            task = loop.create_task(sub.run(), name=f"kv-events {url}")
            task.add_done_callback(lambda t, u=url: self._ended(u, t))
            self._subs[url] = (ep, sub, task)
            log.info("following kv events of %s at %s", url, ep.endpoint)

    def _ended(self, url: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # A feed that crashed leaves its replica stale (trie routing), not the balancer.
            log.error("kv events feed of %s failed: %r", url, task.exception())

    def _drop(self, url: str) -> None:
        _ep, _sub, task = self._subs.pop(url)
        task.cancel()

    def state(self, url: str) -> str:
        entry = self._subs.get(url)
        if entry is None:
            return OFF
        _ep, sub, task = entry
        return LIVE if not task.done() and sub.is_live() else STALE

    def index(self, url: str) -> ReplicaBlockIndex | None:
        entry = self._subs.get(url)
        return None if entry is None else entry[1].index

    def live_indexes(self, urls: Iterable[str]) -> dict[str, ReplicaBlockIndex]:
        """The indexes of ``urls`` whose events are live now."""
        now = self.clock()
        out: dict[str, ReplicaBlockIndex] = {}
        for url in urls:
            entry = self._subs.get(url)
            if entry is not None and not entry[2].done() and entry[1].is_live(now):
                out[url] = entry[1].index
        return out

    async def stop(self) -> None:
        tasks = [t for _ep, _s, t in self._subs.values()]
        self._subs.clear()
        for t in tasks:
            await stop(t)
