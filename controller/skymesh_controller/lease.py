"""The leader lease's decisions, on the caller's clock (pure: no I/O, no sleeping).

One controller of those sharing a store leads: it holds a lease in the store that
expires ``ttl_s`` after its last renewal, and renews it every ``renew_s``. The leader
runs what acts on the world (probing and failover, moves, DNS sync, the planner); the
others stand by and serve the admin API. leadership.py does the store calls this module
decides on.

When may a leader act? A renewal sent at local time ``t`` that succeeded keeps the lease
in the store until at least ``t + ttl_s`` (the store starts its clock later, when the
command arrives), so the leader trusts its lease until ``t + ttl_s - margin_s`` on its own
monotonic clock, which keeps counting while the process is stopped (SIGSTOP) or paused:
a woken leader finds its lease expired before it does anything. The store checks the
lease's value (with its epoch) in the same transaction as each write the leader makes
(store.py, fencing), for what the local clock cannot see.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["standby", "leader"]
Action = Literal["acquire", "renew"]
Event = Literal["elected", "lost"] | None


@dataclass
class LeaseState:
    ttl_s: float
    renew_s: float
    margin_s: float = 0.0
    role: Role = "standby"
    epoch: int = 0
    since: float | None = None  # local clock when this process won the lease
    valid_until: float = 0.0  # local clock: act only before this
    elections: int = 0
    losses: int = 0

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.ttl_s:
            raise ValueError("renew_s must be positive and below ttl_s")
        if self.margin_s == 0.0:
            # The local deadline already falls before the store's expiry (it counts from
            # when the renewal was sent): the margin is room for the leader's loops to
            # stop, and small, so that a loaded host's stalls of up to
            # ttl - renew - margin between renewals do not cost the lease.
            self.margin_s = min(self.renew_s, 0.1 * self.ttl_s)

    def acts(self, now: float) -> bool:
        """Whether the leader's loops may act now."""
        return self.role == "leader" and now < self.valid_until

    def next_action(self) -> Action:
        return "renew" if self.role == "leader" else "acquire"

    def expire(self, now: float) -> Event:
        """Call before each step: a leader whose lease ran out locally stands down (no
        renewal came back in time, or the process was stopped)."""
        if self.role == "leader" and now >= self.valid_until:
            return self._lose()
        return None

    def acquired(self, sent_at: float, epoch: int | None) -> Event:
        """The answer to an acquire sent at ``sent_at``: the new epoch, or None when
        another controller holds the lease."""
        if epoch is None or self.role == "leader":
            return None
        self.role, self.epoch, self.since = "leader", epoch, sent_at
        self.valid_until = sent_at + self.ttl_s - self.margin_s
        self.elections += 1
        return "elected"

    def renewed(self, sent_at: float, ok: bool) -> Event:
        """The answer to a renewal sent at ``sent_at``: False when the store no longer
        holds this controller's lease (expired and taken, or deleted)."""
        if self.role != "leader":
            return None
        if not ok:
            return self._lose()
        self.valid_until = max(self.valid_until, sent_at + self.ttl_s - self.margin_s)
        return None

    def unreachable(self, now: float) -> Event:
        """The store did not answer: a leader keeps acting until its lease runs out
        locally (the store may still hold it), then stands down."""
        return self.expire(now)

    def resign(self) -> Event:
        """Give the lease up (shutdown)."""
        return self._lose() if self.role == "leader" else None

    def wait_s(self, now: float) -> float:
        """How long until the next step: a leader renews every ``renew_s`` but never
        later than its local deadline; a standby tries every ``renew_s``."""
        if self.role == "leader":
            return max(0.0, min(self.renew_s, self.valid_until - now))
        return self.renew_s

    def _lose(self) -> Event:
        self.role, self.since, self.valid_until = "standby", None, 0.0
        self.losses += 1
        return "lost"
