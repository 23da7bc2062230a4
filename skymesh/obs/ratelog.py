"""Log lines an attacker cannot multiply: at most one line per key (a refusal reason, a
replica) every ``every_s``, carrying how many it stood for.

A defence that logs every refusal turns a flood into a disk-filling log; one that logs
none leaves the operator blind. The connection guards of both daemons and of the peering
port log through this.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable

DEFAULT_EVERY_S = 10.0


class RateLimitedLog:
    def __init__(self, logger: logging.Logger, every_s: float = DEFAULT_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.every_s = every_s
        self._clock = clock  # paces the lines only
        self._last: dict[str, float] = {}
        self._unlogged: Counter[str] = Counter()

    def __call__(self, level: int, key: str, message: str) -> None:
        """``message`` at ``level``, unless a line for ``key`` went out less than
        ``every_s`` ago: then it is only counted, and the next line says how many."""
        now = self._clock()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._unlogged[key] += 1
            return
        self._last[key] = now
        more = self._unlogged.pop(key, 0)
        self.logger.log(level, "%s%s", message,
                        f" ({more} more since the last such line)" if more else "")

    def forget(self, keep: Callable[[str], bool]) -> None:
        """Drop the keys ``keep`` rejects (a replica that left), so the table stays bounded."""
        for key in [k for k in self._last if not keep(k)]:
            del self._last[key]
            self._unlogged.pop(key, None)


__all__ = ["DEFAULT_EVERY_S", "RateLimitedLog"]
