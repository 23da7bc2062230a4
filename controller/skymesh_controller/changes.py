"""The one way state changes: a single writer at a time, each commit waking the long polls.

The controller is a single active process; its parts (records, probing, moves) take
``lock`` around a read-decide-commit, so two writes never interleave. Balancers long-poll
their membership on the store's revision (``wait``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from skymesh_controller.store import Delete, Put, Store


class Changes:
    def __init__(self, store: Store, long_poll_max_s: float) -> None:
        self.store = store
        self.long_poll_max_s = long_poll_max_s
        self.lock = asyncio.Lock()
        self._changed = asyncio.Event()

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        rev = await self.store.commit(puts, deletes)
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return rev

    async def wait(self, after: int, timeout: float) -> int:
        """Return the revision once it is past ``after``, or when ``timeout`` runs out."""
        deadline = time.monotonic() + min(timeout, self.long_poll_max_s)
        while True:
            event = self._changed
            rev = await self.store.revision()
            left = deadline - time.monotonic()
            if rev > after or left <= 0:
                return rev
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(event.wait(), left)
