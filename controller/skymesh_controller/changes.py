"""The one way state changes: a single writer at a time, each commit waking the long polls.

The parts (records, probing, moves) take ``lock`` around a read-decide-commit, so two
writes never interleave: the lock is this process's, then the store's writer lock, which
several controllers on one store share (store.py). Balancers long-poll their membership on
the store's revision (``wait``): a commit here wakes them at once, another controller's
within ``poll_s``. ``close`` answers the pending polls at once when the server shuts down:
uvicorn would otherwise cancel them after its graceful timeout, each with a traceback in
the log and a 500 to its balancer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from types import TracebackType
from typing import Any

from skymesh_controller.store import Delete, Put, Store

log = logging.getLogger("skymesh.controller")


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
        self.closing = False
        self.waiting = 0  # long polls pending now

    async def commit(self, puts: list[Put], deletes: list[Delete] | None = None) -> int:
        rev = await self.store.commit(puts, deletes)
        old, self._changed = self._changed, asyncio.Event()
        old.set()
        return rev

    def close(self) -> None:
        """Answer the pending long polls now, and any later one at once (shutting down)."""
        self.closing = True
        log.debug("shutting down: answering %d long poll(s) now", self.waiting)
        self._changed.set()

    async def wait(self, after: int, timeout: float) -> int:
        """Return the revision once it is past ``after``, or when ``timeout`` runs out, or
        at once after ``close``."""
        deadline = time.monotonic() + min(timeout, self.long_poll_max_s)
        self.waiting += 1
        try:
            while True:
                event = self._changed
                rev = await self.store.revision()
                left = deadline - time.monotonic()
                if rev > after or left <= 0 or self.closing:
                    return rev
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(left, self.poll_s))
        finally:
            self.waiting -= 1
