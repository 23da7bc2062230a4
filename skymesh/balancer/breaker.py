"""A per-replica circuit breaker (pure; the caller passes the time).

Counts consecutive failures that are the replica's fault (connect errors, 5xx, timeouts;
never 4xx, which are the client's). ``failure_threshold`` in a row opens it for
``open_s`` seconds; then one trial request is let through (half-open): success closes it,
failure opens it again.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class BreakerState(enum.IntEnum):
    CLOSED = 0
    HALF_OPEN = 1
    OPEN = 2


@dataclass(slots=True)
class Breaker:
    failure_threshold: int = 5
    open_s: float = 10.0
    failures: int = 0
    opened_at: float = 0.0
    state: BreakerState = BreakerState.CLOSED
    trial_in_flight: bool = False

    def allows(self, now: float) -> bool:
        if self.state is BreakerState.CLOSED:
            return True
        if self.state is BreakerState.OPEN and now - self.opened_at >= self.open_s:
            self.state = BreakerState.HALF_OPEN
            self.trial_in_flight = False
        return self.state is BreakerState.HALF_OPEN and not self.trial_in_flight

    def shut(self, now: float) -> bool:
        """Open and not yet due for its trial at ``now``: nothing may go there before
        ``opened_at + open_s``. Asks without moving the state (``allows`` moves it)."""
        return self.state is BreakerState.OPEN and now - self.opened_at < self.open_s

    def trial_in(self, now: float) -> float:
        """Seconds from ``now`` until an open breaker lets its trial through (0: due
        now); what a client turned away while it is open should wait."""
        return max(0.0, self.opened_at + self.open_s - now)

    def on_dispatch(self) -> None:
        if self.state is BreakerState.HALF_OPEN:
            self.trial_in_flight = True

    def on_success(self) -> None:
        self.failures = 0
        self.state = BreakerState.CLOSED
        self.trial_in_flight = False

    def on_neutral(self) -> None:
        """An attempt ended for a reason that says nothing about the replica (4xx, cancel)."""
        self.trial_in_flight = False

    def on_failure(self, now: float) -> None:
        self.failures += 1
        if self.state is BreakerState.HALF_OPEN or self.failures >= self.failure_threshold:
            self.state = BreakerState.OPEN
            self.opened_at = now
            self.trial_in_flight = False
