"""Requests a limit refused: counted by reason (for ``/metrics``) and logged, at most one
line per reason per ``LOG_EVERY_S``, however many an attacker sends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("skymesh.controller")
LOG_EVERY_S = 10.0  # the least time between two log lines for one kind of refusal


class Refusals:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.counts: dict[str, int] = {}
        self._logged: dict[str, float] = {}
        self._clock = clock

    def __call__(self, reason: str, detail: str = "") -> None:
        """Count a request a limit refused; log it, rate-limited per reason."""
        self.counts[reason] = self.counts.get(reason, 0) + 1
        now = self._clock()
        if now - self._logged.get(reason, -LOG_EVERY_S) >= LOG_EVERY_S:
            self._logged[reason] = now
            log.warning("refused a request: %s%s (%d so far)", reason,
                        f": {detail}" if detail else "", self.counts[reason])
