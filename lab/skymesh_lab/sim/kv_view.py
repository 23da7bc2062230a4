"""What a balancer following a simulated replica's KV-cache events knows of its cache.

The live path (docs/kv-events.md): the engine records the blocks it stores and evicts,
publishes them once per step as one batch, and each balancer's subscriber applies a batch
when it arrives. :class:`EventView` is that path in virtual time: it is the engine's
:class:`~skymesh_replica.engine.kv_cache.CacheRecorder` (told of every store, removal and
reset), :meth:`publish` is called by the replica at the end of each step with the step's
length, and the batch becomes visible ``delay`` later, in order. Routing then reads
:meth:`held` (the leading blocks of a prompt the balancer believes cached) instead of the
engine's own cache, so the "exact" state is as stale as the events make it. As the
daemon's index (skymesh.prefix.kv_index ``lost``), the view remembers the leading blocks
the engine dropped (evicted, or all at once by a reset) and has not stored since:
:meth:`lost` names a replica whose trie record of a prompt is stale
(``RouteRequest.exact_lost``).

Parameters:

- ``delay_s`` = None: seconds from a batch's publication to its application at the
  balancers; None: one engine step (the publishing step's mean step time: the subscriber
  learns of a block about a step after the engine could hit it) plus ``transit_s``;
- ``transit_s``: the one-way network delay from the replica to the balancers reading it
  (loopback or in-region; a single balancer elsewhere: the inter-region one-way);
- ``max_lost`` = 100,000: dropped leading blocks remembered (oldest forgotten first), the
  daemon's ``kv_index`` cap.
"""

from __future__ import annotations

from collections.abc import Sequence

from skymesh.prefix.kv_index import DEFAULT_MAX_BLOCKS
from skymesh_lab.sim.events import EventLoop

# FIRST: a leading block (stored with no parent), the one ``lost`` is asked about.
STORED, FIRST, REMOVED, CLEARED = "stored", "first", "removed", "cleared"


class EventView:
    def __init__(self, loop: EventLoop, transit_s: float, delay_s: float | None = None,
                 max_lost: int = DEFAULT_MAX_BLOCKS) -> None:
        if transit_s < 0 or (delay_s is not None and delay_s < 0):
            raise ValueError("KV-event delays must be >= 0")
        self.loop = loop
        self.transit_s = transit_s
        self.delay_s = delay_s
        self.visible: set[int] = set()
        self.max_lost = max_lost
        self._firsts: set[int] = set()  # visible leading blocks
        self._lost: dict[int, None] = {}  # dropped leading blocks, oldest first
        self._pending: list[tuple[str, int]] = []
        # When the last batch is applied: a later one never overtakes it (one ordered
        # stream per replica, as over the publisher's socket).
        self._last_at = 0.0
        self.batches = 0

    # -- CacheRecorder: what the engine records during a step -----------------------------
    def stored(self, block_hash: int, parent: int | None, token_ids: Sequence[int],
               block_size: int) -> None:
        self._pending.append((STORED if parent is not None else FIRST, block_hash))

    def removed(self, block_hash: int) -> None:
        self._pending.append((REMOVED, block_hash))

    def cleared(self) -> None:
        self._pending.append((CLEARED, 0))

    # -- publication and application ------------------------------------------------------
    def delay_for(self, step_s: float) -> float:
        return self.delay_s if self.delay_s is not None else step_s + self.transit_s

    def publish(self, step_s: float) -> None:
        """End of an engine step of ``step_s`` seconds: send what it recorded."""
        if not self._pending:
            return
        batch, self._pending = self._pending, []
        at = max(self.loop.now + self.delay_for(step_s), self._last_at)
        self._last_at = at
        self.loop.at(at, self._apply, batch)

    def _apply(self, batch: list[tuple[str, int]]) -> None:
        visible, firsts, lost = self.visible, self._firsts, self._lost
        for kind, h in batch:
            if kind == STORED:
                visible.add(h)
            elif kind == FIRST:
                visible.add(h)
                firsts.add(h)
                lost.pop(h, None)
            elif kind == REMOVED:
                visible.discard(h)
                if h in firsts:
                    firsts.discard(h)
                    self._mark_lost(h)
            else:
                for f in firsts:
                    self._mark_lost(f)
                firsts.clear()
                visible.clear()
        self.batches += 1

    def _mark_lost(self, h: int) -> None:
        # Insertion order is age: re-marking makes it the newest, the oldest goes first.
        self._lost.pop(h, None)
        self._lost[h] = None
        if len(self._lost) > self.max_lost:
            del self._lost[next(iter(self._lost))]

    def lost(self, first: int) -> bool:
        """Whether the engine dropped this leading block and has not stored it again (as
        far as the applied events tell)."""
        return first in self._lost

    def held(self, keys: Sequence[int]) -> int:
        """Leading blocks of ``keys`` the balancer believes cached."""
        n = 0
        visible = self.visible
        for h in keys:
            if h not in visible:
                break
            n += 1
        return n


__all__ = ["EventView"]
