"""The one way state changes: a single writer at a time, each commit waking the long polls.

The parts (records, probing, moves) take ``lock`` around a read-decide-commit, so two
writes never interleave: the lock is this process's, then the store's writer lock, which
several controllers on one store share (store.py). Balancers long-poll their membership on
the store's revision (``wait``): a commit here wakes them at once, another controller's
within ``poll_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from types import TracebackType
from typing import Any

from skymesh_controller.store import Delete, Put, Store


class _WriterLock:
    """This process's lock, then the store's writer lock (held to the end of the block)."""

    def __init__(self, store: Store) -> None:
        self.store, self.local = store, asyncio.Lock()
        self._held: Any = None

    async def __aenter__(self) -> None:
        await self.local.acquire()
        try:
            held = self.store.writer()
            await held.__aenter__()
        except BaseException:
            self.local.release()
            raise
        self._held = held

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        held, self._held = self._held, None
        try:
            await held.__aexit__(et, e, tb)
        finally:
            self.local.release()

    def locked(self) -> bool:
        return self.local.locked()


class Changes:
    def __init__(self, store: Store, long_poll_max_s: float, poll_s: float = 0.5) -> None:
        self.store = store
        self.long_poll_max_s, self.poll_s = long_poll_max_s, poll_s
        self.lock = _WriterLock(store)
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
                await asyncio.wait_for(event.wait(), min(left, self.poll_s))
