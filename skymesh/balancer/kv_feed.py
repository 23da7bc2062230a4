"""The balancer's KV-event feeds: one subscriber task per replica that publishes events.

A replica whose config has ``kv_events: {endpoint, replay_endpoint}`` gets a
:class:`~skymesh.prefix.kv_events.KVEventSubscriber` filling its own
:class:`~skymesh.prefix.kv_index.ReplicaBlockIndex`. Membership changes start and stop
tasks (an endpoint that changes restarts its task with an empty index); a replica that
leaves takes its index with it. Each replica's events are ``off`` (not configured),
``live`` or ``stale`` (nothing heard within ``stale_after_s``): only live indexes are
offered for routing (:meth:`KVFeeds.live_indexes`), so a policy falls back to its
approximate trie for the others.

:class:`ExactScorer` puts that state on a request (``RouteRequest.exact_prefix``): it
tokenizes the prompt as the engine does and counts, per live replica, the leading full
blocks cached. Only replicas whose tokenization the balancer knows take part: ``kind:
skymesh`` (the emulated replica: the shared ChatML rendering and tokenizer of
:mod:`skymesh.prefix.prompt`) and vLLM/SGLang replicas with a ``tokenizer`` folder (the
model's own tokenizer and chat template, :mod:`skymesh.prefix.kv_tokenize`). Others are
followed and reported but scored by the trie.
Prompts over ``OFFLOAD_CHARS`` are tokenized in a thread, off the event loop. The
prompt's block keys stay on the request (``RouteRequest.block_keys``) for the peer layer,
and :meth:`KVFeeds.exact_groups` hands the mesh heartbeat the indexes its exact prefix
summary is built from (docs/kv-events.md, "Across the mesh").
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric

from skymesh.balancer.config import KVEventsConfig, KVEventsEndpoint, ReplicaConfig
from skymesh.balancer.intake import Intake
from skymesh.policies.base import RouteRequest
from skymesh.prefix.kv_index import ReplicaBlockIndex, block_keys, longest_prefix, lost_first
from skymesh.prefix.kv_tokenize import EngineTokenizer
from skymesh.prefix.prompt import PromptError, Tokenizer, completion_prompt, get_tokenizer

if TYPE_CHECKING:  # the wire needs the kv-events extra: imported when a replica has events
    from skymesh.prefix.kv_events import KVEventSubscriber

log = logging.getLogger(__name__)

OFF, LIVE, STALE = "off", "live", "stale"
# The scoring key of ``kind: skymesh`` replicas (the balancer's own tokenizer); others
# are keyed by their ``tokenizer`` folder.
SKYMESH_KEY = "skymesh"
OFFLOAD_CHARS = 32_768  # about 8k tokens, 1 ms of tokenizing


def scoring_key(r: ReplicaConfig) -> str | None:
    """How the balancer tokenizes for replica ``r``: its own tokenizer for ``kind:
    skymesh``, the model folder given as ``tokenizer``, or None (the trie scores it)."""
    if r.kind == "skymesh":
        return SKYMESH_KEY
    return r.tokenizer


class KVFeeds:
    def __init__(self, cfg: KVEventsConfig, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.cfg = cfg
        self.clock = clock
        self._subs: dict[str, tuple[KVEventsEndpoint, KVEventSubscriber,
                                    asyncio.Task[None]]] = {}
        # Followed replicas whose tokenization the balancer reproduces, by scoring key.
        self.groups: dict[str, tuple[str, ...]] = {}
        self._keys: dict[str, str | None] = {}  # followed url -> its scoring key

    def set_replicas(self, replicas: Iterable[ReplicaConfig]) -> None:
        """Start feeds for new publishers, stop those of replicas that left or changed.
        Needs a running loop."""
        replicas = list(replicas)
        want = {r.url: r.kv_events for r in replicas if r.kv_events is not None}
        self._keys = {r.url: scoring_key(r) for r in replicas if r.kv_events is not None}
        groups: dict[str, list[str]] = {}
        for url, key in self._keys.items():
            if key is not None:
                groups.setdefault(key, []).append(url)
        self.groups = {k: tuple(v) for k, v in groups.items()}
        for url in list(self._subs):
            if want.get(url) != self._subs[url][0]:
                self._drop(url)
        if not want:
            return
        from skymesh.prefix.kv_events import KVEventSubscriber, SubscriberSettings

        cfg = self.cfg
        settings = SubscriberSettings(
            heartbeat_s=cfg.heartbeat_s, stale_after_s=cfg.stale_after_s,
            replay_timeout_s=cfg.replay_timeout_s, max_frame_bytes=cfg.max_frame_bytes)
        loop = asyncio.get_running_loop()
        for url, ep in want.items():
            if url in self._subs:
                continue
            sub = KVEventSubscriber(ep.endpoint, ep.replay_endpoint,
                                    ReplicaBlockIndex(cfg.max_blocks), settings, self.clock)
            task = loop.create_task(sub.run(), name=f"kv-events {url}")
            task.add_done_callback(functools.partial(self._ended, url))
            self._subs[url] = (ep, sub, task)
            log.info("following kv events of %s at %s", url, ep.endpoint)

    def _ended(self, url: str, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            # A feed that crashed leaves its replica stale (trie routing), not the balancer.
            log.error("kv events feed of %s failed: %r", url, task.exception())

    def _drop(self, url: str) -> None:
        _ep, _sub, task = self._subs.pop(url)
        task.cancel()

    def scoring_key(self, url: str) -> str | None:
        return self._keys.get(url)

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

    def exact_groups(self) -> list[tuple[str, int, list[ReplicaBlockIndex]]]:
        """(scoring key, block size, indexes) of each scoring key whose followed replicas
        all have live events, split by the block size their engines use: what the
        region's exact prefix summary may say. A key with a stale replica is left to the
        trie's summary (part of the region's cache unknown would read as not held); an
        index that has not seen a block yet has no size and holds nothing."""
        out: list[tuple[str, int, list[ReplicaBlockIndex]]] = []
        for key, urls in self.groups.items():
            live = self.live_indexes(urls)
            if len(live) < len(urls):
                continue
            by_size: dict[int, list[ReplicaBlockIndex]] = {}
            for idx in live.values():
                if idx.block_size:
                    by_size.setdefault(idx.block_size, []).append(idx)
            out += [(key, bs, idxs) for bs, idxs in sorted(by_size.items())]
        return out

    # -- metrics (registered as a collector: read at scrape time) -------------------------
    def collect(self) -> Iterator[Metric]:
        live = GaugeMetricFamily("skymesh_kv_events_live",
                                 "1 while a replica's KV-cache events are live",
                                 labels=["replica"])
        blocks = GaugeMetricFamily("skymesh_kv_index_blocks",
                                   "Blocks in a replica's exact prefix index", labels=["replica"])
        evicted = CounterMetricFamily("skymesh_kv_index_evicted",
                                      "Blocks forgotten at the kv_events.max_blocks cap",
                                      labels=["replica"])
        events = CounterMetricFamily(
            "skymesh_kv_events", "KV-event batches by outcome: applied, replayed (from the "
            "replay endpoint), gap, restart, resync (index cleared), malformed; and events "
            "skipped: unknown_event, orphan (stored under an unknown parent)",
            labels=["replica", "outcome"])
        now = self.clock()
        for url, (_ep, sub, task) in self._subs.items():
            live.add_metric([url], float(not task.done() and sub.is_live(now)))
            idx, c = sub.index, sub.counters
            blocks.add_metric([url], len(idx))
            evicted.add_metric([url], idx.evicted)
            for outcome, n in (("applied", c.batches), ("replayed", c.replayed),
                               ("gap", c.gaps), ("restart", c.restarts),
                               ("resync", c.resyncs), ("malformed", c.malformed),
                               ("unknown_event", c.unknown_events),
                               ("orphan", idx.orphans)):
                events.add_metric([url, outcome], n)
        yield from (live, blocks, evicted, events)

    async def stop(self) -> None:
        tasks = [t for _ep, _s, t in self._subs.values()]
        self._subs.clear()
        for t in tasks:
            t.cancel()
        # Each closes its sockets as it ends.
        await asyncio.gather(*tasks, return_exceptions=True)


class ExactScorer:
    """Annotates requests with the exact prefix state of the live, exact-capable replicas.

    Tokenizers load once per scoring key (the shared one of ``kind: skymesh``, each model
    folder of ``replicas[].tokenizer``), in a thread; requests route on the trie until
    theirs is ready, and for good if it failed to load (``/status`` says why)."""

    def __init__(self, feeds: KVFeeds,
                 load_tokenizer: Callable[[], Tokenizer] = get_tokenizer,
                 load_engine: Callable[[str], EngineTokenizer] = EngineTokenizer) -> None:
        self.feeds = feeds
        self._load_tokenizer = load_tokenizer
        self._load_engine = load_engine
        self.tokenizers: dict[str, Tokenizer | EngineTokenizer] = {}
        self.errors: dict[str, str] = {}  # key -> why it did not load
        self._loading: dict[str, asyncio.Task[None]] = {}

    def _start_loading(self, key: str) -> None:
        # About 0.2 s of CPU for the Qwen vocabulary, more for a big tokenizer.json: in a
        # thread, once per key; requests route on the trie meanwhile.
        if key in self._loading:
            return

        def load() -> Tokenizer | EngineTokenizer:
            return self._load_tokenizer() if key == SKYMESH_KEY else self._load_engine(key)

        async def run() -> None:
            try:
                tok = await asyncio.to_thread(load)
            except Exception as exc:  # a bad folder leaves its replicas on the trie
                self.errors[key] = f"tokenizer failed to load: {exc!r}"
                log.error("no exact prefix scoring for %s: %s", key, self.errors[key])
                return
            self.tokenizers[key] = tok
            if isinstance(tok, EngineTokenizer) and tok.chat_template is None:
                log.warning("%s has no chat template: chat requests to its replicas are "
                            "scored by the trie, completions on their events", key)

        self._loading[key] = asyncio.get_running_loop().create_task(
            run(), name=f"kv-tokenizer {key}")

    def preload(self) -> None:
        for key in self.feeds.groups:
            self._start_loading(key)

    async def loaded(self) -> None:
        """Waits for the loads started so far (tests, the lab)."""
        await asyncio.gather(*self._loading.values())

    def figures(self, url: str) -> dict[str, Any]:
        """``/status``'s view of one replica: its events' state, the blocks its index
        holds, whether requests are scored against it exactly and, when not (or only
        partly), why (``kv_exact_note``)."""
        index = self.feeds.index(url)
        state = self.feeds.state(url)
        out: dict[str, Any] = {"kv_events": state,
                               "kv_blocks": None if index is None else len(index),
                               "kv_exact": False}
        if state == OFF:
            return out
        key = self.feeds.scoring_key(url)
        tok = None if key is None else self.tokenizers.get(key)
        note: str | None = None
        if key is None:
            note = "trie: no tokenizer configured (replicas[].tokenizer)"
        elif key in self.errors:
            note = f"trie: {self.errors[key]}"
        elif tok is None:
            note = "trie: tokenizer loading"
        elif isinstance(tok, EngineTokenizer) and tok.chat_template is None:
            note = f"chat by the trie: no chat template in {key}"
        out["kv_exact"] = state == LIVE and tok is not None
        if note is not None:
            out["kv_exact_note"] = note
        return out

    async def annotate(self, route: RouteRequest, intake: Intake) -> RouteRequest:
        groups = self.feeds.groups
        if not groups:
            return route
        prefix: dict[str, int] = {}
        keys_of: dict[tuple[str, int], list[int]] = {}
        lost: set[str] = set()
        blocks = 0
        for key, urls in groups.items():
            live = self.feeds.live_indexes(urls)
            if not live:
                continue
            tok = self.tokenizers.get(key)
            if tok is None:
                self._start_loading(key)
                continue
            try:
                if len(intake.prompt_text) > OFFLOAD_CHARS:
                    ids = await asyncio.to_thread(prompt_ids, intake, tok)
                else:
                    ids = prompt_ids(intake, tok)
            except PromptError:  # no chat template, a template refusing: the trie scores
                continue
            block_size = max(i.block_size for i in live.values()) or 16
            # Every live block size's keys, even where no index holds a block yet: a
            # peer's exact summary of that size is probed with them.
            by_size = {bs: block_keys(ids, bs)
                       for bs in {i.block_size for i in live.values() if i.block_size}}
            prefix.update(longest_prefix(live, ids, keys_by_size=by_size))
            keys_of.update(((key, bs), k) for bs, k in by_size.items())
            lost.update(lost_first(live, ids))
            # One model's candidates share a tokenizer; were there several, the longest
            # prompt's blocks bound every fraction.
            blocks = max(blocks, len(ids) // block_size)
        if not prefix:
            return route
        return dataclasses.replace(route, exact_prefix=prefix, exact_blocks=blocks,
                                   block_keys=keys_of or None, exact_lost=frozenset(lost))


def prompt_ids(intake: Intake, tokenizer: Tokenizer | EngineTokenizer) -> list[int]:
    """The token ids the engine computes for this request."""
    if isinstance(tokenizer, EngineTokenizer):
        return tokenizer.request_ids(intake.kind, intake.body)
    if intake.kind == "chat":
        return tokenizer.encode(intake.prompt_text)  # render_chat's text, as the replica
    return completion_prompt(intake.body["prompt"]).ids(tokenizer)
