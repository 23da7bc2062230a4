"""``GET /v1/models`` and ``GET /v1/models/{id}``: the replicas' model objects, merged.

The list is what this balancer routes: every model some replica serves (configured, or
listed by the replica when it was last reached), whether or not that replica is up now, so
clients of a model whose replicas are down see it and get a retryable 503 for it rather
than a 404. Each model object is the replicas' own, fields and all (vLLM adds
``max_model_len``, ``root``, ``parent``, ``permission``): fetched from the healthy replicas
when asked (at most once per ``FRESH_S``), else the last one a replica gave, else a
minimal ``{"id", "object", "created", "owned_by"}``. Where replicas disagree the first
one's fields win, except ``max_model_len``: the smallest, the longest request every
replica of that model accepts.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import aiohttp
from aiohttp import web

from skymesh.balancer.dispatch import Dispatcher
from skymesh.balancer.edge import error_response
from skymesh.balancer.errors import ModelNotFound
from skymesh.balancer.upstream import read_capped

FRESH_S = 1.0  # a client polling /v1/models costs the replicas one fetch per second
MAX_LIST_BYTES = 4 << 20  # a replica's /v1/models larger than this is ignored unread


class ModelCatalog:
    def __init__(self, dispatcher: Dispatcher, session: Callable[[], aiohttp.ClientSession],
                 timeout_s: float, refused: Callable[[web.Request], web.Response | None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.dispatcher = dispatcher
        self._session = session
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._refused = refused
        self._clock = clock
        self._cards: dict[str, list[dict[str, Any]]] = {}  # replica -> its last list
        self._fetched_at = -FRESH_S
        self._created = int(time.time())

    async def refresh(self) -> None:
        now = self._clock()
        if now - self._fetched_at < FRESH_S:
            return
        self._fetched_at = now
        d = self.dispatcher
        up = [tid for tid, t in d.targets.items() if t.healthy]
        for tid, cards in zip(up, await asyncio.gather(*(self._fetch(t) for t in up)),
                              strict=True):
            if cards is not None:
                self._cards[tid] = cards
        for tid in [t for t in self._cards if t not in d.targets]:
            del self._cards[tid]

    async def _fetch(self, target: str) -> list[dict[str, Any]] | None:
        try:
            async with self._session().get(target + "/v1/models",
                                           timeout=self._timeout) as r:
                if r.status != 200:
                    return None
                data = json.loads(await read_capped(r, MAX_LIST_BYTES))
        except (aiohttp.ClientError, TimeoutError, ValueError):
            return None
        cards = data.get("data") if isinstance(data, dict) else None
        if not isinstance(cards, list):
            return None
        return [c for c in cards if isinstance(c, dict) and isinstance(c.get("id"), str)]

    def merged(self) -> dict[str, dict[str, Any]]:
        """Model id -> its object, for every model this balancer routes."""
        out: dict[str, dict[str, Any]] = {}
        for tid, t in self.dispatcher.targets.items():
            for card in self._cards.get(tid, ()):
                mid = card["id"]
                if mid not in t.models:
                    continue  # the replica lists it, but it is not routed to there
                have = out.get(mid)
                if have is None:
                    out[mid] = dict(card)
                    continue
                for k, v in card.items():
                    have.setdefault(k, v)
                a, b = have.get("max_model_len"), card.get("max_model_len")
                if isinstance(a, int) and isinstance(b, int):
                    have["max_model_len"] = min(a, b)
        for mid in self.dispatcher.models():
            out.setdefault(mid, {"id": mid, "object": "model", "created": self._created,
                                 "owned_by": "skymesh"})
        return out

    async def handle_list(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        await self.refresh()
        cards = self.merged()
        return web.json_response({"object": "list",
                                  "data": [cards[m] for m in sorted(cards)]})

    async def handle_one(self, request: web.Request) -> web.Response:
        if (refused := self._refused(request)) is not None:
            return refused
        mid = request.match_info["model"]
        await self.refresh()
        card = self.merged().get(mid)
        if card is None:
            return error_response(ModelNotFound(
                f"model {mid!r} is not served here; see /v1/models", param="model"))
        return web.json_response(card)
